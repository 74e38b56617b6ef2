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
