"""Streaming checkpoint export (mixquant.export.checkpoint) vs ModelOpt's own export_hf_checkpoint.

Core check: on a small random Laguna (dense layer 0, 4 MoE layers, full + sliding attention), ModelOpt's
mtq.quantize + export_hf_checkpoint (CPU) of a placement mixing NVFP4 / FP8 / BF16 routed experts with an
FP8 KV cache, and export_checkpoint of the same source with per-layer quantize_layer results and the
K / V amax of collect_activation_stats, give the same tensors (names, dtypes, shapes, bytes), the same
hf_quant_config.json and the same config.json apart from the producer and the documented keys ModelOpt
drops (see the module docstring of mixquant.export.checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import warnings

import pytest
import torch
from byte_checks import as_bytes, assert_byte_identical

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.export.checkpoint import export_checkpoint  # noqa: E402
from mixquant.export.files import QUANT_CONFIG_FILE  # noqa: E402
from mixquant.export.inputs import ExportInputError, kv_scale_name  # noqa: E402
from mixquant.export.modelopt_config import (  # noqa: E402
    modelopt_hf_quant_config,
    modelopt_quantization_config,
)
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.model.tokenizer import SPECIAL_TOKENS  # noqa: E402
from mixquant.model.toy import init_toy_model, to_bfloat16, toy_laguna_config  # noqa: E402
from mixquant.producer import default_producer  # noqa: E402
from mixquant.quantize.activations import collect_activation_stats  # noqa: E402
from mixquant.quantize.layer import quantize_layer, save_layer_result  # noqa: E402
from mixquant.quantize.reference import (  # noqa: E402
    BF16,
    FP8,
    NVFP4,
    _calibration_forward_loop,
    modelopt_calibration_plan,
    modelopt_placement_quant_cfg,
    modelopt_reference_export,
)
from safetensors import safe_open  # noqa: E402

torch.set_num_threads(1)
cpu_reference = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_LAYERS = 5
NUM_EXPERTS = 16
MOE_LAYERS = (1, 2, 3, 4)
PLACEMENT = {1: NVFP4, 2: FP8, 3: BF16, 4: NVFP4}
ALGORITHMS = ("fp8_sweep", "max")  # one mtq.quantize call, no refine pass
BATCH_SIZE = 2
ARCH = {
    "num_hidden_layers": NUM_LAYERS,
    "hidden_size": 32,
    "head_dim": 16,
    "num_attention_heads_full": 2,
    "num_attention_heads_sliding": 4,
    "num_key_value_heads": 2,
    "sliding_window": 8,
    "intermediate_size": 64,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}
# Keys of the source config.json that ModelOpt's transformers re-serialisation drops (documented).
MODELOPT_DROPPED_CONFIG_KEYS = {
    "_name_or_path",
    "chunk_size_feed_forward",
    "id2label",
    "is_encoder_decoder",
    "label2id",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "torch_dtype",
}
TOKENIZER = {"tokenizer.json": '{"fake": "tokenizer"}\n', "tokenizer_config.json": '{"model_max_length": 64}'}


class StubTokenizer:
    def __len__(self) -> int:
        return 128

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL_TOKENS.index(token)


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def read_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


def raises_one_line(func, *args, match: list[str], **kwargs) -> str:
    with pytest.raises(ExportInputError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for needle in match:
        assert needle in message, (needle, message)
    return message


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = toy_laguna_config(ARCH, StubTokenizer())
    model = init_toy_model(config, seed=5, router_bias_init_std=0.05)
    with torch.no_grad():
        for layer in MOE_LAYERS:
            model.model.layers[layer].mlp.gate.weight.mul_(20.0)  # spread the routing over many experts
    to_bfloat16(model)
    out = tmp_path_factory.mktemp("src")
    with quiet():
        toy_layout.save_upstream_checkpoint(model, out, num_shards=3)
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    for name, text in TOKENIZER.items():
        (out / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(4, 128, (5, 12), generator=torch.Generator().manual_seed(2), dtype=torch.int32)


@pytest.fixture(scope="module")
def stats(source, calibration_ids):
    with quiet():
        return collect_activation_stats(source, calibration_ids, batch_size=BATCH_SIZE, progress=False)


def modelopt_export_with_fp8_kv(source, calibration_ids, placement, out) -> None:
    """modelopt_reference_export plus ModelOpt's FP8 KV-cache preset (single-call algorithms only)."""
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import LagunaForCausalLM

    assert not modelopt_calibration_plan(*ALGORITHMS, set(placement.values())).refine
    quant_cfg, _ = modelopt_placement_quant_cfg(
        placement, nvfp4_algorithm=ALGORITHMS[0], fp8_weight_algorithm=ALGORITHMS[1]
    )
    quant_cfg["quant_cfg"].extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16, experts_implementation="eager")
    model.eval()
    with quiet(), cpu_nvfp4_fake_quant(), torch.no_grad():
        mtq.quantize(model, quant_cfg, forward_loop=_calibration_forward_loop(calibration_ids, BATCH_SIZE))
        out.mkdir(parents=True, exist_ok=True)
        export_hf_checkpoint(model, export_dir=out)


