"""Checkpoint audit on real ModelOpt 0.47 exports of a small random Laguna (all three routed formats).

The audit (headers only) must agree with the config-only prediction and with a count done here straight
from ``safetensors.safe_open``; broken checkpoints fail with one line naming the file.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import shutil
import warnings
from collections import Counter

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt  # noqa: E402
import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.export import predict  # noqa: E402
from mixquant.export.inspect import CheckpointInspectionError, inspect_checkpoint  # noqa: E402
from mixquant.export.inspect_checks import classify_projection  # noqa: E402
from mixquant.export.inspect_text import format_inspection  # noqa: E402
from mixquant.export.metadata_estimate import estimate_metadata_bytes  # noqa: E402
from mixquant.export.predict import (  # noqa: E402
    BF16,
    FP8,
    NVFP4,
    checkpoint_tensors,
    predict_structure,
)
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.quantize import reference  # noqa: E402
from mixquant.quantize.reference import modelopt_placement_quant_cfg, modelopt_reference_export  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_LAYERS = 5
NUM_EXPERTS = 4
PLACEMENT = {1: NVFP4, 2: FP8, 3: BF16}  # layer 4 absent -> BF16
JSON_FILES = ("config.json", "generation_config.json", "hf_quant_config.json")


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def toy_model(make_config) -> LagunaForCausalLM:
    config = make_config(vocab_size=64, num_hidden_layers=NUM_LAYERS, num_experts=NUM_EXPERTS)
    torch.manual_seed(0)
    model = LagunaForCausalLM(config)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(4, 64, (2, 8), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def source(tmp_path_factory, small_laguna_config):
    out = tmp_path_factory.mktemp("src")
    toy_layout.save_upstream_checkpoint(toy_model(small_laguna_config), out, num_shards=1)
    return out


@pytest.fixture(scope="module")
def export(source, calibration_ids, tmp_path_factory):
    """ModelOpt's own export (single model.safetensors) of the toy with NVFP4 / FP8 / BF16 layers."""
    out = tmp_path_factory.mktemp("export")
    with quiet():
        modelopt_reference_export(
            source, calibration_ids, dict(PLACEMENT), out, nvfp4_algorithm="max", fp8_weight_algorithm="max"
        )
    return out


@pytest.fixture(scope="module")
def kv_export(source, calibration_ids, tmp_path_factory):
    """The same placement plus ModelOpt's FP8 KV-cache quantizers (FP8_KV_CFG), exported by ModelOpt."""
    out = tmp_path_factory.mktemp("export_kv")
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16, experts_implementation="eager")
    quant_cfg, _ = modelopt_placement_quant_cfg(PLACEMENT, nvfp4_algorithm="max", fp8_weight_algorithm="max")
    quant_cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    from modelopt.torch.export import export_hf_checkpoint

    with quiet(), cpu_nvfp4_fake_quant(), torch.no_grad():
        mtq.quantize(model, quant_cfg, forward_loop=lambda m: m(input_ids=calibration_ids, use_cache=False))
        export_hf_checkpoint(model, export_dir=out)
    return out


# Quantization beyond the routed experts, as ModelOpt's auto_quantize or a hand-written recipe makes it:
# (quantizer wildcard, weight format, with a static FP8 input quantizer)
NON_EXPERT_RECIPE = (
    ("lm_head", FP8, True),
    ("*self_attn.q_proj", NVFP4, False),
    ("*self_attn.o_proj", FP8, True),
    ("*shared_expert*", NVFP4, False),
    ("model.layers.0.mlp.*", FP8, True),  # the dense layer's MLP
)


