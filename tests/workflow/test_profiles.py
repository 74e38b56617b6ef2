"""Cluster profiles and environments: what the SLURM runs are made of, checked without a cluster."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "profiles"

# What a site sets for its own cluster; everything else in the profile is the workflow's.
SITE_KNOBS = {
    "jobs",
    "software-deployment-method",
    "slurm-status-command",
    "slurm-init-seconds-before-status-checks",
    "slurm-partition-config",
    "latency-wait",
    "slurm_partition",
    "slurm_account",
    "cpus_per_task",
}


def load(name: str) -> dict:
    return yaml.safe_load((PROFILES / name / "config.yaml").read_text())


def flatten(data: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out: dict[tuple, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def test_slurm_local_differs_from_slurm_blackwell_only_in_site_knobs():
    blackwell, local = flatten(load("slurm-blackwell")), flatten(load("slurm-local"))
    differing = {key for key in blackwell.keys() | local.keys() if blackwell.get(key) != local.get(key)}
    assert differing, "the two profiles are identical: slurm-local sets no site knob"
    assert {key[-1] for key in differing} <= SITE_KNOBS, sorted(differing)
    # and the lines that differ are the ones marked as site knobs in slurm-blackwell
    marked = {
        match.group(1)
        for match in re.finditer(
            r"^\s*([\w-]+):.*# site knob", (PROFILES / "slurm-blackwell" / "config.yaml").read_text(), re.M
        )
    }
    assert {key[-1] for key in differing} <= marked


def test_slurm_blackwell_profile():
    profile = load("slurm-blackwell")
    assert profile["executor"] == "slurm"
    assert profile["software-deployment-method"] == "conda"
    assert profile["rerun-incomplete"] is True and profile["retries"] >= 1
    # no placeholder account (the plugin validates it on every job): the user's default from sacct
    assert "slurm_account" not in profile["default-resources"]
    resources = profile["set-resources"]
    # GPUs, nodes, memory and wall time are the rules' (from the config and the geometry), never the profile's
    assert not any(
        {"gpu", "gres", "nodes", "mem_mb", "runtime"} & set(values) for values in resources.values()
    )
    # partitions: the plugin picks from the partition file by each job's resources
    assert profile["slurm-partition-config"] == "profiles/slurm-blackwell/partitions.yaml"
    partitions = yaml.safe_load((PROFILES / "slurm-blackwell" / "partitions.yaml").read_text())["partitions"]
    assert partitions["cpu"]["max_gpu"] == 0 and partitions["gpu"]["max_gpu"] >= 4


def test_workflow_profile_leaves_cluster_settings_to_the_cluster_profile():
    # profiles/default applies to every run and wins key by key over --profile
    default = load("default")
    assert set(default) <= {"rerun-triggers", "rerun-incomplete", "show-failed-logs", "cores"}
