"""The model geometry planning knows: from the toy's settings or a config.json, before any weight exists.

One place for the planning-time shape of the model: the cost model's estimates, the score-job sizing and
the planning checks (context length, MoE layers, budget reach) read it from here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixquant.checkpoint.fp8_config import block_size, is_block_fp8
from mixquant.config import ConfigError, MixquantConfig, parse_layer_ranges
from mixquant.model.families import architecture
from mixquant.model.families.laguna import planning_config as toy_config_json  # the toy is a Laguna

__all__ = [
    "FALLBACK_REQUEST",
    "Geometry",
    "geometry_from_hf_config",
    "geometry_missing_line",
    "model_geometry",
    "planning_geometry",
    "planning_model_config",
    "source_fp8_block",
    "toy_geometry",
]


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
        """The config.json it was read from, else the toy's config.json-shaped dict (model.toy_settings)."""
        if self.source_config_json:
            return json.loads(self.source_config_json)
        return toy_config_json(self)


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
    arch = architecture(config)
    layers = arch.num_hidden_layers
    fixed = [0] * layers
    non_layer = 0
    for name, (shape, _dtype) in arch.non_expert_tensors().items():
        count = math.prod(shape)
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


def planning_geometry(cfg: MixquantConfig, root: Path = Path(".")) -> Geometry | None:
    """The geometry for resource requests, or None where a real model names no config.json."""
    if cfg.model.source != "toy" and cfg.model.geometry is None:
        return None
    return model_geometry(cfg, root)


# Requests for a job whose model has no geometry on file (a hub model without model.geometry).
FALLBACK_REQUEST = {"mem_mb": 4000, "runtime": 60, "disk_mb": 50000}


def geometry_missing_line(cfg: MixquantConfig) -> str | None:
    """What planning cannot estimate without a geometry on file, why, and the fix; None with one."""
    if cfg.model.source == "toy" or cfg.model.geometry is not None:
        return None
    hub, local = cfg.model.hub, cfg.model.local
    model = f"{hub.repo} at revision {hub.revision}" if cfg.model.source == "hub" and hub else local.path
    return (
        f"model.geometry is not set ({cfg.model.source} model {model}): without the model's config.json "
        "planning estimates no memory, time or disk, and every job requests the same "
        + ", ".join(f"{name}={value}" for name, value in FALLBACK_REQUEST.items())
        + " (runtime in minutes); set model.geometry to a copy of the pinned revision's config.json in the "
        "working directory (as config/laguna-s-2.1.yaml does)"
    )


def planning_model_config(cfg: MixquantConfig, source: str, root: Path = Path(".")) -> dict | None:
    """The model's config.json as planning knows it: the toy's, model.geometry, or a local model's own
    config.json; None for a hub model without model.geometry."""
    if cfg.model.source == "toy":
        arch = cfg.model.toy.arch
        return {**toy_geometry(cfg).to_hf_config(), "max_position_embeddings": arch.max_position_embeddings}
    if cfg.model.geometry is not None:
        key, path = "model.geometry", Path(root) / cfg.model.geometry
    elif cfg.model.local is not None and (Path(root) / cfg.model.local.path / "config.json").is_file():
        key, path = "model.local.path", Path(root) / cfg.model.local.path / "config.json"
    else:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{source}: config key '{key}': cannot read {path} ({error})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: config key '{key}': {path} is not a config.json object")
    return config


def source_fp8_block(cfg: MixquantConfig) -> tuple[int, int] | None:
    """The FP8 block size of a source published block-FP8 (its config.json's quantization_config, from
    model.geometry or the local directory), None for a BF16 source."""
    config = planning_model_config(cfg, "config")
    if not config or not is_block_fp8(config):
        return None
    return block_size(config)