@pytest.fixture(scope="module")
def everything_export(source, calibration_ids, tmp_path_factory):
    """ModelOpt's own export of the placement plus an FP8 lm_head, NVFP4 / FP8 attention projections,
    NVFP4 shared experts and an FP8 dense MLP."""
    from mixquant.formats.nvfp4 import nvfp4_w4a16_static_config
    from mixquant.quantize.reference import _preset_quantizer_cfg
    from modelopt.torch.export import export_hf_checkpoint

    out = tmp_path_factory.mktemp("export_everything")
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16, experts_implementation="eager")
    quant_cfg, _ = modelopt_placement_quant_cfg(PLACEMENT, nvfp4_algorithm="max", fp8_weight_algorithm="max")
    weight = {
        NVFP4: _preset_quantizer_cfg(nvfp4_w4a16_static_config("max"), "*weight_quantizer"),
        FP8: _preset_quantizer_cfg(mtq.FP8_DEFAULT_CFG, "*weight_quantizer"),
    }
    fp8_input = _preset_quantizer_cfg(mtq.FP8_DEFAULT_CFG, "*input_quantizer")
    for pattern, fmt, static_input in NON_EXPERT_RECIPE:
        quant_cfg["quant_cfg"].append({"quantizer_name": f"{pattern}*weight_quantizer", "cfg": weight[fmt]})
        if static_input:
            quant_cfg["quant_cfg"].append({"quantizer_name": f"{pattern}*input_quantizer", "cfg": fp8_input})
    with quiet(), cpu_nvfp4_fake_quant(), torch.no_grad():
        mtq.quantize(model, quant_cfg, forward_loop=lambda m: m(input_ids=calibration_ids, use_cache=False))
        export_hf_checkpoint(model, export_dir=out)
    return out


def test_every_quantized_module_is_reported_and_checked(everything_export, tmp_path):
    """Attention, lm_head, shared experts and the dense MLP are counted by format, each module agreeing
    with its quantized_layers entry; a disagreement anywhere fails the inspection (and the CLI's exit)."""
    from mixquant.cli import main

    hf = json.loads((everything_export / "hf_quant_config.json").read_text())
    listed = hf["quantization"]["quantized_layers"]
    report = inspect_checkpoint(everything_export)
    assert report["ok"], report["quant_config_check"]["disagreements"] + report["problems"]
    assert report["quantized_module_count"] == len(listed)  # ModelOpt's own list, module for module
    layers, dense, moe = NUM_LAYERS, 1, NUM_LAYERS - 1
    assert report["quantized_modules"] == {
        "attention": {FP8: layers, NVFP4: layers},
        "dense_mlp": {FP8: 3 * dense},
        "lm_head": {FP8: 1},
        "routed_experts": {FP8: 1, NVFP4: 1},
        "shared_experts": {NVFP4: 3 * moe},
    }
    assert report["non_expert_formats"]["lm_head"] == FP8
    assert "quantized modules: " + str(len(listed)) in format_inspection(report)
    assert main(["inspect", str(everything_export)]) == 0

    broken = copy_dir(everything_export, tmp_path / "ckpt")
    hf["quantization"]["quantized_layers"]["lm_head"] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    del hf["quantization"]["quantized_layers"]["model.layers.2.mlp.shared_expert.up_proj"]
    (broken / "hf_quant_config.json").write_text(json.dumps(hf))
    report = inspect_checkpoint(broken)
    text = " | ".join(report["quant_config_check"]["disagreements"])
    assert "lm_head: hf_quant_config.json says nvfp4_w4a16, tensors are fp8" in text
    assert (
        "quantized non-expert modules not in quantized_layers: model.layers.2.mlp.shared_expert.up_proj"
        in text
    )
    assert not report["ok"] and main(["inspect", "--json", str(broken)]) == 1


def read_config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def tensors_of(directory) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = handle.get_tensor(name)
    return out


@pytest.fixture(scope="module")
def sharded(export, tmp_path_factory):
    """The export re-written as 3 shards + index, with tokenizer files and a README beside it."""
    out = tmp_path_factory.mktemp("sharded")
    layout.write_sharded_safetensors(tensors_of(export), out, num_shards=3)
    for name in JSON_FILES:
        shutil.copy(export / name, out / name)
    (out / "tokenizer.json").write_text('{"model": {"vocab": {}}}\n')
    (out / "tokenizer_config.json").write_text("{}\n")
    (out / "README.md").write_text("# toy\n")
    (out / ".cache").mkdir()
    (out / ".cache" / "download.metadata").write_text("skipped")
    return out


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------- agreement


AGREED_KEYS = (
    "tensors",
    "bytes",
    "payload_bytes",
    "routed_effective_bits",
    "layer_formats",
    "placement_counts",
)


def test_formats_are_the_reference_formats():
    assert predict.FORMATS == reference.FORMATS


