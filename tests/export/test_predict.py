"""Structure prediction from config.json: the Laguna-S-2.1 release's published numbers, placement input."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from mixquant.export.metadata_estimate import estimate_metadata_bytes
from mixquant.export.placement import PlacementError, load_placement, parse_placement, parse_placement_counts
from mixquant.export.predict import (
    BF16,
    FORMATS,
    FP8,
    NVFP4,
    checkpoint_tensors,
    format_prediction,
    moe_layers,
    predict_structure,
    resolve_placement,
)
from mixquant.model.toy_layout import upstream_tensor_names

LAGUNA_S_CONFIG = Path(__file__).resolve().parents[2] / "data" / "models" / "laguna-s-2.1" / "config.json"
RELEASE_COUNTS = {NVFP4: 39, FP8: 3, BF16: 5}


@pytest.fixture(scope="module")
def laguna_s() -> dict:
    return json.loads(LAGUNA_S_CONFIG.read_text())


@pytest.fixture(scope="module")
def release(laguna_s) -> dict:
    return predict_structure(laguna_s, RELEASE_COUNTS, kv_cache_quant="FP8")


# ------------------------------------------------------------------------------ Laguna-S-2.1 config


def test_config_json_loads_as_laguna_config(laguna_s):
    from transformers import LagunaConfig

    config = LagunaConfig(**laguna_s)
    assert config.model_type == "laguna" and laguna_s["architectures"] == ["LagunaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (3072, 48, 128)
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert full == list(range(0, 48, 4)) and config.layer_types.count("sliding_attention") == 36
    assert config.num_attention_heads_per_layer == [48 if i % 4 == 0 else 72 for i in range(48)]
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * 47
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 10, 1024)
    assert (config.shared_expert_intermediate_size, config.intermediate_size) == (1024, 12288)
    assert config.moe_routed_scaling_factor == 2.5 and config.sliding_window == 512
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, [2, 24], 9)
    assert not config.tie_word_embeddings and config.vocab_size == 100352
    assert config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert config.rope_parameters["full_attention"]["attention_factor"] == 1.4852030263919618
    assert config.rope_parameters["sliding_attention"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
    }
    assert config.max_position_embeddings == 1048576


def test_parameter_counts_from_config(laguna_s, release):
    """117,561,977,600 parameters, 113,548,197,888 of them routed: by the predictor and by transformers'
    own module tree (instantiated on the meta device, no memory)."""
    import torch
    from transformers import LagunaConfig, LagunaForCausalLM

    assert release["parameters"] == {
        "total": 117_561_977_600,
        "routed": 113_548_197_888,
        "non_expert": 117_561_977_600 - 113_548_197_888,
    }
    with torch.device("meta"):
        model = LagunaForCausalLM(LagunaConfig(**laguna_s))
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 117_561_977_600
    assert sum(p.numel() for n, p in params.items() if ".mlp.experts." in n) == 113_548_197_888
    rotary = model.model.rotary_emb
    assert rotary.full_attention_attention_scaling == 1.4852030263919618
    assert rotary.sliding_attention_attention_scaling == 1.0


# -------------------------------------------------------------------------------- release numbers


def test_release_structure(release):
    assert release["tensors"] == {
        "routed": {NVFP4: 39 * 768 * 3, FP8: 3 * 768 * 3, BF16: 5 * 768},
        "non_expert": 673,
        "kv_scales": 96,
        "total": 101_377,
    }
    assert release["payload_bytes"] == release["bytes"]["total"] == 92_433_871_744
    assert release["bytes"]["routed"] == {
        NVFP4: 39 * 768 * 1_769_476,
        FP8: 3 * 768 * 3_145_736,
        BF16: 5 * 768 * 6_291_456,
    }
    assert release["bytes"]["kv_scales"] == 96 * 4
    assert release["bytes"]["non_expert"] == 2 * release["parameters"]["non_expert"]
    assert round(release["routed_effective_bits"], 4) == 5.9468
    assert release["routed_effective_bits"] == float(Fraction(39 * 9 + 2 * (3 * 8 + 5 * 16), 2 * 47))
    assert release["routed_effective_bits"] == pytest.approx(5.946808510638298, abs=1e-15)
    assert release["placement_counts"] == RELEASE_COUNTS and release["layer_formats"] is None
    assert release["kv_cache_quant"] == "FP8"


def test_bytes_per_routed_projection(release):
    per = release["bytes_per_routed_projection"]
    assert per[NVFP4] == dict.fromkeys(("gate_proj", "up_proj", "down_proj"), 1_769_476)
    assert per[FP8] == dict.fromkeys(("gate_proj", "up_proj", "down_proj"), 3_145_736)
    assert per[BF16] == dict.fromkeys(("gate_proj", "up_proj", "down_proj"), 6_291_456)
    assert release["tensors_per_routed_projection"] == {NVFP4: 3, FP8: 3, BF16: 1}


def test_kv_cache_quant_is_a_parameter(laguna_s, release):
    plain = predict_structure(laguna_s, RELEASE_COUNTS, kv_cache_quant=None)
    assert plain["tensors"]["kv_scales"] == 0 and plain["tensors"]["total"] == 101_377 - 96
    assert plain["payload_bytes"] == 92_433_871_744 - 384
    assert predict_structure(laguna_s, RELEASE_COUNTS)["tensors"] == release["tensors"]  # FP8 by default
    with pytest.raises(ValueError, match="kv_cache_quant"):
        predict_structure(laguna_s, RELEASE_COUNTS, kv_cache_quant="INT8")


def test_names_follow_the_upstream_layout(laguna_s):
    """All-BF16 prediction names == the upstream checkpoint's names; scales/KV names as ModelOpt writes."""
    formats, _ = resolve_placement(laguna_s, {BF16: 47})
    entries = checkpoint_tensors(laguna_s, formats, kv_cache_quant=None)
    assert sorted(e.name for e in entries) == sorted(upstream_tensor_names(laguna_s))
    formats, _ = resolve_placement(laguna_s, placement={1: NVFP4, 2: FP8})
    names = {e.name for e in checkpoint_tensors(laguna_s, formats, kv_cache_quant="FP8")}
    assert {
        "model.layers.1.mlp.experts.255.down_proj.weight_scale_2",
        "model.layers.2.mlp.experts.0.gate_proj.input_scale",
        "model.layers.47.mlp.experts.3.up_proj.weight",
        "model.layers.0.self_attn.k_proj.k_scale",
        "model.layers.47.self_attn.v_proj.v_scale",
    } <= names


