"""The embedded default model: a tiny Laguna (real transformers architecture) trained by the workflow.

It mirrors Laguna-S-2.1 at toy scale: dense layer 0 then sparse MoE layers (sigmoid router with
e_score_correction_bias, normalised top-k weights (LagunaTopKRouter always renormalises: there is no
norm_topk_prob field), one shared expert, routed scaling 2.5), hybrid attention
(layer l is full attention iff l % 4 == 0, partial RoPE 0.5 / theta 500000 there, sliding window with
default RoPE theta 10000 elsewhere), different head counts on full vs sliding layers, per-head softplus
output gate, q/k norms, untied lm_head. Every matrix input dimension is a multiple of 16 (NVFP4 blocks).

Everything is deterministic for a fixed seed and thread count: weight init (torch.manual_seed), data order
(a seeded torch.Generator), the router-bias balancing updates, the tokenizer (see tokenizer.py), and the
saved bytes (toy_layout.py).

The toy is built in three modules: this one (the model: its config, initialisation, dtype, parameter
counts and outlier channels), :mod:`mixquant.model.toy_training` (the corpus as packed sequences, the
training loop) and :mod:`mixquant.model.toy_build` (tokenizer, training, outliers, the saved checkpoint
and its reload check).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LagunaConfig, LagunaForCausalLM, PreTrainedTokenizerFast

from mixquant.model.tokenizer import special_token_ids
from mixquant.model.toy_settings import ToyArchitecture, ToyOutliers, ToyTokenizer, ToyTraining

NVFP4_BLOCK = 16

# Defaults live in the typed settings (toy_settings.py, also the config schema); plain dicts here.
# Geometry of the toy model (LagunaConfig fields, some derived).
DEFAULT_TOY_ARCH: dict[str, Any] = ToyArchitecture().model_dump()

# Tokenizer training (tokenizer.py): byte-level BPE on the corpus text.
DEFAULT_TOY_TOKENIZER: dict[str, Any] = ToyTokenizer().model_dump()

# Training: AdamW, linear warmup then cosine decay, fp32 on CPU; packed next-token prediction.
DEFAULT_TOY_TRAINING: dict[str, Any] = ToyTraining().model_dump()

# Outlier channels applied after training (apply_outliers).
DEFAULT_TOY_OUTLIERS: dict[str, Any] = ToyOutliers().model_dump()


# ----------------------------------------------------------------------------------------- config


def with_defaults(defaults: dict[str, Any], given: dict[str, Any], what: str) -> dict[str, Any]:
    """`defaults` overridden by `given`; an unknown key (a typo) is an error, not silently ignored."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known: {sorted(defaults)}")
    return {**defaults, **given}


def _require_multiple(name: str, value: int, of: int = NVFP4_BLOCK) -> None:
    if value % of:
        raise ValueError(f"{name}={value} must be a multiple of {of} (NVFP4 blocks along the input dim)")