def test_single_file_export_agrees_with_prediction(export):
    report = inspect_checkpoint(export)
    expected = predict_structure(read_config(export), placement=PLACEMENT, kv_cache_quant=None)
    for key in AGREED_KEYS:
        assert report[key] == expected[key], key
    assert report["layer_formats"] == {"1": NVFP4, "2": FP8, "3": BF16, "4": BF16}
    assert report["routed_effective_bits"] == (4.5 + 8 + 16 + 16) / 4
    assert report["routed_parameters"] == expected["parameters"]["routed"]
    assert report["experts_per_layer"] == dict.fromkeys(("1", "2", "3", "4"), NUM_EXPERTS)
    assert report["ok"] and report["problems"] == []
    assert report["quant_config_check"] == {
        "present": True,
        "ok": True,
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "disagreements": [],
    }
    assert report["index_check"]["present"] is False and report["layout"] == "single"
    assert report["producer"] == {"name": "modelopt", "version": modelopt.__version__}
    digest = hashlib.sha256((export / "hf_quant_config.json").read_bytes()).hexdigest()
    assert report["sha256"] == {"hf_quant_config.json": digest, "model.safetensors.index.json": None}
    json.dumps(report)


def test_independent_count_from_safe_open(export):
    """Counts and bytes per category straight from safe_open, by name prefix and layer placement."""
    counts, nbytes = Counter(), Counter()
    for name, tensor in tensors_of(export).items():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            category = PLACEMENT.get(int(parts[2]), BF16)
        elif name.endswith(("k_scale", "v_scale")):
            category = "kv_scales"
        else:
            category = "non_expert"
        counts[category] += 1
        nbytes[category] += tensor.numel() * tensor.element_size()
    report = inspect_checkpoint(export)
    for fmt in (NVFP4, FP8, BF16):
        assert report["tensors"]["routed"][fmt] == counts[fmt], fmt
        assert report["bytes"]["routed"][fmt] == nbytes[fmt], fmt
    assert report["tensors"]["non_expert"] == counts["non_expert"]
    assert report["bytes"]["non_expert"] == nbytes["non_expert"]
    assert report["tensors"]["kv_scales"] == counts["kv_scales"] == 0
    assert report["tensors"]["total"] == sum(counts.values())
    assert report["payload_bytes"] == sum(nbytes.values())
    assert counts[NVFP4] == counts[FP8] == 3 * 3 * NUM_EXPERTS and counts[BF16] == 2 * 3 * NUM_EXPERTS


def test_disk_bytes_and_exact_header_estimate(export):
    """On-disk bytes add up; the predicted safetensors header is byte-exact for ModelOpt's own file."""
    report = inspect_checkpoint(export)
    disk = report["disk_bytes"]
    sizes = {p.name: p.stat().st_size for p in export.iterdir() if p.is_file()}
    assert disk["total"] == sum(sizes.values())
    parts = ("payload", "shard_headers", "shard_slack", "index", "configs", "tokenizer")
    assert sum(disk[k] for k in parts) + disk["unreferenced_shards"] + disk["other"] == disk["total"]
    header_len = int.from_bytes((export / "model.safetensors").read_bytes()[:8], "little")
    assert disk["shard_headers"] == 8 + header_len and disk["shard_slack"] == 0
    assert disk["configs"] == sum(sizes[n] for n in JSON_FILES if n in sizes)
    assert report["shards"] == [
        {
            "file": "model.safetensors",
            "tensors": report["tensors"]["total"],
            "payload_bytes": report["payload_bytes"],
            "header_bytes": 8 + header_len,
            "slack_bytes": 0,
            "file_bytes": sizes["model.safetensors"],
        }
    ]
    entries = checkpoint_tensors(read_config(export), PLACEMENT, kv_cache_quant=None)
    estimate = estimate_metadata_bytes(entries)
    assert estimate["shards"] == 1 and estimate["index_bytes"] == 0
    assert estimate["shard_header_bytes"] == 8 + header_len


