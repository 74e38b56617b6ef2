"""ModelOpt's own AutoQuantize placement as a stage, on the small random Laguna (4 MoE layers, CPU): its
budget is mixquant's routed effective bits, its placement is what load_placement reads."""

from __future__ import annotations

import json

import pytest
import torch
from mixquant.calibration.tokens import save_token_ids
from mixquant.export.placement import load_placement
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.manifest import verify_manifest
from mixquant.model.families import experts_module_name
from mixquant.search import autoquantize
from mixquant.search.autoquantize import (
    AUTOQUANTIZE_FILE,
    modelopt_autoquantize_placement,
    run_autoquantize_placement,
)
from mixquant.search.groups import SearchGroup, effective_bits
from mixquant.search.run import PlacementSearchError
from mixquant.search.score import load_search_model

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

MOE_LAYERS = [1, 2, 3, 4]
FORMATS = ["nvfp4_w4a16", "fp8", "bf16"]
ROUTED_NUMEL = 16 * (2 * 16 * 32 + 32 * 16)  # experts x (gate_up + down) of one small-Laguna MoE layer
ACTIVE_RATIO = 2 / 16


def settings(**overrides):
    base = {
        "moe_layers": MOE_LAYERS,
        "formats": FORMATS,
        "target_effective_bits": 6.0,
        "cost_model": "numel",
        "method": "kl_div",
        "batch_size": 4,
        "numerics": {"profile": "portable", "threads": 1, "device": "cpu"},
        "threads": 1,
    }
    base.update(overrides)
    return base


@pytest.fixture(scope="module")
def calibration(tmp_path_factory, small_calibration_ids):
    out = tmp_path_factory.mktemp("calibration")
    save_token_ids(out / "calibration.safetensors", small_calibration_ids, {})
    return out


def run(root, model, calibration, **overrides):
    preimage = {"stage": "autoquantize_placement", "settings": settings(**overrides)}
    out = root / "autoquantize_placement" / canonical_sha256(preimage)
    return run_autoquantize_placement(
        out, model=model, calibration=calibration, settings=preimage["settings"], preimage=preimage
    )


def project_routed_bits(placement: dict[int, str], cost_weight: float = 1.0) -> float:
    """mixquant's own budget formula (what solve_placement holds a placement to)."""
    groups = [
        SearchGroup(experts_module_name(layer), ROUTED_NUMEL, dict.fromkeys(FORMATS, 0.0), cost_weight)
        for layer in MOE_LAYERS
    ]
    return effective_bits(groups, {experts_module_name(layer): fmt for layer, fmt in placement.items()})


@pytest.fixture(scope="module")
def published(tmp_path_factory, small_laguna, calibration):
    return run(tmp_path_factory.mktemp("first"), small_laguna, calibration)


def test_placement_is_loadable_and_within_budget(published):
    verify_manifest(published)
    placement = load_placement(published / "placement.json")
    assert sorted(placement) == MOE_LAYERS
    assert set(placement.values()) <= set(FORMATS)
    document = json.loads((published / "placement.json").read_text())
    meta = document["metadata"]
    assert meta["source"] == "modelopt_autoquantize" and meta["method"] == "kl_div"
    assert meta["target_effective_bits"] == 6.0
    ours = project_routed_bits(placement)
    assert meta["routed_effective_bits"] == ours <= 6.0
    # ModelOpt's own effective bits of its selection are mixquant's routed bits exactly
    assert meta["modelopt_effective_bits"] == ours
    # a budget with room to spend: not everything at the cheapest format
    assert set(placement.values()) != {"nvfp4_w4a16"}


def test_audit_records_modelopts_search(published):
    audit = json.loads((published / AUTOQUANTIZE_FILE).read_text())
    assert audit["modelopt_version"].startswith("0.47.")
    assert audit["is_satisfied"] is True
    assert audit["tokens"] == 6 * 24 and audit["batches"] == 2
    assert audit["selection"] == {str(k): v for k, v in load_placement(published / "placement.json").items()}
    assert sum(audit["counts"].values()) == len(MOE_LAYERS)
    for key in ("scores", "clamped_scores", "costs"):
        assert sorted(audit[key]) == [str(layer) for layer in MOE_LAYERS]
    for layer in map(str, MOE_LAYERS):
        assert audit["scores"][layer]["nvfp4_w4a16"] > 0 and audit["scores"][layer]["bf16"] == 0
        assert audit["costs"][layer] == {
            "nvfp4_w4a16": ROUTED_NUMEL * 4.5 / 16,
            "fp8": ROUTED_NUMEL * 8 / 16,
            "bf16": ROUTED_NUMEL,
        }
    # the denominator is the routed experts alone: every other module is excluded from the cost by name
    assert audit["cost_denominator"] == len(MOE_LAYERS) * ROUTED_NUMEL
    constraints = audit["constraints"]
    assert constraints["effective_bits"] == 6.0 and constraints["cost_model"] == "weight"
    excluded = constraints["cost"]["excluded_module_name_patterns"]
    assert "lm_head" in excluded and "model.layers.0.mlp.gate_proj" in excluded
    assert not {experts_module_name(layer) for layer in MOE_LAYERS} & set(excluded)