def toy_laguna_config(arch: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> LagunaConfig:
    """LagunaConfig for `arch` (keys as DEFAULT_TOY_ARCH), vocab and special ids from `tokenizer`.

    The vocabulary is len(tokenizer) rounded up to a multiple of 16.
    """
    arch = with_defaults(DEFAULT_TOY_ARCH, arch, "toy arch")
    layers = int(arch["num_hidden_layers"])
    dense = int(arch["num_dense_layers"])
    period = int(arch["full_attention_period"])
    if not 0 < dense < layers:
        raise ValueError(f"need 0 < num_dense_layers ({dense}) < num_hidden_layers ({layers})")
    vocab = -(-len(tokenizer) // NVFP4_BLOCK) * NVFP4_BLOCK
    head_dim = int(arch["head_dim"])
    heads_full = int(arch["num_attention_heads_full"])
    heads_sliding = int(arch["num_attention_heads_sliding"])
    kv_heads = int(arch["num_key_value_heads"])
    layer_types = ["full_attention" if i % period == 0 else "sliding_attention" for i in range(layers)]
    heads = [heads_full if t == "full_attention" else heads_sliding for t in layer_types]
    for h in sorted(set(heads)):
        if h % kv_heads:
            raise ValueError(f"{h} query heads are not a multiple of {kv_heads} KV heads")
        _require_multiple(f"o_proj input ({h} heads x head_dim {head_dim})", h * head_dim)
    for key in (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        _require_multiple(key, int(arch[key]))
    _require_multiple("num_experts (router rows)", int(arch["num_experts"]))
    return LagunaConfig(
        vocab_size=vocab,
        hidden_size=int(arch["hidden_size"]),
        intermediate_size=int(arch["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads_full,
        num_attention_heads_per_layer=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(arch["max_position_embeddings"]),
        initializer_range=float(arch["initializer_range"]),
        rms_norm_eps=float(arch["rms_norm_eps"]),
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(arch["full_rope_theta"]),
                "partial_rotary_factor": float(arch["full_partial_rotary_factor"]),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(arch["sliding_rope_theta"]),
                "partial_rotary_factor": 1.0,
            },
        },
        sliding_window=int(arch["sliding_window"]),
        layer_types=layer_types,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        num_experts=int(arch["num_experts"]),
        num_experts_per_tok=int(arch["num_experts_per_tok"]),
        moe_intermediate_size=int(arch["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(arch["shared_expert_intermediate_size"]),
        moe_routed_scaling_factor=float(arch["moe_routed_scaling_factor"]),
        gating=True,
        attention_bias=False,
        **special_token_ids(tokenizer),
    )


def init_toy_model(
    config: LagunaConfig, *, seed: int, router_bias_init_std: float = 0.02
) -> LagunaForCausalLM:
    """Seeded fp32 model with a small nonzero e_score_correction_bias (HF initialises it to zeros)."""
    torch.manual_seed(seed)
    model = LagunaForCausalLM(config)
    model.to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for router in routers(model):
            bias = (
                torch.randn(router.e_score_correction_bias.shape, generator=generator) * router_bias_init_std
            )
            router.e_score_correction_bias.copy_(bias)
    return model


def to_bfloat16(model: LagunaForCausalLM) -> LagunaForCausalLM:
    """Cast parameters (router bias included) to bf16 in place, as from_pretrained(dtype=bf16) loads them.

    Unlike model.to(bf16) this leaves the non-persistent RoPE inv_freq buffers in fp32, which is what a
    reloaded checkpoint has (they are recomputed at load time); casting them would change the logits.
    """
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts by role, in the upstream layout's terms."""
    counts = {
        "total": 0,
        "routed_experts": 0,
        "shared_experts": 0,
        "router": 0,
        "attention": 0,
        "embedding": 0,
    }
    counts.update({"lm_head": 0, "dense_mlp": 0, "norms": 0})
    for name, tensor in model.state_dict().items():
        n = tensor.numel()
        counts["total"] += n
        if ".mlp.experts." in name:
            counts["routed_experts"] += n
        elif ".mlp.shared_experts." in name:
            counts["shared_experts"] += n
        elif ".mlp.gate." in name:
            counts["router"] += n
        elif ".self_attn." in name and name.endswith("_proj.weight"):
            counts["attention"] += n
        elif "embed_tokens" in name:
            counts["embedding"] += n
        elif name.startswith("lm_head"):
            counts["lm_head"] += n
        elif ".mlp." in name:
            counts["dense_mlp"] += n
        else:
            counts["norms"] += n
    config = model.config
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    sparse = sum(t == "sparse" for t in config.mlp_layer_types)
    counts["active_per_token"] = (
        counts["total"] - counts["routed_experts"] + (sparse * config.num_experts_per_tok * per_expert)
    )
    return counts


# ----------------------------------------------------------------------------------------- outliers


@torch.no_grad()
def apply_outliers(model: LagunaForCausalLM, outliers: dict[str, Any]) -> list[dict[str, Any]]:
    """Give some MoE layers' routed experts massive intermediate activations, keeping the BF16 function.

    Real MoE models carry a few channels with activations orders of magnitude above the rest and the
    matching tiny down-projection weights ("super weights", Yu et al. 2024, arXiv:2411.07191); they are
    what makes some layers far more sensitive to 4-bit weights than others. Per listed layer and per expert,
    ``channels`` intermediate channels (a seeded permutation) get their up_proj row multiplied by
    2**log2_scale and their down_proj column divided by it. Powers of two scale bf16 values exactly and
    the expert computes silu(gate) * up before down_proj, so the model's logits stay bit-identical (checked
    by the caller), while NVFP4's 16-element blocks along down_proj's input round the tiny column to zero
    and FP8's per-tensor scales keep it. Returns what was changed (for the training report).
    """
    outliers = with_defaults(DEFAULT_TOY_OUTLIERS, outliers, "toy outliers")
    layers = model.model.layers
    changed = []
    for entry in outliers["layers"]:
        layer, channels, log2_scale = int(entry["layer"]), int(entry["channels"]), int(entry["log2_scale"])
        if not 0 <= layer < len(layers) or not hasattr(layers[layer].mlp, "experts"):
            raise ValueError(f"toy outliers: layer {layer} is not a MoE layer")
        experts = layers[layer].mlp.experts
        intermediate = experts.down_proj.shape[-1]
        if channels > intermediate:
            raise ValueError(f"toy outliers: layer {layer} has {intermediate} channels, asked for {channels}")
        generator = torch.Generator().manual_seed(int(outliers["seed"]) * 1000 + layer)
        scale = float(2**log2_scale)
        picked = []
        for expert in range(experts.down_proj.shape[0]):
            chosen = torch.randperm(intermediate, generator=generator)[:channels]
            experts.gate_up_proj.data[expert, intermediate + chosen, :] *= scale  # the "up" half
            experts.down_proj.data[expert][:, chosen] /= scale
            picked.append(sorted(int(c) for c in chosen))
        changed.append({"layer": layer, "log2_scale": log2_scale, "channels_per_expert": picked})
    return changed
