"""The CLI surface: predict on the committed Laguna-S-2.1 config, one-line errors, explain, paths."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from mixquant.cli import main
from mixquant.cli.plan import snakemake_error
from mixquant.jsonio import diff_values
from mixquant.rulelog import failure_marker

REPO = Path(__file__).resolve().parents[1]
LAGUNA = str(REPO / "data/models/laguna-s-2.1/config.json")


def test_predict_reference_release(capsys):
    assert (
        main(
            [
                "predict",
                "--model-config",
                LAGUNA,
                "--placement-counts",
                "nvfp4_w4a16=39,fp8=3,bf16=5",
                "--kv-cache-quant",
                "FP8",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"]["total"] == 101_377 and report["tensors"]["kv_scales"] == 96
    assert report["payload_bytes"] == 92_433_871_744
    assert round(report["routed_effective_bits"], 4) == 5.9468


def test_predict_bad_counts_is_one_line(capsys):
    assert main(["predict", "--model-config", LAGUNA, "--placement-counts", "nvfp4=39"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixquant: ") and "\n" not in err


def test_inspect_missing_directory_is_one_line(capsys, tmp_path):
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nowhere" in err and "\n" not in err


def test_explain_diff_names_leaf_paths():
    a = {"config": {"calibration": {"num_samples": 64, "seed": 0}}, "upstream": {"model": "a" * 64}}
    b = {"config": {"calibration": {"num_samples": 16, "seed": 0}}, "upstream": {"model": "a" * 64}}
    assert diff_values(a, b) == [("config.calibration.num_samples", 64, 16)]


def test_keys_are_found_by_an_unambiguous_prefix(tmp_path, capsys):
    """The 12-hex short keys mixquant prints name a keyed directory; an ambiguous or non-hex prefix is
    one line (a prefix is checked as hex before it becomes part of a glob)."""
    from mixquant.cli.paths import find_keyed_dir

    a, b, c = "ab12" + "0" * 60, "ab120000" + "1" * 56, "cd34" + "2" * 60
    for stage, key in (("pin_prompt", a), ("export_checkpoint", b), ("run_kld", c)):
        (tmp_path / stage / key).mkdir(parents=True)
    (tmp_path / "run_kld" / ".tmp-cd34").mkdir()  # a temporary directory is never a match
    assert find_keyed_dir(a[:12], tmp_path) == tmp_path / "pin_prompt" / a
    assert find_keyed_dir(c[:8], tmp_path) == tmp_path / "run_kld" / c
    assert find_keyed_dir(b, tmp_path) == tmp_path / "export_checkpoint" / b
    with pytest.raises(ValueError, match="key prefix ab120000 is ambiguous .*: 2 directories"):
        find_keyed_dir("ab120000", tmp_path)
    with pytest.raises(ValueError, match="no output directory with key ef567890"):
        find_keyed_dir("ef567890", tmp_path)
    for bad in ("ab12", "../etc", "ab12*", "AB120000"):
        with pytest.raises(ValueError, match="neither an output directory nor a key"):
            find_keyed_dir(bad, tmp_path)
    assert main(["explain", "--results-dir", str(tmp_path), "ab12", c[:12]]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ------------------------------------------------------------------------------ plan, paths: errors


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory with the default config (data/ as in the repo) and no Snakemake to start."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(REPO / "data")

    def no_snakemake(*args, **kwargs):
        raise AssertionError("the config's error must be found before Snakemake is started")

    monkeypatch.setattr(subprocess, "run", no_snakemake)
    return tmp_path


def _write(root: Path, edit=None, text: str | None = None) -> str:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["model"] = {"source": "toy"}
    if edit:
        edit(config)
    (root / "cfg.yaml").write_text(text if text is not None else yaml.safe_dump(config))
    return "cfg.yaml"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda root: "missing.yaml", "mixquant: missing.yaml: config file not found"),
        (
            lambda root: _write(root, text="calibration: [64\nprompt: {}\n"),
            "mixquant: cfg.yaml: not valid YAML: expected ',' or ']', but got ':' at line 2, column 7",
        ),
        (
            lambda root: _write(root, lambda c: c["calibration"].update(num_samples="many")),
            "mixquant: cfg.yaml: config key 'calibration.num_samples': Input should be a valid integer, "
            "unable to parse string as an integer (got 'many')",
        ),
        (
            lambda root: _write(
                root, lambda c: c["placement"]["search"].update(pins=[{"layers": "12", "format": "bf16"}])
            ),
            "mixquant: cfg.yaml: config key 'placement.search.pins.0.layers': layer 12 is not a MoE layer "
            "(the MoE layers are 1-8)",
        ),
        (
            lambda root: _write(root, lambda c: c.update(results_dir="../../etc")),
            "mixquant: cfg.yaml: config key 'results_dir': '../../etc' is outside the working directory "
            "('..' climbs out of it); set allow_outside_workdir: true to allow it",
        ),
        (
            lambda root: _write(root, lambda c: c["prompt"].update(seq_len=8192)),
            "mixquant: cfg.yaml: config key 'prompt.seq_len': 8192 tokens exceed the model's "
            "max_position_embeddings 4096 (model.toy.arch.max_position_embeddings); feasible: 2..4096",
        ),
        (
            lambda root: _write(root, lambda c: c["placement"].update(target_effective_bits=4.0)),
            "mixquant: cfg.yaml: config key 'placement.target_effective_bits': 4 is out of reach; "
            "feasible: 4.5..16 (formats nvfp4_w4a16, fp8, bf16)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["plan", "paths"])
def test_a_bad_config_is_one_line_naming_the_cause(scratch, capsys, make, expected, command):
    assert main([command, "--configfile", make(scratch)]) == 2
    captured = capsys.readouterr()
    assert captured.err == expected + "\n" and captured.out == ""


def test_a_failed_snakemake_reports_its_cause_not_the_profile_note():
    profile = "Using workflow specific profile profiles/default for setting default command line arguments.\n"
    traceback = (
        "Traceback (most recent call last):\n  File ...\nFileNotFoundError: [Errno 2] nope: 'x.yaml'\n"
    )
    assert snakemake_error(traceback, profile) == "FileNotFoundError: [Errno 2] nope: 'x.yaml'"
    ours = profile + "mixquant: cfg.yaml: config key 'results_dir': bad\nWorkflowError: ...\n"
    assert snakemake_error("", ours) == "cfg.yaml: config key 'results_dir': bad"
    assert snakemake_error("", profile + "WorkflowError:\nTarget rules may not contain wildcards.\n") == (
        "Target rules may not contain wildcards."
    )
    schema = "WorkflowError in file common.smk, line 31:\nError validating config file.\n"
    schema += "ValidationError: Additional properties are not allowed ('x' was unexpected)\n"
    schema += "\nOn instance:\n {'x': 1}\n"
    assert (
        snakemake_error(schema, profile)
        == "ValidationError: Additional properties are not allowed ('x' was unexpected)"
    )
    assert snakemake_error("", "") == "(no output)"


def test_paths_shows_a_failed_stage_as_failed(scratch, capsys):
    config = _write(scratch)
    assert main(["paths", "--json", "--configfile", config]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["state"] for row in rows.values()} == {"todo"} and not any(r["done"] for r in rows.values())
    prompt = rows["prompt"]
    log = scratch / "results" / "logs" / prompt["stage"] / f"{prompt['key']}.log"
    log.parent.mkdir(parents=True)
    failure_marker(log).write_text("prompt.sha256: mismatch\n")
    assert main(["paths", "--json", "--configfile", config]) == 0
    row = json.loads(capsys.readouterr().out)["prompt"]
    assert (row["state"], row["done"], row["log"]) == ("failed", False, str(log.relative_to(scratch)))
    assert main(["paths", "--configfile", config]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt "))
    assert line.split()[1] == "failed" and line.endswith(f"(log: {log.relative_to(scratch)})")


@pytest.mark.parametrize("command", [["run", "verify_hashes"], ["run", "check_kld_gates"], ["verify"]])
def test_a_failed_check_exits_1_whichever_command_runs_it(monkeypatch, capsys, command):
    """``mixquant run verify_hashes`` and ``mixquant verify`` exit 1 for the same mismatch (as a failed
    KLD gate does); errors that are not a check's verdict stay 2."""
    import mixquant.cli.parser as parser
    from mixquant.kld.run import KldGateFailure
    from mixquant.release.report import HashMismatchError

    verdict = (
        KldGateFailure("KLD gates failed: x") if "gates" in command[-1] else HashMismatchError("mismatch")
    )

    def fail(args):
        raise verdict

    monkeypatch.setattr(parser, "cmd_run", fail)
    monkeypatch.setattr(parser, "cmd_verify", fail)
    assert main(command) == 1
    assert capsys.readouterr().err.startswith("mixquant: ")

    def broken(args):
        raise ValueError("verify_hashes: results/x is not built")

    monkeypatch.setattr(parser, "cmd_run", broken)
    monkeypatch.setattr(parser, "cmd_verify", broken)
    assert main(command) == 2


