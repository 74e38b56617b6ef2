"""Streaming per-layer quantization (mixquant.quantize.layer) vs ModelOpt's own export, and bad inputs.

The core check: on a small random Laguna, ``modelopt_reference_export`` (mtq.quantize + export_hf_checkpoint,
CPU) with a placement mixing NVFP4 / FP8 / BF16 routed experts, for three algorithm pairs -- (fp8_sweep,
mse), (max, max), (mse, mse) -- and ``quantize_layer`` on the same source checkpoint give byte-identical
routed-expert tensors (same names, dtypes, shapes, bytes) for every MoE layer.

The FP8 layer's activation amaxes are read off the export: ``input_scale = fp32(amax) / 448`` with ``amax``
a bf16 value (ModelOpt's input quantizer keeps its amax in the model dtype), so ``input_scale * 448``
rounded to bf16 recovers ``amax`` exactly (fp32 has 16 more mantissa bits than bf16, the round trip is off
by at most one fp32 ulp); the test asserts that ``fp32(amax) / 448`` reproduces the exported scale bit for
bit, and that every expert of the layer carries the same value.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch
from byte_checks import assert_byte_identical

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.formats.cpu_fake_quant import nvfp4_static_qdq  # noqa: E402
from mixquant.formats.dequant import dequantize_tensors  # noqa: E402
from mixquant.formats.fp8 import mse_multipliers  # noqa: E402
from mixquant.formats.nvfp4 import BLOCK_SIZE, shared_global_amax, sweep_nvfp4_block_amax  # noqa: E402
from mixquant.formats.nvfp4_amax import nvfp4_block_amax, nvfp4_mse_block_amax  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.model.families import default_expert_weight  # noqa: E402
from mixquant.model.layer_reader import read_layer_experts  # noqa: E402
from mixquant.quantize.layer import (  # noqa: E402
    AUDIT_FILE,
    INPUT_SCALE_SOURCE,
    LAYER_FILE,
    QuantizeInputError,
    quantize_layer,
    save_layer_result,
)
from mixquant.quantize.reference import BF16, FP8, NVFP4, modelopt_reference_export  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
cpu_reference = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_EXPERTS = 16
HIDDEN = 32
MOE_INTER = 16
PLACEMENT = {1: NVFP4, 2: FP8, 3: BF16}  # layer 4 absent from the placement -> BF16 too
MOE_LAYERS = {**PLACEMENT, 4: BF16}
UNROUTED = {1: 5, 2: 7}  # layer -> an expert no token is routed to (router bias -100)
PROJ = ("gate_proj", "up_proj", "down_proj")


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


@pytest.fixture(scope="module")
def source(tmp_path_factory, small_laguna_config):
    """Upstream-layout bf16 checkpoint of a random 5-layer Laguna (dense layer 0 + 4 MoE layers)."""
    config = small_laguna_config(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, moe_intermediate_size=MOE_INTER)
    torch.manual_seed(0)
    model = LagunaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in (1, 2, 3, 4):
            mlp = model.model.layers[layer].mlp
            # outliers so max, mse and the sweep disagree; distinct gate/up ranges
            for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                p[torch.rand(p.shape, generator=gen) < 3e-3] *= 25.0
            mlp.experts.gate_up_proj[:, MOE_INTER:] *= 2.0
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
            if layer in UNROUTED:
                mlp.gate.e_score_correction_bias[UNROUTED[layer]] = -100.0
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    out = tmp_path_factory.mktemp("src")
    toy_layout.save_upstream_checkpoint(model, out, num_shards=3)
    return out


def read_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


ALGORITHM_PAIRS = {  # fixture name -> (nvfp4_algorithm, fp8_weight_algorithm)
    "sweep_mse": ("fp8_sweep", "mse"),
    "max_max": ("max", "max"),
    "mse_mse": ("mse", "mse"),
}


@pytest.fixture(scope="module")
def exports(source, tmp_path_factory):
    """ModelOpt reference exports of the placement for each algorithm pair (lazily, once each)."""
    calibration_ids = torch.randint(4, 128, (5, 12), generator=torch.Generator().manual_seed(2))
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(which: str) -> dict[str, torch.Tensor]:
        if which not in cache:
            nvfp4_algorithm, fp8_weight_algorithm = ALGORITHM_PAIRS[which]
            out = tmp_path_factory.mktemp(f"ref_{which}")
            with quiet():
                modelopt_reference_export(
                    source,
                    calibration_ids,
                    dict(PLACEMENT),
                    out,
                    nvfp4_algorithm=nvfp4_algorithm,
                    fp8_weight_algorithm=fp8_weight_algorithm,
                    batch_size=2,
                )
            cache[which] = read_tensors(out)
        return cache[which]

    return get


def routed_expert_tensors(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp.experts."
    return {
        k: v for k, v in tensors.items() if k.startswith(prefix) and not k.endswith("e_score_correction_bias")
    }


def exported_activation_amax(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The layer's gate_up / down input amax recovered from the exported (layer-shared) input_scale."""
    amax = {}
    for key, proj in (("gate_up", "gate_proj"), ("down", "down_proj")):
        scale = tensors[f"model.layers.{layer}.mlp.experts.0.{proj}.input_scale"]
        value = (scale * 448).to(torch.bfloat16).to(torch.float32)
        assert torch.equal(value / 448, scale)  # exact recovery
        for e in range(NUM_EXPERTS):  # one input quantizer per layer: identical for every expert
            for p in ("gate_proj", "up_proj") if key == "gate_up" else ("down_proj",):
                assert torch.equal(tensors[f"model.layers.{layer}.mlp.experts.{e}.{p}.input_scale"], scale)
        amax[key] = value
    return amax


