"""The default DAG for real: the shipped toy Laguna, sample calibration, pin the prompt.

Then the cache behaviour the docs promise: a no-op rerun plans nothing; a changed knob reruns
exactly its stage; reverting it reruns nothing and finds the earlier directory.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
from mixquant.calibration.tokens import token_ids_sha256
from mixquant.keys.manifest import read_manifest, verify_manifest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _dir(wd, paths, name) -> Path:
    return wd.root / paths[name]["path"]


def test_default_run_produces_complete_keyed_outputs(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    assert all(row["done"] for row in paths.values())
    for name in ("model", "calibration", "prompt"):
        directory = _dir(wd, paths, name)
        assert directory.name == paths[name]["key"]
        assert verify_manifest(directory) == []
    assert not list((wd.root / "results").glob("*/.tmp-*"))

    model = _dir(wd, paths, "model")
    assert json.loads((model / "model_source.json").read_text())["path"].endswith("data/toy-laguna")
    shipped = wd.root / "data" / "toy-laguna"
    assert len(list(shipped.glob("model-*-of-*.safetensors"))) >= 2
    report = json.loads((shipped / "training_report.json").read_text())
    vocab = report["model"]["vocab_size"]
    assert report["loss"]["heldout"] < 0.45 * math.log(vocab)  # clearly peaked, not near-uniform
    assert report["loss"]["first_step"] > 0.9 * math.log(vocab)  # it started from (near) uniform
    assert report["checkpoint"]["logits_bit_identical_after_reload"] is True
    assert [entry["layer"] for entry in report["outliers"]] == [2, 5, 7]
    assert "timings_s" not in report

    calibration = load_file(_dir(wd, paths, "calibration") / "calibration.safetensors")["input_ids"]
    config = wd.config()
    assert tuple(calibration.shape) == (
        config["calibration"]["num_samples"],
        config["calibration"]["seq_len"],
    )
    summary = read_manifest(_dir(wd, paths, "calibration"))["summary"]
    assert summary["sha256"] == token_ids_sha256(calibration)

    prompt = read_manifest(_dir(wd, paths, "prompt"))["summary"]
    assert prompt["pin_status"] == "not pinned" and prompt["seq_len"] == config["prompt"]["seq_len"]


def test_no_op_rerun_plans_nothing(built_workdir):
    assert built_workdir.plan() == {}


def test_changing_calibration_reruns_only_calibration_and_reverting_finds_the_old_dir(built_workdir):
    wd = built_workdir
    before = wd.paths()
    old_dir = _dir(wd, before, "calibration")
    old_manifest = (old_dir / "manifest.json").read_text()

    config = wd.config()
    config["calibration"]["num_samples"] = 16
    changed = wd.write_config("config/fewer-samples.yaml", config)
    # Nothing upstream reruns; downstream, only what reads calibration: activations, the FP8 layer
    # results (one window of all 8 MoE layers: the search scores FP8 everywhere), the score passes (16
    # sequences: one pass of macro_batch 32) and the solve.
    assert wd.plan(changed) == {
        "sample_calibration": 1,
        "collect_activation_stats": 1,
        "quantize_layer": 1,
        "score_sensitivity": 1,
        "solve_placement": 1,
    }
    wd.snakemake(wd.paths(changed)["calibration"]["path"], "--configfile", changed)
    after = wd.paths(changed)
    assert after["model"] == before["model"] and after["prompt"] == before["prompt"]
    new_dir = _dir(wd, after, "calibration")
    assert new_dir != old_dir and new_dir.is_dir()

    explanation = wd.mixquant("explain", str(old_dir), after["calibration"]["key"]).stdout
    assert "config.calibration.num_samples: 64 -> 16" in explanation

    assert wd.plan() == {}  # reverted: nothing to run
    assert wd.paths()["calibration"]["path"] == before["calibration"]["path"]
    assert (old_dir / "manifest.json").read_text() == old_manifest


def test_calibration_is_deterministic_across_runs(built_workdir, tmp_path):
    wd = built_workdir
    paths = wd.paths()
    config = wd.config()
    config["results_dir"] = "results-again"
    again = wd.write_config("config/again.yaml", config)
    stage = Path(paths["model"]["path"]).parent.name
    (wd.root / "results-again" / stage).mkdir(parents=True)
    (wd.root / "results-again" / stage / paths["model"]["key"]).symlink_to(_dir(wd, paths, "model"))
    wd.mixquant("run", "sample_calibration", "--configfile", again)
    wd.mixquant("run", "pin_prompt", "--configfile", again)
    for name in ("calibration", "prompt"):
        first = read_manifest(_dir(wd, paths, name))
        second = read_manifest(wd.root / "results-again" / Path(paths[name]["path"]).relative_to("results"))
        assert first["key"] == second["key"]
        assert first["files"] == second["files"]


def test_prompt_pin_mismatch_stops_with_both_hashes_and_leaves_nothing(built_workdir):
    wd = built_workdir
    actual = read_manifest(_dir(wd, wd.paths(), "prompt"))["summary"]["sha256"]
    config = wd.config()
    config["prompt"]["sha256"] = "0" * 64
    wrong = wd.write_config("config/wrong-pin.yaml", config)
    result = wd.snakemake("--configfile", wrong, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]
    assert len(lines) == 1 and actual in lines[0] and "0" * 64 in lines[0], result.stderr
    assert not (wd.root / wd.paths(wrong)["prompt"]["path"]).exists()
    assert not list((wd.root / "results").glob("*/.tmp-*"))

    config["prompt"]["sha256"] = actual
    pinned = wd.write_config("config/right-pin.yaml", config)
    wd.snakemake(wd.paths(pinned)["prompt"]["path"], "--configfile", pinned)
    summary = read_manifest(wd.root / wd.paths(pinned)["prompt"]["path"])["summary"]
    assert summary["pin_status"] == "match" and summary["pinned_sha256"] == actual


def test_local_model_directory_is_pinned_by_content(built_workdir):
    wd = built_workdir
    default = wd.paths()
    config = wd.config()
    copy = wd.root / "toy-copy"
    shutil.copytree(wd.root / config["model"]["local"]["path"], copy)
    config["model"]["local"]["path"] = "toy-copy"
    moved = wd.write_config("config/copy.yaml", config)
    # the model is identified by content, not by path: every key stays, nothing to compute; only the
    # release is bundled anew, since its replay recipe names where the model is
    keys = {name: row["key"] for name, row in wd.paths(moved).items()}
    assert {n: k for n, k in keys.items() if n != "release"} == {
        name: row["key"] for name, row in default.items() if name != "release"
    }
    assert keys["release"] != default["release"]["key"]
    assert wd.plan(moved) == {"assemble_release": 1}
    shard = sorted(copy.glob("model-*-of-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    result = wd.mixquant("plan", "--configfile", moved, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "model.local.sha256" in lines[0], result.stderr


def test_nvfp4_knob_reruns_only_nvfp4_layers(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["quantize"]["nvfp4_w4a16"]["calibration"] = "max"
    # calibration, activations, FP8 results and FP8 scores stay: the NVFP4 window of the 8 layers the
    # search scores, their 2 score jobs and the solve
    plan = wd.plan(wd.write_config("config/nvfp4-max.yaml", config))
    assert {rule: plan[rule] for rule in ("quantize_layer", "score_sensitivity", "solve_placement")} == {
        "quantize_layer": 1,
        "score_sensitivity": 2,
        "solve_placement": 1,
    }
    # and the KLD candidate with NVFP4 layers known before the solve, the uniform-NVFP4 one: its export, runs
    # and the gates that compare with it (the BF16 self-check's too: uniform NVFP4 is its baseline)
    assert {
        k: v for k, v in plan.items() if k not in ("quantize_layer", "score_sensitivity", "solve_placement")
    } == {
        "export_checkpoint": 1,
        "run_kld": 2,
        "gate_kld": 4,
    }
    config["placement"]["source"] = "explicit"  # without the search: the placed layers only
    explicit = wd.write_config("config/nvfp4-max-explicit.yaml", config)
    plan = wd.plan(explicit)
    # the NVFP4 window (layers 1-4 placed, all 8 for the uniform-NVFP4 KLD candidate), the BF16 window if
    # the search placed no BF16 layer, the exports; nothing upstream
    missing = [n for n, row in wd.paths(explicit).items() if n.startswith("layers/") and not row["done"]]
    assert "layers/nvfp4_w4a16/1-8" in missing
    assert all(n.startswith(("layers/nvfp4_w4a16/", "layers/bf16/")) for n in missing)
    # the placement's export and the uniform-NVFP4 candidate's
    assert plan["quantize_layer"] == len(missing) and plan["export_checkpoint"] == 2
    assert not {"sample_calibration", "collect_activation_stats", "score_sensitivity"} & set(plan)


def test_moving_one_layer_runs_only_that_layer_x_format(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["placement"]["source"] = "explicit"
    config["placement"]["explicit"]["layers"].append({"layers": "8", "format": "nvfp4_w4a16"})
    moved = wd.write_config("config/layer8-nvfp4.yaml", config)
    # every NVFP4 and FP8 layer result exists (the search scored them); BF16 ones only where it chose BF16
    paths = wd.paths(moved)
    missing = [n for n, row in paths.items() if n.startswith("layers/") and not row["done"]]
    assert all(name.startswith("layers/bf16/") for name in missing)
    # this checkpoint's KLD and the verification of its hashes
    kld = {"run_kld": 2, "gate_kld": 2, "kld_report": 1, "check_kld_gates": 1, "verify_hashes": 1}
    kld["assemble_release"] = 1  # and its release
    expected = {**({"quantize_layer": len(missing)} if missing else {}), "export_checkpoint": 1, **kld}
    assert wd.plan(moved) == expected
    wd.snakemake(paths["checkpoint"]["path"], "--configfile", moved)
    config["placement"]["explicit"]["layers"][-1] = {"layers": "8", "format": "fp8"}
    assert wd.plan(wd.write_config("config/layer8-fp8.yaml", config)) == {"export_checkpoint": 1, **kld}
    assert wd.plan() == {}  # the searched placement's outputs are all still there


def test_truncated_source_shard_stops_with_one_line_and_leaves_nothing(built_workdir, tmp_path):
    wd = built_workdir
    source = wd.root / wd.config()["model"]["local"]["path"]
    broken = tmp_path / "broken-model"
    shutil.copytree(source, broken)
    shard = sorted(broken.glob("model-*-of-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    config = wd.config()
    config["model"] = {"source": "local", "local": {"path": str(broken)}, "moe_layers": "1-8"}
    config["allow_outside_workdir"] = True  # the broken copy lives outside the workdir
    name = wd.write_config("config/broken.yaml", config)
    result = wd.snakemake("--configfile", name, "--keep-going", check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]
    assert errors and all(shard.name in line for line in errors), result.stderr
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    in_broken_shard = {
        int(key.split(".")[2])
        for key, file in index["weight_map"].items()
        if file == shard.name and ".mlp.experts." in key
    }
    assert in_broken_shard
    paths = wd.paths(name)
    assert not (wd.root / paths["activations"]["path"]).exists()
    for artifact, row in paths.items():  # every window holds a layer of the broken shard
        if artifact.startswith("layers/"):
            assert not (wd.root / row["path"]).exists(), artifact
    assert not list((wd.root / "results").glob("*/.tmp-*"))


def test_the_readme_picture_is_the_default_runs_own_plot(built_workdir):
    """The README's picture (docs/assets/kl-domains.png) is the per-domain KL plot the default run draws,
    byte for byte: regenerate it with the command on docs/development.md when the run's plot changes."""
    report = _dir(built_workdir, built_workdir.paths(), "kld_report")
    drawn = (report / "kl_cdf_domains_bfloat16.png").read_bytes()
    assert (REPO / "docs" / "assets" / "kl-domains.png").read_bytes() == drawn