def test_dotted_config_keys_become_the_mapping_snakemake_takes():
    """`mixquant plan -- --config calibration.num_samples=8` works: Snakemake's own parser refuses dotted
    keys, so mixquant hands it `calibration={num_samples: "8"}` (the config reads "8" as the number)."""
    from mixquant.cli.context import nested_config_args

    assert nested_config_args(["--config", "calibration.num_samples=8", "a.b.c=x y", "seed=3", "target"]) == [
        "--config",
        'calibration={num_samples: "8"}',
        'a={b: {c: "x y"}}',
        "seed=3",
        "target",
    ]
    assert nested_config_args(["--cores", "1", "results/x.y=z"]) == ["--cores", "1", "results/x.y=z"]


def test_plan_warns_while_the_card_would_name_a_placeholder_repository(scratch, capsys, monkeypatch):
    """Without release.repo_id the model card's `vllm serve` names <your-org>/<name>: `mixquant plan` says
    so (with the plan or without anything to do; in --json too), and not once it is set."""
    import mixquant.cli.plan as plan

    monkeypatch.setattr(plan, "dry_run", lambda *args, **kwargs: "")  # a plan with nothing to do
    warning = (
        "warning: release.repo_id is not set: the model card's `vllm serve` commands name the placeholder "
        "<your-org>/<name>; set it to the Hub repository the release is uploaded to\n"
    )
    assert main(["plan", "--configfile", _write(scratch)]) == 0
    assert warning in capsys.readouterr().out
    assert main(["plan", "--json", "--configfile", _write(scratch)]) == 0
    assert warning.removeprefix("warning: ").strip() in json.loads(capsys.readouterr().out)["warnings"]
    named = _write(scratch, lambda c: c["release"].update(repo_id="me/toy"))
    assert main(["plan", "--configfile", named]) == 0
    assert "warning: release.repo_id" not in capsys.readouterr().out


