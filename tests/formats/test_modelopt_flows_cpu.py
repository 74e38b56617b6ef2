"""ModelOpt's mtq.quantize flows (max; mse + fp8_scale_sweep) run on CPU with the patch and match export."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.formats.nvfp4 import nvfp4_w4a16_static_config  # noqa: E402
from modelopt.torch.export.quant_utils import (  # noqa: E402
    get_quantization_format,
    get_weight_scaling_factor,
    get_weight_scaling_factor_2,
    preprocess_linear_fusion,
    to_quantized_weight,
)
from modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates import fp8_scale_candidates  # noqa: E402
from modelopt.torch.quantization.calib import MaxCalibrator, NVFP4MSECalibrator  # noqa: E402
from modelopt.torch.quantization.nn import StaticBlockScaleQuantizer  # noqa: E402
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU replacement is only installed without CUDA"
)

LAYERS = ("gate_proj", "up_proj", "down_proj", "head")


class TinyMLP(nn.Module):
    """A gated MLP (gate/up share their input, as in an MoE expert) plus a biased head."""

    def __init__(self, hidden: int = 64, inter: int = 96, out: int = 32):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.head = nn.Linear(hidden, out)
        with torch.no_grad():
            self.up_proj.weight.mul_(3.0)  # siblings with clearly different amax
            self.down_proj.weight[5, :16] = 0.0  # a zero block
            self.down_proj.weight[7, 3] = 1.5  # an outlier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


@pytest.fixture(autouse=True)
def _patched():
    with cpu_nvfp4_fake_quant():
        yield


def export_dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The weight as ModelOpt's HF export writes it (packed E2M1, E4M3 scales, fp32 scale_2), dequantized."""
    fmt = get_quantization_format(module)
    wsf = get_weight_scaling_factor(module)
    wsf2 = get_weight_scaling_factor_2(module)
    packed = to_quantized_weight(module.weight, wsf, fmt, wsf2, 16)
    assert packed.dtype == torch.uint8 and wsf.dtype == torch.float8_e4m3fn and wsf2.dtype == torch.float32
    qtensor = NVFP4QTensor(module.weight.shape, module.weight.dtype, packed)
    return qtensor.dequantize(scale=wsf, double_scale=wsf2, block_sizes={-1: 16})


def reference_forward(model: TinyMLP, x: torch.Tensor) -> torch.Tensor:
    w = {name: export_dequantized_weight(getattr(model, name)) for name in LAYERS}
    h = F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
    return F.linear(h, w["head"], model.head.bias)


