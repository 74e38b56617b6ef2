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
    """The default config with its explicit placement (the rebuild graph is then known up front)."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["placement"]["source"] = "explicit"
    return config


@pytest.fixture(scope="module")
def raw_search():
    """The default config as shipped: the KL-sensitivity search decides the placement."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["placement"]["source"] == "search"
    return config


# (and verify_hashes, downstream of the prompt, the reference and the checkpoint: tests/release/)
KLD_STAGES = {"reference_logits", "run_kld", "gate_kld", "kld_report", "check_kld_gates", "verify_hashes"}
# assemble_release holds the whole recipe, so every knob moves it (tests/release/test_recipe.py)
KLD_STAGES |= {"assemble_release"}


def keys(raw_config):
    """Keys of the quantization graph (the KLD stages downstream of it are tested separately below)."""
    art = resolve_artifacts(validate_config(raw_config))
    return {
        name: a.key
        for name, a in art.items()
        if a.stage not in KLD_STAGES and not name.startswith("candidate/")
    }


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
    # layers 1-4 of the placement, 5-8 of the uniform-NVFP4 KLD candidate
    assert moved(keys(raw), keys(changed_raw)) == ["checkpoint"] + [
        f"layer/{layer}/nvfp4_w4a16" for layer in range(1, 9)
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


# ------------------------------------------------------------------------------------------ search


def edited_placement(raw_config, **values):
    out = copy.deepcopy(raw_config)
    for key, value in values.items():
        if key in ("method", "calibration", "pins", "layers_per_job", "batch_size"):
            out["placement"]["search"][key] = value
        else:
            out["placement"][key] = value
    return out


def test_search_graph_ends_at_the_placement_until_it_is_solved(raw_search):
    art = resolve_artifacts(validate_config(raw_search))
    scores = sorted(name for name, a in art.items() if a.stage == "score_sensitivity")
    # 8 MoE layers in chunks of 4, per scored format (bf16 is the reference: score 0, no job)
    assert scores == ["scores/fp8/1-4", "scores/fp8/5-8", "scores/nvfp4_w4a16/1-4", "scores/nvfp4_w4a16/5-8"]
    layers = sorted(name for name, a in art.items() if a.stage == "quantize_layer")
    assert layers == sorted(f"layer/{layer}/{fmt}" for layer in range(1, 9) for fmt in ("fp8", "nvfp4_w4a16"))
    assert "checkpoint" not in art
    placement = art["placement"]
    assert placement.stage == "solve_placement"
    assert set(placement.upstream) == {"model"} | {
        f"scores_{fmt}_{i}" for fmt in ("fp8", "nvfp4_w4a16") for i in (1, 5)
    }
    # a score job reads exactly its own layers' results in its format
    assert art["scores/fp8/5-8"].upstream == {
        "model": "model",
        "calibration": "calibration",
        **{f"layer_{layer}": f"layer/{layer}/fp8" for layer in range(5, 9)},
    }


def test_search_scores_the_weights_the_rebuild_ships(raw_search, raw):
    """calibration: rebuild -> the scored layer x format results are the rebuild's own (same keys)."""
    search, explicit = keys(raw_search), keys(raw)
    for name in ("layer/1/nvfp4_w4a16", "layer/5/fp8"):
        assert search[name] == explicit[name]


def test_max_calibration_scores_modelopt_fake_quant_of_the_bf16_weights(raw_search):
    art = resolve_artifacts(validate_config(edited_placement(raw_search, calibration="max")))
    assert art["scores/fp8/5-8"].upstream == {
        "model": "model",
        "calibration": "calibration",
        "activations": "activations",
    }
    assert art["scores/nvfp4_w4a16/1-4"].upstream == {"model": "model", "calibration": "calibration"}
    assert art["scores/fp8/5-8"].settings["weights"] == "max"
    scores = [a for a in art.values() if a.stage == "score_sensitivity"]
    assert not any(role.startswith("layer_") for a in scores for role in a.upstream)  # nothing rebuilt
    assert art["scores/fp8/5-8"].key != resolve_artifacts(validate_config(raw_search))["scores/fp8/5-8"].key


def test_budget_or_solver_change_moves_only_the_placement(raw_search):
    base = keys(raw_search)
    for change in ({"target_effective_bits": 6.0}, {"method": "minimax"}, {"cost_model": "active_moe"}):
        assert moved(base, keys(edited_placement(raw_search, **change))) == ["placement"], change


def test_adding_a_format_adds_only_its_scoring(raw_search):
    without = keys(edited_placement(raw_search, formats=["nvfp4_w4a16", "bf16"]))
    with_fp8 = keys(raw_search)
    added = sorted(set(with_fp8) - set(without))
    assert added == ["layer/5/fp8", "layer/6/fp8", "layer/7/fp8", "layer/8/fp8"][:0] + sorted(
        [f"layer/{layer}/fp8" for layer in range(1, 9)] + ["scores/fp8/1-4", "scores/fp8/5-8"]
    )
    assert not set(without) - set(with_fp8)
    assert moved(without, with_fp8) == ["placement"]  # every nvfp4 score and layer key is unchanged


def test_pinned_layers_are_scored_only_in_their_format(raw_search):
    pinned = edited_placement(
        raw_search, pins=[{"layers": "8", "format": "bf16"}, {"layers": "1", "format": "fp8"}]
    )
    art = resolve_artifacts(validate_config(pinned))
    assert art["scores/nvfp4_w4a16/2-4"].settings["layers"] == [2, 3, 4]
    assert art["scores/nvfp4_w4a16/5-7"].settings["layers"] == [5, 6, 7]
    assert art["scores/fp8/1-4"].settings["layers"] == [1, 2, 3, 4]
    assert art["scores/fp8/5-7"].settings["layers"] == [5, 6, 7]
    assert art["placement"].settings["pins"] == {"1": "fp8", "8": "bf16"}


def test_pins_must_be_candidates_and_moe_layers(raw_search):
    from mixquant.config import ConfigError

    with pytest.raises(ConfigError, match="not a candidate format"):
        validate_config(
            edited_placement(
                raw_search, formats=["nvfp4_w4a16", "bf16"], pins=[{"layers": "3", "format": "fp8"}]
            )
        )
    with pytest.raises(ValueError, match="layer 12, which is not a MoE layer"):
        resolve_artifacts(
            validate_config(edited_placement(raw_search, pins=[{"layers": "12", "format": "bf16"}]))
        )


def test_checkpoint_follows_the_placement_content_not_the_budget(raw_search, raw):
    placement = {1: "nvfp4_w4a16", 2: "nvfp4_w4a16", 3: "nvfp4_w4a16", 4: "nvfp4_w4a16", 5: "fp8", 6: "fp8"}
    placement.update({7: "bf16", 8: "bf16"})
    a = resolve_artifacts(validate_config(raw_search), placement=placement)
    b = resolve_artifacts(
        validate_config(edited_placement(raw_search, target_effective_bits=9.5)), placement=placement
    )
    assert a["placement"].key != b["placement"].key
    assert a["checkpoint"].key == b["checkpoint"].key
    # ... and it is the very checkpoint an explicit placement with the same map gives
    assert a["checkpoint"].key == resolve_artifacts(validate_config(raw))["checkpoint"].key
    assert a["layer/7/bf16"].stage == "quantize_layer"


# --------------------------------------------------------------------------------------------- kld


TOY_PLACEMENT = {1: "nvfp4_w4a16", 2: "nvfp4_w4a16", 3: "fp8", 4: "fp8", 5: "nvfp4_w4a16"}
TOY_PLACEMENT.update({6: "nvfp4_w4a16", 7: "bf16", 8: "bf16"})


def by_stage(art, stage):
    return sorted(name for name, a in art.items() if a.stage == stage)


def test_kld_graph_before_and_after_the_placement(raw_search):
    cfg = validate_config(raw_search)
    before = resolve_artifacts(cfg)
    # what does not depend on the placement is planned up front: the uniform-NVFP4 candidate's export
    # and the runs and gates of uniform-nvfp4 (the baseline) and the BF16 self-check
    assert before["reference_logits"].upstream == {"model": "model", "prompt": "prompt"}
    assert by_stage(before, "export_checkpoint") == ["candidate/uniform-nvfp4"]
    runs = by_stage(before, "run_kld")
    assert len(runs) == 2 * 2 * 5 and not any(name.startswith("kld/searched/") for name in runs)
    assert by_stage(before, "gate_kld") == ["gate/bf16/bfloat16", "gate/bf16/fp8"] + [
        "gate/uniform-nvfp4/bfloat16",
        "gate/uniform-nvfp4/fp8",
    ]
    assert "kld_report" not in before and "kld_verdict" not in before
    after = resolve_artifacts(cfg, placement=TOY_PLACEMENT)
    assert len(by_stage(after, "run_kld")) == 3 * 2 * 5 and len(by_stage(after, "gate_kld")) == 6
    assert after["kld/searched/fp8/4"].upstream["candidate"] == "checkpoint"
    assert after["kld/bf16/bfloat16/0"].upstream["candidate"] == "model"
    assert after["kld/uniform-nvfp4/fp8/0"].upstream["candidate"] == "candidate/uniform-nvfp4"
    gate = after["gate/searched/fp8"]
    assert set(gate.upstream) == {f"run_{i}" for i in range(5)} | {f"baseline_run_{i}" for i in range(5)}
    assert gate.upstream["baseline_run_3"] == "kld/uniform-nvfp4/fp8/3"
    assert "baseline_run_0" not in after["gate/uniform-nvfp4/fp8"].upstream  # the baseline itself
    assert after["gate/bf16/bfloat16"].settings["require_exact_zero"] is True
    assert after["gate/bf16/fp8"].settings["require_exact_zero"] is False
    assert after["kld_verdict"].upstream == {"report": "kld_report"}
    # the uniform candidate's layers are the search's own NVFP4 results (same keys)
    assert after["candidate/uniform-nvfp4"].upstream["layer_3"] == "layer/3/nvfp4_w4a16"


def test_run_keys_follow_content_not_names(raw_search):
    renamed = copy.deepcopy(raw_search)
    renamed["kld"]["candidates"][1]["name"] = "nvfp4-everywhere"
    renamed["kld"]["baseline"] = "nvfp4-everywhere"
    a = resolve_artifacts(validate_config(raw_search))
    b = resolve_artifacts(validate_config(renamed))
    assert a["kld/uniform-nvfp4/fp8/2"].key == b["kld/nvfp4-everywhere/fp8/2"].key
    keys_ = {a[f"kld/bf16/{kv}/{run}"].key for kv in ("bfloat16", "fp8") for run in range(5)}
    assert len(keys_) == 10  # every (KV dtype, run) is its own fresh-engine job


def test_gate_settings_move_only_gates_report_and_verdict(raw_search):
    changed = copy.deepcopy(raw_search)
    changed["kld"]["gates"]["max_mean_kld"] = 0.01
    a = resolve_artifacts(validate_config(raw_search), placement=TOY_PLACEMENT)
    b = resolve_artifacts(validate_config(changed), placement=TOY_PLACEMENT)
    assert {n for n in a if a[n].key != b[n].key} == {n for n in a if n.startswith("gate/")} | {
        "kld_report",
        "kld_verdict",
        "release",  # the recipe it ships holds the gates
    }
    seed = copy.deepcopy(raw_search)
    seed["kld"]["seed"] = 1
    c = resolve_artifacts(validate_config(seed), placement=TOY_PLACEMENT)
    moved_ = {n for n in a if a[n].key != c[n].key}
    assert "reference_logits" in moved_ and all(n in moved_ for n in a if n.startswith("kld/"))
    assert "checkpoint" not in moved_ and "placement" not in moved_


def test_bad_kld_candidates_are_refused(raw_search):
    from mixquant.config import ConfigError

    bad = copy.deepcopy(raw_search)
    bad["kld"]["baseline"] = "nope"
    with pytest.raises(ConfigError, match="baseline 'nope' is not a candidate"):
        validate_config(bad)
    bad = copy.deepcopy(raw_search)
    bad["kld"]["candidates"].append({"name": "x", "source": "uniform"})
    with pytest.raises(ConfigError, match="`format` is required"):
        validate_config(bad)
    bad = copy.deepcopy(raw_search)
    bad["kld"]["candidates"].append({"name": "bf16", "source": "bf16"})
    with pytest.raises(ConfigError, match="used twice"):
        validate_config(bad)
