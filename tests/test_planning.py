"""Planning-time checks (paths, context, budget, layers) and what a run's end reports: one line each."""

import copy
import json
from pathlib import Path

import pytest
import yaml
from mixquant.config import ConfigError, validate_config
from mixquant.graph import Artifact
from mixquant.keys.manifest import MANIFEST
from mixquant.planning import (
    artifact_state,
    check_plan,
    effective_bits_range,
    outside_workdir,
    run_end_lines,
    snakemake_invocation,
)
from mixquant.rulelog import failure_marker, rule_logging, stage_log_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def raw():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["model"] = {"source": "toy"}  # the toy's geometry comes from its settings: no file needed
    return config


def _error(raw_config, root) -> str:
    with pytest.raises(ConfigError) as error:
        check_plan(validate_config(raw_config, "cfg.yaml"), "cfg.yaml", root)
    message = str(error.value)
    assert "\n" not in message and message.startswith("cfg.yaml: config key '")
    return message


# ------------------------------------------------------------------------------------------ paths


@pytest.fixture
def workdir(tmp_path):
    """A workdir whose data/ is a symlink to a shared directory, as tests/workflow's workdirs are."""
    shared, root = tmp_path / "shared-data", tmp_path / "wd"
    (shared / "corpus").mkdir(parents=True)
    (shared / "corpus" / "chat.jsonl").write_text("{}\n")
    (shared / "escape").symlink_to(tmp_path)  # a symlink below data/ that leads out
    root.mkdir()
    (root / "data").symlink_to(shared)
    (root / "inside").mkdir()
    (root / "inside" / "out").symlink_to(tmp_path)
    return root


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("results", None),
        ("./results/run-2", None),
        ("data/corpus/chat.jsonl", None),  # through the workdir's own top-level symlink
        ("data", None),
        ("results/../config", None),
        ("../../etc", "'..' climbs out of it"),
        ("results/../../x", "'..' climbs out of it"),
        ("/etc/passwd", "an absolute path elsewhere"),
        ("data/escape/x", "a symlink leads to"),
        ("data/../x", "a symlink leads to"),  # data/.. is the shared directory's parent
        ("inside/out/x", "a symlink leads to"),
    ],
)
def test_paths_are_checked_on_the_words_then_below_the_top_level_entries(workdir, value, reason):
    got = outside_workdir(value, workdir)
    assert got == reason if reason is None else got.startswith(reason)


def test_an_absolute_path_inside_the_workdir_is_inside(workdir):
    assert outside_workdir(str(workdir / "results" / "x"), workdir) is None
    assert outside_workdir(str(workdir / "data" / "corpus" / "chat.jsonl"), workdir) is None


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda c: c.update(results_dir="../../etc"), "results_dir"),
        (lambda c: c["dataset"]["local"].update(path="/etc/passwd"), "dataset.local.path"),
        (
            lambda c: c["prompt"].update(source="token_ids_file", token_ids_file="../ids.json"),
            "prompt.token_ids_file",
        ),
        (lambda c: c["model"].update(geometry="/etc/config.json"), "model.geometry"),
        (
            lambda c: c["kld"]["candidates"].append(
                {"name": "mine", "source": "local", "local": {"path": "/x"}}
            ),
            "kld.candidates.3.local.path",
        ),
        (
            lambda c: c["kld"]["eval"]["domains"][1]["local"].update(path="/etc/code.jsonl"),
            "kld.eval.domains.1.local.path",
        ),
    ],
)
def test_a_path_outside_the_workdir_is_refused_naming_the_key_and_the_switch(raw, workdir, edit, key):
    edit(raw)
    message = _error(raw, workdir)
    assert message.startswith(f"cfg.yaml: config key '{key}': ")
    assert "is outside the working directory" in message
    assert message.endswith("set allow_outside_workdir: true to allow it")


def test_allow_outside_workdir_lets_an_absolute_path_through(raw, workdir, tmp_path):
    raw.update(results_dir=str(tmp_path / "elsewhere"), allow_outside_workdir=True)
    check_plan(validate_config(raw), "cfg.yaml", workdir)


def test_the_default_config_plans_in_a_workdir_with_symlinked_data(raw, workdir):
    check_plan(validate_config(raw), "cfg.yaml", workdir)


