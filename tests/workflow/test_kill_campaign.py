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
trials and what each found is printed (pytest -s) and asserted.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from mixquant.faults import MARK_ENV, POINT_ENV
from mixquant.keys.manifest import verify_manifest

pytestmark = pytest.mark.slow

KEY_LEN = 64
# What a user's shell may export: another ATen dispatch (no SIMD), MKL's host-dependent mode, more
# threads, dynamic MKL, oneDNN's widest ISA. The profile sets its own before torch is imported.
HOSTILE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AUTO",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    "MKL_DYNAMIC": "TRUE",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
}
LOCK_REMOVED = "removed the lock of a killed run"
# a score job saves its states after every layer (not every 10 minutes), so that a kill mid-pass
# resumes from them; not part of any key: the results stay the clean run's
SAVE_EVERY_LAYER = "placement={search: {checkpoint_interval_s: 0}}"
# ModelOpt's own AutoQuantize placement as a KLD candidate (the default leaves it out for its cost): the
# campaign's last phase kills its stage and resumes
WITH_MODELOPT = (
    "kld={candidates: [{name: searched, source: searched}, {name: modelopt-autoquantize, source: "
    "modelopt_autoquantize}, {name: uniform-nvfp4, source: uniform, format: nvfp4_w4a16}, {name: bf16, "
    "source: bf16}]}"
)
# (kind, point, stage) in about the order the default DAG can first reach them (the BF16 candidate's KLD
# runs and gates need only the reference logits); "hook" stops a process at a mixquant.faults point,
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
    ("hook", "files-written", "gate_kld"),
    ("hook", "layer-saved", "quantize_layer"),
    ("hook", "manifest-written", "quantize_layer"),
    ("appear", None, "run_kld"),
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


def keyed_dirs(results: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for stage in sorted(p for p in results.iterdir() if p.is_dir() and p.name not in ("logs", "benchmarks")):
        out[stage.name] = sorted(p for p in stage.iterdir() if len(p.name) == KEY_LEN and p.is_dir())
    return out


def published(results: Path, stage: str) -> int:
    stage_dir = results / stage
    if not stage_dir.is_dir():
        return 0
    return sum(1 for p in stage_dir.iterdir() if len(p.name) == KEY_LEN and (p / "manifest.json").is_file())


def marked_incomplete(directory: Path) -> set[str]:
    """The outputs Snakemake marks incomplete (jobs started, not recorded as finished): its file persistence
    names each marker by the urlsafe base64 of the output path, split into '@'-prefixed chunks."""
    keys = set()
    if not directory.is_dir():
        return keys
    for path in directory.rglob("*"):
        if path.is_file() and path.name != "migration_underway":
            encoded = "".join(part.removeprefix("@") for part in path.relative_to(directory).parts)
            try:
                keys.add(base64.urlsafe_b64decode(encoded).decode().rstrip("/"))
            except (ValueError, UnicodeDecodeError):
                continue  # a marker being written while we look
    return keys


def finished(wd: Path) -> dict[str, int]:
    """Keyed directories Snakemake recorded as finished (published, no incomplete marker): manifest mtimes."""
    running = marked_incomplete(wd / ".snakemake" / "incomplete")
    out = {}
    if not (wd / "results").is_dir():
        return out
    for dirs in keyed_dirs(wd / "results").values():
        for directory in dirs:
            rel = str(directory.relative_to(wd))
            if (directory / "manifest.json").is_file() and rel not in running:
                out[rel] = (directory / "manifest.json").stat().st_mtime_ns
    return out


def next_output(wd: Path, reference: Path, clean: dict[str, str], stage: str) -> list[str]:
    """The output of ``stage`` the clean run finished first among those not published here yet (the one
    with the fewest inputs to build first); none for the release, whose key is the campaign's own."""
    pending = [p for p, of in clean.items() if of == stage and not (wd / p / "manifest.json").is_file()]
    if stage == "assemble_release" or not pending:
        return []
    return [min(pending, key=lambda p: (reference / p / "manifest.json").stat().st_mtime_ns)]


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it (from /proc), and every process of its session."""
    parents: dict[int, int] = {}
    sessions: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)], sessions[int(entry.name)] = int(fields[1]), int(fields[3])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree | {pid for pid, sid in sessions.items() if sid == root}


def kill_run(proc: subprocess.Popen) -> None:
    """Freeze then SIGKILL the run's whole process tree, as a lost node would stop it, and reap it."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for _ in range(3):  # a process forked while the previous pass ran is caught by the next one
            for pid in process_tree(proc.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(process_tree(proc.pid)) > 1:
        time.sleep(0.1)


def check_no_partial_keyed_dir(results: Path) -> list[str]:
    problems = []
    for stage, dirs in keyed_dirs(results).items():
        for directory in dirs:
            contents = [p.name for p in directory.iterdir() if p.name != ".snakemake_timestamp"]
            if not contents:
                continue  # the empty output directory Snakemake makes before a job starts
            if problems_here := verify_manifest(directory):
                problems.append(f"{stage}/{directory.name[:12]}: {problems_here[0]}")
    return problems


def run_trial(
    wd: Path,
    kind: str,
    point: str | None,
    stage: str,
    log: Path,
    prioritize: list[str] = (),
    config: tuple[str, ...] = (),
) -> tuple[str, float]:
    """One run of the workflow, killed at the point: ("killed" | "finished" | "failed rc", seconds)."""
    mark = wd / "fault.mark"
    mark.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (POINT_ENV, MARK_ENV)} | HOSTILE
    if kind == "hook":
        env.update({POINT_ENV: f"{point}@{stage}", MARK_ENV: str(mark)})
    before = published(wd / "results", stage) if kind == "appear" else 0
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "1"]
            + (["--prioritize", *prioritize] if prioritize else [])
            + ["--config", SAVE_EVERY_LAYER, *config],
            cwd=wd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while True:
            time.sleep(0.02)
            hit = mark.exists() if kind == "hook" else published(wd / "results", stage) > before
            if hit:
                kill_run(proc)
                return "killed", time.monotonic() - started
            if proc.poll() is not None:
                outcome = "finished" if proc.returncode == 0 else f"failed rc {proc.returncode}"
                return outcome, time.monotonic() - started


