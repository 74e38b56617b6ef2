"""GPTQ rounding inside quantize_layer (mixquant.quantize.gptq, .expert_inputs) on the trained toy: the
recorded expert inputs are what the router sent each expert, GPTQ keeps every scale and tensor of
round-to-nearest, experts with too few tokens fall back to RTN (counted and listed), and bad inputs stop
with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mixquant.calibration.disjoint import read_jsonl
from mixquant.calibration.sample import sample_calibration
from mixquant.quantize.activations import collect_activation_stats
from mixquant.quantize.expert_inputs import HIDDEN, ROUTING, collect_expert_inputs, expert_inputs_file
from mixquant.quantize.layer import QuantizeInputError, quantize_layer
from safetensors.torch import load_file

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "data" / "toy-laguna"
RTN = {"calibration": "fp8_sweep"}
GPTQ = {"damping": 0.01, "block_size": 128, "order": "natural", "min_tokens": 64}


def gptq_params(**settings) -> dict:
    return {"calibration": "fp8_sweep", "rounding": "gptq", "gptq": {**GPTQ, **settings}}


@pytest.fixture(scope="module")
def calibration():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOY))
    corpus = [row["messages"] for row in read_jsonl(REPO / "data" / "corpus" / "python-stdlib-chat.jsonl")]
    return sample_calibration(corpus, tokenizer, num_samples=16, seq_len=128, seed=0)


@pytest.fixture(scope="module")
def expert_inputs(tmp_path_factory, calibration):
    directory = tmp_path_factory.mktemp("expert_inputs")
    summary = collect_expert_inputs(TOY, calibration, directory, batch_size=8, progress=False)
    return directory, summary


def test_expert_inputs_are_what_the_router_sent_each_expert(expert_inputs, calibration):
    directory, summary = expert_inputs
    stats = collect_activation_stats(TOY, calibration, batch_size=8, progress=False)
    assert summary["moe_layers"] == list(range(1, 9))
    for layer in summary["moe_layers"]:
        tensors = load_file(str(expert_inputs_file(directory, layer)))
        assert tensors[HIDDEN].shape == (calibration.numel(), 128)
        assert tensors[HIDDEN].dtype == torch.bfloat16
        assert tensors[ROUTING].shape == (calibration.numel(), 2)
        # the same forward as the activation statistics: the same routing and the same input ranges
        assert summary["routed"][str(layer)] == stats["routed_tokens"][layer].tolist()
        per_expert = stats["gate_up_input_amax_per_expert"][layer]
        for expert in (0, 7):
            rows = tensors[HIDDEN][(tensors[ROUTING] == expert).any(-1)]
            assert rows.abs().max().float() == per_expert[expert]


def test_gptq_keeps_every_tensor_and_scale_of_round_to_nearest(expert_inputs):
    directory, _ = expert_inputs
    rtn, _ = quantize_layer(TOY, 2, "nvfp4_w4a16", RTN)
    gptq, audit = quantize_layer(
        TOY, 2, "nvfp4_w4a16", gptq_params(), expert_inputs=expert_inputs_file(directory, 2)
    )
    assert sorted(rtn) == sorted(gptq)
    for name, tensor in rtn.items():
        assert gptq[name].dtype == tensor.dtype and gptq[name].shape == tensor.shape
        if "scale" in name:
            assert torch.equal(gptq[name], tensor), name
    changed = [name for name in rtn if name.endswith(".weight") and not torch.equal(rtn[name], gptq[name])]
    assert len(changed) > 40  # the codes moved on most of the 48 weights
    assert audit["rounding"] == "gptq" and audit["gptq"]["settings"] == GPTQ
    error = audit["gptq"]["calibration_output_error"]
    assert error["ratio"] < 0.7
    assert all(p["gptq"] < p["rtn"] for p in error["projections"].values())
    assert audit["gptq"]["rtn_fallback_experts"] == []


def test_experts_with_too_few_tokens_are_rounded_to_nearest_and_listed(expert_inputs):
    directory, summary = expert_inputs
    counts = summary["routed"]["3"]
    threshold = sorted(counts)[4]  # the 4 least-routed experts fall back
    rtn, _ = quantize_layer(TOY, 3, "nvfp4_w4a16", RTN)
    gptq, audit = quantize_layer(
        TOY,
        3,
        "nvfp4_w4a16",
        gptq_params(min_tokens=threshold),
        expert_inputs=expert_inputs_file(directory, 3),
    )
    fallback = [e for e, n in enumerate(counts) if n < threshold]
    assert audit["gptq"]["rtn_fallback_experts"] == fallback
    assert audit["gptq"]["rtn_fallback"] == len(fallback) == 4
    assert audit["gptq"]["experts_gptq"] == 12
    assert audit["gptq"]["tokens_per_expert"] == counts
    for e in range(16):
        names = [n for n in rtn if f".experts.{e}." in n]
        same = all(torch.equal(rtn[n], gptq[n]) for n in names)
        assert same == (e in fallback), e


def test_gptq_needs_the_layers_expert_inputs_and_its_settings():
    with pytest.raises(QuantizeInputError, match="expert inputs"):
        quantize_layer(TOY, 1, "nvfp4_w4a16", gptq_params())
    with pytest.raises(QuantizeInputError, match="gptq settings"):
        quantize_layer(TOY, 1, "nvfp4_w4a16", {"calibration": "fp8_sweep", "rounding": "gptq"})
    with pytest.raises(QuantizeInputError, match="rounding must be one of"):
        quantize_layer(TOY, 1, "nvfp4_w4a16", {"calibration": "fp8_sweep", "rounding": "stochastic"})