def test_explicit_placement(laguna_s, release):
    placement = {layer: NVFP4 for layer in range(1, 40)} | {40: FP8, 41: FP8, 42: FP8}  # 43-47 absent: BF16
    report = predict_structure(laguna_s, placement=placement)
    for key in ("tensors", "bytes", "payload_bytes", "routed_effective_bits", "placement_counts"):
        assert report[key] == release[key], key
    assert report["layer_formats"]["1"] == NVFP4 and report["layer_formats"]["47"] == BF16
    assert list(report["layer_formats"]) == [str(layer) for layer in moe_layers(laguna_s)]
    both = predict_structure(laguna_s, RELEASE_COUNTS, placement)
    assert both["layer_formats"] == report["layer_formats"]
    assert "fp8=3" in format_prediction(report) and "101,377" in format_prediction(report)


def test_the_tallies_are_those_of_every_listed_tensor(laguna_s, release):
    """predict_structure counts each layer's projections once per format, times the experts: the same
    counts and bytes as the full list of the export's tensors (checkpoint_tensors)."""
    placement = {layer: NVFP4 for layer in range(1, 40)} | {40: FP8, 41: FP8, 42: FP8}
    entries = checkpoint_tensors(laguna_s, placement, kv_cache_quant="FP8")
    tensors = {fmt: sum(1 for e in entries if e.category == "routed" and e.format == fmt) for fmt in FORMATS}
    nbytes = {
        fmt: sum(e.nbytes for e in entries if e.category == "routed" and e.format == fmt) for fmt in FORMATS
    }
    assert release["tensors"]["routed"] == tensors and release["bytes"]["routed"] == nbytes
    assert release["tensors"]["total"] == len(entries) == 101377
    assert release["payload_bytes"] == sum(e.nbytes for e in entries)
    assert release["parameters"]["non_expert"] == sum(
        math.prod(e.shape) for e in entries if e.category == "non_expert"
    )