def test_the_kill_campaign(built_workdir, workdir, tmp_path, capsys):
    wd = workdir.root
    # the clean run's outputs of the default config (the shared run may also hold other tests' outputs)
    clean = {row["path"]: row["stage"] for row in built_workdir.paths().values()}
    assert all(row["done"] for row in built_workdir.paths().values())
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
        first = next_output(wd, built_workdir.root, clean, stage)
        outcome, seconds = run_trial(wd, kind, point, stage, log, first)
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
    final, seconds = run_trial(wd, "appear", None, "none-such-stage", tmp_path / "final.log")
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
        reference = built_workdir.root / path
        for file in sorted(
            p for p in reference.rglob("*") if p.is_file() and p.name != ".snakemake_timestamp"
        ):
            mine = wd / path / file.relative_to(reference)
            if not mine.is_file() or mine.read_bytes() != file.read_bytes():
                differing.append(str(mine.relative_to(wd)))
    # the release's repo/ is the clean run's, but for the recipe (and the card quoting it)
    reference = built_workdir.root / clean_release / "repo"
    for file in sorted(p for p in reference.rglob("*") if p.is_file()):
        if file.name in ("quantization_recipe.yaml", "README.md"):
            continue
        mine = wd / our_release[0] / "repo" / file.relative_to(reference)
        if not mine.is_file() or mine.read_bytes() != file.read_bytes():
            differing.append(str(mine.relative_to(wd)))
    assert differing == []
    # the second clone under the hostile shell: the published hashes, the gates, the profile's numerics
    verified = subprocess.run(
        [sys.executable, "-m", "mixquant.cli", "verify", "--json"],
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

    # the last phase: ModelOpt's AutoQuantize placement added as a candidate, killed once its stage has loaded
    # the model (before ModelOpt calibrates and scores), then the run resumed to a release with it measured
    phase = []
    for name, kind, point, stage in (
        ("autoquantize", "hook", "model-loaded", "autoquantize_placement"),
        ("autoquantize resumed", "appear", None, "none-such-stage"),
    ):
        kept, log = finished(wd), tmp_path / f"{name.replace(' ', '-')}.log"
        outcome, seconds = run_trial(wd, kind, point, stage, log, config=(WITH_MODELOPT,))
        phase.append(f"  {name:22} {outcome:22} {seconds:6.1f} s")
        check_rerun(name, log, kept)
        if partial := check_no_partial_keyed_dir(wd / "results"):
            failures.append(f"{name}: partial keyed directory: {partial}")
        want = "killed" if kind == "hook" else "finished"
        assert outcome == want, f"{name}: {outcome}\n{log.read_text()[-3000:]}"
        after_kill = outcome == "killed"
    warnings.warn("kill campaign, ModelOpt phase:\n" + "\n".join(phase), stacklevel=1)
    assert not failures, failures
    listed = workdir.mixquant("paths", "--json", "--config", SAVE_EVERY_LAYER, WITH_MODELOPT)  # as the runs
    paths = json.loads(listed.stdout)
    assert all(row["done"] for row in paths.values())
    autoquantize = wd / paths["autoquantize"]["path"]
    assert verify_manifest(autoquantize) == [] and (autoquantize / "placement.json").is_file()
