"""Killing a workflow run as a lost node would, and checking what it left: the kill campaign's harness
(test_kill_campaign), also used where another test kills one stage (test_docs_experiments).

A "hook" kill stops the run at a mixquant.faults point (the job writes a mark file there; the harness sees it
and kills); an "appear" kill stops it the moment a new keyed directory of the stage is published."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mixquant.faults import MARK_ENV, POINT_ENV
from mixquant.keys.manifest import verify_manifest

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
    """The output of ``stage`` not published here yet with the fewest upstream outputs still to build here
    (followed through each output's manifest, ``preimage.upstream``, in the clean run ``reference``), the
    one the clean run finished first among equals; none for the release, whose key is the campaign's own."""
    pending = [p for p, of in clean.items() if of == stage and not (wd / p / "manifest.json").is_file()]
    if stage == "assemble_release" or not pending:
        return []
    by_key = {d.name: d for dirs in keyed_dirs(reference / "results").values() for d in dirs}

    def to_build(rel: str) -> int:
        seen: set[str] = set()
        frontier = [Path(rel).name]
        while frontier:
            manifest = by_key[frontier.pop()] / "manifest.json"
            upstream = json.loads(manifest.read_text())["preimage"].get("upstream", {})
            for key in upstream.values():
                if isinstance(key, str) and key in by_key and key not in seen:
                    seen.add(key)
                    frontier.append(key)
        here = [wd / by_key[key].relative_to(reference) / "manifest.json" for key in seen]
        return sum(1 for manifest in here if not manifest.is_file())

    return [min(pending, key=lambda p: (to_build(p), (reference / p / "manifest.json").stat().st_mtime_ns))]


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
    config: tuple[str, ...] = (SAVE_EVERY_LAYER,),
    cores: int = 1,
) -> tuple[str, float]:
    """One run of the workflow (``--config`` entries ``config``) from a shell exporting HOSTILE, killed at
    the point: ("killed" | "finished" | "failed rc", seconds)."""
    mark = wd / "fault.mark"
    mark.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (POINT_ENV, MARK_ENV)} | HOSTILE
    if kind == "hook":
        env.update({POINT_ENV: f"{point}@{stage}", MARK_ENV: str(mark)})
    before = published(wd / "results", stage) if kind == "appear" else 0
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", str(cores)]
            + (["--prioritize", *prioritize] if prioritize else [])
            + (["--config", *config] if config else []),
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
