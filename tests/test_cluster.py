"""Cluster glue: dry-run parsing, per-job requests, and clearing the lock of a killed run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mixquant.cluster import (
    OWNER_FILE,
    _process_start,
    clear_stale_lock,
    engine_gpus,
    job_request,
    parse_dry_run,
    parse_dry_run_jobs,
    record_run_owner,
    release_run_owner,
)
from mixquant.config import load_config_file
from mixquant.graph import resolve_artifacts

REPO = Path(__file__).resolve().parents[1]
KEY = "ab" * 32

DRY_RUN = f"""
Building DAG of jobs...
[Wed Dec  2 19:25:11 2026]
rule quantize_layer:
    input: results/fetch_model/{"cd" * 32}
    output: results/quantize_layer/{KEY}
    log: results/logs/quantize_layer/{KEY}.log
    jobid: 31
    reason: Missing output files: results/quantize_layer/{KEY}; Input files updated by another job: x
    wildcards: key={KEY}
    resources: tmpdir=/tmp, runtime=60, mem_mb=4000, mem=4 GB, mem_mib=3815, gpu=4, slurm_partition=gpu
[Wed Dec  2 19:25:11 2026]
checkpoint solve_placement:
    output: results/solve_placement/{"ef" * 32}
    reason: Missing output files: results/solve_placement/{"ef" * 32}
    resources: tmpdir=/tmp
[Wed Dec  2 19:25:11 2026]
localrule all:
    input: results/quantize_layer/{KEY}
    jobid: 0
"""


def test_parse_dry_run_jobs():
    jobs = parse_dry_run_jobs(DRY_RUN)
    assert [job.rule for job in jobs] == ["quantize_layer", "solve_placement"]
    layer = jobs[0]
    assert layer.key == KEY
    assert layer.reason.startswith("Missing output files: results/quantize_layer/")
    assert layer.resources["mem_mb"] == "4000" and layer.resources["gpu"] == "4"
    assert layer.resources["mem"] == "4 GB"
    assert jobs[1].key == "ef" * 32


def test_parse_dry_run_counts_jobs_and_reasons_per_rule():
    """`mixquant plan`'s rule table reads the same parse as the per-job estimates."""
    assert parse_dry_run(DRY_RUN) == {
        "quantize_layer": {
            "jobs": 1,
            "reasons": {"Missing output files": 1, "Input files updated by another job": 1},
        },
        "solve_placement": {"jobs": 1, "reasons": {"Missing output files": 1}},
    }


@pytest.fixture(scope="module")
def laguna():
    return load_config_file(str(REPO / "config" / "laguna-s-2.1.yaml"))


def test_engine_gpus_follow_the_engine(laguna):
    assert engine_gpus(laguna, "run_kld") == 4 and engine_gpus(laguna, "reference_logits") == 4
    assert engine_gpus(laguna, "quantize_layer") == 1  # numerics.device: cuda
    assert engine_gpus(laguna, "export_checkpoint") == 0
    toy = load_config_file(str(REPO / "config" / "config.yaml"))
    assert engine_gpus(toy, "run_kld") == 0  # hf engine on the host
    assert engine_gpus(toy, "score_sensitivity") == 0


def test_job_request_doubles_per_attempt_and_falls_back_without_geometry(laguna):
    from mixquant.facts import planning_geometry

    arts = resolve_artifacts(laguna)
    geometry = planning_geometry(laguna, REPO)
    layer = next(art for art in arts.values() if art.stage == "quantize_layer")
    first, second = job_request(laguna, geometry, layer, 1), job_request(laguna, geometry, layer, 2)
    assert set(first) == {"mem_mb", "runtime", "disk_mb", "gpu", "nodes"}
    assert first["gpu"] == 1 and first["nodes"] == 1  # numerics.device: cuda, one node
    # memory and time double per retry; what a job writes does not grow
    assert second == {
        **{name: 2 * first[name] for name in ("mem_mb", "runtime")},
        **{name: first[name] for name in ("disk_mb", "gpu", "nodes")},
    }
    assert job_request(laguna, None, layer) == {
        "mem_mb": 4000,
        "runtime": 60,
        "disk_mb": 50000,
        "gpu": 1,
        "nodes": 1,
    }


def test_a_dead_owners_lock_is_removed_a_live_one_is_kept(tmp_path):
    base = tmp_path / ".snakemake"
    (base / "locks").mkdir(parents=True)
    (base / "locks" / "0.input.lock").write_text("x")
    # live owner: this process
    record_run_owner(base)
    assert clear_stale_lock(base) is None
    assert (base / "locks" / "0.input.lock").exists()
    # dead owner: a process that has exited
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = _process_start(child.pid)
    child.wait()
    owner = {"pid": child.pid, "host": socket.gethostname(), "start": start}
    (base / OWNER_FILE).write_text(json.dumps(owner))
    message = clear_stale_lock(base)
    assert message and f"pid {child.pid}" in message
    assert not (base / "locks").exists() and not (base / OWNER_FILE).exists()
    # another host's lock is never touched
    (base / "locks").mkdir()
    (base / "locks" / "0.output.lock").write_text("x")
    (base / OWNER_FILE).write_text(json.dumps({**owner, "host": "elsewhere"}))
    assert clear_stale_lock(base) is None and (base / "locks" / "0.output.lock").exists()


def test_a_recycled_pid_does_not_keep_a_stale_lock(tmp_path):
    base = tmp_path / ".snakemake"
    (base / "locks").mkdir(parents=True)
    (base / "locks" / "0.input.lock").write_text("x")
    # this PID is alive, but it is not the process that took the lock (different start time)
    (base / OWNER_FILE).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": "1"})
    )
    assert clear_stale_lock(base) is not None


def test_release_forgets_only_its_own_record(tmp_path):
    base = tmp_path / ".snakemake"
    base.mkdir()
    (base / OWNER_FILE).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "start": "0"}))
    release_run_owner(base)
    assert (base / OWNER_FILE).exists()
    record_run_owner(base)
    release_run_owner(base)
    assert not (base / OWNER_FILE).exists()
