"""The committed trained instances of the MoE families beyond Laguna (mixquant.model.instances,
data/instances/): content-pinned, trained (held-out loss far below uniform), loadable by transformers as
their family's own class, with the toy's outlier channels; and the build itself on a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixquant.calibration.disjoint import read_jsonl
from mixquant.model.families import architecture
from mixquant.model.fetch import identity_sha256, local_dir_identity
from mixquant.model.instances import (
    INSTANCE_GEOMETRY,
    INSTANCE_MODEL_TYPES,
    build_family_instance,
    read_pins,
)

REPO = Path(__file__).resolve().parents[2]
INSTANCES = REPO / "data" / "instances"
CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
}


def test_every_family_beyond_laguna_has_a_pinned_instance():
    pins = read_pins(INSTANCES)
    assert sorted(pins) == sorted(INSTANCE_MODEL_TYPES) == sorted(CLASSES)
    for model_type, pin in pins.items():
        assert identity_sha256(local_dir_identity(INSTANCES / model_type)) == pin, model_type


@pytest.mark.parametrize("model_type", INSTANCE_MODEL_TYPES)
def test_the_instance_is_trained_and_has_its_familys_shape(model_type):
    directory = INSTANCES / model_type
    report = json.loads((directory / "training_report.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [CLASSES[model_type]]
    loss = report["loss"]
    assert loss["heldout"] < 0.55 * loss["uniform"], loss  # uniform: ln 2048 = 7.62 nats
    assert report["training"]["steps"] == 320  # the toy's recipe
    assert report["logits_bit_identical_after_reload"] is True
    arch = architecture(directory)
    assert len(arch.moe_layers) == 8
    assert list(arch.moe_layers) == report["moe_layers"]
    assert [o["layer"] for o in report["outliers"]] == [arch.moe_layers[i] for i in (1, 4, 6)]
    for geometry_key, value in INSTANCE_GEOMETRY[model_type].items():
        if geometry_key in config:
            assert config[geometry_key] == value, geometry_key


def test_outlier_channels_make_tiny_down_columns(tmp_path):
    """An outlier layer's down_proj columns of the chosen channels are 2^-8 of the others' scale."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(INSTANCES / "qwen3_moe", dtype=torch.bfloat16)
    report = json.loads((INSTANCES / "qwen3_moe" / "training_report.json").read_text())
    entry = report["outliers"][0]
    experts = model.model.layers[entry["layer"]].mlp.experts
    channels = entry["channels_per_expert"][0]
    down = experts.down_proj[0].float().abs()
    others = [c for c in range(down.shape[1]) if c not in channels]
    assert down[:, channels].mean() < down[:, others].mean() / 16


@pytest.mark.parametrize("model_type", ["qwen3_moe", "minimax_m2"])
def test_the_build_trains_saves_and_reloads(tmp_path, model_type):
    """The build on 3 steps: a softmax router with the family's load-balancing loss (Qwen3-MoE) and a
    correction bias held on the block (MiniMax-M2); the reload check is part of the build."""
    conversations = [
        row["messages"] for row in read_jsonl(REPO / "data" / "corpus" / "python-stdlib-chat.jsonl")
    ]
    out = tmp_path / model_type
    report = build_family_instance(
        model_type,
        out,
        conversations=conversations[:400],
        tokenizer_dir=REPO / "data" / "toy-laguna",
        training={"steps": 3, "eval_sequences": 8, "batch_size": 8},
        threads=1,
        progress=False,
    )
    assert report["logits_bit_identical_after_reload"]
    assert (report["aux_loss_coef"] > 0) == (model_type == "qwen3_moe")
    if model_type == "minimax_m2":
        assert report["router_bias"]["nonzero"] > 0  # the bias moved
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="not empty"):
        build_family_instance(
            model_type, out, conversations=conversations, tokenizer_dir=REPO / "data" / "toy-laguna"
        )