@pytest.fixture(scope="module")
def reference(source, calibration_ids, tmp_path_factory):
    """ModelOpt's export of PLACEMENT with an FP8 KV cache: directory and tensors."""
    out = tmp_path_factory.mktemp("ref_kv")
    modelopt_export_with_fp8_kv(source, calibration_ids, dict(PLACEMENT), out)
    return out, read_tensors(out)


def layer_params(fmt: str) -> dict:
    return {NVFP4: {"calibration": ALGORITHMS[0]}, FP8: {"weight_calibration": ALGORITHMS[1]}, BF16: {}}[fmt]


@pytest.fixture(scope="module")
def layer_results(source, stats, tmp_path_factory):
    """quantize_layer + save_layer_result for PLACEMENT (FP8 input amax from the activation stats)."""
    root = tmp_path_factory.mktemp("layers")
    out = {}
    for layer, fmt in PLACEMENT.items():
        amax = None
        if fmt == FP8:
            amax = {"gate_up": stats["gate_up_input_amax"][layer], "down": stats["down_input_amax"][layer]}
        tensors, audit = quantize_layer(source, layer, fmt, layer_params(fmt), activation_amax=amax)
        save_layer_result(tensors, audit, root / f"L{layer}_{fmt}")
        out[layer] = (fmt, root / f"L{layer}_{fmt}")
    return out


@pytest.fixture(scope="module")
def bf16_results(source, tmp_path_factory):
    """BF16 layer results for every MoE layer (cheap inputs for the error and sharding tests)."""
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for layer in MOE_LAYERS:
        tensors, audit = quantize_layer(source, layer, BF16, {})
        save_layer_result(tensors, audit, root / f"L{layer}")
        out[layer] = (BF16, root / f"L{layer}")
    return out


