"""solve_placement as a stage: inputs are score_sensitivity results, outputs the placement and its audit."""

from __future__ import annotations

import csv
import json

import pytest
from mixquant.export.placement import load_placement
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.manifest import verify_manifest
from mixquant.search.run import PlacementSearchError, run_solve_placement, search_groups

# NVFP4 / FP8 per-token KL of 4 layers: layer 4 is very sensitive, layer 1 hardly at all.
SCORES = {
    "nvfp4_w4a16": {"1": 0.001, "2": 0.004, "3": 0.006, "4": 0.05},
    "fp8": {"1": 0.0001, "2": 0.0003, "3": 0.0004, "4": 0.002},
}
CONFIG = {"num_experts": 16, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2}


def settings(**overrides):
    base = {
        "moe_layers": [1, 2, 3, 4],
        "formats": ["nvfp4_w4a16", "fp8", "bf16"],
        "target_effective_bits": 7.0,
        "cost_model": "numel",
        "method": "ilp",
        "pins": {},
        "frontier_points": 9,
    }
    base.update(overrides)
    return base


@pytest.fixture
def inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    return model, score_jobs(tmp_path, SCORES)


def score_jobs(tmp_path, scores, formats=("nvfp4_w4a16", "fp8")):
    """Two score_sensitivity passes of 1 sequence x 50 tokens each, 2 micro-batches of 25 tokens' worth:
    their KL sums add up to score x 100 tokens."""
    roles = {}
    for first in (0, 1):
        directory = tmp_path / f"scores-{first}"
        directory.mkdir(parents=True)
        result = {
            "sequences": [first, first + 1],
            "sequence_length": 50,
            "kl_sums": {
                fmt: {layer: [v * 25, v * 25] for layer, v in scores[fmt].items()} for fmt in formats
            },
        }
        (directory / "scores.json").write_text(json.dumps(result))
        roles[f"scores_{first}"] = directory
    return roles


def test_passes_add_up_in_calibration_order(tmp_path):
    from mixquant.search.score import scores_table

    values = [0.1, 0.2, 0.3, 1e-17]
    results = [
        {"sequences": [2, 4], "sequence_length": 3, "kl_sums": {"fp8": {"1": values[2:]}}},
        {"sequences": [0, 2], "sequence_length": 3, "kl_sums": {"fp8": {"1": values[:2]}}},
    ]
    total = 0.0
    for value in values:  # left to right from 0.0: the accumulation of one pass over every batch
        total += value
    assert scores_table(results) == {1: {"fp8": total / 12}}
    with pytest.raises(ValueError, match="do not tile the calibration: sequences 2.. missing"):
        scores_table([results[1], {**results[0], "sequences": [4, 6]}])


def solve(tmp_path, inputs, **overrides):
    model, roles = inputs
    preimage = {"stage": "solve_placement", "config": settings(**overrides)}
    out = tmp_path / "results" / "solve_placement" / canonical_sha256(preimage)
    run_solve_placement(out, model=model, settings=settings(**overrides), preimage=preimage, **roles)
    return out


def test_outputs(tmp_path, inputs):
    out = solve(tmp_path, inputs)
    assert verify_manifest(out) == []
    # 7.0 bits x 4 equal layers = 28: BF16 anywhere costs >= 4.5*3+16 = 29.5 and three FP8 28.5, so the
    # best is FP8 on the two most sensitive layers (25 bits, KL .001+.004+.0004+.002 = .0074).
    placement = load_placement(out / "placement.json")
    assert placement == {1: "nvfp4_w4a16", 2: "nvfp4_w4a16", 3: "fp8", 4: "fp8"}
    audit = json.loads((out / "placement_audit.json").read_text())
    assert audit["budget"]["effective_bits"] <= 7.0
    assert audit["objective"] == pytest.approx(0.001 + 0.004 + 0.0004 + 0.002)
    assert audit["counts"] == {"nvfp4_w4a16": 2, "fp8": 2, "bf16": 0}
    assert audit["budget"]["effective_bits"] == 6.25 and audit["solver"]["status"] == "Optimal"
    assert audit["uniform"]["uniform nvfp4_w4a16"]["effective_bits"] == 4.5
    rows = list(csv.DictReader((out / "frontier.csv").open()))
    assert [float(r["target_effective_bits"]) for r in rows] == pytest.approx(
        [4.5 + 11.5 * i / 8 for i in range(9)]
    )
    assert (out / "frontier.png").stat().st_size > 1000 and (out / "scores_heatmap.png").stat().st_size > 1000


def test_infeasible_budget_names_the_minimum(tmp_path, inputs):
    with pytest.raises(
        PlacementSearchError, match=r"target_effective_bits.*minimum achievable effective bits is 4\.5"
    ):
        solve(tmp_path, inputs, target_effective_bits=4.0)
    assert not (tmp_path / "results" / "solve_placement").exists() or not any(
        (tmp_path / "results" / "solve_placement").iterdir()
    )


def test_pins_fix_layers(tmp_path, inputs):
    out = solve(tmp_path, inputs, pins={"4": "bf16"}, target_effective_bits=8.0)
    placement = load_placement(out / "placement.json")
    assert placement[4] == "bf16"
    assert sum({"nvfp4_w4a16": 4.5, "fp8": 8.0, "bf16": 16.0}[f] for f in placement.values()) <= 32


def test_missing_score_is_named(tmp_path, inputs):
    model, _ = inputs
    roles = score_jobs(tmp_path / "nvfp4-only", SCORES, formats=("nvfp4_w4a16",))
    with pytest.raises(PlacementSearchError, match="layer 1: no fp8 score"):
        run_solve_placement(
            tmp_path / canonical_sha256({}), model=model, settings=settings(), preimage={}, **roles
        )


def test_active_moe_weights_routed_experts_by_top_k_over_experts():
    table = {layer: {"nvfp4_w4a16": 1.0, "fp8": 0.5} for layer in (1, 2)}
    groups = search_groups(settings(moe_layers=[1, 2], cost_model="active_moe"), table, CONFIG)
    assert [g.cost_weight for g in groups] == [2 / 16, 2 / 16]
    assert groups[0].numel == 16 * 3 * 64 * 32
