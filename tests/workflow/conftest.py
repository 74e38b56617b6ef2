"""A scratch workflow directory: the repo's Snakefile, rules and data, with its own results/."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONSOLE = "build-console.txt"  # built_workdir: the console output of its default run


@dataclass
class Workdir:
    """``host_slurm``: whether `mixquant` here sees this machine's SLURM. Off by default: the local-cluster
    test (test_cluster_runs) starts a real slurmctld that every xdist worker's `sinfo` would then reach, and
    `mixquant plan` checks the profile's partitions against what `sinfo` lists. Without it, the real `sinfo`
    reads an empty slurm.conf and fails at once, as on a machine with no cluster (the check is skipped)."""

    root: Path
    host_slurm: bool = False

    def config(self, name: str = "config/config.yaml") -> dict:
        return yaml.safe_load((self.root / name).read_text())

    def write_config(self, name: str, data: dict) -> str:
        (self.root / name).write_text(yaml.safe_dump(data, sort_keys=False))
        return name

    def snakemake(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "--cores", "2", *args],
            cwd=self.root,
            capture_output=True,
            text=True,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"snakemake {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def mixquant(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        if not self.host_slurm:
            no_cluster = self.root.parent / "no-slurm.conf"  # beside the workdir: nothing added to it
            no_cluster.touch()
            env["SLURM_CONF"] = str(no_cluster)
        result = subprocess.run(
            [sys.executable, "-m", "mixquant.cli", *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            env=env,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"mixquant {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def plan(self, configfile: str | None = None) -> dict:
        args = ["plan", "--json", "--no-env-check"] + (["--configfile", configfile] if configfile else [])
        return {rule: row["jobs"] for rule, row in json.loads(self.mixquant(*args).stdout)["rules"].items()}

    def paths(self, configfile: str = "config/config.yaml") -> dict:
        return json.loads(self.mixquant("paths", "--json", "--configfile", configfile).stdout)


def make_workdir(root: Path) -> Workdir:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Snakefile", root / "Snakefile")
    shutil.copytree(REPO / "config", root / "config")
    shutil.copytree(REPO / "profiles", root / "profiles")
    for shared in ("workflow", "envs", "data"):
        (root / shared).symlink_to(REPO / shared)
    return Workdir(root)


@pytest.fixture
def workdir(tmp_path) -> Workdir:
    return make_workdir(tmp_path / "wd")


@pytest.fixture
def workdir_factory():
    """``make_workdir`` for tests that need more than one scratch workflow directory."""
    return make_workdir


@pytest.fixture(scope="session")
def built_workdir(tmp_path_factory) -> Workdir:
    """The default DAG run once, end to end on the shipped toy (about 3 minutes on 2 cores).

    One build for the whole test session: under pytest-xdist the first worker that asks builds it in the
    session's shared temporary directory while the others wait; each worker then works in its own copy
    (its tests add their own results), checked by a Snakemake run that has nothing to do.

    MIXQUANT_TEST_RESULTS=<results dir of an earlier default run> seeds it (development only: the run
    still happens, and reruns every stage whose key changed since)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(shared / "e2e-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = Workdir(shared / "e2e-build" / "wd")
        if not (build.root / "built").is_file():
            shutil.rmtree(build.root, ignore_errors=True)  # what a failed attempt left
            build = make_workdir(build.root)
            if seed := os.environ.get("MIXQUANT_TEST_RESULTS"):
                shutil.rmtree(build.root / "results", ignore_errors=True)
                shutil.copytree(seed, build.root / "results")
            # what the run printed, for the console test (tests/workflow/test_run_console.py); as bytes, so
            # that a progress bar's \r redraws stay on their line, as on a terminal
            run = subprocess.run(
                [sys.executable, "-m", "snakemake", "--cores", "2"], cwd=build.root, capture_output=True
            )
            if run.returncode != 0:
                raise AssertionError(f"snakemake failed:\n{run.stderr.decode(errors='replace')}")
            (build.root / CONSOLE).write_bytes(run.stderr + run.stdout)
            (build.root / "built").touch()
    wd = make_workdir(tmp_path_factory.mktemp("e2e") / "wd")
    # results (mtimes kept) and Snakemake's records of them, not its locks or the build's markers
    shutil.copytree(build.root / "results", wd.root / "results")
    skip = shutil.ignore_patterns("locks", "incomplete", "log")
    shutil.copytree(build.root / ".snakemake", wd.root / ".snakemake", ignore=skip)
    shutil.copy(build.root / CONSOLE, wd.root / CONSOLE)
    wd.snakemake()
    return wd
