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
    resources = profile["set-resources"]
    # vLLM tensor parallel 4 on the KLD stages, the GPU resource name the plugin maps to --gpus
    assert resources["reference_logits"]["gpu"] == 4 and resources["run_kld"]["gpu"] == 4
    gpu_rules = {rule for rule, values in resources.items() if "gpu" in values or "gres" in values}
    # and one GPU for every stage that computes on numerics.device: the streamed forward stages, the rebuild
    forward = {"collect_activation_stats", "score_sensitivity", "quantize_layer"}
    assert gpu_rules == {"reference_logits", "run_kld"} | forward
    assert all(resources[rule]["gpu"] == 1 for rule in forward)
    assert {resources[rule]["slurm_partition"] for rule in gpu_rules} == {"gpu"}
    assert profile["default-resources"]["slurm_partition"] != resources["run_kld"]["slurm_partition"]
    # memory and runtime are not fixed here: the rules derive them from the geometry
    assert not any({"mem_mb", "runtime"} & set(values) for values in resources.values())


def test_workflow_profile_leaves_cluster_settings_to_the_cluster_profile():
    # profiles/default applies to every run and wins key by key over --profile
    default = load("default")
    assert set(default) <= {"rerun-triggers", "rerun-incomplete", "show-failed-logs", "cores"}