@pytest.mark.parametrize(
    ("counts", "placement", "message"),
    [
        (None, None, "give placement_counts or placement"),
        ({NVFP4: 39, FP8: 3, BF16: 4}, None, "sum to 46, but the model has 47 MoE layers"),
        ({"int4": 1}, None, "unknown formats"),
        (None, {0: NVFP4}, "without routed experts: [0]"),
        (None, {3: "fp4"}, "unknown format 'fp4'"),
        ({NVFP4: 47}, {1: FP8}, "placement has counts"),
    ],
)
def test_placement_errors(laguna_s, counts, placement, message):
    with pytest.raises(PlacementError) as info:
        predict_structure(laguna_s, counts, placement)
    assert message in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------- placement parsing


def test_parse_placement_counts():
    assert parse_placement_counts("nvfp4_w4a16=39,fp8=3,bf16=5") == RELEASE_COUNTS
    assert parse_placement_counts(" fp8 = 2 ") == {NVFP4: 0, FP8: 2, BF16: 0}
    assert list(parse_placement_counts("bf16=1,nvfp4_w4a16=2")) == list(FORMATS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("nvfp4_w4a16:39", "'nvfp4_w4a16:39' is not format=count"),
        ("nvfp4=39", "unknown format 'nvfp4'"),
        ("fp8=1,fp8=2", "fp8 given twice"),
        ("bf16=-1", "bf16=-1 is negative"),
        ("fp8=1,", "'' is not format=count"),
        ("fp8=x", "is not format=count"),
    ],
)
def test_parse_placement_counts_errors(text, message):
    with pytest.raises(PlacementError) as info:
        parse_placement_counts(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_load_placement(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"layers": {"2": FP8, "1": NVFP4, "10": BF16}, "metadata": {"by": "hand"}}))
    assert load_placement(path) == {1: NVFP4, 2: FP8, 10: BF16}
    assert list(load_placement(path)) == [1, 2, 10]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"layers": {"1": "fp8"}, "extra": 1}', "unknown top-level keys ['extra']"),
        ('{"placement": {}}', "unknown top-level keys"),
        ('{"layers": ["fp8"]}', "'layers' must be an object"),
        ('{"layers": {"one": "fp8"}}', "layer key 'one' is not a non-negative integer"),
        ('{"layers": {"1": "w4a16"}}', "layer 1: unknown format 'w4a16'"),
        ('{"layers": {"1": "fp8", "01": "bf16"}}', "layer 1 given twice"),
    ],
)
def test_load_placement_errors(tmp_path, content, message):
    path = tmp_path / "placement.json"
    path.write_text(content)
    with pytest.raises(PlacementError) as info:
        load_placement(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(PlacementError, match="cannot read placement"):
        load_placement(tmp_path / "missing.json")


def test_parse_placement_defaults_source_name():
    with pytest.raises(PlacementError, match=r"^placement: 'layers' must be an object"):
        parse_placement({"layers": None})


# ----------------------------------------------------------------------------- metadata estimate


def test_release_metadata_estimate(laguna_s):
    """export_hf_checkpoint's 10 GB shards give the release's 10 shards; headers + index are tens of MB."""
    formats, _ = resolve_placement(laguna_s, RELEASE_COUNTS)
    entries = checkpoint_tensors(laguna_s, formats, kv_cache_quant="FP8")
    estimate = estimate_metadata_bytes(entries)
    assert estimate["shards"] == 10
    assert 10_000_000 < estimate["shard_header_bytes"] < 15_000_000
    assert 8_000_000 < estimate["index_bytes"] < 11_000_000
    assert estimate["total"] == estimate["shard_header_bytes"] + estimate["index_bytes"]
