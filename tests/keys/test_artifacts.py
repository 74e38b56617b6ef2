"""Merkle keys from config alone: which knob moves which key."""

import copy
from pathlib import Path

import pytest
import yaml
from mixquant.config import validate_config
from mixquant.graph import resolve_artifacts

REPO = Path(__file__).resolve().parents[2]


def without_autoquantize(config: dict) -> dict:
    """The config without its ModelOpt AutoQuantize candidate, whose own placement stage (and the graph it
    completes) is tested on its own below: here the KLD graph is complete once the search's placement is."""
    config["kld"]["candidates"] = [
        c for c in config["kld"]["candidates"] if c["source"] != "modelopt_autoquantize"
    ]
    return config


@pytest.fixture(scope="module")
def raw():
    """The default config with its explicit placement (the rebuild graph is then known up front)."""
    config = without_autoquantize(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    config["placement"]["source"] = "explicit"
    return config


@pytest.fixture(scope="module")
def raw_search():
    """The default config as shipped: the KL-sensitivity search decides the placement."""
    config = without_autoquantize(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    assert config["placement"]["source"] == "search"
    return config


@pytest.fixture(scope="module")
def shipped():
    """The default config exactly as shipped."""
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


@pytest.fixture
def with_modelopt(shipped):
    """The default config with ModelOpt's AutoQuantize placement as a candidate (docs/experiments.md)."""
    config = copy.deepcopy(shipped)
    modelopt = {"name": "modelopt-autoquantize", "source": "modelopt_autoquantize"}
    config["kld"]["candidates"].insert(1, modelopt)
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
    assert moved(base, changed) == ["activations", "calibration", "checkpoint", "layers/fp8/1-8"]


def test_nvfp4_knob_moves_only_nvfp4_layers(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["quantize"]["nvfp4_w4a16"]["calibration"] = "max"
    # one window of all 8 MoE layers (the placement's 1-4 and the uniform-NVFP4 candidate's 5-8)
    assert moved(keys(raw), keys(changed_raw)) == ["checkpoint", "layers/nvfp4_w4a16/1-8"]


def test_quantize_windows_cover_every_moe_layer_in_each_placed_format(raw):
    art = resolve_artifacts(validate_config(raw))
    windows = {name: a.settings for name, a in art.items() if a.stage == "quantize_layer"}
    assert sorted(windows) == ["layers/bf16/1-8", "layers/fp8/1-8", "layers/nvfp4_w4a16/1-8"]
    assert all(settings["layers"] == list(range(1, 9)) for settings in windows.values())
    assert set(art["layers/fp8/1-8"].upstream) == {"model", "activations"}
    assert set(art["layers/bf16/1-8"].upstream) == {"model"}
    # the export reads each layer from the window of its placed format
    assert art["checkpoint"].upstream["layer_5"] == "layers/fp8/1-8"
    assert art["checkpoint"].upstream["layer_8"] == "layers/bf16/1-8"


def test_moving_one_layer_reuses_every_window(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["placement"]["explicit"]["layers"].append({"layers": "7", "format": "fp8"})
    base, changed = keys(raw), keys(changed_raw)
    assert set(changed) == set(base)
    assert moved(base, changed) == ["checkpoint"]


def test_one_layer_per_job_moves_exactly_that_layer_x_format(raw):
    single = edited(raw, "quantize", layers_per_job=1)
    changed_raw = copy.deepcopy(single)
    changed_raw["placement"]["explicit"]["layers"].append({"layers": "7", "format": "fp8"})
    base, changed = keys(single), keys(changed_raw)
    assert set(changed) - set(base) == {"layers/fp8/7-7"} and set(base) - set(changed) == {"layers/bf16/7-7"}
    assert moved(base, changed) == ["checkpoint", "layers/bf16/7-7"]
    # the window size is a knob of the job layout: it moves the windows, not what they are computed from
    assert keys(single)["activations"] == keys(raw)["activations"]


def test_window_keys_do_not_depend_on_the_placement(raw):
    changed_raw = copy.deepcopy(raw)
    changed_raw["placement"]["explicit"]["layers"] = [{"layers": "1-8", "format": "nvfp4_w4a16"}]
    base, changed = keys(raw), keys(changed_raw)
    assert changed["layers/nvfp4_w4a16/1-8"] == base["layers/nvfp4_w4a16/1-8"]
    single = edited(raw, "quantize", layers_per_job=1)
    single_changed = edited(changed_raw, "quantize", layers_per_job=1)
    assert all(
        keys(single_changed)[f"layers/nvfp4_w4a16/{layer}-{layer}"]
        == keys(single)[f"layers/nvfp4_w4a16/{layer}-{layer}"]
        for layer in (1, 2, 3, 4)
    )


def test_prompt_pin_moves_only_prompt(raw):
    base, changed = keys(raw), keys(edited(raw, "prompt", sha256="a" * 64))
    assert changed["prompt"] != base["prompt"]
    assert changed["model"] == base["model"] and changed["calibration"] == base["calibration"]


def test_model_knob_moves_everything_downstream(raw):
    # the shipped toy vs retraining it (build_toy_model): another model, so every key downstream moves
    changed_raw = copy.deepcopy(raw)
    changed_raw["model"] = {"source": "toy", "toy": {**raw["model"]["toy"], "seed": 1}}
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


SEARCH_KEYS = ("method", "calibration", "pins", "batch_size", "macro_batch", "stack_branches", "refine")


def edited_placement(raw_config, **values):
    out = copy.deepcopy(raw_config)
    for key, value in values.items():
        if key in SEARCH_KEYS:
            out["placement"]["search"][key] = value
        else:
            out["placement"][key] = value
    return out


BOTH = ["nvfp4_w4a16", "fp8"]


def test_search_graph_ends_at_the_placement_until_it_is_solved(raw_search):
    art = resolve_artifacts(validate_config(raw_search))
    scores = sorted(name for name, a in art.items() if a.stage == "score_sensitivity")
    # 64 calibration sequences in macro-batches of 32: one streamed pass each, every (layer, format)
    assert scores == ["scores/0-31", "scores/32-63"]
    layers = sorted(name for name, a in art.items() if a.stage == "quantize_layer")
    assert layers == ["layers/fp8/1-8", "layers/nvfp4_w4a16/1-8"]  # one window per scored format
    assert "checkpoint" not in art
    placement = art["placement"]
    assert placement.stage == "solve_placement"
    assert set(placement.upstream) == {"model", "scores_0", "scores_32"}
    # a pass reads every scored layer x format result (from the windows holding them)
    assert art["scores/32-63"].upstream == {
        "model": "model",
        "calibration": "calibration",
        **{f"{fmt}_layer_{layer}": f"layers/{fmt}/1-8" for fmt in BOTH for layer in range(1, 9)},
    }
    assert art["scores/32-63"].settings["sequences"] == [32, 64]
    assert art["scores/32-63"].settings["scored"] == {str(layer): BOTH for layer in range(1, 9)}


def test_search_scores_the_weights_the_rebuild_ships(raw_search, raw):
    """calibration: rebuild -> the scored layer x format results are the rebuild's own (same keys)."""
    search, explicit = keys(raw_search), keys(raw)
    for name in ("layers/nvfp4_w4a16/1-8", "layers/fp8/1-8"):
        assert search[name] == explicit[name]


def test_max_calibration_scores_modelopt_fake_quant_of_the_bf16_weights(raw_search):
    art = resolve_artifacts(validate_config(edited_placement(raw_search, calibration="max")))
    assert art["scores/32-63"].upstream == {
        "model": "model",
        "calibration": "calibration",
        "activations": "activations",
    }
    assert art["scores/32-63"].settings["weights"] == "max"
    scores = [a for a in art.values() if a.stage == "score_sensitivity"]
    assert not any("_layer_" in role for a in scores for role in a.upstream)  # no rebuilt layer read
    assert art["scores/32-63"].key != resolve_artifacts(validate_config(raw_search))["scores/32-63"].key


def test_budget_or_solver_change_moves_only_the_placement(raw_search):
    base = keys(raw_search)
    for change in ({"target_effective_bits": 7.0}, {"method": "minimax"}, {"cost_model": "active_moe"}):
        assert moved(base, keys(edited_placement(raw_search, **change))) == ["placement"], change


def test_scoring_knobs_move_the_score_jobs_and_the_solve_only(raw_search):
    base = keys(raw_search)
    for change in ({"stack_branches": True}, {"batch_size": 4}):
        assert moved(base, keys(edited_placement(raw_search, **change))) == [
            "placement",
            "scores/0-31",
            "scores/32-63",
        ], change
    single = keys(edited_placement(raw_search, macro_batch=64))
    assert sorted(set(single) - set(base)) == ["scores/0-63"]  # one pass over every sequence
    assert moved(base, single) == ["placement", "scores/0-31", "scores/32-63"]  # gone: the two passes
    assert moved({k: v for k, v in base.items() if not k.startswith("scores/")}, single) == ["placement"]


def test_adding_a_format_adds_its_window_and_rescores(raw_search):
    without = keys(edited_placement(raw_search, formats=["nvfp4_w4a16", "bf16"]))
    with_fp8 = keys(raw_search)
    assert sorted(set(with_fp8) - set(without)) == ["layers/fp8/1-8"]
    assert not set(without) - set(with_fp8)
    # every pass carries every format's branches: the passes and the solve rerun, nothing else moves
    assert moved(without, with_fp8) == ["placement", "scores/0-31", "scores/32-63"]


def test_pinned_layers_are_scored_only_in_their_format(raw_search):
    pinned = edited_placement(
        raw_search, pins=[{"layers": "8", "format": "bf16"}, {"layers": "1", "format": "fp8"}]
    )
    art = resolve_artifacts(validate_config(pinned))
    scored = art["scores/0-31"].settings["scored"]
    assert scored == {"1": ["fp8"], **{str(layer): BOTH for layer in range(2, 8)}}  # 8: bf16, no score
    assert "nvfp4_w4a16_layer_1" not in art["scores/0-31"].upstream
    assert art["placement"].settings["pins"] == {"1": "fp8", "8": "bf16"}


def test_macro_batch_must_hold_whole_micro_batches(raw_search):
    from mixquant.config import ConfigError

    with pytest.raises(ConfigError, match="macro_batch 20 is not a multiple of batch_size 8"):
        validate_config(edited_placement(raw_search, macro_batch=20))


def test_forward_stages_key_their_device(raw):
    cpu = resolve_artifacts(validate_config(raw))
    gpu = resolve_artifacts(validate_config(edited(raw, "numerics", device="cuda:1")))
    assert gpu["activations"].preimage["config"]["numerics"]["device"] == "cuda"
    assert gpu["activations"].settings["numerics"]["device"] == "cuda:1"
    assert cpu["activations"].preimage["config"]["numerics"]["device"] == "cpu"
    on_device = {"activations", "layers/nvfp4_w4a16/1-8", "reference_logits"}
    for name in on_device:
        assert cpu[name].key != gpu[name].key, name
    # the index is where, not how: cuda:0 and cuda:1 share every key but the release's (its recipe says)
    other = resolve_artifacts(validate_config(edited(raw, "numerics", device="cuda:0")))
    assert [n for n, a in other.items() if a.key != gpu[n].key] == ["release"]
    # stages that compute on the CPU whatever the device keep their keys
    for name in ("calibration", "prompt", "model"):
        assert cpu[name].key == gpu[name].key, name


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
    assert a["layers/bf16/1-8"].stage == "quantize_layer"


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
    assert runs == [
        "kld/bf16/bfloat16",
        "kld/bf16/fp8",
        "kld/uniform-nvfp4/bfloat16",
        "kld/uniform-nvfp4/fp8",
    ]
    assert by_stage(before, "gate_kld") == ["gate/bf16/bfloat16", "gate/bf16/fp8"] + [
        "gate/uniform-nvfp4/bfloat16",
        "gate/uniform-nvfp4/fp8",
    ]
    assert "kld_report" not in before and "kld_verdict" not in before
    after = resolve_artifacts(cfg, placement=TOY_PLACEMENT)
    # one run_kld job per (candidate, KV dtype), doing all five runs
    assert len(by_stage(after, "run_kld")) == 3 * 2 and len(by_stage(after, "gate_kld")) == 6
    assert after["kld/searched/fp8"].upstream["candidate"] == "checkpoint"
    assert after["kld/searched/fp8"].settings["runs"] == 5
    assert after["kld/bf16/bfloat16"].upstream["candidate"] == "model"
    assert after["kld/uniform-nvfp4/fp8"].upstream["candidate"] == "candidate/uniform-nvfp4"
    gate = after["gate/searched/fp8"]
    assert gate.upstream == {
        "runs": "kld/searched/fp8",
        "baseline_runs": "kld/uniform-nvfp4/fp8",
        "suite": "eval",  # the suite gates: its windows and domains
        "suite_reference": "suite_reference",  # the noise floor
        "floor_runs": "kld/bf16/bfloat16",  # the engine floor
    }
    assert after["kld/searched/fp8"].upstream == {
        "reference": "reference_logits",
        "prompt": "prompt",
        "candidate": "checkpoint",
        "suite_reference": "suite_reference",
        "suite": "eval",
    }
    assert after["suite_reference"].upstream == {"model": "model", "prompt": "eval"}
    assert after["suite_reference"].settings["captures"] == 2
    assert "baseline_runs" not in after["gate/uniform-nvfp4/fp8"].upstream  # the baseline itself
    assert after["gate/bf16/bfloat16"].settings["require_exact_zero"] is True
    assert after["gate/bf16/fp8"].settings["require_exact_zero"] is False
    assert after["kld_verdict"].upstream == {"report": "kld_report"}
    # the uniform candidate's layers are the search's own NVFP4 results (same keys)
    assert after["candidate/uniform-nvfp4"].upstream["layer_3"] == "layers/nvfp4_w4a16/1-8"


def test_run_keys_follow_content_not_names(raw_search):
    renamed = copy.deepcopy(raw_search)
    (uniform,) = [c for c in renamed["kld"]["candidates"] if c["name"] == "uniform-nvfp4"]
    uniform["name"] = "nvfp4-everywhere"
    renamed["kld"]["baseline"] = "nvfp4-everywhere"
    a = resolve_artifacts(validate_config(raw_search))
    b = resolve_artifacts(validate_config(renamed))
    assert a["kld/uniform-nvfp4/fp8"].key == b["kld/nvfp4-everywhere/fp8"].key
    assert a["kld/bf16/bfloat16"].key != a["kld/bf16/fp8"].key
    # the number of runs is part of what a job computed
    fewer = copy.deepcopy(raw_search)
    fewer["kld"]["runs"] = 3
    c = resolve_artifacts(validate_config(fewer))
    assert c["kld/bf16/fp8"].key != a["kld/bf16/fp8"].key and c["kld/bf16/fp8"].settings["runs"] == 3
    assert c["reference_logits"].key == a["reference_logits"].key


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


# ----------------------------------------------------------------------------- ModelOpt's AutoQuantize


def test_autoquantize_candidate_waits_for_its_placement_then_shares_every_layer(with_modelopt):
    """The modelopt_autoquantize candidate: ModelOpt's placement stage reads the model and the calibration
    tokens; its checkpoint is the rebuild of what it chose, from the very layer results the search ships."""
    cfg = validate_config(with_modelopt)
    before = resolve_artifacts(cfg, placement=TOY_PLACEMENT)
    assert before["autoquantize"].upstream == {"model": "model", "calibration": "calibration"}
    assert before["autoquantize"].stage == "autoquantize_placement"
    assert "kld/modelopt-autoquantize/fp8" not in before and "kld_report" not in before
    chosen = {layer: "nvfp4_w4a16" for layer in range(1, 9)} | {1: "fp8", 2: "fp8", 5: "fp8"}
    after = resolve_artifacts(cfg, placement=TOY_PLACEMENT, autoquantized=chosen)
    export = after["candidate/modelopt-autoquantize"]
    assert (
        export.upstream["layer_1"] == "layers/fp8/1-8"
        and export.upstream["layer_3"] == "layers/nvfp4_w4a16/1-8"
    )
    assert after["kld/modelopt-autoquantize/fp8"].upstream["candidate"] == "candidate/modelopt-autoquantize"
    assert "kld_report" in after and after["kld_report"].settings["sources"]["modelopt-autoquantize"] == (
        "modelopt_autoquantize"
    )
    # the same placement as the search: the same checkpoint, so the same runs
    same = resolve_artifacts(cfg, placement=chosen, autoquantized=chosen)
    assert same["candidate/modelopt-autoquantize"].key == same["checkpoint"].key
    assert same["kld/modelopt-autoquantize/fp8"].key == same["kld/searched/fp8"].key


def test_autoquantize_key_holds_the_budget_and_cost_model_not_the_solver(with_modelopt):
    base = resolve_artifacts(validate_config(with_modelopt))["autoquantize"].key

    def key(**change):
        config = validate_config(edited_placement(with_modelopt, **change))
        return resolve_artifacts(config)["autoquantize"].key

    assert key(method="minimax") == base  # ModelOpt selects its own way
    for change in ({"target_effective_bits": 7.0}, {"cost_model": "active_moe"}, {"batch_size": 4}):
        assert key(**change) != base, change


def with_rounding(raw_config: dict, **gptq) -> dict:
    out = copy.deepcopy(raw_config)
    out["quantize"]["nvfp4_w4a16"].update(rounding="gptq", gptq=gptq)
    return out


def test_rtn_keeps_the_nvfp4_slice_it_always_had(raw):
    """The default rounding (rtn) adds nothing to the NVFP4 windows' key slice, so the GPTQ knobs (unused)
    move nothing, and a config that spells the rtn default out plans the same keys."""
    art = resolve_artifacts(validate_config(raw))
    assert art["layers/nvfp4_w4a16/1-8"].preimage["config"]["params"] == {"calibration": "fp8_sweep"}
    unused = copy.deepcopy(raw)
    unused["quantize"]["nvfp4_w4a16"].update(rounding="rtn", gptq={"damping": 0.1, "order": "activation"})
    assert keys(unused) == keys(raw)
    assert "expert_inputs" not in art


def test_gptq_rounding_moves_the_nvfp4_windows_and_reads_the_experts_inputs(raw):
    base, gptq = keys(raw), keys(with_rounding(raw))
    assert sorted(set(gptq) - set(base)) == ["expert_inputs"]
    assert moved(base, gptq) == ["checkpoint", "layers/nvfp4_w4a16/1-8"]  # FP8 and BF16 windows stay
    art = resolve_artifacts(validate_config(with_rounding(raw)))
    assert set(art["layers/nvfp4_w4a16/1-8"].upstream) == {"model", "expert_inputs"}
    assert set(art["expert_inputs"].upstream) == {"model", "calibration"}
    assert art["layers/nvfp4_w4a16/1-8"].preimage["config"]["params"]["gptq"] == {
        "damping": 0.01,
        "block_size": 128,
        "order": "natural",
        "min_tokens": 64,
    }


@pytest.mark.parametrize(
    "knob", [{"damping": 0.05}, {"block_size": 64}, {"order": "activation"}, {"min_tokens": 8}]
)
def test_each_gptq_knob_enters_the_nvfp4_key(raw, knob):
    base = keys(with_rounding(raw))
    assert moved(base, keys(with_rounding(raw, **knob))) == ["checkpoint", "layers/nvfp4_w4a16/1-8"]


def test_a_calibration_change_reruns_the_gptq_windows(raw):
    gptq = with_rounding(raw)
    changed = edited(gptq, "calibration", num_samples=32)
    assert "layers/nvfp4_w4a16/1-8" in moved(keys(gptq), keys(changed))  # their Hessians' tokens moved


def refined(raw_config: dict, **refine) -> dict:
    return edited_placement(raw_config, refine={"candidates": 4, "holdout_samples": 8, **refine})


def test_refinement_follows_the_solve_on_held_out_sequences(raw_search):
    base = keys(raw_search)
    art = resolve_artifacts(validate_config(refined(raw_search)))
    with_refine = keys(refined(raw_search))
    assert sorted(set(with_refine) - set(base)) == ["holdout", "refined"]
    assert moved(base, with_refine) == []  # scores, windows and the solve are reused
    refine = art["refined"]
    assert refine.stage == "refine_placement"
    assert {"model", "holdout", "placement", "scores_0", "scores_32"} <= set(refine.upstream)
    assert {role for role in refine.upstream if "_layer_" in role} == {
        f"{fmt}_layer_{layer}" for fmt in BOTH for layer in range(1, 9)
    }
    holdout = art["holdout"]
    assert holdout.stage == "sample_calibration"
    assert holdout.settings["calibration"]["held_out_after"] == 64
    assert holdout.settings["calibration"]["num_samples"] == 8
    # the held-out draw continues the calibration's: same seed, length and dataset
    calibration = art["calibration"].settings["calibration"]
    assert {k: holdout.settings["calibration"][k] for k in calibration if k != "num_samples"} == {
        k: v for k, v in calibration.items() if k != "num_samples"
    }
    for change in ({"candidates": 6}, {"holdout_samples": 4}):
        assert "refined" in moved(with_refine, keys(refined(raw_search, **change)))
    assert moved(with_refine, keys(refined(raw_search, candidates=6))) == ["refined"]
