"""Cluster cost model: per-job resources of each workflow stage, from the model geometry alone.

Every estimate follows what the stage's code does today (which files it reads and writes, what it holds
in memory, on which device it computes); README "Cluster cost model" documents the formulas. Runtime is
the no-overlap sum ``startup + bytes_read / read_bw + bytes_written / write_bw + download + compute``
(an upper bound: the stages load, then compute, then publish). Every keyed output is re-read and hashed
for its manifest (``publish_keyed_dir``), so a stage's output bytes are also read and hashed once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.config import MixquantConfig, parse_layer_ranges
from mixquant.export.predict import (
    FORMATS,
    ROUTED_FORMAT_BITS,
    checkpoint_tensors,
    predict_structure,
    routed_projection_tensors,
)
from mixquant.keys.stages import STAGES, computes_on_cpu, stage_spec

__all__ = [
    "B200",
    "Geometry",
    "Hardware",
    "StageCost",
    "cost_table_markdown",
    "geometry_from_hf_config",
    "model_geometry",
    "placement_counts",
    "rule_resources",
    "stage_cost",
    "toy_geometry",
]

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Geometry:
    """The model shape the estimates need (a Laguna-style MoE decoder)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (the non-MoE layers)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    moe_layers: tuple[int, ...]
    dtype_bytes: int = 2
    heads_per_layer: tuple[int, ...] = ()  # empty: num_attention_heads on every layer
    tie_word_embeddings: bool = False
    # From the family's architecture (geometry_from_hf_config): exact parameter counts of every layer
    # without its routed experts, and of the embeddings, final norm and lm_head; empty: Laguna's formulas
    fixed_params_per_layer: tuple[int, ...] = ()
    non_layer_params: int = 0
    source_config_json: str = ""  # the config.json it was read from (to_hf_config returns it)

    def heads(self, layer: int) -> int:
        return self.heads_per_layer[layer] if self.heads_per_layer else self.num_attention_heads

    def attention_params(self, layer: int) -> int:
        """q, k, v, o, per-head gate g_proj, q_norm, k_norm (LagunaAttention, no bias)."""
        h, d, hidden = self.heads(layer), self.head_dim, self.hidden_size
        kv = self.num_key_value_heads * d
        return hidden * h * d * 2 + hidden * kv * 2 + hidden * h + 2 * d

    @property
    def routed_params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_params_per_layer(self) -> int:
        return self.num_experts * self.routed_params_per_expert

    def mlp_params(self, layer: int) -> int:
        """The layer's MLP without its routed experts (dense MLP, or router + bias + shared expert)."""
        if layer in self.moe_layers:
            return (
                self.num_experts * (self.hidden_size + 1)
                + 3 * self.hidden_size * self.shared_expert_intermediate_size
            )
        return 3 * self.hidden_size * self.intermediate_size

    def fixed_params(self, layer: int) -> int:
        """Parameters of decoder layer ``layer`` without its routed experts (norms included)."""
        if self.fixed_params_per_layer:
            return self.fixed_params_per_layer[layer]
        return self.attention_params(layer) + self.mlp_params(layer) + 2 * self.hidden_size

    def layer_params(self, layer: int) -> int:
        """Parameters of decoder layer ``layer`` (routed experts included)."""
        routed = self.routed_params_per_layer if layer in self.moe_layers else 0
        return self.fixed_params(layer) + routed

    def layer_active_params(self, layer: int) -> int:
        """Parameters one token multiplies in decoder layer ``layer`` (top-k routed experts only)."""
        routed = self.num_experts_per_tok * self.routed_params_per_expert if layer in self.moe_layers else 0
        return self.fixed_params(layer) + routed

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        layers = sum(self.layer_params(layer) for layer in range(self.num_hidden_layers))
        if self.fixed_params_per_layer:
            return self.non_layer_params + layers
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + layers + self.hidden_size

    @property
    def routed_params(self) -> int:
        return len(self.moe_layers) * self.routed_params_per_layer

    @property
    def active_params_per_token(self) -> int:
        """Total minus the routed experts a token does not use (embeddings included, as model.toy counts)."""
        per_token_routed = len(self.moe_layers) * self.num_experts_per_tok * self.routed_params_per_expert
        return self.total_params - self.routed_params + per_token_routed

    @property
    def bf16_bytes(self) -> int:
        """Bytes of the checkpoint's tensors (every parameter in the model dtype)."""
        return self.total_params * self.dtype_bytes

    @property
    def routed_bytes_per_layer(self) -> int:
        return self.routed_params_per_layer * self.dtype_bytes

    def attention_flops_per_token(self, layer: int, context: int) -> int:
        """Scores and weighted sum: 2 GEMMs of ``heads * head_dim`` over ``context`` keys, 2 FLOPs each."""
        return 4 * self.heads(layer) * self.head_dim * context

    def forward_flops(self, tokens_per_sequence: int, sequences: int = 1, *, first_layer: int = 0) -> float:
        """FLOPs of a forward from decoder layer ``first_layer`` through the lm_head.

        ``2 x active matmul parameters x tokens`` (the embedding lookup is not a matmul) plus the causal
        attention term at the mean context ``(T + 1) / 2`` (sliding windows ignored: an upper bound).
        """
        tokens = tokens_per_sequence * sequences
        context = (tokens_per_sequence + 1) / 2
        per_token = 2 * self.lm_head_params
        for layer in range(first_layer, self.num_hidden_layers):
            per_token += 2 * self.layer_active_params(layer) + self.attention_flops_per_token(layer, context)
        return float(per_token) * tokens

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json it was read from, else a Laguna config.json-shaped dict (the toy's)."""
        if self.source_config_json:
            return json.loads(self.source_config_json)
        layers = self.num_hidden_layers
        return {
            "model_type": "laguna",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": self.num_attention_heads,
            "num_attention_heads_per_layer": [self.heads(layer) for layer in range(layers)],
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "mlp_layer_types": ["sparse" if layer in self.moe_layers else "dense" for layer in range(layers)],
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": {2: "bfloat16", 4: "float32"}[self.dtype_bytes],
            "gating": True,
            "attention_bias": False,
        }


def geometry_from_hf_config(config: dict[str, Any], moe_layers: Any = None) -> Geometry:
    """Geometry of a config.json dict: with a ``model_type``, exact parameter counts from its family's
    architecture (mixquant.model.families: the transformers class on the meta device); without one,
    Laguna's keys. ``moe_layers`` (indices or '1-47') else the model's own."""
    if config.get("model_type"):
        return _geometry_from_architecture(config, moe_layers)
    layers = int(config["num_hidden_layers"])
    if moe_layers is None:
        types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        moe_layers = [layer for layer, kind in enumerate(types) if kind == "sparse"]
    elif isinstance(moe_layers, str):
        moe_layers = parse_layer_ranges(moe_layers)
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return Geometry(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config["num_key_value_heads"]),
        head_dim=int(
            config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])
        ),
        intermediate_size=int(config["intermediate_size"]),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(config["shared_expert_intermediate_size"]),
        moe_layers=tuple(int(layer) for layer in moe_layers),
        dtype_bytes={"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype)],
        heads_per_layer=tuple(int(h) for h in config.get("num_attention_heads_per_layer") or ()),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _geometry_from_architecture(config: dict[str, Any], moe_layers: Any = None) -> Geometry:
    import math as _math

    from mixquant.model.families import architecture

    arch = architecture(config)
    layers = arch.num_hidden_layers
    fixed = [0] * layers
    non_layer = 0
    for name, (shape, _dtype) in arch.non_expert_tensors().items():
        count = _math.prod(shape)
        if name.startswith("model.layers."):
            fixed[int(name.split(".")[2])] += count
        else:
            non_layer += count
    if moe_layers is None:
        moe_layers = list(arch.moe_layers)
    elif isinstance(moe_layers, str):
        moe_layers = parse_layer_ranges(moe_layers)
    inter, hidden = arch.expert_shape("gate_proj")
    heads = int(config["num_attention_heads"])
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return Geometry(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        intermediate_size=int(config.get("intermediate_size") or inter),
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.experts_per_token,
        moe_intermediate_size=int(inter),
        shared_expert_intermediate_size=int(
            config.get("shared_expert_intermediate_size")
            or int(config.get("n_shared_experts") or 0) * int(inter)
        ),
        moe_layers=tuple(int(layer) for layer in moe_layers),
        dtype_bytes={"bfloat16": 2, "float16": 2, "float32": 4}[str(dtype)],
        heads_per_layer=tuple(int(h) for h in config.get("num_attention_heads_per_layer") or ()),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        fixed_params_per_layer=tuple(fixed),
        non_layer_params=non_layer,
        source_config_json=json.dumps(config, sort_keys=True),
    )


def toy_geometry(cfg: MixquantConfig) -> Geometry:
    """The embedded toy's geometry (model.toy.toy_laguna_config): vocabulary = tokenizer size rounded up
    to 16, assuming the BPE trainer reaches its configured vocab_size."""
    arch = cfg.model.toy.arch
    layers, period = arch.num_hidden_layers, arch.full_attention_period
    heads = tuple(
        arch.num_attention_heads_full if layer % period == 0 else arch.num_attention_heads_sliding
        for layer in range(layers)
    )
    return Geometry(
        vocab_size=-(-cfg.model.toy.tokenizer.vocab_size // 16) * 16,
        hidden_size=arch.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=arch.num_attention_heads_full,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.num_experts_per_tok,
        moe_intermediate_size=arch.moe_intermediate_size,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
        moe_layers=tuple(range(arch.num_dense_layers, layers)),
        heads_per_layer=heads,
    )


def model_geometry(cfg: MixquantConfig, root: Path = Path(".")) -> Geometry:
    """The configured model's geometry: the toy's settings, or the config.json that model.geometry names."""
    if cfg.model.source == "toy":
        return toy_geometry(cfg)
    geometry = getattr(cfg.model, "geometry", None)
    if geometry is None:
        raise ValueError(
            "model.geometry: planning a hub/local model needs its config.json (a path relative to the "
            "workdir, e.g. data/models/laguna-s-2.1/config.json)"
        )
    path = Path(root) / geometry
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.geometry: cannot read {path} ({exc})") from None
    return geometry_from_hf_config(config, cfg.model.moe_layers)


# ------------------------------------------------------------------------------------------ hardware


@dataclass(frozen=True)
class Hardware:
    """What a job's node offers. Defaults: one HGX B200 node on a shared filesystem.

    Measured on this 2-core development VM (Intel, bf16 AMX), torch 1 thread, with the real code
    (README "Cluster cost model"): quantize_layer on a synthetic checkpoint layer of two
    Laguna-shaped experts (gate/up [1024, 3072], down [3072, 1024], N(0, 0.02) bf16), elements/s including
    the read, the per-expert audit and the dequantization; the forward rate of transformers'
    LagunaForCausalLM.model (eager experts, sdpa) on a 2-layer Laguna-S-2.1-geometry model, B=8 x T=512,
    counted as 2 x active decoder params x tokens; hashlib SHA-256 over 256 MiB. Two threads ran slower
    than one on this VM (shared cores), so the per-core rates are the 1-thread ones, scaled linearly.
    """

    gpu_name: str = "HGX B200"  # what a plan says its estimates assume (mixquant plan)
    gpu_memory_bytes: int = 179 * GIB  # B200 (HGX): nvidia-smi reports 183,359 MiB = 179 GiB HBM3e
    gpu_bf16_flops: float = 2.25e15  # B200 (HGX, 1000 W) dense BF16 tensor-core peak per GPU
    gpu_mfu: float = 0.2  # assumption: eager (no CUDA graphs) prefill of one prompt
    vllm_gpu_memory_utilization: float = 0.9  # vLLM's default; vllm_llm_kwargs does not set it
    vllm_worker_host_bytes: int = 8 * GIB  # assumption: host RSS of one vLLM worker (torch, CUDA, NCCL)
    storage_read_bytes_per_s: float = 2e9  # assumption: shared filesystem, per job
    # measured (benchmarks/bench_layer_load.py, README "Cluster cost model"): the host side of
    # StreamedModel.load_layer at the real Laguna layer size -- the copy out of the page cache, the fused
    # layout, transformers' attach -- from the page cache (warm): 1.51 s per 4.98 GB MoE layer (3.3 GB/s;
    # 1.42 s in a second run). It follows the storage read in the same prefetch thread, so a streamed layer
    # loads in bytes / storage + bytes / it (cold there: 5.13 s measured, 4.11 + 1.51 = 5.62 s modelled).
    host_layer_load_bytes_per_s: float = 3.3e9
    storage_write_bytes_per_s: float = 2e9  # assumption
    hub_download_bytes_per_s: float = 5e8  # assumption: Hugging Face hub (Xet/CDN), per job
    process_startup_s: float = 10.0  # python + torch + transformers import: measured 6.4 s here (warm)
    vllm_startup_s: float = 180.0  # assumption: engine spawn, CUDA/NCCL init, profiling run (not loading)
    process_base_bytes: int = 2 * GIB  # assumption: RSS of python + torch + transformers before any data
    cpu_forward_flops_per_core: float = 2.4e11  # measured: 2.41e11 FLOP/s (Laguna layer forward, bf16)
    cpu_quantize_elements_per_s_per_core: dict[str, float] = field(
        default_factory=lambda: {
            "nvfp4_w4a16:fp8_sweep": 3.79e6,  # measured
            "nvfp4_w4a16:mse": 5.16e5,  # measured
            "nvfp4_w4a16:max": 1.32e7,  # measured
            "fp8:mse": 2.06e6,  # measured
            "fp8:max": 4.32e7,  # measured
            "bf16": 5.81e7,  # measured (read + audit only)
        }
    )
    # measured: checkpoint.fp8_source.dequantize_block_fp8 of a 2048 x 7168 block-FP8 weight, torch 1 thread
    cpu_dequant_fp8_elements_per_s_per_core: float = 1.68e8
    sha256_bytes_per_s: float = 1.19e9  # measured: hashlib, one core
    hub_dataset_split_bytes: int = 2 * 10**9  # assumption: one hub dataset split (or local JSONL) as loaded
    python_object_factor: float = 3.0  # assumption: a dataset column as Python lists / dicts vs its bytes
    # assumption: datasets' JSON/Parquet -> Arrow conversion of a hub split works in record batches
    arrow_conversion_bytes: int = 2 * GIB
    tokenize_tokens_per_s: float = 2e5  # assumption: apply_chat_template + fast tokenizer, one core
    # measured: the toy's training step on the 2-core dev VM (320 steps in 198 s, 2 threads, idle machine):
    # a tiny model's step is dispatch-bound, so the FLOP estimate alone is ~8x short of it
    toy_step_s: float = 0.62
    ilp_solve_s: float = 1.0  # assumption: one pulp CBC solve of ~50 groups (process spawn dominates)
    plot_s: float = 2.0  # assumption: one matplotlib figure
    # Layer-streamed forward stages on a GPU (README "Cluster cost model", GPU constants). Not measured
    # here (no GPU); tools/gpu-check.sh measures each on a lent GPU.
    # assumption: transformers' eager LagunaExperts runs one GEMM pair per routed expert, so a layer call
    # is many mid-sized GEMMs; 25% of peak is the middle of the 20-30% eager prefill reaches
    gpu_streamed_mfu: float = 0.25
    # assumption: pinned host->device copies over PCIe Gen5 x16 (~64 GB/s raw, ~50 GB/s in
    # practice); half of it, since a layer's tensors arrive as many separate copies
    host_to_device_bytes_per_s: float = 25e9
    # assumption: the NVFP4 / FP8 scale sweeps are unfused torch elementwise passes, memory-bound: ~126
    # E4M3 candidates x ~16 B of traffic per element at ~4 TB/s of HBM is ~2e9 elements/s; half of it
    gpu_quantize_elements_per_s: float = 1e9
    # the share of GPU memory a streamed stage plans to use (allocator fragmentation, CUDA context)
    gpu_memory_headroom: float = 0.85
    # assumption: host memory a CPU forward job may plan its macro-batch for (a node share, not a whole node)
    cpu_job_memory_bytes: int = 64 * GIB

    def assumed_gpu(self) -> str:
        """The GPU a plan's estimates assume, in words (``one HGX B200 GPU (179 GiB) per GPU job``)."""
        return f"one {self.gpu_name} GPU ({self.gpu_memory_bytes / GIB:.0f} GiB) per GPU job"


B200 = Hardware()


# ----------------------------------------------------------------------------------------- estimates


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

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.runtime_s / 3600


def placement_counts(cfg: MixquantConfig, geometry: Geometry) -> dict[str, int]:
    """Routed formats per MoE layer the export will have: the explicit map; for a search, the expected
    counts when given, else the heaviest placement the bit budget allows (an upper bound on the bytes).

    Every MoE layer's routed experts have the same size, so the budget bounds the mean bits per layer:
    as many layers as fit take the widest format, the rest the narrowest, and one layer takes a middle
    format when the remainder allows it."""
    layers = list(geometry.moe_layers)
    if cfg.placement.source == "explicit":
        formats = dict.fromkeys(layers, cfg.placement.explicit.default_format)
        for entry in cfg.placement.explicit.layers:
            for layer in parse_layer_ranges(entry.layers):
                formats[layer] = entry.format
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


def _layer_result_bytes(geometry: Geometry, fmt: str) -> int:
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
_AUDIT_BYTES_PER_TENSOR = 1200
_QUANTIZE_TEMP_BYTES = 256 * MIB  # per-expert temporaries: fp32 dequant, float64 audit diff, sweep chunks


def _checkpoint_bytes(geometry: Geometry, counts: dict[str, int], kv_cache_quant: str | None) -> int:
    return predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv_cache_quant)[
        "payload_bytes"
    ]


def _candidate_bytes(cfg: MixquantConfig, geometry: Geometry, name: str | None) -> tuple[int, str]:
    """Checkpoint bytes of a KLD candidate and a note on where the number comes from."""
    candidates = {c.name: c for c in cfg.kld.candidates}
    candidate = candidates[name] if name is not None else cfg.kld.candidates[0]
    kv = "FP8" if cfg.export.kv_cache_quant else None
    moe = len(geometry.moe_layers)
    if candidate.source == "bf16":
        return geometry.bf16_bytes, f"candidate {candidate.name}: the BF16 model"
    if candidate.source == "uniform":
        return _checkpoint_bytes(geometry, {candidate.format: moe}, kv), f"candidate {candidate.name}"
    if candidate.source in ("hub", "local"):
        return (
            _checkpoint_bytes(geometry, {"nvfp4_w4a16": moe}, None),
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
        return _checkpoint_bytes(
            geometry, placement_counts(explicit, geometry), kv
        ), f"candidate {candidate.name}"
    return _checkpoint_bytes(geometry, placement_counts(cfg, geometry), kv), f"candidate {candidate.name}"


def _activation_stats_bytes(geometry: Geometry) -> int:
    """activation_stats.safetensors (2 fp32 scalars + 2 fp32 and 1 int64 per expert, per MoE layer; k/v
    amax per layer) and its JSON twin (~2x)."""
    moe = len(geometry.moe_layers)
    return 3 * (moe * (8 + geometry.num_experts * 16) + geometry.num_hidden_layers * 8)


def _dataset_split_bytes(cfg: MixquantConfig, hardware: Hardware) -> int:
    """Bytes of one loaded dataset split: a local JSONL's size when it is there (relative to the
    working directory), else the assumed hub split size."""
    if cfg.dataset.source == "local" and cfg.dataset.local is not None:
        path = Path(cfg.dataset.local.path)
        if path.is_file():
            return path.stat().st_size
    return hardware.hub_dataset_split_bytes


def _batch_activation_bytes(geometry: Geometry, sequences: int, seq_len: int) -> int:
    """Transient activations of one bf16 forward (no logits): residual copies, the widest MLP, and the
    [B, heads, T, T] fp32 attention weights sdpa's math path materialises on CPU."""
    tokens = sequences * seq_len
    widest = max(geometry.intermediate_size, geometry.shared_expert_intermediate_size) * 3
    heads = max(geometry.heads(layer) for layer in range(geometry.num_hidden_layers))
    return tokens * (8 * geometry.hidden_size + widest) * 2 + sequences * heads * seq_len * seq_len * 4


def _max_layer_bytes(geometry: Geometry) -> int:
    """The largest decoder layer's bytes: what a streamed pass holds (twice, with the read-ahead)."""
    largest = max(geometry.layer_params(layer) for layer in range(geometry.num_hidden_layers))
    return largest * geometry.dtype_bytes


def _pinned_layer_bytes(geometry: Geometry) -> int:
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


def _non_layer_bytes(geometry: Geometry) -> int:
    """Token embedding, final norm and lm_head: what a streamed model keeps on the device throughout."""
    embeddings = geometry.vocab_size * geometry.hidden_size * (1 if geometry.tie_word_embeddings else 2)
    return (embeddings + geometry.hidden_size) * geometry.dtype_bytes


def _state_bytes(geometry: Geometry, sequences: int, seq_len: int) -> int:
    """One stream's hidden states for ``sequences`` x ``seq_len`` tokens (bf16)."""
    return sequences * seq_len * geometry.hidden_size * geometry.dtype_bytes


def scored_pairs(cfg: MixquantConfig) -> int:
    """(MoE layer, format) pairs the search scores: the branches a full pass carries at its last layer."""
    from mixquant.keys.artifacts import scored_formats

    return sum(len(formats) for formats in scored_formats(cfg).values())


# Live branches stacked into one layer call at most (mixquant.search.branches): bounds a call's transient
# activations, which the macro-batch budget reserves.
STACK_LIMIT = 16


def _score_transient_bytes(cfg: MixquantConfig, geometry: Geometry) -> int:
    """Transient device memory of one scoring step: a layer call on the stacked branches of one
    micro-batch (or one branch), and the reference's and a branch's logits / log-probabilities."""
    search, seq_len = cfg.placement.search, cfg.calibration.seq_len
    stacked = (STACK_LIMIT if search.stack_branches else 1) * search.batch_size
    tokens = search.batch_size * seq_len
    logits = tokens * geometry.vocab_size * (2 * 2 + 4 * 4)  # bf16 x2; log_p, p, log_q, product in fp32
    return _batch_activation_bytes(geometry, stacked, seq_len) + logits


def score_macro_batch(cfg: MixquantConfig, geometry: Geometry, hardware: Hardware | None = None) -> int:
    """Calibration sequences per score_sensitivity pass (``placement.search.macro_batch: null``).

    The largest multiple of the micro-batch whose hidden states -- the reference and a branch per scored
    (layer, format) -- fit the device next to two streamed layers, the resident embedding and lm_head, a
    quantized layer copy and one step's transients (``gpu_memory_headroom`` of the GPU; for CPU,
    ``cpu_job_memory_bytes``); then evened out so the passes are the same size.
    """
    from mixquant.numerics import device_type

    hw = hardware or B200
    search, calib = cfg.placement.search, cfg.calibration
    if device_type(cfg.numerics.device) == "cuda":
        budget = hw.gpu_memory_bytes * hw.gpu_memory_headroom
    else:
        budget = hw.cpu_job_memory_bytes - hw.process_base_bytes
    fixed = (
        2 * _max_layer_bytes(geometry)
        + _non_layer_bytes(geometry)
        + geometry.routed_bytes_per_layer
        + _score_transient_bytes(cfg, geometry)
    )
    per_sequence = (1 + scored_pairs(cfg)) * _state_bytes(geometry, 1, calib.seq_len)
    size = max(1, int((budget - fixed) // per_sequence) // search.batch_size) * search.batch_size
    size = min(size, -(-calib.num_samples // search.batch_size) * search.batch_size)
    passes = -(-calib.num_samples // size)
    return -(-calib.num_samples // passes // search.batch_size) * search.batch_size


def _scored_layers(cfg: MixquantConfig) -> list[tuple[int, list[str]]]:
    from mixquant.keys.artifacts import scored_formats

    return sorted(scored_formats(cfg).items())


def _streamed_seconds(read: float, compute_s: float, geometry: Geometry, hw: Hardware, on_gpu: bool) -> float:
    """A layer-streamed pass: the first layer is loaded (read, then laid out in host memory) before
    anything computes; from then on the next layer's load (and, on a GPU, its host-to-device copy) overlaps
    the current layer's compute."""
    first = _max_layer_bytes(geometry)
    # the prefetch thread reads a layer, then lays it out in memory: the two follow each other
    read_rate = 1 / (1 / hw.storage_read_bytes_per_s + 1 / hw.host_layer_load_bytes_per_s)
    # the background thread reads from storage; the copy to the GPU happens with the compute, in turn
    serial = compute_s + (read / hw.host_to_device_bytes_per_s if on_gpu else 0.0)
    return first / read_rate + max((read - first) / read_rate, serial)


def _fp8_source_bytes(geometry: Geometry) -> int:
    """A block-FP8 checkpoint's bytes: one per weight element and a float32 scale per 128 x 128 block."""
    return geometry.total_params + geometry.total_params * 4 // (128 * 128)


def _fits_note(stage: str, peak_gpu: int, hardware: Hardware) -> tuple[str, ...]:
    if peak_gpu > hardware.gpu_memory_bytes:
        need, have = peak_gpu / GIB, hardware.gpu_memory_bytes / GIB
        return (f"{stage}: needs {need:.0f} GiB on one GPU, more than its {have:.0f} GiB",)
    return ()


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
    hardware: Hardware = B200,
) -> StageCost:
    """Resources of one job of ``stage`` (formulas: README "Cluster cost model").

    ``gpus``: GPUs the job gets (0: a CPU job; a stage computing on a CUDA numerics.device uses one);
    ``fmt``: quantize_layer format; ``layers``: MoE layers in a quantize_layer window; ``sequences``:
    calibration sequences of a score_sensitivity pass (default: the planned macro-batch);
    ``candidate``: run_kld's candidate name (default: the first). A run_kld job does all ``kld.runs``
    runs.
    """
    serves_model = stage_spec(stage).serves_model  # an unknown stage is refused here
    from mixquant.keys.artifacts import compute_device
    from mixquant.numerics import device_type

    hw = hardware
    if stage == "build_toy_model":
        cpus = cfg.model.toy.threads
    else:
        cpus = cfg.numerics.threads if computes_on_cpu(stage) else 1
    notes: list[str] = []
    on_gpu = device_type(compute_device(cfg, stage)) == "cuda"
    if on_gpu and gpus < 1:
        notes.append(f"{stage}: numerics.device is {cfg.numerics.device} but the job has no GPU")
    if on_gpu:
        gpus = max(gpus, 1)
    # a layer-streamed pass: its reads (streamed_read bytes) overlap its compute (_streamed_seconds)
    streamed_s, streamed_read = 0.0, 0
    read = written = download = scratch = 0  # scratch: bytes written outside the keyed output
    hashed = 0  # bytes hashed besides the manifest (fetch_model's file identities, logits SHA-256)
    compute_s = 0.0
    host = hw.process_base_bytes
    gpu_bytes = 0
    startup = hw.process_startup_s
    cpu_flops = hw.cpu_forward_flops_per_core * cpus
    device_flops = hw.gpu_bf16_flops * hw.gpu_streamed_mfu if on_gpu else cpu_flops
    model_bytes = geometry.bf16_bytes
    prompt_len = cfg.prompt.seq_len
    logits_bytes = (prompt_len - 1) * geometry.vocab_size * 4
    calib = cfg.calibration

    if stage == "fetch_model":
        from mixquant.keys.artifacts import source_fp8_block

        source_bytes = _fp8_source_bytes(geometry) if source_fp8_block(cfg) else model_bytes
        if cfg.model.source == "hub":
            download, written, hashed = source_bytes, source_bytes, source_bytes
            read = source_bytes  # local_dir_identity hashes every downloaded file
        else:
            read = hashed = model_bytes  # fetch_local_model hashes the directory in place
            notes.append("local: nothing copied, every file hashed")
    elif stage == "dequantize_source":  # block FP8 -> BF16 a shard at a time (checkpoint.fp8_source)
        read = hashed = _fp8_source_bytes(geometry)
        written = model_bytes
        compute_s = geometry.total_params / (hw.cpu_dequant_fp8_elements_per_s_per_core * cpus)
        host += 3 * model_bytes // max(1, geometry.num_hidden_layers)  # about one shard in and out
    elif stage == "build_toy_model":
        toy = cfg.model.toy
        tokens = toy.training.steps * toy.training.batch_size * toy.training.seq_len
        evaluated = 2 * toy.training.eval_sequences * toy.training.seq_len
        compute_s = max(
            (
                3 * geometry.forward_flops(toy.training.seq_len, 1) * tokens / toy.training.seq_len
                + geometry.forward_flops(toy.training.seq_len, 1) * evaluated / toy.training.seq_len
            )
            / cpu_flops,
            toy.training.steps * hw.toy_step_s,
        )
        read = _dataset_split_bytes(cfg, hw)
        written = model_bytes
        host += (
            geometry.total_params * 16
            + _batch_activation_bytes(geometry, toy.training.batch_size, toy.training.seq_len) * 4
        )
    elif stage in ("sample_calibration", "pin_prompt"):
        splits = sum(len(m.splits) for m in cfg.dataset.hub) if cfg.dataset.source == "hub" else 1
        split_bytes = _dataset_split_bytes(cfg, hw)
        if stage == "pin_prompt":
            splits = 0 if cfg.prompt.source == "token_ids_file" else 1
            written = prompt_len * 4
            tokens = prompt_len
        else:
            written = calib.num_samples * calib.seq_len * 4
            tokens = calib.num_samples * calib.seq_len
        data = splits * split_bytes
        if cfg.dataset.source == "hub":
            download = data
            scratch = data  # the Arrow cache of the downloaded splits (a temporary directory)
        read = data
        if cfg.dataset.source == "hub" and data:  # memory-mapped Arrow, rows decoded as they are sampled
            host += hw.arrow_conversion_bytes
        else:  # the local JSONL is materialised as Python lists and dicts
            host += int(data * hw.python_object_factor)
        compute_s = tokens / hw.tokenize_tokens_per_s
    elif stage == "collect_activation_stats":  # one layer-streamed pass, every sequence through each layer
        tokens = calib.num_samples * calib.seq_len
        read = model_bytes + tokens * 4
        flops = geometry.forward_flops(calib.seq_len, calib.num_samples, first_layer=0)
        compute_s = flops / device_flops
        states = _state_bytes(geometry, calib.num_samples, calib.seq_len)
        transient = _batch_activation_bytes(geometry, cfg.quantize.activation_batch_size, calib.seq_len)
        streamed_s, streamed_read = _streamed_seconds(read, compute_s, geometry, hw, on_gpu), read
        compute_s = 0.0
        held = 2 * _max_layer_bytes(geometry) + _non_layer_bytes(geometry) + states + transient
        if on_gpu:
            gpu_bytes = held
            host += 2 * _pinned_layer_bytes(geometry)  # pinned read-ahead buffer and the layer being copied
        else:
            host += held
        written = _activation_stats_bytes(geometry)
    elif stage == "quantize_layer":  # one window of ``layers`` MoE layers, one after the other
        fmt = fmt or "nvfp4_w4a16"
        params = {
            "nvfp4_w4a16": f"nvfp4_w4a16:{cfg.quantize.nvfp4_w4a16.calibration}",
            "fp8": f"fp8:{cfg.quantize.fp8.weight_calibration}",
            "bf16": "bf16",
        }[fmt]
        result = _layer_result_bytes(geometry, fmt)
        read = layers * geometry.routed_bytes_per_layer
        written = layers * (result + 3 * geometry.num_experts * _AUDIT_BYTES_PER_TENSOR)
        elements = layers * geometry.routed_params_per_layer
        if on_gpu:
            compute_s = elements / hw.gpu_quantize_elements_per_s + read / hw.host_to_device_bytes_per_s
            gpu_bytes = 4 * geometry.routed_params_per_expert * 4 + _QUANTIZE_TEMP_BYTES  # one expert, fp32
        else:
            compute_s = elements / (hw.cpu_quantize_elements_per_s_per_core[params] * cpus)
        # one layer at a time: the growing result, safetensors' save_file copy of it, per-expert temporaries
        host += 2 * result + _QUANTIZE_TEMP_BYTES
    elif stage == "score_sensitivity":  # one macro-batch: a streamed, branch-parallel pass
        search = cfg.placement.search
        size = sequences or score_macro_batch(cfg, geometry, hw)
        tokens = size * calib.seq_len
        pairs = scored_pairs(cfg)
        read = model_bytes + tokens * 4
        if search.calibration == "rebuild":  # each scored layer x format result, once
            from mixquant.keys.artifacts import scored_formats

            read += sum(
                _layer_result_bytes(geometry, f) for formats in scored_formats(cfg).values() for f in formats
            )
        flops = geometry.forward_flops(calib.seq_len, size)  # the reference
        for layer, formats in _scored_layers(cfg):
            routed = 2 * geometry.num_experts_per_tok * geometry.routed_params_per_expert * tokens
            suffix = geometry.forward_flops(calib.seq_len, size, first_layer=layer + 1)
            flops += len(formats) * (routed + suffix)
        flops += (1 + pairs) * 20 * tokens * geometry.vocab_size  # log-softmax, exp and the KL sums
        states = (1 + pairs) * _state_bytes(geometry, size, calib.seq_len)
        # the states saved every checkpoint_interval_s (one stream at a time through the host)
        compute_s = flops / device_flops
        streamed_s, streamed_read = _streamed_seconds(read, compute_s, geometry, hw, on_gpu), read
        compute_s = 0.0
        # null: a quarter of the requested wall time, which is twice the estimate (rule_resources)
        interval = search.checkpoint_interval_s
        interval = streamed_s / 2 if interval is None else interval
        if interval > 0:
            saves = int(streamed_s // interval)
            # a save sits beside the last until progress.json names it, then the last goes: the footprint,
            # not the sum of the saves (their time is counted below)
            scratch = 2 * states if saves else 0
            streamed_s += saves * states / hw.storage_write_bytes_per_s
        held = (
            2 * _max_layer_bytes(geometry)
            + _non_layer_bytes(geometry)
            + geometry.routed_bytes_per_layer  # one format's dequantized copy of a scored layer
            + states
            + _score_transient_bytes(cfg, geometry)
        )
        # host: the read-ahead layer, a quantized layer's file and its dequantized copy, one stream's states
        staging = (
            2 * _pinned_layer_bytes(geometry)  # read pinned (on a GPU, where staging is what the host holds)
            + geometry.routed_bytes_per_layer
            + _layer_result_bytes(geometry, "fp8")
            + _state_bytes(geometry, size, calib.seq_len)
        )
        if on_gpu:
            gpu_bytes = held
            host += staging
        else:
            host += held + _layer_result_bytes(geometry, "fp8")
        written = 400 * pairs * (size // search.batch_size + 1) + 2000
        notes.append(f"{size} sequences, {pairs} branches")
    elif stage == "solve_placement":
        search = cfg.placement.search
        read = 500 * len(geometry.moe_layers) * len(cfg.placement.formats)
        compute_s = (1 + search.frontier_points) * hw.ilp_solve_s + 2 * hw.plot_s
        written = 2000 * len(geometry.moe_layers) + 200 * search.frontier_points + 400_000  # JSON, CSV, 2 PNG
        host += 512 * MIB
    elif stage == "export_checkpoint":
        counts = placement_counts(cfg, geometry)
        kv = "FP8" if cfg.export.kv_cache_quant else None
        structure = predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv)
        written = structure["payload_bytes"]
        routed = sum(structure["bytes"]["routed"].values())
        # non-expert tensors from the source, routed ones from the layer results
        read = structure["bytes"]["non_expert"] + routed
        if kv:
            read += _activation_stats_bytes(geometry)  # k/v amax for the KV-cache scales
        entries = checkpoint_tensors(geometry.to_hf_config(), {}, kv_cache_quant=kv)
        written += 200 * len(entries)  # shard headers + index (~200 B of JSON per tensor)
        host += 256 * MIB  # headers and records only: tensor bytes are copied file to file
        notes.append("placement " + ", ".join(f"{f}={n}" for f, n in counts.items()))
    elif stage in ("reference_logits", "run_kld"):
        # run_kld: one job does every run, each with a fresh engine (vllm: a fresh process per run), so
        # the per-run load, forward and statistics repeat; the peak is one run's
        engine = cfg.kld.engine
        runs = cfg.kld.runs if stage == "run_kld" else 1
        if stage == "reference_logits":
            checkpoint, what = model_bytes, "the BF16 model"
        else:
            checkpoint, what = _candidate_bytes(cfg, geometry, candidate)
            notes.append(what)
        read = checkpoint + prompt_len * 4 + (logits_bytes if stage == "run_kld" else 0)
        written = logits_bytes if stage == "reference_logits" else (prompt_len - 1) * 41 + 10_000
        hashed = logits_bytes * (2 if stage == "run_kld" else 1)  # logits_sha256 (candidate; reference)
        flops = geometry.forward_flops(prompt_len)
        # lm_head applied off-engine in fp32 (vllm), and the KL statistics over [T-1, V] (run_kld)
        off_engine = 2 * (prompt_len - 1) * geometry.lm_head_params if engine == "vllm" else 0
        off_engine += 20 * (prompt_len - 1) * geometry.vocab_size if stage == "run_kld" else 0
        compute_s = off_engine / hw.cpu_forward_flops_per_core
        # output logits: fp32 result, its bf16 rounding and fp32 copy, numpy copy for the SHA-256
        host += 3 * logits_bytes
        if stage == "run_kld":
            host += logits_bytes  # the reference logits
        if engine == "vllm":
            startup += hw.vllm_startup_s
            tp = cfg.kld.tensor_parallel_size
            if gpus < tp:
                raise ValueError(
                    f"{stage}: vllm with tensor_parallel_size {tp} needs {tp} GPUs, job has {gpus}"
                )
            compute_s += flops / (tp * hw.gpu_bf16_flops * hw.gpu_mfu)
            gpu_bytes = int(hw.vllm_gpu_memory_utilization * hw.gpu_memory_bytes)
            host += tp * hw.vllm_worker_host_bytes + geometry.lm_head_params * 6  # bf16 + fp32 lm_head
            if checkpoint / tp > gpu_bytes:
                notes.append(f"weights {checkpoint / tp / GIB:.0f} GiB per GPU exceed vLLM's reservation")
        else:  # hf: layer-streamed on numerics.device, a quantized layer dequantized as it is read
            act = _batch_activation_bytes(geometry, 1, prompt_len) + (prompt_len * geometry.vocab_size * 2)
            held = 2 * _max_layer_bytes(geometry) + _non_layer_bytes(geometry) + act
            streamed_s = _streamed_seconds(checkpoint, flops / device_flops, geometry, hw, on_gpu)
            streamed_read = checkpoint
            if on_gpu:
                gpu_bytes = held
                host += 2 * _pinned_layer_bytes(geometry)
            else:
                host += held
            host += prompt_len * geometry.vocab_size * 2  # logits [1, T, V] bf16
        if runs > 1:
            per_process = startup if engine == "vllm" else 0.0  # a vllm run's own process and engine
            startup += (runs - 1) * per_process
            # the prompt (and, for hf, the reference logits) is read once per job
            once = prompt_len * 4 + (logits_bytes if engine == "hf" else 0)
            read = once + runs * (read - once)
            written, hashed, compute_s = runs * written, runs * hashed, runs * compute_s
            streamed_s, streamed_read = runs * streamed_s, runs * streamed_read
    elif stage == "gate_kld":
        positions = prompt_len - 1
        runs = cfg.kld.runs * (2 if cfg.kld.baseline else 1)
        read = runs * (positions * 41 + 10_000)
        samples = cfg.kld.gates.bootstrap_samples
        compute_s = samples * positions * 10 / hw.cpu_forward_flops_per_core
        host += 3 * samples * positions * 8  # resampled indices and the paired means
        written = positions * 8 + 20_000
    elif stage == "kld_report":
        pairs = len(cfg.kld.candidates) * len(cfg.kld.kv_cache_dtypes)
        read = pairs * ((prompt_len - 1) * 8 + 20_000)
        compute_s = 2 * len(cfg.kld.kv_cache_dtypes) * hw.plot_s
        written = pairs * 2000 + 2 * len(cfg.kld.kv_cache_dtypes) * 150_000
        host += 512 * MIB
    elif stage == "check_kld_gates":
        read, written = 50_000, 20_000
    elif stage == "verify_hashes":
        # the prompt, the reference logits (loaded, then hashed from a numpy copy) and the checkpoint's
        # hf_quant_config.json and index (~100 B of JSON per tensor)
        entries = checkpoint_tensors(geometry.to_hf_config(), {}, kv_cache_quant=None)
        read = prompt_len * 4 + logits_bytes + 100 * len(entries)
        hashed = logits_bytes + 100 * len(entries)
        host += 2 * logits_bytes
        written = 5_000

    elif stage == "assemble_release":
        # the checkpoint is hardlinked (no bytes copied) but the release's manifest hashes every file of it;
        # release_hashes re-hashes the reference logits; card, recipe, audits and aggregates are small
        counts = placement_counts(cfg, geometry)
        kv = "FP8" if cfg.export.kv_cache_quant else None
        structure = predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv)
        entries = checkpoint_tensors(geometry.to_hf_config(), {}, kv_cache_quant=kv)
        checkpoint = structure["payload_bytes"] + 200 * len(entries)
        read = checkpoint + logits_bytes + prompt_len * 4
        hashed = checkpoint + logits_bytes
        host += 2 * logits_bytes + 512 * MIB
        written = 200_000

    read += written  # the manifest re-reads every published file
    hashed += written
    written += scratch
    compute_s += hashed / hw.sha256_bytes_per_s
    runtime = (
        startup
        + streamed_s
        + (read - streamed_read) / hw.storage_read_bytes_per_s
        + written / hw.storage_write_bytes_per_s
        + download / hw.hub_download_bytes_per_s
        + compute_s
    )
    if not (on_gpu or (serves_model and cfg.kld.engine == "vllm")):
        gpu_bytes = 0
        gpus = 0 if not serves_model else gpus
    return StageCost(
        stage, gpus, cpus, runtime, int(read), int(written), int(host), int(gpu_bytes), tuple(notes)
    )


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
    hardware: Hardware = B200,
) -> dict[str, int]:
    """SLURM request of one job: ``mem_mb`` = peak host x 1.25 rounded up to whole GiB (at least 2000),
    ``runtime`` = runtime x 2 in minutes rounded up to 10 (at least 10), ``disk_mb`` (:func:`disk_mb`),
    ``gpu`` when the job has GPUs."""
    cost = stage_cost(
        cfg, geometry, stage, gpus=gpus, fmt=fmt, layers=layers, sequences=sequences, hardware=hardware
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
    from mixquant.keys.artifacts import compute_device
    from mixquant.numerics import device_type

    if stage_spec(stage).serves_model and cfg.kld.engine == "vllm":
        return cfg.kld.tensor_parallel_size
    return 1 if device_type(compute_device(cfg, stage)) == "cuda" else 0


def cost_table_markdown(cfg: MixquantConfig, geometry: Geometry, hardware: Hardware = B200) -> str:
    """The per-stage per-job table of the README (quantize_layer per format; one score pass)."""
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