def test_fp8_kv_cache_export(kv_export):
    """ModelOpt writes self_attn.{k_proj.k_scale, v_proj.v_scale} on every attention layer: the predictor's
    KV rule (2 F32 scalars per layer) matches a real export."""
    report = inspect_checkpoint(kv_export)
    expected = predict_structure(read_config(kv_export), placement=PLACEMENT, kv_cache_quant="FP8")
    for key in AGREED_KEYS:
        assert report[key] == expected[key], key
    assert report["tensors"]["kv_scales"] == 2 * NUM_LAYERS and report["bytes"]["kv_scales"] == 8 * NUM_LAYERS
    assert report["kv_scale_layers"] == list(range(NUM_LAYERS))
    assert report["quant_config_check"]["kv_cache_quant_algo"] == "FP8" and report["ok"]


def test_sharded_export(export, sharded):
    report = inspect_checkpoint(sharded)
    single = inspect_checkpoint(export)
    for key in AGREED_KEYS:
        assert report[key] == single[key], key
    assert report["layout"] == "sharded" and len(report["shards"]) == 3 and report["ok"]
    index_text = (sharded / "model.safetensors.index.json").read_bytes()
    assert report["index_check"]["ok"] and report["index_check"]["entries"] == report["tensors"]["total"]
    assert report["index_check"]["total_size"] == report["payload_bytes"]
    assert report["sha256"]["model.safetensors.index.json"] == hashlib.sha256(index_text).hexdigest()
    disk = report["disk_bytes"]
    assert disk["index"] == len(index_text)
    assert disk["tokenizer"] == sum(
        (sharded / n).stat().st_size for n in ("tokenizer.json", "tokenizer_config.json")
    )
    assert disk["other"] == (sharded / "README.md").stat().st_size  # .cache is skipped
    assert disk["shard_headers"] == sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in sharded.glob("*.safetensors")
    )
    assert disk["total"] == sum(f["bytes"] for f in report["files"])
    assert not any(f["path"].startswith(".cache") for f in report["files"])
    # the index estimate is byte-exact (same JSON layout, shard names of equal length)
    entries = checkpoint_tensors(read_config(sharded), PLACEMENT, kv_cache_quant=None)
    estimate = estimate_metadata_bytes(entries, max_shard_bytes=report["payload_bytes"] // 3)
    assert estimate["shards"] > 1 and estimate["index_bytes"] == len(index_text)
    text = format_inspection(report)
    assert "index vs shard headers: ok" in text and "overall: ok" in text and "README.md" in text


# ---------------------------------------------------------------------------- disagreements


def test_index_disagreements(sharded, tmp_path):
    broken = copy_dir(sharded, tmp_path / "ckpt")
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    dropped = "model.norm.weight"
    del weight_map[dropped]
    moved = "model.embed_tokens.weight"
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[moved])
    weight_map[moved] = other
    weight_map["model.layers.9.mlp.gate.weight"] = other
    weight_map["model.layers.8.mlp.gate.weight"] = "missing.safetensors"
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))
    extra = broken / "extra.safetensors"
    shutil.copy(broken / other, extra)
    report = inspect_checkpoint(broken)
    check = report["index_check"]
    assert check["ok"] is False
    text = " | ".join(check["problems"])
    assert f"shard tensors not in weight_map: {dropped}" in text
    assert f"wrong shard for: {moved}" in text
    assert "absent from the shards: model.layers.9.mlp.gate.weight" in text
    assert "weight_map names missing shards: missing.safetensors" in text
    assert "total_size" in text
    assert report["problems"] == [
        "safetensors files not referenced by model.safetensors.index.json: extra.safetensors"
    ]
    assert report["disk_bytes"]["unreferenced_shards"] == extra.stat().st_size
    assert not report["ok"]


def test_quant_config_disagreements(export, tmp_path):
    broken = copy_dir(export, tmp_path / "ckpt")
    path = broken / "hf_quant_config.json"
    hf = json.loads(path.read_text())
    layers = hf["quantization"]["quantized_layers"]
    del layers["model.layers.1.mlp.experts"]
    layers["model.layers.3.mlp.experts"] = {"quant_algo": "FP8"}
    layers["model.layers.0.mlp.experts"] = {"quant_algo": "FP8"}
    hf["quantization"]["kv_cache_quant_algo"] = "FP8"
    path.write_text(json.dumps(hf))
    report = inspect_checkpoint(broken)
    text = " | ".join(report["quant_config_check"]["disagreements"])
    assert "layer 1: hf_quant_config.json says bf16, tensors are nvfp4_w4a16" in text
    assert "layer 3: hf_quant_config.json says fp8, tensors are bf16" in text
    assert "names model.layers.0.mlp.experts, which has no routed-expert tensors" in text
    assert "kv_cache_quant_algo FP8, but layers lack a k_scale or v_scale: 0, 1, 2, 3, 4" in text
    assert "config.json quantization_config.quantized_layers differs" in text
    assert not report["ok"] and "DISAGREE" in format_inspection(report)
    # the CLI says so with its exit code too (a check that failed: 1), in text and in JSON
    from mixquant.cli import main

    assert main(["inspect", str(broken)]) == 1
    assert main(["inspect", "--json", str(broken)]) == 1
    assert main(["inspect", str(export)]) == 0