def layer_params(fmt: str, which: str) -> dict:
    nvfp4_algorithm, fp8_weight_algorithm = ALGORITHM_PAIRS[which]
    return {
        NVFP4: {"calibration": nvfp4_algorithm},
        FP8: {"weight_calibration": fp8_weight_algorithm},
        BF16: {},
    }[fmt]


# ----------------------------------------------------------------------------------------- vs ModelOpt


@cpu_reference
@pytest.mark.parametrize("which", list(ALGORITHM_PAIRS))
def test_layers_byte_identical_to_modelopt_export(which, exports, source):
    out = exports(which)
    for layer, fmt in MOE_LAYERS.items():
        ref = routed_expert_tensors(out, layer)
        amax = exported_activation_amax(out, layer) if fmt == FP8 else None
        tensors, audit = quantize_layer(source, layer, fmt, layer_params(fmt, which), activation_amax=amax)
        assert len(ref) == NUM_EXPERTS * 3 * {NVFP4: 3, FP8: 3, BF16: 1}[fmt]
        assert_byte_identical(tensors, ref)
        assert audit["format"] == fmt and audit["num_experts"] == NUM_EXPERTS
        json.dumps(audit)


@cpu_reference
def test_algorithms_discriminate(exports, source):
    """Each NVFP4 calibration gives different block scales on this weight set, so the byte checks bite."""
    src = read_layer_experts(source, 1)
    gate, up = src[default_expert_weight(1, 0, "gate_proj")], src[default_expert_weight(1, 0, "up_proj")]
    g = shared_global_amax(gate, up)
    amax = {c: nvfp4_block_amax(gate, g, c) for c in ("fp8_sweep", "max", "mse")}
    assert not torch.equal(amax["fp8_sweep"], amax["max"])
    assert not torch.equal(amax["mse"], amax["max"])
    assert not torch.equal(amax["mse"], amax["fp8_sweep"])
    assert torch.equal(amax["fp8_sweep"], sweep_nvfp4_block_amax(gate, g))
    # blocks are independent: chunking ModelOpt's calibrator changes nothing
    assert torch.equal(nvfp4_mse_block_amax(gate, g, chunk_blocks=5), amax["mse"])
    # every mse amax is the block's max amax times one of ModelOpt's 39 multipliers
    block_max = amax["max"].expand(-1, 39) * mse_multipliers().view(1, -1)
    assert bool((block_max == amax["mse"]).any(dim=1).all())
    # the FP8 mse and max exports differ too
    mse, mx = exports("sweep_mse"), exports("max_max")
    name = "model.layers.2.mlp.experts.0.down_proj.weight_scale"
    assert not torch.equal(mse[name], mx[name])


