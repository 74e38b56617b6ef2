"""Small random instances of transformers' own MoE classes, one per supported model type, saved in their
upstream disk layout (``save_pretrained``: transformers reverses its load conversions), with the toy's
tokenizer so the whole workflow can run on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from mixquant.model.instances import publish_dtypes

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "data" / "toy-laguna"
VOCAB = 2048  # the toy's tokenizer
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# model_type -> what makes the small instance that type's own shape (MoE layers, shared experts, routers)
SPECS = {
    "qwen3_moe": {"num_hidden_layers": 3, "num_experts": 8, "mlp_only_layers": [0], "norm_topk_prob": True},
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "num_key_value_heads": 4,  # MLA: one key/value per query head
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 16,
    },
    "glm4_moe": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": True,
    },
    "mixtral": {"num_hidden_layers": 3, "num_local_experts": 8, "intermediate_size": 32},
    "minimax_m2": {
        "num_hidden_layers": 3,
        "num_local_experts": 8,
        "intermediate_size": 32,
        "use_qk_norm": True,
    },
}
# the family each model type belongs to (mixquant.model.families)
FAMILY = {
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "deepseek_v3",
    "mixtral": "mixtral",
    "minimax_m2": "mixtral",
}


def make_instance(model_type: str, out: Path, *, seed: int = 0, **overrides) -> Path:
    """A random bf16 ``model_type`` model saved with ``save_pretrained`` into ``out`` (+ the toy tokenizer).

    Routers are scaled up so tokens spread over the experts, correction biases are random, a few expert
    weights are outliers and the lm_head is sharp, so that quantization errors and KL scores are well
    above rounding noise. ``overrides``: config settings beyond the family's (e.g. ``head_dim=32``, what
    vLLM's CPU attention needs). What the class keeps in float32 and the publisher ships in BF16 (DeepSeek's
    routers) is rewritten to the published dtype (:func:`mixquant.model.instances.publish_dtypes`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **SPECS[model_type], **overrides})
    torch.manual_seed(seed)
    # bf16 as published; what the class keeps in float32 (the routers of DeepSeek, GLM) is written as the
    # publishers write it (publish_dtypes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.05, generator=generator)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(1.0)
            elif ".gate.weight" in name:
                param.mul_(20.0)
            elif name.startswith("lm_head"):
                param.mul_(8.0)
            elif "experts.gate_up_proj" in name or "experts.down_proj" in name:
                param[torch.rand(param.shape, generator=generator) < 3e-3] *= 25.0
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    publish_dtypes(model_type, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOY / name, out / name)
    return out
