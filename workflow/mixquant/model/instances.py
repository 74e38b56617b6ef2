"""Trained tiny instances of the MoE families beyond Laguna: transformers' own classes, trained on the
committed corpus by the toy's recipe, in their upstream disk layout.

Each supported family gets what the embedded toy Laguna has: a small instance of transformers' own model
class (``AutoModelForCausalLM.from_config``) with the family's own shape -- its MoE and dense layers, shared
experts, router (softmax top-k, DeepSeek's sigmoid + correction bias with group limits, MiniMax's bias on
the block), attention (DeepSeek's MLA, GLM's partial RoPE and q/k norms) -- trained with the toy's
tokenizer on the toy's corpus by :func:`mixquant.model.toy_training.train_moe_model` (the toy's steps,
batch, learning-rate schedule and AdamW settings; routers with a correction bias are balanced by the bias
update, softmax routers by the family's own load-balancing loss), then cast to BF16, given the toy's
outlier channels (:func:`mixquant.model.toy.apply_outliers`, an exact power-of-two rescaling that leaves the
BF16 logits bit for bit unchanged) and saved by ``save_pretrained`` (transformers reverses its load
conversions, so the files carry the publisher's tensor names). The reload through ``from_pretrained`` is
checked to give the saved model's logits bit for bit.

Training is deterministic for a fixed seed and thread count on one machine, not across machines (CPU
kernels differ), so the instances are committed (``data/instances/<model_type>/``) and content-pinned
(``data/instances/instances.json``); ``mixquant build-instance`` rebuilds one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mixquant.model.families import moe_experts
from mixquant.model.layout import write_json
from mixquant.model.tokenizer import special_token_ids
from mixquant.model.toy import DEFAULT_TOY_TRAINING, apply_outliers, with_defaults
from mixquant.model.toy_training import token_stream, torch_threads, train_moe_model

__all__ = [
    "AUX_LOSS_COEF",
    "INSTANCE_GEOMETRY",
    "INSTANCE_MODEL_TYPES",
    "PINS_FILE",
    "build_family_instance",
    "instance_config",
    "outlier_layers",
    "publish_dtypes",
]

PINS_FILE = "instances.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Shared by every instance: the toy's vocabulary, width and expert shape (hidden 128, experts of 32, top-2),
# 4 heads of 32 (vLLM's CPU attention refuses head_dim 16), an untied lm_head.
COMMON_GEOMETRY: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}
# model_type -> what makes the instance that family's own shape; 8 MoE layers each, as the toy.
INSTANCE_GEOMETRY: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B / 235B-A22B: every layer MoE, softmax router with renormalised top-k, no shared expert
    "qwen3_moe": {"num_hidden_layers": 8, "num_experts": 16, "mlp_only_layers": [], "norm_topk_prob": True},
    # DeepSeek-V3: leading dense layer, one shared expert, sigmoid router with correction bias, 4 groups of
    # 4 experts with 2 groups kept per token, routed scaling 2.5, MLA attention
    "deepseek_v3": {
        "num_hidden_layers": 9,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "num_key_value_heads": 4,  # MLA: one key/value per query head
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "head_dim": 16,  # transformers' rotary width for MLA: the RoPE part of a q/k head
        "v_head_dim": 32,
    },
    # GLM-4.5/4.6: leading dense layer, one shared expert, DeepSeek-style router (one group), q/k norms,
    # partial RoPE
    "glm4_moe": {
        "num_hidden_layers": 9,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
    },
    # Mixtral 8x7B: every layer MoE, 8 experts top-2, softmax router (the expert width is intermediate_size)
    "mixtral": {"num_hidden_layers": 8, "num_local_experts": 8, "intermediate_size": 64},
    # MiniMax-M2: every layer MoE, sigmoid router with the correction bias on the block, q/k norms
    "minimax_m2": {
        "num_hidden_layers": 8,
        "num_local_experts": 16,
        "intermediate_size": 32,
        "use_qk_norm": True,
    },
}
INSTANCE_MODEL_TYPES = tuple(INSTANCE_GEOMETRY)
# The families' own load-balancing loss weight where the router has no correction bias (transformers'
# default router_aux_loss_coef of Qwen3-MoE and Mixtral).
AUX_LOSS_COEF = 0.001
# The toy's outlier layers (its 2nd, 5th and 7th MoE layers; toy_settings._default_outliers), by MoE ordinal.
OUTLIER_ORDINALS = ((1, 4, 8), (4, 2, 8), (6, 1, 8))  # (MoE ordinal, channels, log2 scale)

# Tensors a publisher writes in another dtype than transformers' class holds them in. DeepSeek-V3 ships its
# routers' weights in BF16 (the hub's float32 bytes are the weight_scale_inv tensors and the 58 x 256
# correction biases and nothing else), while DeepseekV3TopkRouter holds its weight in float32 and
# save_pretrained writes it so: the instance is rewritten to the publisher's dtypes.
PUBLISHED_DTYPES = {"deepseek_v3": {".mlp.gate.weight": torch.bfloat16}}


def instance_config(model_type: str, tokenizer: Any, **overrides: Any) -> Any:
    """transformers' config of the ``model_type`` instance: its geometry, the tokenizer's vocabulary
    (rounded up to 16, NVFP4 blocks) and special ids."""
    from transformers import AutoConfig

    if model_type not in INSTANCE_GEOMETRY:
        raise ValueError(f"no instance geometry for model_type {model_type!r}; known: {INSTANCE_MODEL_TYPES}")
    vocab = -(-len(tokenizer) // 16) * 16
    special = special_token_ids(tokenizer)
    settings = {**COMMON_GEOMETRY, **INSTANCE_GEOMETRY[model_type], **overrides}
    return AutoConfig.for_model(model_type, vocab_size=vocab, **special, **settings)


def outlier_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The toy's outlier channels placed on the instance's MoE layers of the same ordinals."""
    moe = sorted(moe_experts(model))
    return {
        "seed": 0,
        "layers": [
            {"layer": moe[ordinal], "channels": channels, "log2_scale": scale}
            for ordinal, channels, scale in OUTLIER_ORDINALS
            if ordinal < len(moe)
        ],
    }


