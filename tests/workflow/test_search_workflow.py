"""Issue acceptance for the placement search, on the trained toy after the default run.

- the search's outputs (placement, audit, frontier, plots) and the export of the searched placement;
- the searched placement's measured KL on the prompt beats uniform NVFP4 and random placements with the
  same or more bits;
- cache behaviour: a new budget reruns only solve_placement and what follows; a new candidate format runs
  its layer results and the score passes, which carry every format.
"""

from __future__ import annotations

import csv
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from mixquant.calibration.tokens import load_token_ids
from mixquant.keys.manifest import read_manifest, verify_manifest
from mixquant.model.fetch import resolve_model_dir
from mixquant.search.evaluate import placement_kld
from mixquant.search.score import layer_quant_from_tensors, load_search_model
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
BITS = {"nvfp4_w4a16": 4.5, "fp8": 8.0, "bf16": 16.0}


def _dir(wd, paths, name) -> Path:
    return wd.root / paths[name]["path"]


def test_search_outputs_and_the_export_of_the_searched_placement(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    assert all(row["done"] for row in paths.values())
    directory = _dir(wd, paths, "placement")
    assert verify_manifest(directory) == []
    placement = json.loads((directory / "placement.json").read_text())
    audit = json.loads((directory / "placement_audit.json").read_text())
    layers = {int(k): v for k, v in placement["layers"].items()}
    assert sorted(layers) == list(range(1, 9))
    config = wd.config()
    target = config["placement"]["target_effective_bits"]
    bits = sum(BITS[f] for f in layers.values()) / len(layers)
    assert audit["solver"]["status"] == "Optimal"
    assert audit["budget"]["effective_bits"] == pytest.approx(bits) and bits <= target + 1e-9
    assert audit["objective"] == pytest.approx(
        sum(g["scores"][g["chosen"]] for g in audit["groups"]), rel=1e-12
    )
    for group in audit["groups"]:
        assert group["scores"]["bf16"] == 0.0
        assert group["scores"]["nvfp4_w4a16"] > 0 and group["scores"]["fp8"] > 0
        assert layers[group["layer"]] == group["chosen"]
    for name in ("frontier.png", "scores_heatmap.png"):
        assert (directory / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((directory / "frontier.csv").open()))
    assert len(rows) >= 2
    objectives = [
        float(r["objective"]) for r in sorted(rows, key=lambda r: float(r["target_effective_bits"]))
    ]
    assert all(a >= b - 1e-15 for a, b in zip(objectives, objectives[1:], strict=False))

    # the export is of exactly this placement
    checkpoint = _dir(wd, paths, "checkpoint")
    manifest = read_manifest(checkpoint)
    assert manifest["preimage"]["config"]["placement"] == placement["layers"]
    quantized = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    listed = quantized.get("quantized_layers", {})
    for layer, fmt in layers.items():
        name = f"model.layers.{layer}.mlp.experts"
        expected = {"nvfp4_w4a16": "W4A16_NVFP4", "fp8": "FP8"}.get(fmt)
        got = listed.get(name, {}).get("quant_algo") if listed else quantized.get("quant_algo")
        assert got == expected or (expected is None and name not in listed), (layer, fmt, got)


@pytest.fixture(scope="module")
def toy_eval(built_workdir):
    """The BF16 toy, the prompt, and every layer's NVFP4 and FP8 results (the ones the search scored)."""
    wd = built_workdir
    paths = wd.paths()
    model = load_search_model(resolve_model_dir(_dir(wd, paths, "model")))
    prompt = load_token_ids(_dir(wd, paths, "prompt") / "prompt.safetensors")
    quants = {}
    for layer in range(1, 9):
        for fmt in ("nvfp4_w4a16", "fp8"):
            window = _dir(wd, paths, f"layers/{fmt}/1-8")
            tensors = load_file(str(window / f"layer_{layer}" / "layer.safetensors"))
            quants[layer, fmt] = layer_quant_from_tensors(tensors, layer, fmt)
    placement = json.loads((_dir(wd, paths, "placement") / "placement.json").read_text())
    searched = {int(k): v for k, v in placement["layers"].items()}
    return model, prompt, quants, searched


def measured(toy_eval, placement: dict[int, str]) -> float:
    model, prompt, quants, _ = toy_eval
    chosen = {layer: quants[layer, fmt] for layer, fmt in placement.items() if fmt != "bf16"}
    return placement_kld(model, prompt, chosen)["mean_kl"]


def bits_of(placement: dict[int, str]) -> float:
    return sum(BITS[f] for f in placement.values()) / len(placement)


def test_searched_placement_beats_uniform_nvfp4_and_the_average_random_placement(toy_eval):
    """Measured on the prompt (every placed layer quantized at once): the searched placement beats uniform
    NVFP4 and the average of random placements with the same bits, and costs less KL than placements with
    more bits on average (numbers printed). test_placement_matters.py checks it beats every one of 8 random
    same-bit placements, which the toy's outlier layers make decisive."""
    _, _, _, searched = toy_eval
    ours = measured(toy_eval, searched)
    uniform = measured(toy_eval, dict.fromkeys(range(1, 9), "nvfp4_w4a16"))
    rng = random.Random(0)
    same_bits: list[dict[int, str]] = []
    formats = list(searched.values())
    while len(same_bits) < 6:  # the searched counts on other layers
        rng.shuffle(formats)
        candidate = dict(zip(range(1, 9), formats, strict=True))
        if candidate != searched and candidate not in same_bits:
            same_bits.append(dict(candidate))
    more_bits: list[dict[int, str]] = []
    while len(more_bits) < 6:
        candidate = {layer: rng.choice(list(BITS)) for layer in range(1, 9)}
        if bits_of(candidate) > bits_of(searched):
            more_bits.append(candidate)
    same = [measured(toy_eval, p) for p in same_bits]
    more = [(bits_of(p), measured(toy_eval, p)) for p in more_bits]
    print(f"searched {bits_of(searched):.4f} bits: mean KL {ours:.6f}; uniform NVFP4 4.5 bits: {uniform:.6f}")
    print("random, same bits:", ", ".join(f"{kl:.6f}" for kl in same))
    print("random, more bits:", ", ".join(f"{b:.3f} bits {kl:.6f}" for b, kl in more))
    assert ours < uniform
    assert ours < sum(same) / len(same)


def _rules_run(result) -> dict[str, int]:
    """Jobs per stage, as a run's console announces them (``[10:25:08] quantize_layer fp8 layers 1-1``)."""
    text = result.stdout + result.stderr
    return dict(Counter(re.findall(r"^\[\d\d:\d\d:\d\d\] (\w+)", text, re.MULTILINE)))


def test_budget_change_reruns_only_the_solve_and_what_follows(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["placement"]["target_effective_bits"] = 5.0
    name = wd.write_config("config/budget-5.yaml", config)
    assert wd.plan(name) == {"solve_placement": 1}
    scores_before = sorted(p.name for p in (wd.root / "results" / "score_sensitivity").iterdir())
    # the placement first (the checkpoint's path is known once it is solved), then its checkpoint
    ran = _rules_run(wd.snakemake(wd.paths(name)["placement"]["path"], "--configfile", name))
    ran_after = _rules_run(wd.snakemake(wd.paths(name)["checkpoint"]["path"], "--configfile", name))
    ran = {rule: ran.get(rule, 0) + ran_after.get(rule, 0) for rule in {*ran, *ran_after}}
    assert ran.get("solve_placement") == 1 and ran.get("export_checkpoint") == 1, ran
    assert not {"score_sensitivity", "collect_activation_stats", "sample_calibration"} & set(ran), ran
    # what follows: the rebuild of the new placement and its export
    assert set(ran) <= {"solve_placement", "quantize_layer", "export_checkpoint"}, ran
    assert sorted(p.name for p in (wd.root / "results" / "score_sensitivity").iterdir()) == scores_before
    paths = wd.paths(name)
    placement = json.loads((_dir(wd, paths, "placement") / "placement.json").read_text())
    assert bits_of({int(k): v for k, v in placement["layers"].items()}) <= 5.0
    # this budget's KLD runs (and what follows them) were not asked for
    kld = ("kld/", "gate/", "kld_report", "kld_verdict", "verify", "release")
    assert all(row["done"] for name, row in paths.items() if not name.startswith(kld))
    assert wd.plan() == {}  # the default budget's placement and checkpoint are still there


def test_adding_a_candidate_format_adds_its_window_and_rescores(built_workdir, tmp_path):
    """A workdir searched over {NVFP4, BF16} gains FP8: FP8's layer window runs, and so do the score
    passes (each carries every format's branches) and the solve; NVFP4's scores are the same floats.
    (That a rerun output has its old key and bytes: the kill campaign, which reruns every stage kind.)"""
    wd = built_workdir
    config = wd.config()
    config["placement"]["formats"] = ["nvfp4_w4a16", "bf16"]
    narrow = wd.write_config("config/no-fp8.yaml", config)
    wd.snakemake(wd.paths(narrow)["placement"]["path"], "--configfile", narrow)
    narrow_paths, paths = wd.paths(narrow), wd.paths()
    score_passes = [name for name in paths if name.startswith("scores/")]
    assert sorted(score_passes) == sorted(n for n in narrow_paths if n.startswith("scores/"))
    for name in score_passes:  # the same passes with and without FP8's branches
        without = json.loads((_dir(wd, narrow_paths, name) / "scores.json").read_text())
        full = json.loads((_dir(wd, paths, name) / "scores.json").read_text())
        assert narrow_paths[name]["key"] != paths[name]["key"]
        assert set(without["kl_sums"]) == {"nvfp4_w4a16"} and set(full["kl_sums"]) == {"nvfp4_w4a16", "fp8"}
        assert full["kl_sums"]["nvfp4_w4a16"] == without["kl_sums"]["nvfp4_w4a16"]
    # Leave results/ as a {NVFP4, BF16}-only history would: no FP8 layer results, passes or placement.
    parked = tmp_path / "parked"
    parked.mkdir()
    moved = [n for n in paths if n.startswith(("layers/fp8", "scores/"))] + ["placement"]
    for name in moved:
        shutil.move(_dir(wd, paths, name), parked / paths[name]["key"])
    try:
        # what follows the solve waits for its checkpoint: Snakemake plans it once the placement is known
        assert wd.plan() == {"quantize_layer": 1, "score_sensitivity": 2, "solve_placement": 1}
    finally:  # the session's other tests use this workdir's default results
        for name in moved:
            shutil.move(parked / paths[name]["key"], _dir(wd, paths, name))
    assert wd.plan() == {}


def test_scores_match_modelopt_auto_quantize_kl_div(built_workdir):
    """Issue acceptance: mixquant's scores equal ModelOpt auto_quantize(method="kl_div")'s scores for the
    same model, data and formats, within 1e-3 relative (max calibration, as ModelOpt's presets)."""
    from mixquant.quantize.activations import collect_activation_stats
    from mixquant.search.reference import modelopt_kl_div_scores
    from mixquant.search.score import modelopt_search_quant, sensitivity_scores

    wd = built_workdir
    paths = wd.paths()
    model_dir = resolve_model_dir(_dir(wd, paths, "model"))
    ids = load_token_ids(_dir(wd, paths, "calibration") / "calibration.safetensors")[:16]
    batch = 8
    # FP8 input amax over the same 16 sequences in the same batches, as ModelOpt's calibration sees them
    stats = collect_activation_stats(model_dir, ids, batch_size=batch, progress=False)
    model = load_search_model(model_dir)
    layers = list(range(1, 9))
    ours = {}
    for fmt in ("nvfp4_w4a16", "fp8"):
        quants = {}
        for layer in layers:
            amax = None
            if fmt == "fp8":
                amax = {
                    "gate_up": stats["gate_up_input_amax"][layer],
                    "down": stats["down_input_amax"][layer],
                }
            quants[layer] = modelopt_search_quant(model, layer, fmt, amax)
        ours[fmt] = sensitivity_scores(model, ids, quants, fmt, batch_size=batch)
    theirs = modelopt_kl_div_scores(
        model, ids, layers=layers, formats=["nvfp4_w4a16", "fp8"], batch_size=batch
    )
    worst = 0.0
    for layer in layers:
        for fmt in ("nvfp4_w4a16", "fp8"):
            a, b = ours[fmt][layer]["kl_sum"], theirs["scores"][layer][fmt]
            worst = max(worst, abs(a - b) / abs(b))
            assert a == pytest.approx(b, rel=1e-3), (layer, fmt, a, b)
    print(f"max relative difference vs ModelOpt: {worst:.2e}")
