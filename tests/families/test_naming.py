"""Reading checkpoint names by family (mixquant.model.families.naming): the qwen2_moe-style layout and
Mixtral's block_sparse_moe / w1-w3-w2 layout, from the architecture's templates, no name written here
twice."""

from __future__ import annotations

from mixquant.model.families import DEFAULT_EXPERT_TEMPLATES, Architecture
from mixquant.model.families.naming import (
    expert_prefix,
    experts_module_layer,
    experts_module_names,
    module_category,
    routed_expert_tensor,
)

MIXTRAL_TEMPLATES = {
    "gate_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
    "up_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    "down_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
}


def _arch(templates: dict[str, str]) -> Architecture:
    return Architecture(
        model_type="test",
        family="test",
        moe_layers=(0, 1),
        num_experts=2,
        experts_per_token=1,
        num_hidden_layers=2,
        dtype="bfloat16",
        tensors={},
        expert_templates=templates,
    )


def test_routed_tensors_in_either_layout():
    mixtral = _arch(MIXTRAL_TEMPLATES)
    assert routed_expert_tensor("model.layers.3.block_sparse_moe.experts.7.w3.weight_scale", mixtral) == (
        3,
        7,
        "up_proj",
        "weight_scale",
    )
    assert routed_expert_tensor("model.layers.3.mlp.experts.7.up_proj.weight", mixtral) is None
    for arch in (None, _arch(dict(DEFAULT_EXPERT_TEMPLATES))):
        assert routed_expert_tensor("model.layers.3.mlp.experts.7.down_proj.input_scale", arch) == (
            3,
            7,
            "down_proj",
            "input_scale",
        )
        assert routed_expert_tensor("model.layers.3.mlp.experts.e_score_correction_bias", arch) is None
        assert routed_expert_tensor("model.layers.3.mlp.gate.weight", arch) is None
    assert expert_prefix(2, 5, "down_proj", mixtral) == "model.layers.2.block_sparse_moe.experts.5.w2"
    assert expert_prefix(2, 5, "down_proj", None) == "model.layers.2.mlp.experts.5.down_proj"


def test_the_names_a_quant_config_gives_a_layers_experts():
    mixtral = _arch(MIXTRAL_TEMPLATES)
    assert experts_module_names(4, mixtral) == (
        "model.layers.4.mlp.experts",
        "model.layers.4.block_sparse_moe.experts",
    )
    assert experts_module_names(4, None) == ("model.layers.4.mlp.experts",)
    assert experts_module_layer("model.layers.12.block_sparse_moe.experts", mixtral) == 12
    assert experts_module_layer("model.layers.12.mlp.experts", mixtral) == 12
    assert experts_module_layer("model.layers.12.block_sparse_moe.experts", None) is None
    assert experts_module_layer("model.layers.12.mlp.experts.0", None) is None


def test_module_categories():
    assert module_category("lm_head") == "lm_head"
    assert module_category("model.layers.1.mlp.shared_expert.gate_proj") == "shared_experts"
    assert module_category("model.layers.1.self_attn.q_proj") == "attention"
    assert module_category("model.layers.1.block_sparse_moe.gate") == "router"
    assert module_category("model.layers.0.mlp.down_proj") == "dense_mlp"
    assert module_category("model.embed_tokens") == "embeddings"
    assert module_category("model.norm") == "other"
