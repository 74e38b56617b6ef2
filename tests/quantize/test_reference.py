"""ModelOpt reference path on a small random Laguna: placement quant_cfg, mtq.quantize, HF export on CPU.

The exported tensors are checked bit for bit against mixquant's standalone numerics (what a streaming
per-layer implementation will use): the NVFP4 fp8-code sweep with the shared gate/up global amax, the FP8
MSE / max weight amax over the fused gate+up slice, and the shared per-layer FP8 input scales computed
from the unquantized model's own routed activations.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.formats.fp8 import fp8_export_tensors, fp8_max_amax, fp8_mse_weight_amax  # noqa: E402
from mixquant.formats.nvfp4 import (  # noqa: E402
    BLOCK_SIZE,
    nvfp4_export_tensors,
    shared_global_amax,
    sweep_nvfp4_block_amax,
)
from mixquant.model import toy_layout  # noqa: E402
from mixquant.quantize.reference import (  # noqa: E402
    BF16,
    FP8,
    NVFP4,
    expert_quantizer_pattern,
    modelopt_calibration_plan,
    modelopt_placement_quant_cfg,
    modelopt_reference_export,
)
from safetensors import safe_open  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_EXPERTS = 16
HIDDEN = 32
MOE_INTER = 16
PLACEMENT = {1: NVFP4, 2: FP8, 3: BF16}  # layer 4 absent -> BF16 too
UNROUTED = {1: 5, 2: 7}  # layer -> an expert no token is routed to (router bias -100)


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
    toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    return out


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(4, 128, (5, 12), generator=torch.Generator().manual_seed(2))


def read_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


def export(source, calibration_ids, out, **algorithms):
    with quiet():
        summary = modelopt_reference_export(
            source, calibration_ids, dict(PLACEMENT), out, batch_size=2, **algorithms
        )
    return summary, read_tensors(out), out


@pytest.fixture(scope="module")
def default_export(source, calibration_ids, tmp_path_factory):
    """Default algorithms: NVFP4 fp8_scale_sweep, FP8 weights mse (one call + FP8 refine pass)."""
    return export(source, calibration_ids, tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def max_export(source, calibration_ids, tmp_path_factory):
    return export(
        source,
        calibration_ids,
        tmp_path_factory.mktemp("ref_max"),
        nvfp4_algorithm="max",
        fp8_weight_algorithm="max",
    )


def expert(tensors: dict, layer: int, e: int, proj: str) -> torch.Tensor:
    return tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]


def expected_names(source_names: list[str], placement: dict[int, str]) -> set[str]:
    extra = {NVFP4: ("weight_scale", "weight_scale_2"), FP8: ("weight_scale", "input_scale")}
    names = set(source_names)
    for layer, fmt in placement.items():
        for suffix in extra.get(fmt, ()):
            names |= {
                f"model.layers.{layer}.mlp.experts.{e}.{p}.{suffix}"
                for e in range(NUM_EXPERTS)
                for p in ("gate_proj", "up_proj", "down_proj")
            }
    return names


# ----------------------------------------------------------------------------------------- config


def test_calibration_plan():
    plan = modelopt_calibration_plan
    assert plan("fp8_sweep", "max").algorithm == {"method": "mse", "fp8_scale_sweep": True}
    assert plan("fp8_sweep", "max").refine == {}
    assert plan("mse", "mse").algorithm == {"method": "mse"} and plan("mse", "mse").refine == {}
    assert plan("max", "max").algorithm == "max" and plan("max", "max").refine == {}
    sweep_mse = plan("fp8_sweep", "mse")
    assert sweep_mse.algorithm == {"method": "mse", "fp8_scale_sweep": True}
    assert list(sweep_mse.refine) == [FP8] and sweep_mse.refine[FP8]["fp8_scale_sweep"] is False
    assert plan("max", "mse").algorithm == "max" and list(plan("max", "mse").refine) == [FP8]
    assert plan("mse", "max").algorithm == "max" and list(plan("mse", "max").refine) == [NVFP4]
    # an absent format imposes nothing
    assert plan("fp8_sweep", "mse", {NVFP4, BF16}).refine == {}
    assert plan("fp8_sweep", "mse", {FP8}).algorithm == {"method": "mse"}
    with pytest.raises(ValueError):
        plan("awq", "mse")
    with pytest.raises(ValueError):
        plan("max", "fp8_sweep")


def test_quant_cfg_enables_only_the_placed_routed_experts(source):
    presets = copy.deepcopy((mtq.W4A16_NVFP4_CFG, mtq.FP8_DEFAULT_CFG))
    quant_cfg, algorithm = modelopt_placement_quant_cfg(
        dict(PLACEMENT), nvfp4_algorithm="max", fp8_weight_algorithm="max"
    )
    assert (mtq.W4A16_NVFP4_CFG, mtq.FP8_DEFAULT_CFG) == presets  # presets untouched
    assert algorithm == "max" and quant_cfg["algorithm"] == "max"
    entries = quant_cfg["quant_cfg"]
    assert entries[0] == {"quantizer_name": "*", "enable": False}
    by_name = {e["quantizer_name"]: e for e in entries[1:]}
    assert set(by_name) == {
        expert_quantizer_pattern(1, "weight"),
        expert_quantizer_pattern(2, "weight"),
        expert_quantizer_pattern(2, "input"),
    }
    nvfp4 = by_name["model.layers.1.mlp.experts.*weight_quantizer"]["cfg"]
    assert nvfp4["num_bits"] == (2, 1) and nvfp4["block_sizes"] == {
        -1: 16,
        "type": "static",
        "scale_bits": (4, 3),
    }
    assert by_name["model.layers.2.mlp.experts.*weight_quantizer"]["cfg"] == {
        "num_bits": (4, 3),
        "axis": None,
    }
    assert by_name["model.layers.2.mlp.experts.*input_quantizer"]["cfg"] == {"num_bits": (4, 3), "axis": None}

    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    with quiet(), cpu_nvfp4_fake_quant(), torch.no_grad():
        mtq.quantize(model, quant_cfg, forward_loop=lambda m: m(input_ids=torch.arange(4, 12)[None]))
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__.startswith("Quant") and "_QuantFusedExperts" in {
        c.__name__ for c in type(experts).__mro__
    }
    assert not hasattr(model.model.layers[1].mlp, "_moe_calib_experts_ratio")  # MoE block not wrapped
    enabled = sorted(
        n for n, m in model.named_modules() if isinstance(m, mtq.nn.TensorQuantizer) and m.is_enabled
    )
    want = [
        f"model.layers.1.mlp.experts.{q}_weight_quantizers.{e}"
        for q in ("gate_up_proj", "down_proj")
        for e in range(NUM_EXPERTS)
    ]
    want += [
        f"model.layers.2.mlp.experts.{q}_weight_quantizers.{e}"
        for q in ("gate_up_proj", "down_proj")
        for e in range(NUM_EXPERTS)
    ]
    want += [f"model.layers.2.mlp.experts.{q}_input_quantizer" for q in ("gate_up_proj", "down_proj")]
    assert enabled == sorted(want)


# ----------------------------------------------------------------------------------------- export layout


def test_export_layout(default_export, source):
    summary, out, _ = default_export
    src = read_tensors(source)
    assert set(out) == expected_names(list(src), PLACEMENT)  # upstream names + scale companions
    assert not [n for n in out if n.endswith(("k_scale", "v_scale")) or "quantizer" in n or "_amax" in n]
    # everything not quantized is copied bit for bit (bf16, upstream names)
    quantized = [
        n for n in src if n.startswith(("model.layers.1.mlp.experts.", "model.layers.2.mlp.experts."))
    ]
    quantized = [n for n in quantized if not n.endswith("e_score_correction_bias")]
    for name, tensor in src.items():
        if name not in quantized:
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensor), name
    h, i = HIDDEN, MOE_INTER
    for e in (0, UNROUTED[1], NUM_EXPERTS - 1):
        p = f"model.layers.1.mlp.experts.{e}"
        for proj, (n, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
            assert out[f"{p}.{proj}.weight"].dtype == torch.uint8 and out[f"{p}.{proj}.weight"].shape == (
                n,
                k // 2,
            )
            assert out[f"{p}.{proj}.weight_scale"].dtype == torch.float8_e4m3fn
            assert out[f"{p}.{proj}.weight_scale"].shape == (n, k // BLOCK_SIZE)
            assert out[f"{p}.{proj}.weight_scale_2"].dtype == torch.float32
            assert out[f"{p}.{proj}.weight_scale_2"].shape == ()
        p = f"model.layers.2.mlp.experts.{e}"
        for proj, (n, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
            assert out[f"{p}.{proj}.weight"].dtype == torch.float8_e4m3fn and out[
                f"{p}.{proj}.weight"
            ].shape == (n, k)
            for s in ("weight_scale", "input_scale"):
                assert out[f"{p}.{proj}.{s}"].dtype == torch.float32 and out[f"{p}.{proj}.{s}"].shape == ()
    hf_quant_config = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": {
                "model.layers.1.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                "model.layers.2.mlp.experts": {"quant_algo": "FP8"},
            },
        },
    }
    assert summary["hf_quant_config"] == hf_quant_config
    assert summary["tensors"][BF16] == sorted(
        n
        for n in src
        if n.startswith(("model.layers.3.mlp.experts.", "model.layers.4.mlp.experts."))
        and not n.endswith("e_score_correction_bias")
    )
    assert summary["algorithm"] == {"method": "mse", "fp8_scale_sweep": True}
    assert [r["format"] for r in summary["refine"]] == [FP8]
    json.dumps(summary)  # serialisable


def test_config_json_and_files(default_export, source):
    summary, _, out_dir = default_export
    assert summary["files"] == [
        "config.json",
        "generation_config.json",
        "hf_quant_config.json",
        "model.safetensors",
    ]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LagunaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["quantization_config"] == {
        "config_groups": {
            "group_0": {
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["model.layers.1.mlp.experts"],
            },
            "group_1": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["model.layers.2.mlp.experts"],
            },
        },
        "quantized_layers": {
            "model.layers.1.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
            "model.layers.2.mlp.experts": {"quant_algo": "FP8"},
        },
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quant_method": "modelopt",
    }
    source_config = json.loads((source / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"}.items() <= source_config.items()


# ----------------------------------------------------------------------------------------- numerics


def assert_nvfp4_expert(out, src, layer, e, block_amax_fn):
    gate, up, down = (expert(src, layer, e, p) for p in ("gate_proj", "up_proj", "down_proj"))
    g_gate_up = shared_global_amax(gate, up)  # one quantizer over the fused [2I, H] slice
    for proj, w, g in (("gate_proj", gate, g_gate_up), ("up_proj", up, g_gate_up), ("down_proj", down, None)):
        g = shared_global_amax(w) if g is None else g
        packed, scale, scale_2 = nvfp4_export_tensors(w, block_amax_fn(w, g), g)
        p = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        assert torch.equal(out[f"{p}.weight"], packed), p
        assert torch.equal(out[f"{p}.weight_scale"].view(torch.uint8), scale.view(torch.uint8)), p
        assert torch.equal(out[f"{p}.weight_scale_2"], scale_2), p


def test_nvfp4_sweep_matches_standalone(default_export, source):
    """Point 3: ModelOpt's fp8_scale_sweep on the fused gate_up slice == sweep_nvfp4_block_amax per
    projection with the shared gate/up global amax; every expert, routed or not."""
    _, out, _ = default_export
    src = read_tensors(source)
    for e in range(NUM_EXPERTS):
        assert_nvfp4_expert(out, src, 1, e, sweep_nvfp4_block_amax)


def test_fp8_mse_matches_standalone(default_export, source):
    """Point 4 in situ: gate/up share one MSE amax over cat([gate, up]); down has its own."""
    _, out, _ = default_export
    src = read_tensors(source)
    for e in range(NUM_EXPERTS):
        gate, up, down = (expert(src, 2, e, p) for p in ("gate_proj", "up_proj", "down_proj"))
        amax_gate_up = fp8_mse_weight_amax(torch.cat([gate, up]))
        for proj, w, amax in (
            ("gate_proj", gate, amax_gate_up),
            ("up_proj", up, amax_gate_up),
            ("down_proj", down, fp8_mse_weight_amax(down)),
        ):
            weight, scale = fp8_export_tensors(w, amax)
            p = f"model.layers.2.mlp.experts.{e}.{proj}"
            assert torch.equal(out[f"{p}.weight_scale"], scale), p
            assert torch.equal(out[f"{p}.weight"].view(torch.uint8), weight.view(torch.uint8)), p


def routed_activation_amax(source, calibration_ids, layer: int, batch_size: int = 2):
    """(max |x| into gate_up, max |act(gate) * up| into down, tokens per expert) over routed tokens,
    from the unquantized bf16 model with eager experts, batched like the reference forward loop."""
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16, experts_implementation="eager")
    experts = model.model.layers[layer].mlp.experts
    gate_up_amax, down_amax = [], []
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.long)

    def hook(module, args):
        hidden, top_k_index, _ = args
        for e in range(module.num_experts):
            token_idx = (top_k_index == e).any(dim=-1).nonzero().flatten()
            counts[e] += token_idx.numel()
            if token_idx.numel() == 0:
                continue
            x = hidden[token_idx]
            gate, up = F.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
            gate_up_amax.append(x.abs().amax())
            down_amax.append((module.act_fn(gate) * up).abs().amax())

    experts.register_forward_pre_hook(hook)
    with quiet(), torch.no_grad():
        for start in range(0, calibration_ids.shape[0], batch_size):
            model(input_ids=calibration_ids[start : start + batch_size], use_cache=False)
    return torch.stack(gate_up_amax).amax(), torch.stack(down_amax).amax(), counts


def test_fp8_input_scales_shared_per_layer(default_export, source, calibration_ids):
    """Point 1: one input quantizer per projection per layer; its amax is the max over the tokens routed
    to any expert, from the unquantized model; an expert without tokens gets the same input_scale."""
    _, out, _ = default_export
    gate_up_amax, down_amax, counts = routed_activation_amax(source, calibration_ids, 2)
    assert counts[UNROUTED[2]] == 0 and (counts > 0).sum() > 1
    for e in range(NUM_EXPERTS):
        p = f"model.layers.2.mlp.experts.{e}"
        assert torch.equal(out[f"{p}.gate_proj.input_scale"], gate_up_amax.float() / 448)
        assert torch.equal(out[f"{p}.up_proj.input_scale"], gate_up_amax.float() / 448)
        assert torch.equal(out[f"{p}.down_proj.input_scale"], down_amax.float() / 448)


def test_max_algorithms(max_export, source):
    """nvfp4 max (static per-block max) and FP8 max: standalone numerics reproduce the export too."""
    summary, out, _ = max_export
    assert summary["algorithm"] == "max" and summary["refine"] == []
    src = read_tensors(source)

    def block_max(w, _global_amax):
        return w.float().abs().reshape(-1, BLOCK_SIZE).amax(dim=1, keepdim=True)

    for e in range(NUM_EXPERTS):
        assert_nvfp4_expert(out, src, 1, e, block_max)
        gate, up, down = (expert(src, 2, e, p) for p in ("gate_proj", "up_proj", "down_proj"))
        for proj, w, amax in (
            ("gate_proj", gate, fp8_max_amax(torch.cat([gate, up]))),
            ("up_proj", up, fp8_max_amax(torch.cat([gate, up]))),
            ("down_proj", down, fp8_max_amax(down)),
        ):
            weight, scale = fp8_export_tensors(w, amax)
            p = f"model.layers.2.mlp.experts.{e}.{proj}"
            assert torch.equal(out[f"{p}.weight_scale"], scale), p
            assert torch.equal(out[f"{p}.weight"].view(torch.uint8), weight.view(torch.uint8)), p


def test_algorithms_are_not_trivial(default_export, max_export):
    """The sweep / MSE results differ from max, so the bit-exact checks above discriminate."""
    _, out, _ = default_export
    _, out_max, _ = max_export
    for name in out:
        if ".experts." in name and name.endswith("weight_scale") and ".layers.3." not in name:
            differ = not torch.equal(out[name].view(torch.uint8), out_max[name].view(torch.uint8))
            if differ:
                break
    else:
        pytest.fail("no expert scale differs between the default and the max algorithms")
    fp8_differ = [
        e
        for e in range(NUM_EXPERTS)
        if not torch.equal(
            out[f"model.layers.2.mlp.experts.{e}.down_proj.weight_scale"],
            out_max[f"model.layers.2.mlp.experts.{e}.down_proj.weight_scale"],
        )
    ]
    nvfp4_differ = [
        e
        for e in range(NUM_EXPERTS)
        if not torch.equal(
            out[f"model.layers.1.mlp.experts.{e}.gate_proj.weight_scale"].view(torch.uint8),
            out_max[f"model.layers.1.mlp.experts.{e}.gate_proj.weight_scale"].view(torch.uint8),
        )
    ]
    assert len(fp8_differ) > NUM_EXPERTS // 2 and len(nvfp4_differ) > NUM_EXPERTS // 2


def test_two_step_plans_equal_single_call_results(
    source, calibration_ids, tmp_path, default_export, max_export
):
    """The refine pass reproduces what a per-format algorithm gives: (mse, mse) is one mtq call; its FP8
    experts equal the (fp8_sweep, mse) export's and its NVFP4 experts equal the (mse, max) export's, whose
    FP8 experts equal the (max, max) export's."""
    _, mse_mse, _ = export(
        source, calibration_ids, tmp_path / "mm", nvfp4_algorithm="mse", fp8_weight_algorithm="mse"
    )
    summary, mse_max, _ = export(
        source, calibration_ids, tmp_path / "mx", nvfp4_algorithm="mse", fp8_weight_algorithm="max"
    )
    assert summary["algorithm"] == "max" and [r["format"] for r in summary["refine"]] == [NVFP4]
    _, sweep_mse, _ = default_export
    _, max_max, _ = max_export

    def layer(tensors, index):
        prefix = f"model.layers.{index}.mlp.experts."
        return {
            k: v.view(torch.uint8) if v.element_size() == 1 else v
            for k, v in tensors.items()
            if k.startswith(prefix)
        }

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(layer(mse_mse, 2), layer(sweep_mse, 2))
    assert same(layer(mse_mse, 1), layer(mse_max, 1))
    assert same(layer(mse_max, 2), layer(max_max, 2))
    assert not same(layer(mse_mse, 1), layer(sweep_mse, 1))
