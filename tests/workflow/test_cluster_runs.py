"""The cluster path for real: a slice of the default DAG through a local SLURM (sbatch, fake 4-GPU GRES),
compared file by file with the plain local run. (A run killed with SIGKILL and resumed: the kill campaign,
test_kill_campaign.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SLURM_TOOLS = REPO / "tools" / "slurm-local"


def slice_targets(wd) -> dict[str, str]:
    """One job of every kind of rule before the placement's solve, GPU-requesting ones included: the toy
    model, calibration, prompt, activation statistics, the layer windows, the first score pass (it reads
    every window), the evaluation suite's windows, the BF16 reference logits of the prompt and of the suite,
    and the BF16 candidate's KLD job (BF16 KV)."""
    paths = wd.paths()
    scores = sorted(name for name in paths if name.startswith("scores/"))[0]
    names = [
        "model",
        "calibration",
        "prompt",
        "activations",
        scores,
        "eval",
        "reference_logits",
        "suite_reference",
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


# The toy computes on the CPU (numerics.device: cpu, the hf engine): its jobs ask for no GPU. To put GPU
# requests through the real plugin and SLURM as well, the KLD jobs are given the 4 fake GPUs here, the way a
# site would override a rule's resources.
GPU_OVERRIDE = ("--set-resources", "reference_logits:gpu=4", "run_kld:gpu=4")


def submitted_calls(log: str) -> list[tuple[str, str | None, str]]:
    """(rule, output key or None, sbatch options) of every submission the plugin logged (--verbose:
    "sbatch call: ..."); its comment names the rule and, for a keyed rule, the key wildcard."""
    from mixquant.slurm import submitted_options

    calls = []
    for line in log.splitlines():
        if "sbatch call: " not in line:
            continue
        call = line.split("sbatch call: ", 1)[1].split(" --wrap=", 1)[0]
        comment = re.search(r"--comment '?rule_(\w+?)(?:_wildcards_([0-9a-f]{64}))?'?(?: |$)", call)
        calls.append((comment.group(1), comment.group(2), submitted_options(call)))
    return calls


def targets_keys(targets: dict[str, str]) -> set[str]:
    return {path.rstrip("/").rsplit("/", 1)[1] for path in targets.values()}


def test_slice_through_local_slurm_equals_the_local_run(slurm_cluster, built_workdir, workdir):
    wd = workdir
    wd.host_slurm = True  # `mixquant plan` checks the profiles' partitions with this cluster's sinfo
    targets = slice_targets(wd)
    assert targets == slice_targets(built_workdir)  # same config, same keys
    # what `mixquant plan` says the plugin will submit, job by job
    plan = json.loads(
        wd.mixquant("plan", "--json", "--profile", "profiles/slurm-local", "--", *GPU_OVERRIDE).stdout
    )
    assert plan["ready"] is True, plan["blockers"]  # sinfo lists the profile's one partition
    # the Blackwell profile's partitions are not on this cluster: the plan says so, naming them
    blackwell = json.loads(wd.mixquant("plan", "--json", "--profile", "profiles/slurm-blackwell").stdout)
    assert sorted(line for line in blackwell["blockers"] if line.startswith("partition ")) == [
        "partition 'cpu' (the profile's) does not exist here: sinfo lists local",
        "partition 'gpu' (the profile's) does not exist here: sinfo lists local",
    ], blackwell["blockers"]
    planned = {job["outputs"][0].rstrip("/").rsplit("/", 1)[1]: job for job in plan["jobs"]}
    started = time.monotonic()
    result = wd.snakemake("--profile", "profiles/slurm-local", "--verbose", *targets.values(), *GPU_OVERRIDE)
    seconds = time.monotonic() - started
    log = result.stdout + result.stderr
    submitted = re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", log)
    kinds = {"fetch_model", "sample_calibration", "pin_prompt", "collect_activation_stats"}
    kinds |= {"quantize_layer", "score_sensitivity", "sample_eval", "reference_logits", "run_kld"}
    ran = set(re.findall(r"^rule (\w+):$", log, re.M))
    assert kinds <= ran, ran
    # every job went through sbatch, and SLURM ran it
    assert len(submitted) == len(re.findall(r"^rule \w+:$", log, re.M)), log[-3000:]
    job_ids = {int(slurm_id) for _, slurm_id in submitted}
    slurm_logs = list((wd.root / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert {int(p.stem) for p in slurm_logs} >= job_ids or len(slurm_logs) >= len(job_ids)
    # the plugin submitted each job with exactly the options the plan printed
    calls = submitted_calls(log)
    assert len(calls) == len(submitted), calls
    for rule, key, options in calls:
        if key is None:  # a rule whose one job's path is fixed at planning
            (key,) = [k for k, job in planned.items() if job["rule"] == rule and k in targets_keys(targets)]
        assert planned[key]["rule"] == rule and options == planned[key]["sbatch"], (
            rule,
            options,
            planned[key],
        )
    gpu_jobs = [options for _, _, options in calls if "--gpus=4" in options]
    # the two references (the prompt's, the suite's) and the KLD job
    assert len(gpu_jobs) == 3 and all("--nodes=1" in options for _, _, options in calls)
    # the GPU jobs got their 4 fake GPUs (GRES): SLURM ran them
    for rule in ("reference_logits", "run_kld"):
        logs = list((wd.root / ".snakemake" / "slurm_logs" / f"rule_{rule}").rglob("*.log"))
        assert logs, f"no SLURM log for {rule}"
    assert_same_results(wd, built_workdir, targets)
    print(f"SLURM slice: {len(job_ids)} sbatch jobs in {seconds:.0f} s")
