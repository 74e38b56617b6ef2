"""How a config's score_sensitivity jobs are sized: calibration sequences per job, from the model geometry
and a memory budget, resolved before the artifact graph is built (a score key holds the resolved
sequences, never the memory figure that sized them)."""

from __future__ import annotations

from pathlib import Path

from mixquant.config import MixquantConfig
from mixquant.facts.geometry import Geometry, planning_geometry
from mixquant.facts.layers import scored_formats
from mixquant.numerics import device_type

__all__ = [
    "CPU_JOB_MEMORY_BYTES",
    "GPU_MEMORY_BYTES",
    "GPU_MEMORY_HEADROOM",
    "PROCESS_BASE_BYTES",
    "STACK_LIMIT",
    "batch_activation_bytes",
    "fitted_macro_batch",
    "gptq_chunk_experts",
    "gptq_expert_bytes",
    "max_layer_bytes",
    "non_layer_bytes",
    "score_jobs",
    "score_macro_batch",
    "score_memory_budget",
    "score_transient_bytes",
    "scored_pairs",
    "state_bytes",
]

GIB = 1 << 30

# The memory a score job plans for (the cost model's hardware, mixquant.costs.Hardware, has the same
# defaults): one HGX B200 GPU (nvidia-smi reports 183,359 MiB = 179 GiB HBM3e), of which a streamed stage
# plans to use this share (allocator fragmentation, CUDA context); on a CPU, a node share for one job less
# the process itself (python + torch + transformers before any data).
GPU_MEMORY_BYTES = 179 * GIB
GPU_MEMORY_HEADROOM = 0.85
CPU_JOB_MEMORY_BYTES = 64 * GIB
PROCESS_BASE_BYTES = 2 * GIB

# Live branches stacked into one layer call at most (mixquant.search.branches): bounds a call's transient
# activations, which the macro-batch budget reserves.
STACK_LIMIT = 16


def batch_activation_bytes(geometry: Geometry, sequences: int, seq_len: int) -> int:
    """Transient activations of one bf16 forward (no logits): residual copies, the widest MLP, and the
    [B, heads, T, T] fp32 attention weights sdpa's math path materialises on CPU."""
    tokens = sequences * seq_len
    widest = max(geometry.intermediate_size, geometry.shared_expert_intermediate_size) * 3
    heads = max(geometry.heads(layer) for layer in range(geometry.num_hidden_layers))
    return tokens * (8 * geometry.hidden_size + widest) * 2 + sequences * heads * seq_len * seq_len * 4


def max_layer_bytes(geometry: Geometry) -> int:
    """The largest decoder layer's bytes: what a streamed pass holds (twice, with the read-ahead)."""
    largest = max(geometry.layer_params(layer) for layer in range(geometry.num_hidden_layers))
    return largest * geometry.dtype_bytes


def non_layer_bytes(geometry: Geometry) -> int:
    """Token embedding, final norm and lm_head: what a streamed model keeps on the device throughout."""
    embeddings = geometry.vocab_size * geometry.hidden_size * (1 if geometry.tie_word_embeddings else 2)
    return (embeddings + geometry.hidden_size) * geometry.dtype_bytes


def state_bytes(geometry: Geometry, sequences: int, seq_len: int) -> int:
    """One stream's hidden states for ``sequences`` x ``seq_len`` tokens (bf16)."""
    return sequences * seq_len * geometry.hidden_size * geometry.dtype_bytes


def scored_pairs(cfg: MixquantConfig) -> int:
    """(MoE layer, format) pairs the search scores: the branches a full pass carries at its last layer."""
    return sum(len(formats) for formats in scored_formats(cfg).values())


def score_transient_bytes(cfg: MixquantConfig, geometry: Geometry) -> int:
    """Transient device memory of one scoring step: a layer call on the stacked branches of one
    micro-batch (or one branch), and the reference's and a branch's logits / log-probabilities."""
    search, seq_len = cfg.placement.search, cfg.calibration.seq_len
    stacked = (STACK_LIMIT if search.stack_branches else 1) * search.batch_size
    tokens = search.batch_size * seq_len
    logits = tokens * geometry.vocab_size * (2 * 2 + 4 * 4)  # bf16 x2; log_p, p, log_q, product in fp32
    return batch_activation_bytes(geometry, stacked, seq_len) + logits


