"""The block-FP8 source dequantization against the publisher's formula, written here independently.

DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant_kernel`` (run by ``inference/fp8_cast_bf16.py`` with
bf16 as the default dtype) defines the BF16 source: per 128x128 block, ``bf16(f32(x) * scale_inv)``, the
partial edge blocks with their own scale. :func:`publisher_dequant` below is that definition in its
plainest form, one block at a time, so the library's vectorized version is checked against it bit for bit
-- on small synthetic checkpoints whose shapes are not multiples of 128, and on a tiny random DeepSeek-V3
whose dequantized checkpoint transformers must load. transformers' own fine-grained FP8 dequantization is
cross-checked too where it is defined for the shape (its load path infers the block from the scale grid,
which is wrong for edge blocks; its backward-pass helper is not).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from mixquant.checkpoint.fp8_source import (
    block_size,
    dequantize_block_fp8,
    dequantize_checkpoint,
    is_block_fp8,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BLOCK = (128, 128)
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
# (shard of the weight, shard of its scale, shape): edge blocks in both dims, one aligned, one scale stored
# in the other shard (fp8_cast_bf16.py looks scales up across shards too)
FP8_WEIGHTS = {
    "model.layers.0.self_attn.q_proj.weight": (SHARD_1, SHARD_1, (200, 300)),
    "model.layers.0.mlp.gate_proj.weight": (SHARD_1, SHARD_2, (130, 300)),
    "model.layers.0.mlp.down_proj.weight": (SHARD_2, SHARD_2, (300, 130)),
    "model.layers.0.self_attn.o_proj.weight": (SHARD_2, SHARD_2, (256, 128)),
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (SHARD_2, SHARD_2, (40, 64)),
}
OTHER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n',
    "tokenizer_config.json": '{"bos_token": "<s>", "model_max_length": 64}\n',
    "generation_config.json": '{"bos_token_id": 0, "eos_token_id": 1}\n',
    "modeling_deepseek.py": "# remote code travels with the checkpoint\n",
}


# ------------------------------------------------------------------------ the publisher, independently


def publisher_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """DeepSeek-V3 weight_dequant, block by block: y = bf16(f32(x) * s[bi, bj]), partial edge blocks."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    for bi in range(math.ceil(rows / block[0])):
        for bj in range(math.ceil(cols / block[1])):
            r = slice(bi * block[0], min((bi + 1) * block[0], rows))
            c = slice(bj * block[1], min((bj + 1) * block[1], cols))
            x = weight[r, c].to(torch.float32)
            s = scale_inv[bi, bj].to(torch.float32)
            out[r, c] = (x * s).to(torch.bfloat16)
    return out