# --------------------------------------------------------------------------------------- geometry


def test_a_prompt_longer_than_the_context_is_refused_with_the_range(raw, tmp_path):
    raw["prompt"]["seq_len"] = 5000
    assert _error(raw, tmp_path) == (
        "cfg.yaml: config key 'prompt.seq_len': 5000 tokens exceed the model's max_position_embeddings 4096 "
        "(model.toy.arch.max_position_embeddings); feasible: 2..4096"
    )


def test_the_context_of_a_real_model_comes_from_its_geometry(tmp_path):
    raw = yaml.safe_load((REPO / "config" / "laguna-s-2.1.yaml").read_text())
    geometry = json.loads((REPO / "data/models/laguna-s-2.1/config.json").read_text())
    geometry["max_position_embeddings"] = 1024
    (tmp_path / "config.json").write_text(json.dumps(geometry))
    raw["model"]["geometry"] = "config.json"
    message = _error(raw, tmp_path)
    assert message.startswith("cfg.yaml: config key 'prompt.seq_len': 2048 tokens exceed the model's ")
    assert message.endswith("max_position_embeddings 1024 (model.geometry); feasible: 2..1024")


@pytest.mark.parametrize("target", [3.0, 4.49, 16.5])
def test_an_unreachable_budget_is_refused_with_the_feasible_range(raw, tmp_path, target):
    raw["placement"]["target_effective_bits"] = target
    assert _error(raw, tmp_path) == (
        f"cfg.yaml: config key 'placement.target_effective_bits': {target:g} is out of reach; "
        "feasible: 4.5..16 (formats nvfp4_w4a16, fp8, bf16)"
    )


def test_pins_and_formats_narrow_the_feasible_range(raw, tmp_path):
    raw["placement"]["search"]["pins"] = [{"layers": "1-4", "format": "bf16"}]
    raw["placement"]["target_effective_bits"] = 6.0
    assert _error(raw, tmp_path).endswith(
        "6 is out of reach; feasible: 10.25..16 (formats nvfp4_w4a16, fp8, bf16; 4 of 8 MoE layers pinned)"
    )
    cfg = validate_config(raw)
    assert effective_bits_range(cfg) == (10.25, 16.0)  # 4 x 4.5 + 4 x 16, over 8 equal layers
    narrow = copy.deepcopy(raw)
    narrow["placement"].update(formats=["nvfp4_w4a16", "fp8"], target_effective_bits=6.0)
    narrow["placement"]["search"]["pins"] = []
    assert effective_bits_range(validate_config(narrow)) == (4.5, 8.0)


def test_an_explicit_placement_has_no_budget_to_check(raw, tmp_path):
    raw["placement"].update(source="explicit", target_effective_bits=3.0)
    check_plan(validate_config(raw), "cfg.yaml", tmp_path)


def test_a_pin_on_a_layer_that_is_not_moe_is_refused(raw, tmp_path):
    raw["placement"]["search"]["pins"] = [
        {"layers": "8", "format": "bf16"},
        {"layers": "0,12", "format": "fp8"},
    ]
    assert _error(raw, tmp_path) == (
        "cfg.yaml: config key 'placement.search.pins.1.layers': layer 0 is not a MoE layer "
        "(the MoE layers are 1-8)"
    )


def test_an_explicit_entry_on_a_missing_layer_is_refused(raw, tmp_path):
    raw["placement"]["source"] = "explicit"
    raw["placement"]["explicit"]["layers"].append({"layers": "9", "format": "fp8"})
    assert "'placement.explicit.layers.2.layers': layer 9 is not a MoE layer" in _error(raw, tmp_path)


# --------------------------------------------------------------------------------------- run's end


def _artifact(results: Path, name: str, stage: str, key: str, done: bool) -> Artifact:
    path = results / stage / key
    if done:
        path.mkdir(parents=True)
        (path / MANIFEST).write_text("{}")
    return Artifact(name, stage, key, path, {}, {})