@cpu_reference
def test_unrouted_expert_gets_layer_input_scale_and_is_counted(exports, source):
    out = exports("sweep_mse")
    amax = exported_activation_amax(out, 2)
    routed = torch.ones(NUM_EXPERTS, dtype=torch.long)
    routed[UNROUTED[2]] = 0
    tensors, audit = quantize_layer(
        source,
        2,
        FP8,
        {"weight_calibration": "mse"},
        activation_amax={
            "gate_up_input_amax": amax["gate_up"],
            "down": amax["down"],
            "routed_tokens": routed,
        },
    )
    assert audit["input_scale_source"] == INPUT_SCALE_SOURCE
    assert audit["unrouted_experts"] == 1 and audit["unrouted_expert_ids"] == [UNROUTED[2]]
    name = f"model.layers.2.mlp.experts.{UNROUTED[2]}.down_proj.input_scale"
    assert torch.equal(tensors[name], out[name])
    assert audit["input_scale"]["down"] == float(amax["down"] / 448)


# ----------------------------------------------------------------------------------------- audit / io


def test_audit_dequantize_and_save(source, tmp_path):
    src = read_layer_experts(source, 1)
    assert len(src) == NUM_EXPERTS * 3 and all(t.dtype == torch.bfloat16 for t in src.values())
    amax = {"gate_up": torch.tensor(3.0), "down": torch.tensor(0.5)}
    results = {
        NVFP4: quantize_layer(source, 1, NVFP4, {"calibration": "fp8_sweep"}, progress=True),
        FP8: quantize_layer(source, 1, FP8, {"weight_calibration": "max"}, activation_amax=amax),
        BF16: quantize_layer(source, 1, BF16, {}),
    }
    bounds = {NVFP4: (0.05, 0.3), FP8: (0.005, 0.1), BF16: (0.0, 0.0)}
    for fmt, (tensors, audit) in results.items():
        deq = dequantize_tensors(tensors)
        assert sorted(deq) == sorted(src)
        lo, hi = bounds[fmt]
        for name, w in src.items():
            entry = audit["tensors"][name]
            assert entry["format"] == fmt and entry["shape"] == list(w.shape)
            assert deq[name].dtype == torch.bfloat16 and deq[name].shape == w.shape
            diff = (w.double() - deq[name].double()).norm() / w.double().norm()
            assert entry["relative_error"] == pytest.approx(float(diff), rel=1e-9, abs=1e-12)
            assert lo <= entry["relative_error"] <= hi, (fmt, name, entry["relative_error"])
        totals = audit["totals"]
        assert totals["tensors"] == NUM_EXPERTS * 3 and set(totals["projections"]) == set(PROJ)
        assert lo <= totals["relative_error"] <= hi
        assert totals["source_bytes"] == sum(t.numel() * 2 for t in src.values())
        if fmt != BF16:
            assert totals["exported_bytes"] < totals["source_bytes"]
    # dequantization == ModelOpt's export round trip / fp8 * scale
    tensors, audit = results[NVFP4]
    deq = dequantize_tensors(tensors)
    gate, up = src[default_expert_weight(1, 3, "gate_proj")], src[default_expert_weight(1, 3, "up_proj")]
    g = shared_global_amax(gate, up)
    qdq = nvfp4_static_qdq(up.float().reshape(-1, BLOCK_SIZE), sweep_nvfp4_block_amax(up, g), g)
    assert torch.equal(deq[default_expert_weight(1, 3, "up_proj")], qdq.reshape(up.shape).to(torch.bfloat16))
    entry = audit["tensors"][default_expert_weight(1, 3, "up_proj")]
    assert entry["dtype"] == "uint8" and set(entry["exported"]) == {
        "weight",
        "weight_scale",
        "weight_scale_2",
    }
    assert set(entry["scales"]) == {"weight_scale", "weight_scale_2"}
    assert entry["scales"]["weight_scale_2"]["min"] == pytest.approx(float(g) / (6 * 448))
    fp8_tensors, fp8_audit = results[FP8]
    p = "model.layers.1.mlp.experts.3.down_proj"
    assert torch.equal(
        dequantize_tensors(fp8_tensors)[f"{p}.weight"],
        (fp8_tensors[f"{p}.weight"].float() * fp8_tensors[f"{p}.weight_scale"]).to(torch.bfloat16),
    )
    assert fp8_audit["unrouted_experts"] is None and fp8_audit["input_amax"] == {"gate_up": 3.0, "down": 0.5}
    assert set(fp8_audit["tensors"][f"{p}.weight"]["scales"]) == {"weight_scale", "input_scale"}
    bf16_tensors, _ = results[BF16]
    assert all(torch.equal(bf16_tensors[n], src[n]) for n in src)

    save_layer_result(tensors, audit, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [AUDIT_FILE, LAYER_FILE]
    with safe_open(tmp_path / LAYER_FILE, "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        back = {n: handle.get_tensor(n) for n in handle.keys()}  # noqa: SIM118
    assert_byte_identical(back, tensors)
    assert json.loads((tmp_path / AUDIT_FILE).read_text()) == json.loads(json.dumps(audit))
    save_layer_result(fp8_tensors, fp8_audit, tmp_path / "fp8")  # 0-dim scales, many equal input_scales
    with safe_open(tmp_path / "fp8" / LAYER_FILE, "pt") as handle:
        assert len(list(handle.keys())) == NUM_EXPERTS * 9


# ----------------------------------------------------------------------------------------- bad inputs


def fake_checkpoint(
    directory, *, hidden=32, inter=16, experts=2, layers=(1,), num_shards=1, drop=(), config=None
):
    """Hand-made upstream shards + index holding only routed-expert tensors (no transformers model)."""
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in layers:
        for e in range(experts):
            shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
            for proj, shape in shapes.items():
                name = default_expert_weight(layer, e, proj)
                if name not in drop:
                    tensors[name] = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    layout.write_sharded_safetensors(tensors, directory, num_shards=num_shards)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return tensors


def shard_of(directory, name) -> str:
    return json.loads((directory / layout.INDEX_FILE).read_text())["weight_map"][name]


def raises_one_line(func, *args, match: list[str], **kwargs) -> str:
    with pytest.raises(QuantizeInputError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for needle in match:
        assert needle in message, (needle, message)
    return message


def test_nvfp4_inner_dim_not_multiple_of_16(tmp_path):
    fake_checkpoint(tmp_path, hidden=24, inter=16)
    gate = default_expert_weight(1, 0, "gate_proj")
    raises_one_line(
        quantize_layer, tmp_path, 1, NVFP4, {"calibration": "fp8_sweep"}, match=["layer 1", gate, "24"]
    )
    # the other formats have no block constraint
    tensors, _ = quantize_layer(
        tmp_path,
        1,
        FP8,
        {"weight_calibration": "max"},
        activation_amax={"gate_up": 1.0, "down": 1.0},
    )
    assert tensors[gate].dtype == torch.float8_e4m3fn and tensors[gate].shape == (16, 24)
    fake_checkpoint(tmp_path / "down", hidden=32, inter=40)
    down = default_expert_weight(1, 0, "down_proj")
    raises_one_line(
        quantize_layer, tmp_path / "down", 1, NVFP4, {"calibration": "max"}, match=["layer 1", down, "40"]
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_source_weight(tmp_path, bad):
    tensors = fake_checkpoint(tmp_path, experts=3)
    name = default_expert_weight(1, 2, "up_proj")
    tensors[name][3, 5] = bad
    save_file(tensors, str(tmp_path / shard_of(tmp_path, name)))  # the only shard
    kind = "NaN" if bad != bad else "Inf"
    raises_one_line(read_layer_experts, tmp_path, 1, match=["layer 1", name, kind])
    for fmt, params in ((NVFP4, {"calibration": "mse"}), (BF16, {})):
        raises_one_line(quantize_layer, tmp_path, 1, fmt, params, match=["layer 1", name])


def test_truncated_or_corrupt_shard(tmp_path):
    fake_checkpoint(tmp_path, layers=(1, 2), num_shards=2)
    shard1 = tmp_path / shard_of(tmp_path, default_expert_weight(1, 0, "gate_proj"))
    shard2 = tmp_path / shard_of(tmp_path, default_expert_weight(2, 0, "gate_proj"))
    assert shard1 != shard2
    data = shard2.read_bytes()
    shard2.write_bytes(data[:-10])  # a download cut short
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name, "truncated"])
    raises_one_line(quantize_layer, tmp_path, 2, BF16, {}, match=[shard2.name])
    assert len(read_layer_experts(tmp_path, 1)) == 6  # streaming: layer 1 never touches shard 2
    shard2.write_bytes(data[:5])  # not even a header length
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name])
    shard2.write_bytes(b"\xff" * 8 + data[8:])  # garbage header length
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name, "corrupt"])
    shard2.write_bytes(data[:8] + b"{" * 4 + data[12:])  # unparsable header JSON
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name, "corrupt"])
    shard2.write_bytes(data + b"\0" * 10)  # trailing bytes: refused from the header, as safetensors does
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name, "10 bytes after the last tensor"])
    shard2.unlink()
    raises_one_line(read_layer_experts, tmp_path, 2, match=[shard2.name])


