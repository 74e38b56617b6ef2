"""A scratch workflow directory: the repo's Snakefile, rules and data, with its own results/."""

from __future__ import annotations

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


@dataclass
class Workdir:
    root: Path

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
        result = subprocess.run(
            [sys.executable, "-m", "mixquant.cli", *args], cwd=self.root, capture_output=True, text=True
        )
        if check and result.returncode != 0:
            raise AssertionError(f"mixquant {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def plan(self, configfile: str | None = None) -> dict:
        args = ["plan", "--json"] + (["--configfile", configfile] if configfile else [])
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


@pytest.fixture(scope="session")
def built_workdir(tmp_path_factory) -> Workdir:
    """The default DAG run once, end to end on the shipped toy (about 3 minutes on 2 cores).

    MIXQUANT_TEST_RESULTS=<results dir of an earlier default run> seeds it (development only: the run
    still happens, and reruns every stage whose key changed since)."""
    wd = make_workdir(tmp_path_factory.mktemp("e2e") / "wd")
    if seed := os.environ.get("MIXQUANT_TEST_RESULTS"):
        shutil.copytree(seed, wd.root / "results")
    wd.snakemake()
    return wd
