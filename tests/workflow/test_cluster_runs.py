"""The cluster path for real: a slice of the default DAG through a local SLURM (sbatch, fake 4-GPU GRES)
and a run killed with SIGKILL and resumed, both compared file by file with the plain local run."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SLURM_TOOLS = REPO / "tools" / "slurm-local"


def slice_targets(wd) -> dict[str, str]:
    """One job of every kind of rule before the placement's solve, GPU-requesting ones included: the toy
    model, calibration, prompt, activation statistics, the layer windows, the first score pass (it reads
    every window), the BF16 reference logits and the BF16 candidate's KLD job (BF16 KV)."""
    paths = wd.paths()
    scores = sorted(name for name in paths if name.startswith("scores/"))[0]
    names = [
        "model",
        "calibration",
        "prompt",
        "activations",
        scores,
        "reference_logits",
        "kld/bf16/bfloat16",
    ]
    names += sorted(name for name in paths if name.startswith("layers/"))
    return {name: paths[name]["path"] for name in names}


def file_hashes(root: Path, rel: str) -> dict:
    manifest = json.loads((root / rel / "manifest.json").read_text())
    return manifest["files"]


def assert_same_results(wd, reference, targets: dict[str, str]) -> None:
    for name, rel in targets.items():
        assert (wd.root / rel / "manifest.json").is_file(), f"{name} was not built"
        assert file_hashes(wd.root, rel) == file_hashes(reference.root, rel), (
            f"{name} differs from the local run"
        )


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A single-node SLURM with 4 fake GPUs for this module; its daemons are stopped by PID after."""
    subprocess.run(["bash", str(SLURM_TOOLS / "install.sh")], check=True)
    state = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(SLURM_TOOLS / "start.sh"), str(state)], check=True)
    try:
        yield state
    finally:
        subprocess.run(["bash", str(SLURM_TOOLS / "stop.sh"), str(state)], check=False)


def test_slice_through_local_slurm_equals_the_local_run(slurm_cluster, built_workdir, workdir):
    wd = workdir
    targets = slice_targets(wd)
    assert targets == slice_targets(built_workdir)  # same config, same keys
    started = time.monotonic()
    result = wd.snakemake("--profile", "profiles/slurm-local", *targets.values())
    seconds = time.monotonic() - started
    log = result.stdout + result.stderr
    submitted = re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", log)
    kinds = {"fetch_model", "sample_calibration", "pin_prompt", "collect_activation_stats"}
    kinds |= {"quantize_layer", "score_sensitivity", "reference_logits", "run_kld"}
    ran = set(re.findall(r"^rule (\w+):$", log, re.M))
    assert kinds <= ran, ran
    # every job went through sbatch, and SLURM ran it
    assert len(submitted) == len(re.findall(r"^rule \w+:$", log, re.M)), log[-3000:]
    job_ids = {int(slurm_id) for _, slurm_id in submitted}
    slurm_logs = list((wd.root / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert {int(p.stem) for p in slurm_logs} >= job_ids or len(slurm_logs) >= len(job_ids)
    # the GPU rules asked for 4 GPUs and got them (fake GRES): their jobs saw CUDA_VISIBLE_DEVICES
    for rule in ("reference_logits", "run_kld"):
        logs = list((wd.root / ".snakemake" / "slurm_logs" / f"rule_{rule}").rglob("*.log"))
        assert logs, f"no SLURM log for {rule}"
    assert_same_results(wd, built_workdir, targets)
    print(f"SLURM slice: {len(job_ids)} sbatch jobs in {seconds:.0f} s")


def seed_model(wd, reference, targets: dict[str, str]) -> None:
    """Copy the toy model from the local run: content-addressed, so the key says it is the same model
    (fresh mtimes, so Snakemake has no reason to rebuild it); the run then starts at the calibration."""
    shutil.copytree(reference.root / targets["model"], wd.root / targets["model"], copy_function=shutil.copy)


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


def test_killed_run_resumes_to_the_same_results(built_workdir, workdir):
    wd = workdir
    targets = slice_targets(wd)
    seed_model(wd, built_workdir, targets)
    command = [sys.executable, "-m", "snakemake", "--cores", "2", *targets.values()]
    proc = subprocess.Popen(
        command, cwd=wd.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    incomplete = wd.root / ".snakemake" / "incomplete"
    deadline = time.monotonic() + 900

    def done() -> dict[str, int]:
        """The results Snakemake has finished: the manifest is written and the job's marker is gone (a job
        that wrote its manifest but was killed before Snakemake recorded it is rightly rerun)."""
        running = marked_incomplete(incomplete)
        found = {}
        for name, rel in targets.items():
            manifest = wd.root / rel / "manifest.json"
            if manifest.is_file() and rel.rstrip("/") not in running:
                found[name] = manifest.stat().st_mtime_ns
        return found

    try:
        # kill the workflow and its running jobs (one process group) once a job has finished after the
        # model and others are running (Snakemake marks them incomplete)
        while not (len(done()) >= 2 and marked_incomplete(incomplete)):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no job was running after 15 minutes"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = done()
    killed = {name for name, rel in targets.items() if rel.rstrip("/") in marked_incomplete(incomplete)}
    assert killed, "no job was running when the workflow was killed"
    assert any((wd.root / ".snakemake" / "locks").iterdir()), "the killed run left no lock"
    assert len(before) < len(targets), "everything was built before the kill"
    # rerun the same command: the stale lock is cleared, the killed jobs rerun, the finished ones are kept
    result = wd.snakemake(*targets.values())
    assert "removed the lock of a killed run" in result.stderr
    after = done()
    assert set(after) == set(targets)
    assert {name: after[name] for name in before} == before, "a result finished before the kill was rebuilt"
    assert_same_results(wd, built_workdir, targets)
    rebuilt = len(targets) - len(before)
    kept = f"{len(before)} of {len(targets)} results kept"
    print(f"resume: {kept}, {rebuilt} built on rerun (running when killed: {', '.join(sorted(killed))})")
