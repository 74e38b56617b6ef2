"""Every `--config` experiment the docs' experiments page suggests runs from the default config to a release,
and `mixquant verify` with the same overrides says what it can compare: the toy's published hashes are
"not comparable" (naming the setting) for an artifact made otherwise, never a failure; --strict fails.

One workdir for all of them, seeded with the session's default build, so each run reuses every stage its
change does not touch. Each runs with a BF16 KV cache only (BF16_KV, merged into the experiment's own
`kld` by Snakemake's --config merge): what is checked here is the same with either KV dtype, the default
build has the FP8 runs, and the candidates an experiment leaves alone reuse the build's BF16 runs. The
experiment that adds ModelOpt's AutoQuantize placement is also the kill campaign's point in that stage
(test_kill_campaign has the rest): its first run is killed, SIGKILL to the whole process tree, once the
stage has loaded the model; nothing is left partial, and the run after it removes the killed run's lock
and finishes."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from killing import LOCK_REMOVED, check_no_partial_keyed_dir, finished, run_trial

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# the KV dtype every experiment measures with (the default also runs FP8, which this check does not need)
BF16_KV = "kld={kv_cache_dtypes: [bfloat16]}"

RUN = re.compile(r"^\.venv/bin/snakemake --cores 2 --config '(?P<override>[^']+)'", re.MULTILINE)


def docs_experiments() -> list[str]:
    """The `--config` values of the run examples on docs/experiments.md, in order."""
    return [
        match["override"] for match in RUN.finditer((REPO / "docs" / "experiments.md").read_text("utf-8"))
    ]


def changes_a_hashed_artifact(override: str) -> bool:
    """Whether an override changes what a published hash is read from (the checkpoint, the prompt, the
    reference logits): in these examples every section does but kld (its candidates)."""
    return override.split("=", 1)[0] != "kld"


def test_the_docs_name_the_experiments_a_new_user_runs():
    experiments = docs_experiments()
    assert "placement={target_effective_bits: 5.0}" in experiments
    assert "placement={target_effective_bits: 7.0}" in experiments
    assert any(e.startswith("calibration={num_samples: ") for e in experiments)
    assert any(e.startswith("kld={candidates: [") and "modelopt_autoquantize" in e for e in experiments)


def test_each_docs_experiment_runs_to_a_release_and_verify_says_not_comparable(
    built_workdir, workdir_factory, tmp_path
):
    wd = workdir_factory(tmp_path / "wd")
    shutil.copytree(built_workdir.root / "results", wd.root / "results")
    skip = shutil.ignore_patterns("locks", "incomplete", "log")
    shutil.copytree(built_workdir.root / ".snakemake", wd.root / ".snakemake", ignore=skip)
    timings = {}
    for override in docs_experiments():
        started = time.monotonic()
        killed = "modelopt_autoquantize" in override
        config = (override, BF16_KV)  # the --config entries of every run and CLI call of this experiment
        if killed:  # killed once ModelOpt's stage has loaded the model, before it calibrates and scores
            log = tmp_path / "autoquantize-killed.log"
            outcome, _ = run_trial(
                wd.root, "hook", "model-loaded", "autoquantize_placement", log, config=config, cores=2
            )
            assert outcome == "killed", f"{outcome}\n{log.read_text()[-3000:]}"
            assert check_no_partial_keyed_dir(wd.root / "results") == []
            kept = finished(wd.root)
        run = wd.snakemake("--config", *config, check=False)
        timings[override] = round(time.monotonic() - started)
        assert run.returncode == 0, f"--config {override}:\n{run.stderr[-3000:]}"
        if killed:  # the killed run's lock removed, nothing it had recorded as finished built again
            assert LOCK_REMOVED in run.stdout + run.stderr
            now = finished(wd.root)
            assert [rel for rel, mtime in kept.items() if now.get(rel) != mtime] == []
        paths = json.loads(wd.mixquant("paths", "--json", "--config", *config).stdout)
        assert paths["release"]["done"], override
        if "modelopt_autoquantize" in override:  # ModelOpt's own placement was computed and measured
            aq = [
                row for name, row in paths.items() if name.startswith(("autoquantize", "candidate/modelopt"))
            ]
            assert len(aq) >= 2 and all(row["done"] for row in aq), override

        verify = wd.mixquant("verify", "--config", *config, check=False)
        strict = wd.mixquant("verify", "--strict", "--config", *config, check=False)
        assert verify.returncode == 0, f"--config {override}:\n{verify.stdout}{verify.stderr}"
        lines = verify.stdout.splitlines()
        section = override.split("=", 1)[0]
        if changes_a_hashed_artifact(override):
            assert "not comparable" in lines[-1] and lines[-1].startswith("passed: "), lines[-1]
            assert f"differs from the published config in {section}" in verify.stdout, verify.stdout
            assert "mismatch" not in lines[-1]
            assert strict.returncode == 1 and strict.stdout.splitlines()[-1].startswith(
                "FAILED: --strict: "
            ), strict.stdout
        else:  # another candidate leaves the checkpoint, the prompt and the logits as published
            assert lines[-2:] == ["4 match, 0 mismatch, 0 not pinned", "passed"], verify.stdout
            assert strict.returncode == 0
    print("seconds per experiment:", timings)