@pytest.fixture(scope="module")
def exported(source, layer_results, stats, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ours") / "export"
    producer = default_producer()
    summary = export_checkpoint(
        source,
        layer_results,
        out,
        tokenizer_dir=tokenizer_dir,
        num_shards=2,
        kv_cache="fp8",
        kv_amax=stats,
        producer=producer,
    )
    return out, summary, producer


# ----------------------------------------------------------------------------------------- vs ModelOpt


@cpu_reference
def test_export_equals_modelopt_export(exported, reference, source, tokenizer_dir):
    out, summary, producer = exported
    ref_dir, ref = reference
    ours = read_tensors(out)
    assert_byte_identical(ours, ref)
    # what the comparison covers: every MoE format, KV scales on full and sliding attention layers
    assert ours["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8
    assert ours["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert ours["model.layers.3.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    config = json.loads((source / "config.json").read_text())
    assert len(set(config["layer_types"])) == 2
    for layer in range(NUM_LAYERS):
        for kind in "kv":
            scale = ours[kv_scale_name(layer, kind)]
            assert scale.dtype == torch.float32 and scale.shape == ()
    # non-expert tensors are the source's, byte for byte
    src = read_tensors(source)
    for name, tensor in ours.items():
        if ".mlp.experts." not in name or name.endswith("e_score_correction_bias"):
            if not name.endswith(("k_scale", "v_scale")):
                assert torch.equal(as_bytes(tensor), as_bytes(src[name])), name

    # hf_quant_config.json: ModelOpt's, byte for byte, apart from the producer
    ref_hf = json.loads((ref_dir / QUANT_CONFIG_FILE).read_text())
    our_text = (out / QUANT_CONFIG_FILE).read_text()
    our_hf = json.loads(our_text)
    assert our_hf["producer"] == producer and producer["name"] == "mixquant"
    assert producer["numerics"] == ref_hf["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert (
        json.dumps({**our_hf, "producer": ref_hf["producer"]}, indent=4)
        == (ref_dir / QUANT_CONFIG_FILE).read_text()
    )
    assert our_text == json.dumps(our_hf, indent=4)
    assert our_hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert our_hf["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert "model.layers.3.mlp.experts" not in our_hf["quantization"]["quantized_layers"]

    # config.json: every key ModelOpt writes, same value (producer aside); extra keys: the documented ones
    ref_cfg = json.loads((ref_dir / "config.json").read_text())
    our_cfg = json.loads((out / "config.json").read_text())
    assert our_cfg["quantization_config"]["producer"] == producer
    our_cfg["quantization_config"]["producer"] = ref_cfg["quantization_config"]["producer"]
    assert list(our_cfg)[-1] == list(ref_cfg)[-1] == "quantization_config"
    for key, value in ref_cfg.items():
        assert our_cfg[key] == value, key
    assert set(our_cfg) - set(ref_cfg) == MODELOPT_DROPPED_CONFIG_KEYS
    assert {k: our_cfg[k] for k in MODELOPT_DROPPED_CONFIG_KEYS} == {
        k: config[k] for k in MODELOPT_DROPPED_CONFIG_KEYS
    }
    assert our_cfg["quantization_config"]["kv_cache_scheme"] == {
        "dynamic": False,
        "num_bits": 8,
        "type": "float",
    }

    # other files
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    for name, text in TOKENIZER.items():
        assert (out / name).read_text() == text
    assert summary["quant_algo"] == "MIXED_PRECISION" and summary["kv_cache_quant_algo"] == "FP8"
    assert summary["num_tensors"] == len(ref) and summary["num_shards"] == 2
    json.dumps(summary)


@cpu_reference
def test_shards_and_index(exported):
    out, summary, _ = exported
    index = json.loads((out / layout.INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [layout.shard_file_name(k, 2) for k in range(2)]
    total = 0
    by_layer: dict[int | None, set[str]] = {}
    for shard in shards:
        with safe_open(shard, "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():  # noqa: SIM118
                assert index["weight_map"][name] == shard.name
                t = handle.get_tensor(name)
                total += t.numel() * t.element_size()
                by_layer.setdefault(layout.layer_of(name), set()).add(shard.name)
    assert index["metadata"]["total_size"] == total == summary["total_size"]
    assert len(index["weight_map"]) == summary["num_tensors"]
    assert all(len(files) == 1 for layer, files in by_layer.items() if layer is not None)  # whole layers


@pytest.mark.parametrize(
    "placement",
    [
        {1: NVFP4, 2: FP8, 3: BF16},  # MIXED_PRECISION
        {1: NVFP4, 2: NVFP4},  # single algorithm: exclude_modules
        {2: FP8},
        {},  # nothing quantized: no hf_quant_config.json, no quantization_config
    ],
    ids=["mixed", "nvfp4", "fp8", "bf16"],
)
@cpu_reference
def test_quant_config_forms_equal_modelopt(placement, source, calibration_ids, tmp_path):
    """hf_quant_config and quantization_config == ModelOpt's export for each form (producer included)."""
    with quiet():
        modelopt_reference_export(
            source,
            calibration_ids,
            placement,
            tmp_path,
            nvfp4_algorithm="max",
            fp8_weight_algorithm="max",
            batch_size=BATCH_SIZE,
        )
    config = json.loads((source / "config.json").read_text())
    full = {layer: placement.get(layer, BF16) for layer in MOE_LAYERS}
    ours = modelopt_hf_quant_config(config, full)
    ref_cfg = json.loads((tmp_path / "config.json").read_text())
    if not placement:
        assert ours is None and not (tmp_path / QUANT_CONFIG_FILE).exists()
        assert "quantization_config" not in ref_cfg
        return
    assert json.dumps(ours, indent=4) == (tmp_path / QUANT_CONFIG_FILE).read_text()
    assert modelopt_quantization_config(ours) == ref_cfg["quantization_config"]


def test_kv_only_and_single_format_with_kv_configs(source):
    """ModelOpt's forms with an FP8 KV cache (checked against real exports while writing this module)."""
    config = json.loads((source / "config.json").read_text())
    kv_only = modelopt_hf_quant_config(config, dict.fromkeys(MOE_LAYERS, BF16), kv_cache="fp8")
    assert kv_only["quantization"] == {
        "quant_algo": None,
        "kv_cache_quant_algo": "FP8",
        "quantized_layers": {},
    }
    qc = modelopt_quantization_config(kv_only)
    assert "quant_algo" not in qc and "config_groups" not in qc and qc["ignore"] == []
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    one = modelopt_hf_quant_config(config, {1: BF16, 2: BF16, 3: NVFP4, 4: BF16}, kv_cache="fp8")
    assert one["quantization"] == {
        "quant_algo": "W4A16_NVFP4",
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.0*",
            "model.layers.1*",
            "model.layers.2*",
            "model.layers.3.mlp.gate",
            "model.layers.3.mlp.shared_expert*",
            "model.layers.3.self_attn*",
            "model.layers.4*",
        ],
    }
    assert modelopt_quantization_config(one)["config_groups"]["group_0"]["targets"] == ["Linear"]


# ----------------------------------------------------------------------------------------- sharding


def test_sharding_options_and_determinism(source, bf16_results, tokenizer_dir, tmp_path):
    producer = default_producer()
    common = dict(tokenizer_dir=tokenizer_dir, producer=producer, fsync=False)
    a = export_checkpoint(source, bf16_results, tmp_path / "a", num_shards=3, **common)
    export_checkpoint(source, bf16_results, tmp_path / "b", num_shards=3, **common)
    assert a["num_shards"] == 3
    for name in a["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    # all BF16 and no KV cache: nothing quantized, as ModelOpt writes no hf_quant_config.json
    assert not (tmp_path / "a" / QUANT_CONFIG_FILE).exists()
    assert "quantization_config" not in json.loads((tmp_path / "a" / "config.json").read_text())
    assert read_tensors(tmp_path / "a").keys() == read_tensors(source).keys()
    assert_byte_identical(read_tensors(tmp_path / "a"), read_tensors(source))

    # max bytes: every shard within the limit unless it is one group (a layer) on its own
    limit = a["total_size"] // 4
    c = export_checkpoint(source, bf16_results, tmp_path / "c", max_shard_bytes=limit, **common)
    assert c["num_shards"] >= 4
    index = json.loads((tmp_path / "c" / layout.INDEX_FILE).read_text())
    for shard in c["shards"]:
        names = [n for n, f in index["weight_map"].items() if f == shard["file"]]
        layers = {layout.layer_of(n) for n in names}
        data = sum(t.numel() * t.element_size() for t in read_tensors_of(tmp_path / "c" / shard["file"]))
        assert data <= limit or len(layers) == 1, shard
    one = export_checkpoint(source, bf16_results, tmp_path / "d", max_shard_bytes=10**12, **common)
    assert one["num_shards"] == 1 and (tmp_path / "d" / layout.shard_file_name(0, 1)).exists()
    raises_one_line(
        export_checkpoint,
        source,
        bf16_results,
        tmp_path / "e",
        num_shards=2,
        max_shard_bytes=5,
        match=["not both"],
        **common,
    )
    raises_one_line(
        export_checkpoint,
        source,
        bf16_results,
        tmp_path / "f",
        num_shards=99,
        match=["num_shards=99"],
        **common,
    )


def read_tensors_of(path):
    with safe_open(path, "pt") as handle:
        return [handle.get_tensor(n) for n in handle.keys()]  # noqa: SIM118


# ----------------------------------------------------------------------------------------- bad inputs


def test_bad_placement_and_layer_results(source, bf16_results, layer_results, tokenizer_dir, tmp_path):
    common = dict(tokenizer_dir=tokenizer_dir, producer=default_producer(), fsync=False)
    out = tmp_path / "out"

    def check(layer_dirs, match, **kwargs):
        raises_one_line(export_checkpoint, source, layer_dirs, out, match=match, **{**common, **kwargs})
        assert not out.exists() or not any(out.iterdir())  # validation happens before writing

    missing = {k: v for k, v in bf16_results.items() if k != 3}
    check(missing, ["layer 3", "no layer result"])
    check({**bf16_results, 9: (BF16, bf16_results[1][1])}, ["layer 9", "does not exist", "5 layers"])
    check({**bf16_results, 0: (BF16, bf16_results[1][1])}, ["layer 0", "not an MoE layer"])
    check({**bf16_results, 2: ("int4", bf16_results[2][1])}, ["layer 2", "int4"])
    check({**bf16_results, 2: (BF16, tmp_path / "nowhere")}, ["layer 2", str(tmp_path / "nowhere")])
    # a result of the wrong format or layer: the audit says so; without the audit, the tensors do
    check({**bf16_results, 1: (FP8, layer_results[1][1])}, ["layer 1", "nvfp4_w4a16 result", "fp8"])
    check({**bf16_results, 2: (BF16, bf16_results[1][1])}, ["layer 2", "result of layer 1"])
    stripped = tmp_path / "no_audit"
    stripped.mkdir()
    shutil.copy(layer_results[1][1] / "layer.safetensors", stripped)
    check({**bf16_results, 1: (FP8, stripped)}, ["layer 1", "input_scale", "fp8"])
    other = tmp_path / "other_layer"
    other.mkdir()
    shutil.copy(bf16_results[1][1] / "layer.safetensors", other)
    check({**bf16_results, 2: (BF16, other)}, ["layer 2", "lacks model.layers.2.mlp.experts.0."])
    # a truncated layer result
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (bf16_results[4][1] / "layer.safetensors").read_bytes()
    (cut / "layer.safetensors").write_bytes(data[:-7])
    check({**bf16_results, 4: (BF16, cut)}, ["layer 4", "truncated", str(cut / "layer.safetensors")])
    # KV cache options
    check(bf16_results, ["kv_amax"], kv_cache="fp8")
    check(bf16_results, ["kv_cache", "int8"], kv_cache="int8")
    amax = {"k_amax": dict.fromkeys(range(NUM_LAYERS), 1.0), "v_amax": dict.fromkeys(range(4), 1.0)}
    check(bf16_results, ["layer 4", "v_amax"], kv_cache="fp8", kv_amax=amax)
    amax["v_amax"][4] = float("nan")
    check(bf16_results, ["layer 4", "v_amax", "finite"], kv_cache="fp8", kv_amax=amax)
    check(bf16_results, ["producer"], producer={})
    # the output directory must be empty
    out.mkdir(exist_ok=True)
    (out / "stale").write_text("x")
    raises_one_line(export_checkpoint, source, bf16_results, out, match=[str(out), "not empty"], **common)


def test_bad_source_checkpoint(source, bf16_results, tokenizer_dir, tmp_path):
    common = dict(tokenizer_dir=tokenizer_dir, producer=default_producer(), fsync=False)
    bad = tmp_path / "src"
    shutil.copytree(source, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # a download cut short
    raises_one_line(
        export_checkpoint, bad, bf16_results, tmp_path / "o1", match=[shard.name, "truncated"], **common
    )
    shard.write_bytes(data[:8] + b"{" * 4 + data[12:])  # unparsable header
    raises_one_line(
        export_checkpoint, bad, bf16_results, tmp_path / "o2", match=[shard.name, "corrupt"], **common
    )
    shard.write_bytes(b"\xff" * 8 + data[8:])  # garbage header length
    raises_one_line(
        export_checkpoint, bad, bf16_results, tmp_path / "o3", match=[shard.name, "corrupt"], **common
    )
    shard.unlink()
    raises_one_line(
        export_checkpoint, bad, bf16_results, tmp_path / "o4", match=[shard.name, "missing"], **common
    )
    shard.write_bytes(data)
    (bad / "config.json").write_text("{not json")
    raises_one_line(
        export_checkpoint, bad, bf16_results, tmp_path / "o5", match=["config.json", "corrupt"], **common
    )
    shutil.copy(source / "config.json", bad / "config.json")
    raises_one_line(
        export_checkpoint,
        bad,
        bf16_results,
        tmp_path / "o6",
        tokenizer_dir=tmp_path,
        producer={"name": "x"},
        match=[str(tmp_path), "tokenizer"],
    )
    # an expert tensor missing from the source (index): the layer and the tensor are named
    index = json.loads((bad / layout.INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.7.up_proj.weight"]
    (bad / layout.INDEX_FILE).write_text(json.dumps(index))
    raises_one_line(
        export_checkpoint,
        bad,
        bf16_results,
        tmp_path / "o7",
        match=["layer 2", "lacks model.layers.2.mlp.experts.7.up_proj.weight"],
        **common,
    )