def test_same_inputs_same_bytes(published, tmp_path, small_laguna, calibration):
    again = run(tmp_path, small_laguna, calibration)
    for name in ("placement.json", AUTOQUANTIZE_FILE):
        assert (again / name).read_bytes() == (published / name).read_bytes()


def test_active_moe_cost_model(small_laguna, small_calibration_ids, published):
    """active_moe: ModelOpt weighs the experts by top_k / num_experts, as mixquant does; the budget is the
    same routed bits (the weight is common to every group), and so is the pick."""
    result = modelopt_autoquantize_placement(
        load_search_model(small_laguna),
        small_calibration_ids,
        layers=MOE_LAYERS,
        formats=FORMATS,
        batch_size=4,
        target_effective_bits=6.0,
        cost_model="active_moe",
    )
    audit = result["audit"]
    assert audit["constraints"]["cost_model"] == "active_moe"
    assert audit["constraints"]["cost"]["active_moe_expert_ratio"] == ACTIVE_RATIO
    assert audit["cost_denominator"] == len(MOE_LAYERS) * ROUTED_NUMEL * ACTIVE_RATIO
    ours = project_routed_bits(result["selection"], ACTIVE_RATIO)
    assert result["routed_effective_bits"] == ours == audit["modelopt_effective_bits"] <= 6.0
    assert result["selection"] == load_placement(published / "placement.json")


def test_whole_model_denominator_would_not_be_the_budget(small_laguna, small_calibration_ids):
    """Without the exclusion (ModelOpt's default constraint) every other module counts at 16 bits: 6.0 bits
    is out of reach on this model, and at a reachable target ModelOpt's effective bits are not the routed
    experts' -- the reason for the exclusion."""
    from mixquant.search.reference import modelopt_kl_div_scores

    model = load_search_model(small_laguna)

    def default_constraint(bits):
        return modelopt_kl_div_scores(
            model,
            small_calibration_ids,
            layers=MOE_LAYERS,
            formats=FORMATS[:2],
            batch_size=4,
            effective_bits=bits,
        )

    with pytest.raises(ValueError, match="effective_bits target 6.0 is infeasible"):
        default_constraint(6.0)
    res = default_constraint(12.0)
    assert res["cost_denominator"] > len(MOE_LAYERS) * ROUTED_NUMEL
    assert res["effective_bits"] <= 12.0
    assert res["effective_bits"] != project_routed_bits(res["selection"])


def test_budget_below_all_nvfp4_fails_in_one_line(tmp_path, small_laguna, calibration):
    with pytest.raises(PlacementSearchError, match=r"target_effective_bits.*4\.5") as info:
        run(tmp_path, small_laguna, calibration, target_effective_bits=4.0)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "autoquantize_placement").exists() or not any(
        (tmp_path / "autoquantize_placement").iterdir()
    )


def test_selection_over_budget_fails_in_one_line(tmp_path, small_laguna, calibration, monkeypatch):
    """ModelOpt's bisection can end on a placement over the budget (is_satisfied False): the stage stops."""
    real = autoquantize.modelopt_kl_div_scores

    def over_budget(*args, **kwargs):
        result = real(*args, **kwargs)
        return {**result, "selection": dict.fromkeys(MOE_LAYERS, "fp8"), "selection_satisfied": False}

    monkeypatch.setattr(autoquantize, "modelopt_kl_div_scores", over_budget)
    with pytest.raises(PlacementSearchError, match=r"over budget \(8\.0000 > 6\.0") as info:
        run(tmp_path, small_laguna, calibration)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"formats": ["nvfp4_w4a16", "fp8"]}, "lack bf16"),
        ({"method": "gradient"}, "method 'gradient' is not supported"),
        ({"cost_model": "bytes"}, "cost_model must be one of"),
    ],
)
def test_bad_settings_fail_in_one_line(tmp_path, small_laguna, calibration, overrides, message):
    with pytest.raises(PlacementSearchError, match=message) as info:
        run(tmp_path, small_laguna, calibration, **overrides)
    assert "\n" not in str(info.value)
