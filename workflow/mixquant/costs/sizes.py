"""Sizes and times the stage estimates share: the export's routed formats, a layer result's and a
checkpoint's bytes, a streamed pass's time, the score pass's size on a given hardware."""

from __future__ import annotations

import math
from pathlib import Path

from mixquant.config import MixquantConfig
from mixquant.costs.hardware import MIB, Hardware
from mixquant.export.predict import FORMATS, ROUTED_FORMAT_BITS, predict_structure, routed_projection_tensors
from mixquant.facts import Geometry, explicit_placement, fitted_macro_batch
from mixquant.facts.jobs import max_layer_bytes


def placement_counts(cfg: MixquantConfig, geometry: Geometry) -> dict[str, int]:
    """Routed formats per MoE layer the export will have: the explicit map; for a search, the expected
    counts when given, else the heaviest placement the bit budget allows (an upper bound on the bytes).

    Every MoE layer's routed experts have the same size, so the budget bounds the mean bits per layer:
    as many layers as fit take the widest format, the rest the narrowest, and one layer takes a middle
    format when the remainder allows it."""
    layers = list(geometry.moe_layers)
    if cfg.placement.source == "explicit":
        formats = explicit_placement(cfg, cfg.placement.explicit, layers)
        return {fmt: sum(1 for f in formats.values() if f == fmt) for fmt in FORMATS}
    if cfg.expected.placement_counts is not None:
        return cfg.expected.placement_counts.model_dump()
    allowed = sorted(cfg.placement.formats, key=ROUTED_FORMAT_BITS.__getitem__)
    counts = dict.fromkeys(FORMATS, 0)
    counts[allowed[0]] = len(layers)
    spare = (cfg.placement.target_effective_bits - ROUTED_FORMAT_BITS[allowed[0]]) * len(layers) + 1e-9
    for fmt in reversed(allowed[1:]):  # widest first
        step = ROUTED_FORMAT_BITS[fmt] - ROUTED_FORMAT_BITS[allowed[0]]
        upgraded = min(counts[allowed[0]], max(0, math.floor(spare / step)))
        counts[fmt] += upgraded
        counts[allowed[0]] -= upgraded
        spare -= upgraded * step
    return counts


def layer_result_bytes(geometry: Geometry, fmt: str) -> int:
    """Tensor bytes of one quantize_layer result (the exported tensors only: no dequantized copies)."""
    shapes = {
        "gate_proj": (geometry.moe_intermediate_size, geometry.hidden_size),
        "up_proj": (geometry.moe_intermediate_size, geometry.hidden_size),
        "down_proj": (geometry.hidden_size, geometry.moe_intermediate_size),
    }
    per_expert = sum(e.nbytes for n, k in shapes.values() for e in routed_projection_tensors("p", n, k, fmt))
    return geometry.num_experts * per_expert


# audit.json: one entry per routed weight (format, shapes, scale stats, errors), indent=2 JSON;
# measured ~1,200 B per quantized weight
AUDIT_BYTES_PER_TENSOR = 1200
QUANTIZE_TEMP_BYTES = 256 * MIB  # per-expert temporaries: fp32 dequant, float64 audit diff, sweep chunks


def checkpoint_bytes(geometry: Geometry, counts: dict[str, int], kv_cache_quant: str | None) -> int:
    return predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv_cache_quant)[
        "payload_bytes"
    ]


def candidate_bytes(cfg: MixquantConfig, geometry: Geometry, name: str | None) -> tuple[int, str]:
    """Checkpoint bytes of a KLD candidate and a note on where the number comes from."""
    candidates = {c.name: c for c in cfg.kld.candidates}
    candidate = candidates[name] if name is not None else cfg.kld.candidates[0]
    kv = "FP8" if cfg.export.kv_cache_quant else None
    moe = len(geometry.moe_layers)
    if candidate.source == "bf16":
        return geometry.bf16_bytes, f"candidate {candidate.name}: the BF16 model"
    if candidate.source == "uniform":
        return checkpoint_bytes(geometry, {candidate.format: moe}, kv), f"candidate {candidate.name}"
    if candidate.source in ("hub", "local"):
        return (
            checkpoint_bytes(geometry, {"nvfp4_w4a16": moe}, None),
            f"candidate {candidate.name}: external checkpoint sized as uniform NVFP4",
        )
    if candidate.source == "explicit":
        explicit = cfg.model_copy(
            update={
                "placement": cfg.placement.model_copy(
                    update={"source": "explicit", "explicit": candidate.explicit}
                )
            }
        )
        return checkpoint_bytes(
            geometry, placement_counts(explicit, geometry), kv
        ), f"candidate {candidate.name}"
    return checkpoint_bytes(geometry, placement_counts(cfg, geometry), kv), f"candidate {candidate.name}"