# ------------------------------------------------------------------ one config view for every command


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"mixquant {version('mixquant')}\n"


def test_options_are_never_abbreviated(capsys):
    """argparse would read `--config` as `--configfile` by prefix matching; an abbreviation is refused."""
    from mixquant.cli import build_parser

    args = build_parser().parse_args(["paths", "--config", "placement={target_effective_bits: 5.0}"])
    assert args.configfile == "config/config.yaml" and args.config == [
        "placement={target_effective_bits: 5.0}"
    ]
    with pytest.raises(SystemExit) as refused:
        main(["paths", "--configf", "cfg.yaml"])
    assert refused.value.code == 2 and "unrecognized arguments: --configf" in capsys.readouterr().err


@pytest.fixture
def snakemake_parser():
    """Snakemake's --config parser, imported before `scratch` stops subprocesses (its executor plugins
    look for SLURM's tools on import)."""
    import snakemake.cli  # noqa: F401


def test_paths_with_config_overrides_shows_the_keys_of_the_run_that_uses_them(
    snakemake_parser, scratch, capsys
):
    """`paths --config ...` reads the config as `snakemake --config ...` does (Snakemake's syntax, nested
    and dotted): the keys are those of the config file with the override written into it."""
    base = _write(scratch)

    def paths(*args: str) -> dict:
        assert main(["paths", "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)

    default = paths("--configfile", base)
    written = paths(
        "--configfile", _write(scratch, lambda c: c["placement"].update(target_effective_bits=5.0))
    )
    nested = paths("--configfile", base, "--config", "placement={target_effective_bits: 5.0}")
    dotted = paths("--configfile", base, "--config", "placement.target_effective_bits=5.0")
    assert nested == written and dotted == written
    assert nested["placement"]["key"] != default["placement"]["key"]
    assert nested["calibration"]["key"] == default["calibration"]["key"]  # upstream of the budget
    # an unknown key in an override is the run's one line, naming --config
    assert main(["paths", "--configfile", base, "--config", "placement={target_effective_bitz: 5}"]) == 2
    assert capsys.readouterr().err == (
        f"mixquant: {base} with --config placement: unknown config key 'placement.target_effective_bitz'; "
        "did you mean 'placement.target_effective_bits'?\n"
    )


def test_verify_json_says_nothing_is_built_in_json(scratch, capsys):
    assert main(["verify", "--json", "--configfile", _write(scratch)]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["built"] is False
    assert "is not built; run the workflow first" in report["error"]


def test_explain_works_on_planned_keys_not_built_yet(scratch, capsys):
    """Two planned KLD runs (same candidate, another KV-cache dtype): explained from the planned inputs,
    each marked as planned; a key neither built nor planned is one line."""
    config = _write(scratch)
    assert main(["paths", "--json", "--configfile", config]) == 0
    table = json.loads(capsys.readouterr().out)
    a, b = table["kld/bf16/bfloat16"]["key"], table["kld/bf16/fp8"]["key"]
    assert main(["explain", a[:12], b, "--configfile", config]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"A: {table['kld/bf16/bfloat16']['path']} (planned, not built)"
    assert out[1] == f"B: {table['kld/bf16/fp8']['path']} (planned, not built)"
    assert out[2:] == ['config.kv_cache_dtype: "bfloat16" -> "fp8"']
    assert main(["explain", "0" * 64, b, "--configfile", config]) == 2
    assert capsys.readouterr().err == (
        f"mixquant: no output directory with key {'0' * 64} under results/ nor among the config's planned "
        "outputs\n"
    )


def test_the_command_starts_without_torch():
    """`mixquant --help`, `mixquant plan` and the other planning commands import no torch, transformers, pulp
    or matplotlib: the commands that need them import them when they run."""
    import sys

    heavy = ("torch", "transformers", "pulp", "matplotlib")
    code = f"import sys, mixquant.cli; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
