"""From a job's estimate to what the cluster is asked for: SLURM's mem_mb, runtime, disk_mb and GPUs."""

from __future__ import annotations

import math

from mixquant.config import MixquantConfig
from mixquant.costs.hardware import B200, GIB, Hardware
from mixquant.costs.job import stage_cost
from mixquant.facts import Geometry, compute_device
from mixquant.keys.stages import stage_spec
from mixquant.numerics import device_type


def disk_mb(bytes_written: int) -> int:
    """Disk a job asks for: what it writes x 1.1 in MB, at least 1000 (Snakemake's unit; its own default,
    max(2 x input, 50 GB), knows nothing of a stage's output)."""
    return max(1000, math.ceil(bytes_written * 1.1 / 1e6))


def rule_resources(
    cfg: MixquantConfig,
    geometry: Geometry,
    stage: str,
    *,
    gpus: int = 0,
    fmt: str | None = None,
    layers: int = 1,
    sequences: int | None = None,
    suite: bool = False,
    hardware: Hardware = B200,
) -> dict[str, int]:
    """SLURM request of one job: ``mem_mb`` = peak host x 1.25 rounded up to whole GiB (at least 2000),
    ``runtime`` = runtime x 2 in minutes rounded up to 10 (at least 10), ``disk_mb`` (:func:`disk_mb`),
    ``gpu`` when the job has GPUs."""
    cost = stage_cost(
        cfg,
        geometry,
        stage,
        gpus=gpus,
        fmt=fmt,
        layers=layers,
        sequences=sequences,
        suite=suite,
        hardware=hardware,
    )
    mem_mb = max(2000, math.ceil(cost.peak_host_bytes * 1.25 / GIB) * 1024)
    runtime = max(10, math.ceil(cost.runtime_s * 2 / 60 / 10) * 10)
    resources = {"mem_mb": mem_mb, "runtime": runtime, "disk_mb": disk_mb(cost.bytes_written)}
    if cost.gpus:
        resources["gpu"] = cost.gpus
    return resources


def job_gpus(cfg: MixquantConfig, stage: str) -> int:
    """GPUs one job of ``stage`` uses: vLLM's tensor-parallel size for its stages, one for a stage that
    computes on a CUDA numerics.device, else none."""
    if stage_spec(stage).serves_model and cfg.kld.engine == "vllm":
        return cfg.kld.tensor_parallel_size
    return 1 if device_type(compute_device(cfg, stage)) == "cuda" else 0