def activation_stats_bytes(geometry: Geometry) -> int:
    """activation_stats.safetensors (2 fp32 scalars + 2 fp32 and 1 int64 per expert, per MoE layer; k/v
    amax per layer) and its JSON twin (~2x)."""
    moe = len(geometry.moe_layers)
    return 3 * (moe * (8 + geometry.num_experts * 16) + geometry.num_hidden_layers * 8)


def dataset_split_bytes(cfg: MixquantConfig, hardware: Hardware) -> int:
    """Bytes of one loaded dataset split: a local JSONL's size when it is there (relative to the
    working directory), else the assumed hub split size."""
    if cfg.dataset.source == "local" and cfg.dataset.local is not None:
        path = Path(cfg.dataset.local.path)
        if path.is_file():
            return path.stat().st_size
    return hardware.hub_dataset_split_bytes


def pinned_layer_bytes(geometry: Geometry) -> int:
    """The largest decoder layer as host memory holds it when read pinned for a GPU (ShardReader,
    pin_memory=True). The routed experts are read straight into two fused buffers (StreamedModel's fused
    reads: gate_up [E, 2 x moe_intermediate, hidden] and down [E, hidden, moe_intermediate]); torch's caching
    host allocator rounds every pinned block up to a power of two and keeps it (CachingHostAllocator.h):
    Laguna's 3 GiB and 1.5 GiB buffers take 4 and 2 GiB. The rest of the layer is counted at most doubled."""
    expert = geometry.moe_intermediate_size * geometry.hidden_size * geometry.dtype_bytes

    def rounded(size: int) -> int:
        return 1 << max(0, size - 1).bit_length()

    routed = rounded(2 * geometry.num_experts * expert) + rounded(geometry.num_experts * expert)
    return max(
        2 * geometry.fixed_params(layer) * geometry.dtype_bytes
        + (routed if layer in geometry.moe_layers else 0)
        for layer in range(geometry.num_hidden_layers)
    )


def streamed_seconds(read: float, compute_s: float, geometry: Geometry, hw: Hardware, on_gpu: bool) -> float:
    """A layer-streamed pass: the first layer is loaded (read, then laid out in host memory) before
    anything computes; from then on the next layer's load (and, on a GPU, its host-to-device copy) overlaps
    the current layer's compute."""
    first = max_layer_bytes(geometry)
    # the prefetch thread reads a layer, then lays it out in memory: the two follow each other
    read_rate = 1 / (1 / hw.storage_read_bytes_per_s + 1 / hw.host_layer_load_bytes_per_s)
    # the background thread reads from storage; the copy to the GPU happens with the compute, in turn
    serial = compute_s + (read / hw.host_to_device_bytes_per_s if on_gpu else 0.0)
    return first / read_rate + max((read - first) / read_rate, serial)


def fp8_source_bytes(geometry: Geometry) -> int:
    """A block-FP8 checkpoint's bytes: one per weight element and a float32 scale per 128 x 128 block."""
    return geometry.total_params + geometry.total_params * 4 // (128 * 128)


def score_macro_batch(cfg: MixquantConfig, geometry: Geometry, hardware: Hardware) -> int:
    """Calibration sequences per score_sensitivity pass on ``hardware`` (mixquant.facts.fitted_macro_batch
    with the memory of the job's device there)."""
    return fitted_macro_batch(cfg, geometry, hardware.score_memory_budget(cfg.numerics.device))