def score_memory_budget(
    device: str,
    gpu_memory_bytes: int = GPU_MEMORY_BYTES,
    gpu_memory_headroom: float = GPU_MEMORY_HEADROOM,
    cpu_job_memory_bytes: int = CPU_JOB_MEMORY_BYTES,
    process_base_bytes: int = PROCESS_BASE_BYTES,
) -> float:
    """Bytes a score pass may fill on ``device`` (numerics.device): ``gpu_memory_headroom`` of the GPU's
    memory on CUDA, else ``cpu_job_memory_bytes`` less the process's own."""
    if device_type(device) == "cuda":
        return gpu_memory_bytes * gpu_memory_headroom
    return cpu_job_memory_bytes - process_base_bytes


def fitted_macro_batch(cfg: MixquantConfig, geometry: Geometry, budget: float | None = None) -> int:
    """Calibration sequences per score_sensitivity pass (``placement.search.macro_batch: null``).

    The largest multiple of the micro-batch whose hidden states -- the reference and a branch per scored
    (layer, format) -- fit ``budget`` bytes (default :func:`score_memory_budget` of numerics.device) next to
    two streamed layers, the resident embedding and lm_head, a quantized layer copy and one step's
    transients; then evened out so the passes are the same size.
    """
    search, calib = cfg.placement.search, cfg.calibration
    if budget is None:
        budget = score_memory_budget(cfg.numerics.device)
    fixed = (
        2 * max_layer_bytes(geometry)
        + non_layer_bytes(geometry)
        + geometry.routed_bytes_per_layer
        + score_transient_bytes(cfg, geometry)
    )
    per_sequence = (1 + scored_pairs(cfg)) * state_bytes(geometry, 1, calib.seq_len)
    size = max(1, int((budget - fixed) // per_sequence) // search.batch_size) * search.batch_size
    size = min(size, -(-calib.num_samples // search.batch_size) * search.batch_size)
    passes = -(-calib.num_samples // size)
    return -(-calib.num_samples // passes // search.batch_size) * search.batch_size


def score_macro_batch(cfg: MixquantConfig, root: Path = Path(".")) -> int:
    """Calibration sequences per score_sensitivity job: ``placement.search.macro_batch``, or the largest
    that fits the device (:func:`fitted_macro_batch`; every sequence when the geometry is not known)."""
    search = cfg.placement.search
    if search.macro_batch is not None:
        return min(search.macro_batch, cfg.calibration.num_samples)
    geometry = planning_geometry(cfg, root)
    return fitted_macro_batch(cfg, geometry) if geometry is not None else cfg.calibration.num_samples


def score_jobs(cfg: MixquantConfig) -> list[tuple[int, int]]:
    """``(first, stop)`` calibration sequences of each score_sensitivity job: one streamed pass over the
    weights per macro-batch, scoring every (MoE layer, format) on those sequences."""
    size, total = score_macro_batch(cfg), cfg.calibration.num_samples
    return [(first, min(first + size, total)) for first in range(0, total, size)]


# GPTQ rounding (quantize.nvfp4_w4a16.rounding: gptq): the float64 work of the experts a quantize_layer job
# rounds as one batch -- one error-feedback column step for all of them, so a GPU is not launch-bound.
GPTQ_CHUNK_BYTES = {"cuda": 16 << 30, "cpu": 2 << 30}


def gptq_expert_bytes(hidden: int, inter: int) -> int:
    """float64 GPTQ work of one expert: its two Hessians and their factors (3 copies), and the gate/up and
    down weights' working, compensated and scale copies."""
    return 8 * (hidden * hidden + inter * inter) * 3 + 24 * 3 * inter * hidden


def gptq_chunk_experts(hidden: int, inter: int, device: str) -> int:
    """Experts rounded as one batch on ``device`` (``cpu`` or ``cuda[:N]``)."""
    budget = GPTQ_CHUNK_BYTES["cuda" if device_type(device) == "cuda" else "cpu"]
    return max(1, budget // gptq_expert_bytes(hidden, inter))