def publisher_quant(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 weight_quant, block by block: s = amax / 448, x_fp8 = (x / s) as float8_e4m3fn."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(grid, dtype=torch.float32)
    for bi in range(grid[0]):
        for bj in range(grid[1]):
            r = slice(bi * block[0], min((bi + 1) * block[0], rows))
            c = slice(bj * block[1], min((bj + 1) * block[1], cols))
            x = weight[r, c].to(torch.float32)
            s = x.abs().max().clamp(min=1e-12) / 448.0
            quantized[r, c] = (x / s).to(torch.float8_e4m3fn)
            scale_inv[bi, bj] = s
    return quantized, scale_inv


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-for-bit comparison (nan == nan, -0 != +0)."""
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


# --------------------------------------------------------------------------- synthetic checkpoints


def synthetic_shards(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Two shards in DeepSeek's layout: FP8 weights + float32 ``_scale_inv``, bf16 norms and embeddings,
    and a float32 router weight (MiniMax-M2 keeps its gate in float32) that must come through unchanged."""
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {SHARD_1: {}, SHARD_2: {}}
    for name, (weight_shard, scale_shard, shape) in FP8_WEIGHTS.items():
        weight = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 0.05
        quantized, scale_inv = publisher_quant(weight)
        shards[weight_shard][name] = quantized
        shards[scale_shard][name + "_scale_inv"] = scale_inv
    shards[SHARD_1]["model.embed_tokens.weight"] = torch.randn(64, 300, generator=gen).to(torch.bfloat16)
    shards[SHARD_1]["model.layers.0.input_layernorm.weight"] = torch.rand(300, generator=gen).bfloat16()
    shards[SHARD_2]["model.layers.0.mlp.gate.weight"] = torch.randn(8, 300, generator=gen)
    shards[SHARD_2]["model.norm.weight"] = torch.rand(300, generator=gen).to(torch.bfloat16)
    shards[SHARD_2]["lm_head.weight"] = torch.randn(64, 300, generator=gen).to(torch.bfloat16)
    return shards


def write_checkpoint(
    path: Path, shards: dict[str, dict[str, torch.Tensor]], quantization_config=QUANT_CONFIG
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
    }
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in OTHER_FILES.items():
        (path / name).write_text(text)
    return path


@pytest.fixture
def fp8_checkpoint(tmp_path):
    return write_checkpoint(tmp_path / "fp8", synthetic_shards())


def one_line_error(call, *culprits: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for culprit in culprits:
        assert culprit in message, message
    return message


# ------------------------------------------------------------------------------------------- tests


def test_output_is_the_publisher_dequantization(fp8_checkpoint, tmp_path):
    source = {name: t for tensors in synthetic_shards().values() for name, t in tensors.items()}
    out = tmp_path / "bf16"
    summary = dequantize_checkpoint(fp8_checkpoint, out)

    expected_names = {name for name in source if not name.endswith("_scale_inv")}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == sorted(expected_names)
    for name, file in index["weight_map"].items():
        assert file == (FP8_WEIGHTS[name][0] if name in FP8_WEIGHTS else _shard_of(name))
    written = {}
    for file in (SHARD_1, SHARD_2):
        with safe_open(str(out / file), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        written.update(load_file(str(out / file)))
    assert set(written) == expected_names
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    for name, tensor in written.items():
        if name in FP8_WEIGHTS:
            assert tensor.dtype == torch.bfloat16
            expected = publisher_dequant(source[name], source[name + "_scale_inv"])
            assert torch.equal(bits(tensor), bits(expected)), name
        else:
            assert tensor.dtype == source[name].dtype  # the float32 router stays float32
            assert torch.equal(bits(tensor), bits(source[name])), name

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    for name in OTHER_FILES:
        assert (out / name).read_bytes() == (fp8_checkpoint / name).read_bytes()
    assert summary["tensors_dequantized"] == summary["scales_dropped"] == len(FP8_WEIGHTS)
    assert summary["tensors_copied"] == len(expected_names) - len(FP8_WEIGHTS)
    assert sorted(summary["files_copied"]) == sorted(OTHER_FILES)
    assert summary["bytes_out"] == index["metadata"]["total_size"]
    assert summary["bytes_in"] == sum(t.numel() * t.element_size() for t in source.values())


def _shard_of(name: str) -> str:
    return next(file for file, tensors in synthetic_shards().items() if name in tensors)


def test_two_runs_write_identical_bytes(fp8_checkpoint, tmp_path):
    dequantize_checkpoint(fp8_checkpoint, tmp_path / "a")
    dequantize_checkpoint(fp8_checkpoint, tmp_path / "b", progress=True)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*"))
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*"))
    assert files_a == files_b
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


@pytest.mark.parametrize(
    ("shape", "block"),
    [((200, 300), (128, 128)), ((1, 1), (128, 128)), ((256, 384), (128, 128)), ((70, 45), (32, 16))],
)
def test_tensor_dequantization_matches_the_loop_form(shape, block):
    gen = torch.Generator().manual_seed(1)
    quantized, scale_inv = publisher_quant(torch.randn(shape, generator=gen), block)
    result = dequantize_block_fp8(quantized, scale_inv, block)
    assert result.dtype == torch.bfloat16 and result.shape == quantized.shape
    assert torch.equal(bits(result), bits(publisher_dequant(quantized, scale_inv, block)))


def test_stacked_experts_dequantize_one_matrix_at_a_time():
    gen = torch.Generator().manual_seed(2)
    pairs = [publisher_quant(torch.randn(130, 200, generator=gen)) for _ in range(3)]
    stacked = dequantize_block_fp8(
        torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]), BLOCK
    )
    for expert, (quantized, scale_inv) in enumerate(pairs):
        assert torch.equal(bits(stacked[expert]), bits(publisher_dequant(quantized, scale_inv)))


def test_tensor_errors_are_one_line():
    weight = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    one_line_error(
        lambda: dequantize_block_fp8(weight, torch.ones(2, 2), BLOCK, name="q.weight"), "q.weight", "[2, 3]"
    )
    one_line_error(lambda: dequantize_block_fp8(weight.float(), torch.ones(2, 3), BLOCK), "not float8")
    double = torch.ones(2, 3, dtype=torch.float64)
    one_line_error(lambda: dequantize_block_fp8(weight, double, BLOCK), "float64")
    one_line_error(lambda: dequantize_block_fp8(weight, torch.ones(2, 3), (128, 0)), "block")
    one_line_error(lambda: dequantize_block_fp8(weight[0], torch.ones(3), BLOCK), "not a matrix")


def test_matches_transformers_fine_grained_fp8_dequantization():
    """transformers 5.24 has two dequantizations (integrations/finegrained_fp8.py): the backward-pass
    ``_dequantize_fp8_weight`` (lines 285-303) gives the publisher's bits when run in float32 and rounded
    once; the load-time ``Fp8Dequantize._dequantize_one`` (lines 1130-1173) does too whenever the block
    tiles the weight exactly. (It infers the block as weight // scale grid, so a partial edge block --
    DeepSeek-V3's kv_a_proj_with_mqa [576, 7168] -- raises there, or silently uses the wrong block.)"""
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    except ImportError as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers' fine-grained FP8 dequantization not importable: {exc}")
    gen = torch.Generator().manual_seed(3)
    for shape in ((200, 300), (130, 300), (256, 384)):
        quantized, scale_inv = publisher_quant(torch.randn(shape, generator=gen) * 0.02)
        ours = dequantize_block_fp8(quantized, scale_inv, BLOCK)
        theirs = _dequantize_fp8_weight(quantized, scale_inv, list(BLOCK), torch.float32).to(torch.bfloat16)
        assert torch.equal(bits(ours), bits(theirs)), shape
        if shape[0] % BLOCK[0] == 0 and shape[1] % BLOCK[1] == 0:
            loaded = Fp8Dequantize(None)._dequantize_one(quantized, scale_inv, output_dtype=torch.bfloat16)
            assert torch.equal(bits(ours), bits(loaded)), shape


def _drop(shards, name):
    for tensors in shards.values():
        tensors.pop(name, None)
    return shards


def _set(shards, name, value):
    for tensors in shards.values():
        if name in tensors:
            tensors[name] = value
    return shards


Q = "model.layers.0.self_attn.q_proj.weight"
GATE_SCALE = "model.layers.0.mlp.gate_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("mutate", "culprits"),
    [
        (lambda s: _drop(s, Q + "_scale_inv"), [Q, "without its scale"]),
        (lambda s: _drop(s, Q), [Q + "_scale_inv", "without its weight"]),
        (lambda s: _set(s, GATE_SCALE, torch.ones(1, 3)), [GATE_SCALE, "[1, 3]", "[2, 3]"]),
        (
            lambda s: _set(s, GATE_SCALE, torch.tensor([[1.0, math.inf, 1.0], [1.0, 1.0, 1.0]])),
            [GATE_SCALE, "non-finite"],
        ),
        (
            lambda s: _set(s, Q + "_scale_inv", torch.tensor([[1.0, 1.0, 1.0], [math.nan, 1.0, 1.0]])),
            [Q, "non-finite"],
        ),
        (lambda s: _set(s, Q, torch.zeros(200, 300, dtype=torch.bfloat16)), [Q, "not FP8"]),
        (lambda s: _set(s, Q, torch.zeros(200, 300).to(torch.float8_e5m2)), [Q, "e4m3"]),
        (
            lambda s: _set(s, Q + "_scale_inv", torch.ones(2, 3, dtype=torch.float64)),
            [Q + "_scale_inv", "F64"],
        ),
    ],
    ids=[
        "no-scale",
        "no-weight",
        "scale-shape",
        "inf-scale",
        "nan-scale",
        "bf16-weight",
        "e5m2",
        "f64-scale",
    ],
)
def test_checkpoint_errors_name_the_tensor_and_write_nothing(tmp_path, mutate, culprits):
    source = write_checkpoint(tmp_path / "fp8", mutate(synthetic_shards()))
    one_line_error(lambda: dequantize_checkpoint(source, tmp_path / "out"), *culprits)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"weight_block_size": None}, "weight_block_size"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [128, 0]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "compressed-tensors"}, "quant_method"),
        ({"fmt": "e5m2"}, "fmt"),
        ({"scale_fmt": "e4m3"}, "scale_fmt"),
        ({"expert_dtype": "fp4"}, "expert_dtype"),
    ],
)
def test_unsupported_quantization_configs_name_the_field(tmp_path, change, field):
    quant = {k: v for k, v in {**QUANT_CONFIG, **change}.items() if v is not None}
    one_line_error(lambda: is_block_fp8({"quantization_config": quant}), f"quantization_config.{field}")
    source = write_checkpoint(tmp_path / "fp8", synthetic_shards(), quantization_config=quant)
    one_line_error(lambda: dequantize_checkpoint(source, tmp_path / "out"), f"quantization_config.{field}")