def quantize(cfg: dict, dtype: torch.dtype) -> tuple[TinyMLP, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyMLP().to(dtype)
    x = torch.randn(4, 64, dtype=dtype)
    mtq.quantize(model, cfg, forward_loop=lambda m: m(x))
    return model, x


def assert_matches_export(model: TinyMLP, x: torch.Tensor) -> None:
    for name in LAYERS:
        module = getattr(model, name)
        assert get_quantization_format(module) == "w4a16_nvfp4"
        assert torch.equal(module.weight_quantizer(module.weight), export_dequantized_weight(module)), name
    with torch.no_grad():
        assert torch.equal(model(x), reference_forward(model, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_max_calibration_w4a16_preset(dtype):
    """The W4A16_NVFP4_CFG preset as shipped: dynamic block scales, per-tensor amax from max calibration."""
    preset = copy.deepcopy(mtq.W4A16_NVFP4_CFG)
    model, x = quantize(copy.deepcopy(mtq.W4A16_NVFP4_CFG), dtype)
    assert mtq.W4A16_NVFP4_CFG == preset  # ModelOpt's shared preset untouched
    q = model.gate_proj.weight_quantizer
    assert type(q).__name__ == "TensorQuantizer" and q.block_sizes["type"] == "dynamic"
    assert isinstance(q._calibrator, MaxCalibrator) and q.amax.numel() == 1
    assert_matches_export(model, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mse_fp8_scale_sweep(dtype):
    """Static weights + {"method": "mse", "fp8_scale_sweep": True}: ModelOpt's reference sweep, on CPU."""
    model, x = quantize(nvfp4_w4a16_static_config({"method": "mse", "fp8_scale_sweep": True}), dtype)
    gate, up, down = (getattr(model, n).weight_quantizer for n in ("gate_proj", "up_proj", "down_proj"))
    for q, module in ((gate, model.gate_proj), (up, model.up_proj), (down, model.down_proj)):
        assert isinstance(q, StaticBlockScaleQuantizer) and q.is_nvfp4_static
        assert isinstance(q._calibrator, NVFP4MSECalibrator)
        assert q._amax.dtype == torch.float32 and q._amax.shape == (module.weight.numel() // 16, 1)
        # Every per-block amax is one of the 126 candidates global_amax * e4m3 / 448.
        candidates = q.global_amax * fp8_scale_candidates()
        assert torch.isin(q._amax, candidates).all()
    # gate/up share one global amax (the max of both), fixed before the sweep; down has its own.
    assert torch.equal(gate.global_amax, up.global_amax)
    assert (
        gate.global_amax == max(model.gate_proj.weight.abs().max(), model.up_proj.weight.abs().max()).float()
    )
    assert down.global_amax == model.down_proj.weight.abs().max().float()
    # The sweep moved some blocks away from their max-calibrated amax.
    max_amax = model.down_proj.weight.detach().float().abs().view(-1, 16).amax(1, keepdim=True)
    assert not torch.equal(down._amax, max_amax)
    assert_matches_export(model, x)


def test_max_calibration_static_weights():
    model, x = quantize(nvfp4_w4a16_static_config("max"), torch.bfloat16)
    q = model.down_proj.weight_quantizer
    assert isinstance(q, StaticBlockScaleQuantizer)
    assert torch.equal(
        q._amax, model.down_proj.weight.detach().float().abs().view(-1, 16).amax(1, keepdim=True)
    )
    assert_matches_export(model, x)


def test_w4a16_dynamic_gate_up_scale_unified_only_at_export():
    """ModelOpt behaviour worth knowing: with the dynamic W4A16 preset, gate/up are calibrated (and
    fake-quantized) with their own per-tensor amax; export's preprocess_linear_fusion later gives both the
    max, so the smaller sibling's exported weight_scale_2 differs from the one its fake quant used."""
    model, _ = quantize(copy.deepcopy(mtq.W4A16_NVFP4_CFG), torch.bfloat16)
    gate_before = get_weight_scaling_factor_2(model.gate_proj)
    assert not torch.equal(gate_before, get_weight_scaling_factor_2(model.up_proj))
    preprocess_linear_fusion([model.gate_proj, model.up_proj])
    assert torch.equal(
        get_weight_scaling_factor_2(model.gate_proj), get_weight_scaling_factor_2(model.up_proj)
    )
    assert get_weight_scaling_factor_2(model.gate_proj) > gate_before


@pytest.mark.parametrize("method", ["gradient", "kl_div"])
def test_auto_quantize_scores_on_cpu(method):
    """auto_quantize (both score methods) fake-quantizes NVFP4 candidates; it runs on CPU with the patch."""
    torch.manual_seed(0)
    model = TinyMLP()
    data = [torch.randn(4, 64) for _ in range(2)]
    kwargs = {"forward_step": lambda m, batch: m(batch)}
    if method == "gradient":
        kwargs["loss_func"] = lambda out, batch: out.pow(2).mean()
    formats = [copy.deepcopy(mtq.W4A16_NVFP4_CFG), copy.deepcopy(mtq.FP8_DEFAULT_CFG)]
    _, state = mtq.auto_quantize(
        model,
        constraints={"effective_bits": 6.0},
        quantization_formats=formats,
        data_loader=data,
        num_calib_steps=2,
        num_score_steps=2,
        method=method,
        **kwargs,
    )
    assert state["best"]["is_satisfied"]
