"""The kill campaign: SIGKILL the whole default workflow (Snakemake and every job) at named points across
every stage kind, rerun, and again, until a rerun finishes; then its results equal a clean run's byte for
byte. After every kill: no keyed directory is partial (each verifies against its manifest, or is the
empty directory Snakemake makes for a job's output), the next run removes the killed run's lock and
starts, and no result Snakemake had recorded as finished is built again.

The campaign's working directory is also the second clone of the portability check: another absolute
path, and every run started from a shell that exported what the numerics profile overrides (another ATen
dispatch, MKL's host-dependent mode, more threads, oneDNN's widest ISA); its results are compared with
the session's clean build, and they reproduce the four published hashes.

Points (mixquant.faults): inside a stage's computation (a quantized layer saved, a scoring stream's
state saved before its progress file, the export's shards written before the audit), between a stage's
files and its manifest, between the manifest and the publishing rename, after the rename before the job
exits, at a run's start (locks taken, no job started) and at its end (every job done, Snakemake's
bookkeeping not). Bookkeeping points without a hook are hit from outside: the harness kills the run the
moment a new keyed directory of a stage appears, while Snakemake records the finished job.

The campaign runs on one working directory, trial after trial (each kills a run that resumes what the
previous ones left), taking the next point of the list whose stage still has jobs to do; the count of
trials and what each found is printed (pytest -s) and asserted. It measures with a BF16 KV cache only and
two KLD runs (CAMPAIGN): every stage kind and kill point is there, with half the KLD jobs of the default
and each of them two engine passes instead of five. Its clean counterpart is the session's default build
run again with the same setting: it makes those KLD runs (their key holds the count), the gates, report,
verdict and release, and reuses everything else. ModelOpt's AutoQuantize stage is killed where the docs'
experiment adds it (test_docs_experiments).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from killing import (
    HOSTILE,
    LOCK_REMOVED,
    SAVE_EVERY_LAYER,
    check_no_partial_keyed_dir,
    finished,
    keyed_dirs,
    next_output,
    published,
    run_trial,
)
from mixquant.keys.manifest import verify_manifest

pytestmark = pytest.mark.slow

# the campaign's one setting beyond the default: KLD with a BF16 KV cache only (the default also runs FP8)
# and two runs (the default's five): the hf engine's runs are bit-identical, and two still gate their spread
CAMPAIGN = "kld={kv_cache_dtypes: [bfloat16], runs: 2}"

# (kind, point, stage) in about the order the default DAG can first reach them (the BF16 candidate's KLD
# runs need only the reference logits, every gate also the uniform baseline's runs, so the gate comes after
# the BF16 candidate's runs are published); "hook" stops a process at a mixquant.faults point,
# "appear" kills when the stage's next keyed directory appears. Each trial runs on one core and asks
# Snakemake to prioritize the stage's next output (and so its inputs): the stage is reached before other
# jobs finish it on the side.
POINTS = [
    ("hook", "run-start", "snakemake"),
    ("hook", "files-written", "fetch_model"),
    ("hook", "manifest-written", "pin_prompt"),
    ("hook", "files-written", "sample_eval"),
    ("hook", "manifest-written", "reference_logits"),
    ("hook", "files-written", "sample_calibration"),
    ("hook", "files-written", "run_kld"),
    ("hook", "published", "sample_calibration"),
    ("hook", "files-written", "collect_activation_stats"),
    ("appear", None, "collect_activation_stats"),
    ("hook", "manifest-written", "run_kld"),
    ("hook", "layer-saved", "quantize_layer"),
    ("hook", "manifest-written", "quantize_layer"),
    ("appear", None, "run_kld"),
    ("hook", "files-written", "gate_kld"),
    ("hook", "published", "quantize_layer"),
    ("appear", None, "quantize_layer"),
    ("hook", "stream-state-saved", "score_sensitivity"),
    ("hook", "progress-saved", "score_sensitivity"),
    ("hook", "files-written", "score_sensitivity"),
    ("hook", "published", "score_sensitivity"),
    ("hook", "manifest-written", "solve_placement"),
    ("hook", "published", "solve_placement"),
    ("hook", "shards-written", "export_checkpoint"),
    ("hook", "manifest-written", "export_checkpoint"),
    ("appear", None, "export_checkpoint"),
    ("hook", "published", "run_kld"),
    ("hook", "files-written", "verify_hashes"),
    ("hook", "published", "kld_report"),
    ("hook", "manifest-written", "check_kld_gates"),
    ("hook", "manifest-written", "assemble_release"),
    ("hook", "published", "assemble_release"),
    ("hook", "run-end", "snakemake"),
]


def clean_counterpart(built_workdir, workdir_factory, root: Path):
    """The session's default build, run again with CAMPAIGN: it reuses every output but the KLD runs (two
    each, BF16 KV), their gates, the report, the verdict, the verify and the release."""
    reference = workdir_factory(root)
    shutil.copytree(built_workdir.root / "results", reference.root / "results")
    skip = shutil.ignore_patterns("locks", "incomplete", "log")
    shutil.copytree(built_workdir.root / ".snakemake", reference.root / ".snakemake", ignore=skip)
    reference.snakemake("--config", CAMPAIGN)
    rows = json.loads(reference.mixquant("paths", "--json", "--config", CAMPAIGN).stdout).values()
    assert all(row["done"] for row in rows)
    return reference, {row["path"]: row["stage"] for row in rows}


def test_the_kill_campaign(built_workdir, workdir, workdir_factory, tmp_path, capsys):
    wd = workdir.root
    # the clean outputs of the campaign's config (the shared run may also hold other tests' outputs)
    reference, clean = clean_counterpart(built_workdir, workdir_factory, tmp_path / "reference" / "wd")
    expected_jobs = Counter(clean.values())
    rows, failures = [], []
    after_kill = False

    def check_rerun(name: str, log: Path, kept: dict[str, int]) -> None:
        """The run after a kill removed the killed run's lock; nothing recorded as finished was rebuilt."""
        if after_kill and LOCK_REMOVED not in log.read_text():
            failures.append(f"{name}: the killed run's lock was not removed")
        now = finished(wd)
        if rebuilt := sorted(rel for rel, mtime in kept.items() if now.get(rel) != mtime):
            failures.append(f"{name}: finished results built again: {rebuilt}")

    for index, (kind, point, stage) in enumerate(POINTS):
        last = index == len(POINTS) - 1
        if stage != "snakemake" and published(wd / "results", stage) >= expected_jobs.get(stage, 0):
            rows.append((kind, point, stage, "skipped: stage done", 0.0))
            continue
        kept, log = finished(wd), tmp_path / f"trial{index:02}.log"
        first = next_output(wd, reference.root, clean, stage)
        outcome, seconds = run_trial(wd, kind, point, stage, log, first, config=(SAVE_EVERY_LAYER, CAMPAIGN))
        rows.append((kind, point, stage, outcome, seconds))
        check_rerun(f"trial {index} ({point or kind}@{stage})", log, kept)
        after_kill = outcome == "killed"
        if outcome != "killed":
            if not (last and outcome == "finished"):
                failures.append(f"trial {index} ({point or kind}@{stage}): {outcome}")
            break
        if partial := check_no_partial_keyed_dir(wd / "results"):
            failures.append(f"trial {index} ({point or kind}@{stage}): partial keyed directory: {partial}")
    # the run that finishes the work, with no fault armed
    kept = finished(wd)
    final, seconds = run_trial(
        wd, "appear", None, "none-such-stage", tmp_path / "final.log", config=(SAVE_EVERY_LAYER, CAMPAIGN)
    )
    rows.append(("final", None, "-", final, seconds))
    check_rerun("final run", tmp_path / "final.log", kept)
    after_kill = final == "killed"
    killed = sum(1 for row in rows if row[3] == "killed")
    table = "\n".join(
        [f"kill campaign: {len(rows) - 1} trials, {killed} kills, {len(failures)} failures"]
        + [
            f"  {kind:6} {point or '-':20} {stage:26} {outcome:22} {secs:6.1f} s"
            for kind, point, stage, outcome, secs in rows
        ]
    )
    with capsys.disabled():
        print("\n" + table)
    # the figures reach the CI log too (pytest's warnings summary; xdist workers print nothing else)
    warnings.warn(table, stacklevel=1)
    assert not failures, failures
    assert final == "finished", (tmp_path / "final.log").read_text()[-3000:]
    assert killed >= 20
    # nothing half-done is left, and every result equals the clean run's bytes
    leftovers = sorted(str(p.relative_to(wd)) for p in (wd / "results").glob("*/.tmp-*"))
    assert leftovers == []
    ours = {f"results/{stage}/{d.name}" for stage, dirs in keyed_dirs(wd / "results").items() for d in dirs}
    # The release's key holds the whole resolved recipe, this campaign's checkpoint_interval_s: 0 included
    # (a setting no other key holds), so it is the one output whose key differs from the clean run's.
    clean_release = next(path for path, stage in clean.items() if stage == "assemble_release")
    our_release = sorted(path for path in ours if path.startswith("results/assemble_release/"))
    assert len(our_release) == 1 and verify_manifest(wd / our_release[0]) == []
    assert ours - set(our_release) == set(clean) - {clean_release}  # every other output, nothing else
    differing = []
    for path in sorted(set(clean) - {clean_release}):
        reference_dir = reference.root / path
        for file in sorted(
            p for p in reference_dir.rglob("*") if p.is_file() and p.name != ".snakemake_timestamp"
        ):
            mine = wd / path / file.relative_to(reference_dir)
            if not mine.is_file() or mine.read_bytes() != file.read_bytes():
                differing.append(str(mine.relative_to(wd)))
    # the release's repo/ is the clean run's, but for the recipe (and the card quoting it)
    release_repo = reference.root / clean_release / "repo"
    for file in sorted(p for p in release_repo.rglob("*") if p.is_file()):
        if file.name in ("quantization_recipe.yaml", "README.md"):
            continue
        mine = wd / our_release[0] / "repo" / file.relative_to(release_repo)
        if not mine.is_file() or mine.read_bytes() != file.read_bytes():
            differing.append(str(mine.relative_to(wd)))
    assert differing == []
    # the second clone under the hostile shell: the published hashes, the gates, the profile's numerics
    verified = subprocess.run(
        [sys.executable, "-m", "mixquant.cli", "verify", "--json", "--config", CAMPAIGN],
        cwd=wd,
        env={**os.environ, **HOSTILE},
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["counts"] == {"match": 4, "mismatch": 0, "not pinned": 0}
    verdict = next(path for path, stage in clean.items() if stage == "check_kld_gates")
    assert json.loads((wd / verdict / "verdict.json").read_text())["passed"] is True
    reference_logits = next(path for path, stage in clean.items() if stage == "reference_logits")
    numerics = json.loads((wd / reference_logits / "manifest.json").read_text())["environment"]["numerics"]
    decisive = (numerics["cpu_capability"], numerics["mkl_cbwr"], numerics["threads"])
    assert decisive == ("AVX2", "COMPATIBLE", 1)
