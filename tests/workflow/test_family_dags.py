"""The whole DAG on CPU for each MoE family beyond Laguna, on its trained tiny instance (transformers' own
class, trained on the shipped corpus by the toy's recipe: data/instances/, content-pinned in
data/instances/instances.json): calibration, activation statistics, the streamed branch-parallel search,
the rebuild, the export, the KLD runs and gates, verify and release. Two of them round NVFP4 with GPTQ and
refine the placement by measured KL (collect_expert_inputs, refine_placement).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from mixquant.model.instances import INSTANCE_MODEL_TYPES, read_pins  # noqa: E402
from vllm_resolution import resolve_quantized_layers, unmatched_quantized_layers  # noqa: E402

pytestmark = pytest.mark.slow

INSTANCES = Path(__file__).resolve().parents[2] / "data" / "instances"
# the families whose DAG also runs GPTQ rounding and the measured refinement
GPTQ_REFINED = ("deepseek_v3", "mixtral")


def family_config(wd, model_type: str) -> str:
    """The default config pointed at the committed instance (by its content pin), sized for a quick run: 32
    calibration sequences of 64 tokens in one scoring pass, the 6-bit budget, a 128-token prompt, a suite
    of 12 windows of 64 tokens, 2 KLD runs with a BF16 KV cache; GPTQ rounding and a refinement over 3
    candidates on 8 held-out sequences for the GPTQ_REFINED families."""
    from mixquant.model.families import architecture
    from mixquant.release.recipe import layer_ranges

    model_dir = INSTANCES / model_type
    arch = architecture(model_dir)
    config = wd.config()
    config["model"] = {
        "source": "local",
        "local": {"path": f"data/instances/{model_type}", "sha256": read_pins(INSTANCES)[model_type]},
        "geometry": f"data/instances/{model_type}/config.json",
        "moe_layers": layer_ranges(list(arch.moe_layers)),
    }
    config["calibration"].update(num_samples=32, seq_len=64)
    config["prompt"].update(seq_len=128, sha256=None)
    search = config["placement"]["search"]
    search.update(batch_size=8, macro_batch=32, frontier_points=5)
    if model_type in GPTQ_REFINED:
        config["quantize"]["nvfp4_w4a16"]["rounding"] = "gptq"
        config["quantize"]["nvfp4_w4a16"]["gptq"] = {"min_tokens": 32}
        search["refine"] = {"candidates": 3, "holdout_samples": 8}
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


@pytest.mark.parametrize("model_type", INSTANCE_MODEL_TYPES)
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
    algos = {"nvfp4_w4a16": "W4A16_NVFP4", "fp8": "FP8", "bf16": None}
    quantization = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    if len({fmt for fmt in placement.values() if fmt != "bf16"}) > 1:
        assert unmatched_quantized_layers(checkpoint, model_type) == []
        resolved = resolve_quantized_layers(checkpoint, model_type)
        assert {prefix.split(".")[2]: algo for prefix, algo in resolved.items()} == {
            layer: algos[fmt] for layer, fmt in placement.items()
        }
    else:  # one format (and BF16 layers): ModelOpt's single-algorithm form, BF16 layers excluded by wildcard
        (fmt,) = {fmt for fmt in placement.values() if fmt != "bf16"}
        assert quantization["quant_algo"] == algos[fmt]
        excluded = quantization["exclude_modules"]
        for layer, placed in placement.items():
            names = [f"model.layers.{layer}.mlp.experts", f"model.layers.{layer}.block_sparse_moe.experts"]
            hit = any(fnmatch.fnmatch(name, pattern) for name in names for pattern in excluded)
            assert hit == (placed == "bf16"), (layer, placed, excluded)
    repo = root / paths["release"]["path"] / "repo"
    card = (repo / "README.md").read_text()
    if model_type in GPTQ_REFINED:
        assert "NVFP4 rounding `gptq`" in card and "Refined by measured KL" in card
        refine = json.loads((repo / "refine_audit.json").read_text())
        assert len(refine["candidates"]) == 3
        assert placement == refine["candidates"][refine["chosen"] - 1]["placement"]
        layer_dir = next((root / paths[name]["path"]) for name in paths if name.startswith("layers/nvfp4"))
        layer_audit = json.loads(next(layer_dir.glob("layer_*/audit.json")).read_text())
        assert layer_audit["rounding"] == "gptq"
        assert layer_audit["gptq"]["calibration_output_error"]["ratio"] < 1
    else:
        assert "NVFP4 rounding `rtn`" in card