def test_a_finished_run_names_the_release_and_the_checkpoint(tmp_path):
    release = _artifact(tmp_path, "release", "assemble_release", "a" * 64, True)
    checkpoint = _artifact(tmp_path, "checkpoint", "export_checkpoint", "b" * 64, True)
    assert run_end_lines({"checkpoint": checkpoint, "release": release}) == [
        f"mixquant run release: {release.path}/repo",  # the directory to publish
        f"mixquant run checkpoint: {checkpoint.path}",
    ]
    stopped = run_end_lines({"checkpoint": checkpoint}, succeeded=False)
    assert stopped == [
        f"mixquant run checkpoint: {checkpoint.path}",
        "mixquant run stopped: `mixquant paths` shows which stages failed, and their logs",
    ]
    assert run_end_lines({}) == [
        "mixquant run done; no checkpoint or release built yet: `mixquant paths` shows what is"
    ]


def test_a_stage_that_failed_under_rule_logging_is_failed_until_it_runs_again(tmp_path):
    art = _artifact(tmp_path, "prompt", "pin_prompt", "c" * 64, False)
    log = stage_log_path(tmp_path, art.stage, art.key)
    log.parent.mkdir(parents=True)
    assert artifact_state(art, tmp_path) == "todo"
    with pytest.raises(SystemExit), rule_logging(str(log)):
        raise ValueError("prompt.sha256: the token IDs do not match\nsecond line")
    assert failure_marker(log).read_text() == "prompt.sha256: the token IDs do not match\n"
    assert artifact_state(art, tmp_path) == "failed"
    with rule_logging(str(log)):  # the next attempt clears the marker
        pass
    assert not failure_marker(log).exists() and artifact_state(art, tmp_path) == "todo"
    assert artifact_state(_artifact(tmp_path, "x", "pin_prompt", "d" * 64, True), tmp_path) == "done"


def test_what_to_fix_before_the_release_is_uploaded_is_a_warning(raw):
    """A card without a repository id or, with license: other, without a license link is worth a warning
    (the run completes; the upload needs them), one line per key."""
    from mixquant.planning import plan_warnings

    assert plan_warnings(validate_config(raw, "cfg.yaml")) == [
        "release.repo_id is not set: the model card's `vllm serve` commands name the placeholder "
        "<your-org>/<name>; set it to the Hub repository the release is uploaded to"
    ]
    raw["release"].update(repo_id="me/toy-laguna", license_link=None)
    assert plan_warnings(validate_config(raw, "cfg.yaml")) == [
        "release.license is other but release.license_link is not set: the Hub expects a link to the license "
        "text; set release.license_link (and release.license_name)"
    ]
    raw["release"].update(license="apache-2.0")
    assert plan_warnings(validate_config(raw, "cfg.yaml")) == []
    raw["release"].update(repo_id="not a repo id")
    with pytest.raises(ConfigError, match="release.repo_id"):
        validate_config(raw, "cfg.yaml")


def test_the_snakemake_invocation_is_read_with_snakemake_s_own_parser(tmp_path, monkeypatch):
    """common.smk decides before Snakemake does: a dry run or not, the executor (a profile's too), the
    lock."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "config.yaml").write_text("executor: slurm\njobs: 4\n")
    main = "/venv/lib/python3.11/site-packages/snakemake/__main__.py"
    plain = snakemake_invocation([main, "--cores", "2"])
    assert (plain.dry_run, plain.executor, plain.lock, plain.local) == (False, "local", True, True)
    assert snakemake_invocation(["/venv/bin/snakemake", "-n", "--nolock"]).dry_run is True
    assert snakemake_invocation(["/venv/bin/snakemake", "--cores", "1", "--nolock"]).lock is False
    cluster = snakemake_invocation(["/venv/bin/snakemake", "--profile", "cluster"])
    assert (cluster.executor, cluster.local) == ("slurm", False)
    assert snakemake_invocation(["/venv/bin/snakemake", "-n", "--profile", "cluster"]).local is False
    assert plain.executes and not snakemake_invocation(["/venv/bin/snakemake", "-n"]).executes
    assert not snakemake_invocation(["/venv/bin/snakemake", "--unlock"]).executes
    assert not snakemake_invocation(["/venv/bin/snakemake", "--report", "report.html"]).executes
    assert snakemake_invocation(["pytest", "-q"]) is None  # not Snakemake's command line
