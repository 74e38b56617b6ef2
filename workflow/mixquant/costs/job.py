"""One job's estimate: what every stage shares (startup, the manifest's re-read, the no-overlap runtime),
and the stage's own cost function, named by the stage registry (``StageSpec.cost``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from mixquant.config import MixquantConfig
from mixquant.costs.hardware import B200, Hardware
from mixquant.facts import Geometry, compute_device
from mixquant.keys.stages import stage_spec, torch_decides_numbers
from mixquant.numerics import device_type


@dataclass(frozen=True)
class StageCost:
    """Resources of one job of a stage."""

    stage: str
    gpus: int
    cpus: int
    runtime_s: float
    bytes_read: int
    bytes_written: int
    peak_host_bytes: int
    peak_gpu_bytes: int  # per GPU, 0 on CPU jobs
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # what a plan prints as a warning (a choice of the config that costs much)

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.runtime_s / 3600


@dataclass
class CostJob:
    """One job being estimated: its inputs (config, geometry, hardware, shape) and the totals its stage's
    cost function adds to (bytes read, written and hashed, seconds, peak memory)."""

    cfg: MixquantConfig
    geometry: Geometry
    stage: str
    hw: Hardware
    gpus: int
    cpus: int
    on_gpu: bool
    fmt: str | None = None  # quantize_layer's format
    layers: int = 1  # MoE layers in a quantize_layer window
    sequences: int | None = None  # calibration sequences of a score_sensitivity pass
    candidate: str | None = None  # run_kld's candidate
    suite: bool = False  # reference_logits: the evaluation suite's reference (kld.eval), not the prompt's
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # a layer-streamed pass: its reads (streamed_read bytes) overlap its compute (streamed_seconds)
    streamed_s: float = 0.0
    streamed_read: float = 0
    read: float = 0
    written: float = 0
    download: float = 0
    scratch: float = 0  # bytes written outside the keyed output
    hashed: float = 0  # bytes hashed besides the manifest (fetch_model's file identities, logits SHA-256)
    compute_s: float = 0.0
    host: float = 0
    gpu_bytes: float = 0
    startup: float = 0.0

    @property
    def cpu_flops(self) -> float:
        return self.hw.cpu_forward_flops_per_core * self.cpus

    @property
    def device_flops(self) -> float:
        return self.hw.gpu_bf16_flops * self.hw.gpu_streamed_mfu if self.on_gpu else self.cpu_flops

    @property
    def model_bytes(self) -> int:
        return self.geometry.bf16_bytes

    @property
    def prompt_len(self) -> int:
        return self.cfg.prompt.seq_len

    @property
    def logits_bytes(self) -> int:
        return (self.prompt_len - 1) * self.geometry.vocab_size * 4

    @property
    def suite_windows(self) -> int:
        """Windows of the evaluation suite (0 without ``kld.eval``)."""
        suite = self.cfg.kld.eval
        return 0 if suite is None else sum(domain.windows for domain in suite.domains)

    @property
    def suite_tokens(self) -> int:
        suite = self.cfg.kld.eval
        return 0 if suite is None else self.suite_windows * suite.window_tokens

    @property
    def suite_positions(self) -> int:
        """Scored positions of the suite: T-1 per window."""
        suite = self.cfg.kld.eval
        return 0 if suite is None else self.suite_windows * (suite.window_tokens - 1)


def cost_function(stage: str) -> Callable[[CostJob], None]:
    """The stage's cost function (the registry's ``cost``, "module:function")."""
    module, function = stage_spec(stage).cost.split(":")
    return getattr(importlib.import_module(module), function)


def stage_cost(
    cfg: MixquantConfig,
    geometry: Geometry,
    stage: str,
    *,
    gpus: int = 0,
    fmt: str | None = None,
    layers: int = 1,
    sequences: int | None = None,
    candidate: str | None = None,
    suite: bool = False,
    hardware: Hardware = B200,
) -> StageCost:
    """Resources of one job of ``stage`` (formulas: docs/cost-model.md).

    ``gpus``: GPUs the job gets (0: a CPU job; a stage computing on a CUDA numerics.device uses one);
    ``fmt``: quantize_layer format; ``layers``: MoE layers in a quantize_layer window; ``sequences``:
    calibration sequences of a score_sensitivity pass (default: the planned macro-batch);
    ``candidate``: run_kld's candidate name (default: the first); ``suite``: reference_logits of the
    evaluation suite (``kld.eval``) rather than of the pinned prompt. A run_kld job does all ``kld.runs``
    runs.
    """
    serves_model = stage_spec(stage).serves_model  # an unknown stage is refused here
    hw = hardware
    cpus = cfg.numerics.threads if torch_decides_numbers(stage) else 1  # build_toy_model: the toy's threads
    notes: list[str] = []
    on_gpu = device_type(compute_device(cfg, stage)) == "cuda"
    if on_gpu and gpus < 1:
        notes.append(f"{stage}: numerics.device is {cfg.numerics.device} but the job has no GPU")
    if on_gpu:
        gpus = max(gpus, 1)
    job = CostJob(
        cfg,
        geometry,
        stage,
        hw,
        gpus,
        cpus,
        on_gpu,
        fmt=fmt,
        layers=layers,
        sequences=sequences,
        candidate=candidate,
        suite=suite,
        notes=notes,
        host=hw.process_base_bytes,
        startup=hw.process_startup_s,
    )
    cost_function(stage)(job)
    return _finish(job, serves_model)


def _finish(job: CostJob, serves_model: bool) -> StageCost:
    """What every job adds: the manifest re-reads and hashes every published file; the runtime is the
    no-overlap sum of startup, the streamed pass, storage reads and writes, downloads and compute."""
    hw, read, written, hashed = job.hw, job.read, job.written, job.hashed
    read += written  # the manifest re-reads every published file
    hashed += written
    written += job.scratch
    compute_s = job.compute_s + hashed / hw.sha256_bytes_per_s
    runtime = (
        job.startup
        + job.streamed_s
        + (read - job.streamed_read) / hw.storage_read_bytes_per_s
        + written / hw.storage_write_bytes_per_s
        + job.download / hw.hub_download_bytes_per_s
        + compute_s
    )
    gpus, gpu_bytes = job.gpus, job.gpu_bytes
    if not (job.on_gpu or (serves_model and job.cfg.kld.engine == "vllm")):
        gpu_bytes = 0
        gpus = 0 if not serves_model else gpus
    return StageCost(
        job.stage,
        gpus,
        job.cpus,
        runtime,
        int(read),
        int(written),
        int(job.host),
        int(gpu_bytes),
        tuple(job.notes),
        tuple(job.warnings),
    )
