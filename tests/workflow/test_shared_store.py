"""Two workflows, one results store (mixquant.store): two Snakemake runs in different working directories
with overlapping targets on one results_dir take turns -- the second waits, says for whom, plans again and
reuses what the first published (no keyed directory is computed twice) -- and a second run in a working
directory another run holds stops in one line naming the holder."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mixquant.keys.manifest import verify_manifest
from mixquant.store import STORE_LOCK

pytestmark = pytest.mark.slow


def shared_store(store: Path) -> list[str]:
    """The --config of a run on ``store`` (last on the command line: --config takes what follows)."""
    return ["--config", f"results_dir={store}", "allow_outside_workdir=true"]


def start(wd: Path, store: Path, targets: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", *targets, *shared_store(store)],
        cwd=wd,
        stdout=open(log, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
    )


def wait_for_store_owner(store: Path, pid: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until the run ``pid`` holds the store (it writes itself into the lock file at its start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((store / STORE_LOCK).read_text())["pid"] == pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, "the first run ended before it took the store"
        time.sleep(0.05)
    raise AssertionError("the first run never took the store")


def jobs_run(log_text: str) -> list[str]:
    """The stage of every job a run's console announces (``[10:25:08] quantize_layer fp8 layers 1-1``)."""
    return [match.group(1) for match in re.finditer(r"^\[\d\d:\d\d:\d\d\] (\w+)", log_text, re.MULTILINE)]


def test_two_workflows_on_one_store_take_turns_and_share_results(tmp_path, workdir_factory):
    store = tmp_path / "store"
    a, b = workdir_factory(tmp_path / "a"), workdir_factory(tmp_path / "b")
    paths = json.loads(a.mixquant("paths", "--json").stdout)
    rel = {
        name: str(Path(paths[name]["path"]).relative_to("results"))
        for name in ("prompt", "reference_logits", "activations")
    }
    target = {name: str(store / path) for name, path in rel.items()}

    first = start(a.root, store, [target["prompt"], target["reference_logits"]], tmp_path / "a.log")
    wait_for_store_owner(store, first.pid, first)
    second = start(b.root, store, [target["reference_logits"], target["activations"]], tmp_path / "b.log")
    # meanwhile a rerun in the first run's working directory stops at once, naming who holds it
    again = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", target["prompt"], *shared_store(store)],
        cwd=a.root,
        capture_output=True,
        text=True,
    )
    assert first.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]
    assert second.wait(timeout=600) == 0, (tmp_path / "b.log").read_text()[-3000:]

    assert again.returncode != 0
    holder_line = (
        f"mixquant: this working directory is in use by the run of pid {first.pid} on "
        f"{socket.gethostname()}; wait for it or stop it (snakemake --unlock only once it is gone)"
    )
    assert holder_line in again.stderr.splitlines()
    assert "LockException" not in again.stderr + again.stdout  # nor Snakemake's advice to --unlock

    a_log, b_log = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    host = socket.gethostname()
    waiting = f"mixquant: {store}/ is in use by the run of pid {first.pid} on {host} in {a.root} (since "
    assert any(line.startswith(waiting) for line in b_log.splitlines()), b_log[-3000:]
    assert "mixquant: the other run is done; planning again to reuse what it published" in b_log
    # the first run computed the prompt and the reference logits; the second, after planning again, only
    # what the first did not publish (the calibration and the activation statistics)
    assert {"pin_prompt", "reference_logits"} <= set(jobs_run(a_log))
    replanned = b_log.split("planning again to reuse what it published", 1)[1]
    assert "reference_logits" not in jobs_run(replanned) and "pin_prompt" not in jobs_run(replanned)
    assert {"sample_calibration", "collect_activation_stats"} <= set(jobs_run(replanned))
    for path in target.values():
        assert verify_manifest(path) == []
    assert sorted(p.name for p in (store / "reference_logits").iterdir()) == [
        Path(target["reference_logits"]).name
    ]
