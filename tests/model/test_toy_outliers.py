"""The toy's outlier layers: the BF16 function is unchanged bit for bit, NVFP4 loses the tiny columns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from mixquant.model.toy import apply_outliers
from test_toy_build import SHORT_TRAINING, build, stdlib_conversations
from transformers import LagunaForCausalLM

OUTLIERS = {"seed": 0, "layers": [{"layer": 2, "channels": 3, "log2_scale": 8}]}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("outliers")
    conversations = stdlib_conversations()
    plain = build(root / "plain", conversations)
    from mixquant.model.toy_build import build_toy_model

    (root / "outliers").mkdir()
    report = build_toy_model(
        root / "outliers",
        conversations=conversations,
        arch={},
        tokenizer_spec={"vocab_size": 512},
        training=SHORT_TRAINING,
        seed=0,
        outliers=OUTLIERS,
        threads=2,
        num_shards=2,
        progress=False,
    )
    return root, plain, report


def test_outliers_keep_the_bf16_logits_bit_for_bit(builds):
    root, _, report = builds
    ids = torch.arange(2, 200).unsqueeze(0)
    models = [
        LagunaForCausalLM.from_pretrained(root / n, dtype=torch.bfloat16).eval()
        for n in ("plain", "outliers")
    ]
    with torch.no_grad():
        plain, changed = (m(input_ids=ids).logits for m in models)
    assert torch.equal(plain, changed)
    (entry,) = report["outliers"]
    assert entry["layer"] == 2 and len(entry["channels_per_expert"]) == 16
    assert all(len(set(channels)) == 3 for channels in entry["channels_per_expert"])
    written = json.loads((root / "outliers" / "training_report.json").read_text())["outliers"]
    assert written == report["outliers"]


def test_outlier_rows_and_columns_are_exact_powers_of_two(builds):
    root, _, report = builds
    plain, changed = (
        LagunaForCausalLM.from_pretrained(root / n, dtype=torch.bfloat16) for n in ("plain", "outliers")
    )
    a, b = plain.model.layers[2].mlp.experts, changed.model.layers[2].mlp.experts
    inter = a.down_proj.shape[-1]
    for expert, channels in enumerate(report["outliers"][0]["channels_per_expert"]):
        others = sorted(set(range(inter)) - set(channels))
        assert torch.equal(
            b.gate_up_proj[expert, inter + torch.tensor(channels)],
            a.gate_up_proj[expert, inter + torch.tensor(channels)] * 256,
        )
        assert torch.equal(b.down_proj[expert][:, channels], a.down_proj[expert][:, channels] / 256)
        assert torch.equal(b.down_proj[expert][:, others], a.down_proj[expert][:, others])
    # other layers untouched
    assert torch.equal(
        plain.model.layers[3].mlp.experts.down_proj, changed.model.layers[3].mlp.experts.down_proj
    )


def test_nvfp4_zeroes_the_tiny_columns_and_fp8_keeps_them(builds):
    from mixquant.formats.dequant import dequantize_tensors
    from mixquant.quantize.layer import quantize_layer

    root, _, report = builds
    channels = report["outliers"][0]["channels_per_expert"][0]
    tensors, _ = quantize_layer(root / "outliers", 2, "nvfp4_w4a16", {"calibration": "max"})
    down = dequantize_tensors(tensors, torch.float32)["model.layers.2.mlp.experts.0.down_proj.weight"]
    assert down[:, channels].abs().max() == 0  # the outlier channels' contribution is gone under NVFP4
    assert down.abs().sum() > 0
    amax = {"gate_up": torch.tensor(1.0), "down": torch.tensor(1.0)}
    tensors, _ = quantize_layer(
        root / "outliers", 2, "fp8", {"weight_calibration": "max"}, activation_amax=amax
    )
    down = dequantize_tensors(tensors, torch.float32)["model.layers.2.mlp.experts.0.down_proj.weight"]
    assert (down[:, channels] != 0).float().mean() > 0.9


def test_outliers_on_a_dense_layer_are_refused():
    model = LagunaForCausalLM._from_config(
        __import__("transformers").LagunaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=64,
            mlp_layer_types=["dense", "sparse"],
        )
    )
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        apply_outliers(model, {"layers": [{"layer": 0, "channels": 1, "log2_scale": 4}]})


def test_build_toy_cli_refuses_an_existing_directory_and_pin_model_prints_the_pin(tmp_path, builds):
    root, _, _ = builds
    cli = [sys.executable, "-m", "mixquant.cli"]
    (tmp_path / "exists").mkdir()
    result = subprocess.run([*cli, "build-toy", str(tmp_path / "exists")], capture_output=True, text=True)
    assert result.returncode != 0 and "exists: give a new directory" in result.stderr
    pin = subprocess.run([*cli, "pin-model", str(root / "plain")], capture_output=True, text=True, check=True)
    from mixquant.model.fetch import identity_sha256, local_dir_identity

    assert pin.stdout.strip() == identity_sha256(local_dir_identity(root / "plain"))
