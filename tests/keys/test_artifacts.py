"""Merkle keys from config alone: which knob moves which key."""

import copy
from pathlib import Path

import pytest
import yaml
from mixquant.config import validate_config
from mixquant.keys.artifacts import resolve_artifacts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def keys(raw_config):
    return {name: art.key for name, art in resolve_artifacts(validate_config(raw_config)).items()}


def edited(raw_config, section, **values):
    out = copy.deepcopy(raw_config)
    out.setdefault(section, {}).update(values)
    return out


def test_keys_are_stable_and_paths_are_keyed(raw):
    first, second = keys(raw), keys(copy.deepcopy(raw))
    assert first == second
    art = resolve_artifacts(validate_config(raw))
    for artifact in art.values():
        assert artifact.path == Path("results") / artifact.stage / artifact.key


def moved(base, changed):
    return sorted(name for name in base if changed.get(name) != base[name])


def test_calibration_knob_moves_calibration_and_what_reads_it(raw):
    base, changed = keys(raw), keys(edited(raw, "calibration", num_samples=32))
    # FP8 layers read the activation statistics; NVFP4 and BF16 layers only read weights.
    assert moved(base, changed) == ["activations", "calibration", "checkpoint", "layer/5/fp8", "layer/6/fp8"]


def test_nvfp4_knob_moves_only_nvfp4_layers(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["quantize"]["nvfp4_w4a16"]["calibration"] = "max"
    assert moved(keys(raw), keys(changed_raw)) == ["checkpoint"] + [
        f"layer/{layer}/nvfp4_w4a16" for layer in (1, 2, 3, 4)
    ]


def test_moving_one_layer_adds_exactly_that_layer_x_format(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["placement"]["explicit"]["layers"].append({"layers": "7", "format": "fp8"})
    base, changed = keys(raw), keys(changed_raw)
    assert set(changed) - set(base) == {"layer/7/fp8"} and set(base) - set(changed) == {"layer/7/bf16"}
    assert moved(base, changed) == ["checkpoint", "layer/7/bf16"]


def test_a_layer_x_format_key_does_not_depend_on_the_rest_of_the_placement(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["placement"]["explicit"]["layers"] = [{"layers": "1-8", "format": "nvfp4_w4a16"}]
    base, changed = keys(raw), keys(changed_raw)
    assert all(
        changed[f"layer/{layer}/nvfp4_w4a16"] == base[f"layer/{layer}/nvfp4_w4a16"] for layer in (1, 2, 3, 4)
    )


def test_prompt_pin_moves_only_prompt(raw):
    base, changed = keys(raw), keys(edited(raw, "prompt", sha256="a" * 64))
    assert changed["prompt"] != base["prompt"]
    assert changed["model"] == base["model"] and changed["calibration"] == base["calibration"]


def test_model_knob_moves_everything_downstream(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["model"]["toy"]["seed"] = 1
    base, changed = keys(raw), keys(changed_raw)
    assert moved(base, changed) == sorted(base)


def test_defaults_spelled_out_give_the_same_keys(raw):
    explicit = edited(raw, "calibration", short_policy="pack")
    assert keys(explicit) == keys(raw)


def test_paths_are_not_part_of_keys(raw, tmp_path):
    moved = copy.deepcopy(raw)
    moved["dataset"]["local"]["path"] = str(tmp_path / "elsewhere.jsonl")
    assert keys(moved) == keys(raw)


def test_preimage_names_code_and_packages(raw):
    preimage = resolve_artifacts(validate_config(raw))["calibration"].preimage
    assert set(preimage) == {"key_schema", "stage", "config", "upstream", "code", "packages"}
    assert "mixquant.calibration.sample" in preimage["code"]
    assert preimage["packages"]["transformers"].startswith("5.24")