def publish_dtypes(model_type: str, out: Path) -> None:
    """Rewrite the saved shards' tensors whose published dtype differs from the class's (PUBLISHED_DTYPES)."""
    from safetensors.torch import load_file, save_file

    casts = PUBLISHED_DTYPES.get(model_type, {})
    if not casts:
        return
    index = out / "model.safetensors.index.json"
    if index.exists():
        raise ValueError(f"{index}: a sharded instance needs its total_size recomputed")
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            for suffix, dtype in casts.items():
                if name.endswith(suffix):
                    tensors[name] = tensor.to(dtype)
        save_file(tensors, shard, metadata={"format": "pt"})


def _bfloat16_copy(model_type: str, trained: torch.nn.Module) -> torch.nn.Module:
    """The trained fp32 model as from_pretrained(dtype=bf16) holds it: bf16 parameters, the modules the
    class keeps in float32 (DeepSeek's and GLM's routers) in float32, the trained values rounded once (to
    the published dtype where it differs, PUBLISHED_DTYPES)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(trained.config, dtype=torch.bfloat16)
    state = trained.state_dict()
    casts = PUBLISHED_DTYPES.get(model_type, {})
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = state[name]
            for suffix, dtype in casts.items():  # what the published file holds, read back
                if name.endswith(suffix):
                    value = value.to(dtype)
            tensor.copy_(value.to(tensor.dtype))
    return model.eval()


def build_family_instance(
    model_type: str,
    out_dir: Path,
    *,
    conversations: list[list[dict]],
    tokenizer_dir: Path,
    training: dict[str, Any] | None = None,
    seed: int = 0,
    threads: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the ``model_type`` instance and write it into the empty ``out_dir`` (module docstring).

    ``tokenizer_dir``: the toy's tokenizer files (copied beside the weights). Returns the report also
    written to ``out_dir/training_report.json`` (timings left out, so the files are deterministic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")
    training = with_defaults(DEFAULT_TOY_TRAINING, training or {}, "instance training")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = instance_config(model_type, tokenizer)
    with torch_threads(threads):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    aux = 0.0 if any(hasattr(m, "e_score_correction_bias") for m in model.modules()) else AUX_LOSS_COEF
    model, report = train_moe_model(
        model,
        conversations,
        tokenizer,
        training=training,
        seed=seed,
        threads=threads,
        aux_loss_coef=aux,
        progress=progress,
        desc=f"train {model_type} instance",
    )
    with torch_threads(threads), torch.no_grad():
        model = _bfloat16_copy(model_type, model)
        probe = token_stream(tokenizer, conversations[:8])[: int(training["seq_len"])].unsqueeze(0)
        before = model(input_ids=probe).logits
        outliers = outlier_layers(model)
        outlier_report = apply_outliers(model, outliers)
        if not torch.equal(before, model(input_ids=probe).logits):
            raise RuntimeError(
                f"{model_type}: outliers changed the bf16 logits (they must be exact rescalings)"
            )
        model.save_pretrained(out_dir)
        publish_dtypes(model_type, out_dir)
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_dir) / name, out_dir / name)
        # what a user of the checkpoint gets: from_pretrained with the published dtypes
        expected = before
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
        identical = bool(torch.equal(expected, reloaded(input_ids=probe).logits))
    if not identical:
        raise RuntimeError(f"{model_type}: from_pretrained logits differ from the saved bf16 model's logits")
    report = {
        "model_type": model_type,
        "geometry": {**COMMON_GEOMETRY, **INSTANCE_GEOMETRY[model_type]},
        "moe_layers": sorted(moe_experts(model)),
        "parameters": {
            "total": sum(t.numel() for t in model.state_dict().values()),
            "routed_experts": sum(
                e.gate_up_proj.numel() + e.down_proj.numel() for e in moe_experts(model).values()
            ),
        },
        "aux_loss_coef": aux,
        **{k: v for k, v in report.items() if k != "timings_s"},
        "outliers": outlier_report,
        "logits_bit_identical_after_reload": identical,
    }
    write_json(out_dir / "training_report.json", report)
    report["timings_s"] = {"total": time.perf_counter() - started}
    return report


def read_pins(directory: Path) -> dict[str, str]:
    """``{model_type: content SHA-256}`` of the committed instances (``instances.json``)."""
    return json.loads((Path(directory) / PINS_FILE).read_text(encoding="utf-8"))