def test_missing_tensor(tmp_path):
    # absent from shard and index, found via the index's expert ids
    name = default_expert_weight(1, 1, "down_proj")
    fake_checkpoint(tmp_path / "a", experts=3, drop=(name,))
    raises_one_line(read_layer_experts, tmp_path / "a", 1, match=["layer 1", name, "missing"])
    raises_one_line(
        quantize_layer,
        tmp_path / "a",
        1,
        FP8,
        {"weight_calibration": "mse"},
        match=[name],
        activation_amax={"gate_up": 1.0, "down": 1.0},
    )
    # the last expert absent altogether: only config.json's num_experts can tell
    last = default_expert_weight(1, 3, "gate_proj")
    config = {"num_experts": 4, "num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"]}
    fake_checkpoint(tmp_path / "b", experts=3, config=config)
    raises_one_line(read_layer_experts, tmp_path / "b", 1, match=["layer 1", last, "missing"])
    raises_one_line(read_layer_experts, tmp_path / "b", 0, match=["layer 0", "dense"])
    # listed in the index but not in the shard it points to
    fake_checkpoint(tmp_path / "c", experts=2)
    shard = tmp_path / "c" / shard_of(tmp_path / "c", name)
    with safe_open(shard, "pt") as handle:
        kept = {n: handle.get_tensor(n) for n in handle.keys() if n != name}  # noqa: SIM118
    save_file(kept, str(shard))
    raises_one_line(read_layer_experts, tmp_path / "c", 1, match=[name, shard.name])
    # no routed experts for that layer at all
    raises_one_line(read_layer_experts, tmp_path / "c", 7, match=["layer 7"])


