"""Upstream checkpoint layout: names, shards, index, and bit-identical reload through transformers."""

from __future__ import annotations

import json
import re

import pytest
import torch
from mixquant.model import layout, toy_layout
from mixquant.model.tokenizer import SPECIAL_TOKENS
from mixquant.model.toy import DEFAULT_TOY_ARCH, init_toy_model, to_bfloat16, toy_laguna_config
from safetensors import safe_open
from transformers import LagunaForCausalLM


class StubTokenizer:
    """Just what toy_laguna_config reads: a length and the special-token ids."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL_TOKENS.index(token)


SMALL_ARCH = {
    "num_hidden_layers": 5,
    "hidden_size": 32,
    "head_dim": 16,
    "num_attention_heads_full": 2,
    "num_attention_heads_sliding": 4,
    "num_key_value_heads": 2,
    "sliding_window": 8,
    "intermediate_size": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}


@pytest.fixture(scope="module")
def small_model():
    config = toy_laguna_config(SMALL_ARCH, StubTokenizer(300))
    model = init_toy_model(config, seed=3, router_bias_init_std=0.05)
    to_bfloat16(model).eval()
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_model):
    out = tmp_path_factory.mktemp("ckpt")
    info = toy_layout.save_upstream_checkpoint(small_model, out, num_shards=3)
    return out, info


def read_all(out) -> dict[str, tuple[str, torch.Tensor, dict]]:
    tensors = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as handle:
            metadata = handle.metadata()
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = (shard.name, handle.get_tensor(name), metadata)
    return tensors


def test_config_geometry(small_model):
    config = small_model.config
    assert config.vocab_size == 304  # 300 rounded up to a multiple of 16
    assert config.layer_types == ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    assert config.num_attention_heads_per_layer == [2, 4, 4, 4, 2]
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * 4
    assert config.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.5
    assert config.rope_parameters["full_attention"]["rope_theta"] == 500000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.moe_routed_scaling_factor == 2.5 and config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, [0, 3], 1)


def test_default_arch_is_nvfp4_friendly():
    """Every matrix of the default toy geometry has an input dim that is a multiple of 16."""
    config = toy_laguna_config({}, StubTokenizer(2048))
    assert config.num_hidden_layers >= 9 and config.num_experts >= 16 and config.num_experts_per_tok >= 2
    assert sum(t == "sparse" for t in config.mlp_layer_types) >= 8 and config.mlp_layer_types[0] == "dense"
    assert len(set(config.num_attention_heads_per_layer)) == 2
    with torch.device("meta"):
        model = LagunaForCausalLM(config)
    for name, tensor in model.state_dict().items():
        if tensor.dim() >= 2:
            assert tensor.shape[-1] % 16 == 0, (name, tuple(tensor.shape))
            assert tensor.shape[-2] % 16 == 0 or name.endswith("g_proj.weight"), (name, tuple(tensor.shape))
    assert DEFAULT_TOY_ARCH["moe_routed_scaling_factor"] == 2.5


def test_rejects_non_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        toy_laguna_config({**SMALL_ARCH, "moe_intermediate_size": 24}, StubTokenizer(300))


def test_tensor_names_are_upstream(saved, small_model):
    out, info = saved
    tensors = read_all(out)
    names = sorted(tensors, key=layout.natural_key)
    assert names == toy_layout.upstream_tensor_names(small_model.config)
    assert names == toy_layout.upstream_tensor_names(json.loads((out / "config.json").read_text()))
    for layer in range(1, 5):
        p = f"model.layers.{layer}.mlp"
        for e in (0, 15):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{p}.experts.{e}.{proj}.weight" in tensors
                assert f"{p}.shared_expert.{proj}.weight" in tensors
        assert f"{p}.experts.e_score_correction_bias" in tensors
        assert f"{p}.gate.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "lm_head.weight" in tensors
    assert not [
        n for n in names if re.search(r"shared_experts|gate_up_proj|gate\.e_score|experts\.(down|up)_", n)
    ]
    assert info["num_tensors"] == len(names)


def test_names_match_transformers_reverse_mapping(tmp_path, small_model):
    """transformers 5 save_pretrained reverses its conversion mapping; it must agree with ours."""
    small_model.save_pretrained(tmp_path)
    hf_names = set()
    for shard in tmp_path.glob("*.safetensors"):
        with safe_open(shard, "pt") as handle:
            hf_names.update(handle.keys())
    assert sorted(hf_names, key=layout.natural_key) == toy_layout.upstream_tensor_names(small_model.config)


def test_shards_index_and_dtypes(saved):
    out, info = saved
    tensors = read_all(out)
    index = json.loads((out / layout.INDEX_FILE).read_text())
    shard_files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shard_files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert info["num_shards"] == 3 >= 2
    assert index["weight_map"] == {name: shard for name, (shard, _, _) in tensors.items()}
    total = sum(t.numel() * t.element_size() for _, t, _ in tensors.values())
    assert index["metadata"]["total_size"] == total == info["total_size"]
    assert all(t.dtype == torch.bfloat16 for _, t, _ in tensors.values())
    assert all(meta == {"format": "pt"} for _, _, meta in tensors.values())
    # whole layers per shard, layers in order across shards
    shard_of_layer: dict[int, set[str]] = {}
    for name, (shard, _, _) in tensors.items():
        if (layer := layout.layer_of(name)) is not None:
            shard_of_layer.setdefault(layer, set()).add(shard)
    assert all(len(s) == 1 for s in shard_of_layer.values())
    order = [next(iter(shard_of_layer[k])) for k in sorted(shard_of_layer)]
    assert order == sorted(order)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "laguna" and config["architectures"] == ["LagunaForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": [0, 3], "pad_token_id": 1}


def test_router_bias_saved_nonzero(saved):
    tensors = read_all(saved[0])
    biases = [t for name, (_, t, _) in tensors.items() if name.endswith("e_score_correction_bias")]
    assert len(biases) == 4 and all(b.shape == (16,) and bool((b != 0).all()) for b in biases)


def test_unfused_experts_match_fused(saved, small_model):
    tensors = read_all(saved[0])
    fused = small_model.model.layers[2].mlp.experts
    inter = small_model.config.moe_intermediate_size
    for e in (0, 7, 15):
        p = f"model.layers.2.mlp.experts.{e}"
        assert torch.equal(tensors[f"{p}.gate_proj.weight"][1], fused.gate_up_proj[e, :inter])
        assert torch.equal(tensors[f"{p}.up_proj.weight"][1], fused.gate_up_proj[e, inter:])
        assert torch.equal(tensors[f"{p}.down_proj.weight"][1], fused.down_proj[e])


def test_state_dict_roundtrip(small_model):
    state = small_model.state_dict()
    back = toy_layout.upstream_to_hf_state_dict(toy_layout.hf_to_upstream_state_dict(state))
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_from_pretrained_logits_bit_identical(saved, small_model):
    out, _ = saved
    reloaded = LagunaForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[0, 2, 17, 200, 45, 3, 9, 9, 130, 250, 77, 5, 6, 299, 1, 0, 42, 43, 44, 45]])
    with torch.no_grad():
        expected = small_model(input_ids=ids).logits
        actual = reloaded(input_ids=ids).logits
    assert expected.dtype == torch.bfloat16
    assert torch.equal(expected, actual)
    # routing is exercised: sliding window (8) shorter than the input, several experts hit
    assert ids.shape[1] > small_model.config.sliding_window


def test_from_pretrained_default_dtype_is_bf16(saved):
    reloaded = LagunaForCausalLM.from_pretrained(saved[0])
    assert reloaded.dtype == torch.bfloat16


def test_saving_is_deterministic(tmp_path, small_model):
    for out in ("a", "b"):
        (tmp_path / out).mkdir()
        toy_layout.save_upstream_checkpoint(small_model, tmp_path / out, num_shards=2)
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_assign_shards_limits(small_model):
    tensors = toy_layout.hf_to_upstream_state_dict(small_model.state_dict())
    assert len(layout.assign_shards(tensors, 7)) == 7  # embed, 5 layers, norm+lm_head
    assert all(layout.assign_shards(tensors, 7))
    with pytest.raises(ValueError, match="exceeds"):
        layout.assign_shards(tensors, 8)
    (single,) = layout.assign_shards(tensors, 1)
    assert single[0] == "model.embed_tokens.weight"
    assert set(single[-2:]) == {"model.norm.weight", "lm_head.weight"}
    assert sorted(single) == sorted(tensors)