def test_single_algorithm_quant_config(export, tmp_path):
    """A non-mixed hf_quant_config (one quant_algo + exclude_modules) is checked too."""
    broken = copy_dir(export, tmp_path / "ckpt")
    hf = json.loads((broken / "hf_quant_config.json").read_text())
    hf["quantization"] = {
        "quant_algo": "W4A16_NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["model.layers.3.mlp.experts*", "model.layers.4.*", "lm_head"],
    }
    (broken / "hf_quant_config.json").write_text(json.dumps(hf))
    config = read_config(broken)
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    disagreements = inspect_checkpoint(broken)["quant_config_check"]["disagreements"]
    assert disagreements == ["layer 2: hf_quant_config.json says nvfp4_w4a16, tensors are fp8"]


def test_classify_projection():
    def entry(dtype, shape):
        return {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}

    nvfp4 = {
        "weight": entry("U8", [8, 16]),
        "weight_scale": entry("F8_E4M3", [8, 2]),
        "weight_scale_2": entry("F32", []),
    }
    assert classify_projection(nvfp4) == (NVFP4, 8 * 32, None)
    assert classify_projection({**nvfp4, "input_scale": entry("F32", [])})[0] == "nvfp4"
    fmt, _, problem = classify_projection({**nvfp4, "weight_scale": entry("F8_E4M3", [8, 1])})
    assert fmt == NVFP4 and "not [8, 2]" in problem
    fp8 = {
        "weight": entry("F8_E4M3", [8, 16]),
        "weight_scale": entry("F32", []),
        "input_scale": entry("F32", []),
    }
    assert classify_projection(fp8) == (FP8, 128, None)
    assert classify_projection({"weight": entry("BF16", [8, 16])}) == (BF16, 128, None)
    fmt, numel, problem = classify_projection({"weight": entry("F16", [8, 16])})
    assert fmt == "unknown" and numel == 128 and "weight:F16" in problem


# ------------------------------------------------------------------------------- broken files


def one_line_naming(exc_info, path) -> None:
    message = str(exc_info.value)
    assert "\n" not in message and str(path) in message, message


def test_corrupt_header(export, tmp_path):
    broken = copy_dir(export, tmp_path / "ckpt")
    shard = broken / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#not json!!#"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointInspectionError, match="corrupt safetensors header") as info:
        inspect_checkpoint(broken)
    one_line_naming(info, shard)


def test_header_length_beyond_file(export, tmp_path):
    broken = copy_dir(export, tmp_path / "ckpt")
    shard = broken / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointInspectionError, match="corrupt or truncated") as info:
        inspect_checkpoint(broken)
    one_line_naming(info, shard)


def test_truncated_shard(sharded, tmp_path):
    broken = copy_dir(sharded, tmp_path / "ckpt")
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointInspectionError, match="truncated safetensors file") as info:
        inspect_checkpoint(broken)
    one_line_naming(info, shard)


def test_corrupt_index_and_missing_checkpoint(sharded, tmp_path):
    broken = copy_dir(sharded, tmp_path / "ckpt")
    index = broken / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointInspectionError, match="corrupt JSON") as info:
        inspect_checkpoint(broken)
    one_line_naming(info, index)
    index.write_text("[]")
    with pytest.raises(CheckpointInspectionError, match="expected a JSON object") as info:
        inspect_checkpoint(broken)
    one_line_naming(info, index)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointInspectionError, match="no \\*.safetensors files") as info:
        inspect_checkpoint(empty)
    one_line_naming(info, empty)
    with pytest.raises(CheckpointInspectionError, match="not a directory"):
        inspect_checkpoint(tmp_path / "absent")
