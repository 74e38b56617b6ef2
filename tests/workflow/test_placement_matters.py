"""On the embedded default the search matters: its placement beats uniform NVFP4 decisively (both KV dtypes)
and every one of 8 random placements with the same effective bits, measured on the pinned prompt."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_searched_beats_uniform_nvfp4_by_ten_percent_on_the_lower_bound(built_workdir):
    wd = built_workdir
    paths = wd.paths()  # the default config's gates (other tests run stricter ones in this workdir)
    seen = set()
    for name in ("gate/searched/bfloat16", "gate/searched/fp8"):
        document = json.loads((wd.root / paths[name]["path"] / "aggregate.json").read_text())
        if document["candidate"] != "searched":
            continue
        seen.add(document["kv_cache_dtype"])
        assert document["improvement"]["ci_low"] >= 0.10, (
            document["kv_cache_dtype"],
            document["improvement"],
        )
        assert document["verdict"]["passed"]
    assert seen == {"bfloat16", "fp8"}


def test_bf16_self_check_has_its_own_gates(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    by_kv = {}
    for kv in ("bfloat16", "fp8"):
        by_kv[kv] = json.loads((wd.root / paths[f"gate/bf16/{kv}"]["path"] / "aggregate.json").read_text())
    exact = {c["name"]: c["passed"] for c in by_kv["bfloat16"]["verdict"]["checks"]}
    assert exact["require_exact_zero"] and by_kv["bfloat16"]["aggregate"]["mean_kld"] == 0
    fp8_checks = {c["name"] for c in by_kv["fp8"]["verdict"]["checks"]}
    assert not any("improvement" in name for name in fp8_checks)  # the KV effect is measured, not gated
    assert by_kv["fp8"]["aggregate"]["mean_kld"] > 0


def test_searched_placement_beats_eight_random_placements_with_the_same_bits(built_workdir):
    from mixquant.numerics import enter

    enter("portable", 1)
    from mixquant.calibration.tokens import load_token_ids
    from mixquant.keys.manifest import read_manifest
    from mixquant.search.evaluate import compare_with_random
    from mixquant.search.score import layer_quant_from_tensors, load_search_model
    from safetensors.torch import load_file

    root = built_workdir.root
    paths = built_workdir.paths()  # the default run's results (other tests add their own to this workdir)
    quants = {}
    for window in (root / row["path"] for name, row in paths.items() if name.startswith("layers/")):
        fmt = read_manifest(window)["preimage"]["config"]["format"]
        for directory in window.glob("layer_*"):
            layer = int(directory.name.split("_")[1])
            if fmt != "bf16":
                tensors = load_file(str(directory / "layer.safetensors"))
                quants[(layer, fmt)] = layer_quant_from_tensors(tensors, layer, fmt)
    placement_file = root / paths["placement"]["path"] / "placement.json"
    placement = {int(k): v for k, v in json.loads(placement_file.read_text())["layers"].items()}
    assert len(set(placement.values())) > 1  # a mixed placement: permutations exist
    ids = load_token_ids(root / paths["prompt"]["path"] / "prompt.safetensors").reshape(-1).long()
    model = load_search_model(root / "data" / "toy-laguna")
    outcome = compare_with_random(model, ids, quants, placement, count=8, seed=0)
    assert len(outcome["random"]) == 8
    assert outcome["beats_all"], json.dumps(outcome, indent=1)
    own = outcome["placement"]["mean_kl"]
    assert all(other["mean_kl"] > own for other in outcome["random"])