def test_supported_quantization_configs():
    assert is_block_fp8({"quantization_config": QUANT_CONFIG})
    assert block_size({"quantization_config": QUANT_CONFIG}) == (128, 128)
    minimax = {  # MiniMax-M2's quantization_config
        "activation_scheme": "dynamic",
        "fmt": "float8_e4m3fn",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }
    assert block_size({"quantization_config": minimax}) == (128, 128)
    assert block_size({"quantization_config": {**QUANT_CONFIG, "scale_fmt": "ue8m0"}}) == (128, 128)  # V3.1
    assert not is_block_fp8({"torch_dtype": "bfloat16"})


def test_refuses_a_plain_checkpoint_and_a_used_output_directory(tmp_path):
    plain = write_checkpoint(tmp_path / "plain", synthetic_shards(), quantization_config=None)
    one_line_error(lambda: dequantize_checkpoint(plain, tmp_path / "out"), "no quantization_config")
    source = write_checkpoint(tmp_path / "fp8", synthetic_shards())
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "stale.safetensors").write_bytes(b"")
    one_line_error(lambda: dequantize_checkpoint(source, tmp_path / "used"), "not empty")
    one_line_error(lambda: dequantize_checkpoint(source, source / "bf16"), "inside")


# ------------------------------------------------------------------------------- a tiny DeepSeek-V3

