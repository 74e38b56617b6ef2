"""The per-stage, per-job cost table."""

from __future__ import annotations

from typing import Any

from mixquant.config import MixquantConfig
from mixquant.costs.hardware import B200, Hardware
from mixquant.costs.job import stage_cost
from mixquant.costs.resources import job_gpus, rule_resources
from mixquant.costs.sizes import score_macro_batch
from mixquant.export.predict import FORMATS
from mixquant.facts import Geometry
from mixquant.keys.stages import STAGES


def cost_table_markdown(cfg: MixquantConfig, geometry: Geometry, hardware: Hardware = B200) -> str:
    """The per-stage per-job table of docs/cost-model.md (quantize_layer per format; one score pass)."""
    rows = [
        "| stage (job) | GPUs | CPUs | runtime | read | written | peak host | GPU mem/GPU "
        "| rule mem_mb / runtime |"
    ]
    rows.append("|---|---|---|---|---|---|---|---|---|")
    window = cfg.quantize.layers_per_job or len(geometry.moe_layers)
    jobs: list[tuple[str, str, dict[str, Any]]] = []
    for stage in STAGES:
        if stage == ("build_toy_model" if cfg.model.source != "toy" else "fetch_model"):
            continue
        if stage == "quantize_layer":
            jobs += [(stage, f"{stage} {fmt} x{window}", {"fmt": fmt, "layers": window}) for fmt in FORMATS]
        elif stage == "score_sensitivity":
            size = score_macro_batch(cfg, geometry, hardware)
            jobs.append((stage, f"{stage} ({size} sequences)", {"sequences": size}))
        else:
            jobs.append((stage, stage, {}))
    for stage, label, kwargs in jobs:
        gpus = job_gpus(cfg, stage)
        cost = stage_cost(cfg, geometry, stage, gpus=gpus, hardware=hardware, **kwargs)
        res = rule_resources(cfg, geometry, stage, gpus=gpus, hardware=hardware, **kwargs)
        rows.append(
            f"| {label} | {cost.gpus} | {cost.cpus} | {_duration(cost.runtime_s)} | "
            f"{_size(cost.bytes_read)} | {_size(cost.bytes_written)} | {_size(cost.peak_host_bytes)} | "
            f"{_size(cost.peak_gpu_bytes)} | "
            f"{res['mem_mb']} / {res['runtime']} min |"
        )
    return "\n".join(rows)


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"
