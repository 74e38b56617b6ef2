"""The whole DAG on CPU for each MoE family beyond Laguna (one model type per family), on a small random
instance of transformers' own class in its upstream disk layout: calibration, activation statistics,
the streamed branch-parallel search, the rebuild, the export, the KLD runs and gates, verify and release.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from family_models import make_instance  # noqa: E402
from vllm_resolution import resolve_quantized_layers, unmatched_quantized_layers  # noqa: E402

pytestmark = pytest.mark.slow

# one model type per family (the others are covered by tests/families)
DAG_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral")


def family_config(wd, model_type: str) -> str:
    """The default config pointed at the instance, sized for a quick run: 16 calibration sequences of 64
    tokens in one scoring pass, a 7-bit budget, a 128-token prompt, a suite of 12 windows of 64 tokens, 2 KLD
    runs with a BF16 KV cache."""
    from mixquant.model.families import architecture
    from mixquant.model.fetch import identity_sha256, local_dir_identity
    from mixquant.release.recipe import layer_ranges

    model_dir = make_instance(model_type, wd.root / "models" / model_type)
    arch = architecture(model_dir)
    config = wd.config()
    config["model"] = {
        "source": "local",
        "local": {"path": f"models/{model_type}", "sha256": identity_sha256(local_dir_identity(model_dir))},
        "geometry": f"models/{model_type}/config.json",
        "moe_layers": layer_ranges(list(arch.moe_layers)),
    }
    config["calibration"].update(num_samples=16, seq_len=64)
    config["prompt"].update(seq_len=128, sha256=None)
    config["placement"]["target_effective_bits"] = 7.0  # with 2 MoE layers, room for one FP8 layer
    search = config["placement"]["search"]
    search.update(batch_size=4, macro_batch=16, frontier_points=5)
    config["placement"]["explicit"] = {"default_format": "nvfp4_w4a16", "layers": []}
    config["quantize"]["activation_batch_size"] = 4
    config["export"]["num_shards"] = 2
    kld = config["kld"]
    kld.update(runs=2, kv_cache_dtypes=["bfloat16"])
    kld["candidates"] = [
        {"name": "searched", "source": "searched"},
        {"name": "uniform-nvfp4", "source": "uniform", "format": "nvfp4_w4a16"},
    ]
    kld["gates"] = {"max_run_spread": 0.0, "bootstrap_samples": 1000, "confidence": 0.95}
    kld["eval"]["window_tokens"] = 64  # the suite: 3 domains x 4 windows of 64 tokens
    for domain in kld["eval"]["domains"]:
        domain["windows"] = 4
    config.pop("published", None)
    config["release"] = {"name": f"tiny-{model_type}-mixquant", "license": "other", "license_name": "test"}
    return wd.write_config(f"config/{model_type}.yaml", config)


@pytest.mark.parametrize("model_type", DAG_MODEL_TYPES)
def test_the_whole_dag_runs_on_a_family(workdir, model_type):
    name = family_config(workdir, model_type)
    workdir.snakemake("--configfile", name)
    paths = workdir.paths(name)
    assert all(row["done"] for row in paths.values()), {n: r["state"] for n, r in paths.items()}
    root = workdir.root
    placement = json.loads((root / paths["placement"]["path"] / "placement.json").read_text())["layers"]
    audit = json.loads((root / paths["checkpoint"]["path"] / "checkpoint_audit.json").read_text())
    assert audit["inspection"]["problems"] == []
    assert {str(k): v for k, v in audit["inspection"]["layer_formats"].items()} == placement
    verdict = json.loads((root / paths["kld_verdict"]["path"] / "verdict.json").read_text())
    assert verdict["passed"] is True
    with (root / paths["kld_report"]["path"] / "kld_table.csv").open() as table:
        rows = list(csv.DictReader(table))
    for protocol in ("prompt", "suite"):
        mean = {row["candidate"]: float(row["mean_kld"]) for row in rows if row["protocol"] == protocol}
        assert 0 < mean["searched"] < mean["uniform-nvfp4"], protocol  # the search pays off at 7 bits
    checkpoint = root / paths["checkpoint"]["path"]
    assert unmatched_quantized_layers(checkpoint, model_type) == []
    algos = {"nvfp4_w4a16": "W4A16_NVFP4", "fp8": "FP8", "bf16": None}
    resolved = resolve_quantized_layers(checkpoint, model_type)
    assert {prefix.split(".")[2]: algo for prefix, algo in resolved.items()} == {
        layer: algos[fmt] for layer, fmt in placement.items()
    }
    assert (root / paths["release"]["path"] / "repo" / "README.md").is_file()