_QUANTIZED_PROJECTION = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def test_tiny_deepseek_v3_dequantizes_into_a_loadable_bf16_checkpoint(tmp_path):
    """A random DeepSeek-V3 (MLA, dense layer 0, 8 routed experts) saved by transformers, its projections
    rewritten to block FP8 as DeepSeek publishes them, dequantized: transformers loads it without missing
    or unexpected keys and every weight is the publisher's dequantization of the FP8 tensors (edge blocks
    included: the dense MLP is 200 wide)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=200,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    bf16_dir, fp8_dir, out_dir = tmp_path / "bf16", tmp_path / "fp8", tmp_path / "out"
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(bf16_dir, max_shard_size="100KB")

    index = json.loads((bf16_dir / "model.safetensors.index.json").read_text())
    fp8_dir.mkdir()
    source: dict[str, torch.Tensor] = {}
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(bf16_dir / file))
        for name in sorted(tensors):
            if _QUANTIZED_PROJECTION.match(name):
                tensors[name], tensors[name + "_scale_inv"] = publisher_quant(tensors[name])
        save_file(tensors, str(fp8_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        source.update(tensors)
    (fp8_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    fp8_config = json.loads((bf16_dir / "config.json").read_text())
    fp8_config["quantization_config"] = QUANT_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(fp8_config))
    (fp8_dir / "generation_config.json").write_bytes((bf16_dir / "generation_config.json").read_bytes())
    fp8_names = [n for n in source if _QUANTIZED_PROJECTION.match(n)]
    assert any(source[n + "_scale_inv"].numel() > 1 for n in fp8_names)  # multi-block, with edges

    summary = dequantize_checkpoint(fp8_dir, out_dir)
    assert summary["tensors_dequantized"] == len(fp8_names)
    model, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    def expected(name):
        if name in fp8_names:
            return publisher_dequant(source[name], source[name + "_scale_inv"])
        return source[name]

    checked = 0
    for name, param in model.state_dict().items():
        fused = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if fused:  # transformers fuses the per-expert weights: gate_up_proj[e] = [gate; up]
            prefix, kind = fused.groups()
            assert param.dtype == torch.bfloat16, name
            for expert in range(config.n_routed_experts):
                parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
                want = torch.cat([expected(f"{prefix}.{expert}.{part}.weight") for part in parts])
                assert torch.equal(bits(param[expert]), bits(want)), f"{name}[{expert}]"
                checked += len(parts)
        else:
            # the router transformers keeps in float32 (_keep_in_fp32_modules_strict) widens bf16 exactly
            in_fp32 = any(part in name for part in model._keep_in_fp32_modules_strict)
            assert param.dtype == (torch.float32 if in_fp32 else torch.bfloat16), name
            assert torch.equal(bits(param), bits(expected(name).to(param.dtype))), name
            checked += 1
    assert checked == len(source) - len(fp8_names)  # every checkpoint tensor but the scales


def test_single_file_checkpoint_without_index(tmp_path):
    shards = synthetic_shards()
    source = write_checkpoint(tmp_path / "fp8", {"model.safetensors": {**shards[SHARD_1], **shards[SHARD_2]}})
    (source / "model.safetensors.index.json").unlink()
    summary = dequantize_checkpoint(source, tmp_path / "out")
    assert summary["shards"] == 1 and summary["tensors_dequantized"] == len(FP8_WEIGHTS)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(
        bits(written[Q]), bits(publisher_dequant(shards[SHARD_1][Q], shards[SHARD_1][Q + "_scale_inv"]))
    )