def test_bad_parameters(tmp_path):
    fake_checkpoint(tmp_path)
    raises_one_line(quantize_layer, tmp_path, 1, "int4", {}, match=["layer 1", "int4"])
    raises_one_line(quantize_layer, tmp_path, 1, NVFP4, {"calibration": "awq"}, match=["layer 1", "awq"])
    raises_one_line(quantize_layer, tmp_path, 1, NVFP4, {}, match=["calibration"])
    raises_one_line(
        quantize_layer, tmp_path, 1, FP8, {"weight_calibration": "mse", "x": 1}, match=["layer 1", "'x'"]
    )
    raises_one_line(
        quantize_layer, tmp_path, 1, FP8, {"weight_calibration": "mse"}, match=["layer 1", "gate_up"]
    )
    raises_one_line(
        quantize_layer,
        tmp_path,
        1,
        FP8,
        {"weight_calibration": "mse"},
        activation_amax={"gate_up": 1.0},
        match=["layer 1", "down"],
    )
    raises_one_line(
        quantize_layer,
        tmp_path,
        1,
        FP8,
        {"weight_calibration": "mse"},
        activation_amax={"gate_up": torch.ones(2), "down": 1.0},
        match=["scalar"],
    )
    raises_one_line(
        quantize_layer,
        tmp_path,
        1,
        FP8,
        {"weight_calibration": "mse"},
        activation_amax={"gate_up": float("nan"), "down": 1.0},
        match=["gate_up"],
    )
    raises_one_line(
        quantize_layer,
        tmp_path,
        1,
        FP8,
        {"weight_calibration": "max"},
        activation_amax={"gate_up": 1.0, "down": 1.0, "routed_tokens": [1, 2, 3]},
        match=["routed_tokens", "2 experts"],
    )
    raises_one_line(read_layer_experts, tmp_path / "nowhere", 1, match=["nowhere"])
