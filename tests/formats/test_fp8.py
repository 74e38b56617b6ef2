"""mixquant's standalone FP8 numerics equal ModelOpt's calibration and export, bit for bit."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.formats.fp8 import (  # noqa: E402
    fp8_export_tensors,
    fp8_fake_quant,
    fp8_max_amax,
    fp8_mse_weight_amax,
    mse_multipliers,
)
from modelopt.torch.export.unified_export_hf import _export_quantized_weight  # noqa: E402
from modelopt.torch.quantization.calib import MseCalibrator  # noqa: E402
from modelopt.torch.quantization.tensor_quant import fp8_eager  # noqa: E402

torch.set_num_threads(1)


def _weight(kind: str, shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # StudentT samples from the global generator
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    if kind == "outliers":
        w[torch.rand(shape, generator=gen) < 3e-3] *= 40.0
    elif kind == "heavy_tail":
        w = torch.distributions.StudentT(2.0).sample(shape) * 0.01
    elif kind == "tiny":  # deep in E4M3's subnormal range for most candidates
        w *= 1e-5
    elif kind == "sparse":
        w[torch.rand(shape, generator=gen) < 0.9] = 0.0
    elif kind == "zeros":
        w.zero_()
    return w.to(dtype)


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def modelopt_fp8_weight(w: torch.Tensor, algorithm) -> torch.nn.Linear:
    """An nn.Linear holding ``w`` after mtq.quantize with FP8_DEFAULT_CFG weights (inputs disabled)."""
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") != "*input_quantizer"]
    cfg["algorithm"] = algorithm
    model = torch.nn.Sequential(_linear(w))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        mtq.quantize(model, cfg, None)
    return model[0]


KINDS = ["gaussian", "outliers", "heavy_tail", "tiny", "sparse"]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def test_mse_multipliers_are_modelopts():
    ref = MseCalibrator(amax=torch.tensor(1.0))._generate_candidates(torch.device("cpu"))
    ours = mse_multipliers()
    assert ours.dtype == torch.float32 and ours.numel() == 39
    assert torch.equal(ours, ref)
    assert ours[0] == 0.25 and ours[-1] == 4.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_is_fp8_eager(dtype):
    x = _weight("outliers", (32, 64), torch.float32, 0).to(dtype)
    for amax in (x.abs().amax(), x.abs().amax() * 0.3, x.abs().amax() * 3.7, torch.tensor(0.0)):
        for a in (amax.float(), amax.to(dtype)):
            assert torch.equal(fp8_fake_quant(x, a), fp8_eager(x, a))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mse_amax_equals_modelopt(kind, dtype, seed):
    w = _weight(kind, (48, 80), dtype, seed)
    ref = modelopt_fp8_weight(w, {"method": "mse"}).weight_quantizer._amax
    ours = fp8_mse_weight_amax(w)
    assert ours.dtype == ref.dtype == dtype and ours.shape == ref.shape == ()
    assert torch.equal(ours, ref)


def test_mse_amax_edge_cases():
    for w in (
        _weight("zeros", (16, 32), torch.bfloat16, 0),
        torch.full((16, 32), 0.01, dtype=torch.bfloat16),
    ):
        ref = modelopt_fp8_weight(w, {"method": "mse"}).weight_quantizer._amax
        assert torch.equal(fp8_mse_weight_amax(w), ref)


def test_mse_amax_is_rounded_to_weight_dtype():
    """ModelOpt copies the fp32 winner into the bf16 ``_amax`` buffer: the stored amax is bf16-rounded."""
    rounded = 0
    for seed in range(8):
        w = _weight("gaussian", (32, 64), torch.bfloat16, seed)
        amax = fp8_mse_weight_amax(w)
        exact = fp8_max_amax(w).float() * mse_multipliers()
        assert amax.dtype == torch.bfloat16 and torch.isin(amax.float(), exact.to(torch.bfloat16).float())
        rounded += not torch.isin(amax.float(), exact).item()
    assert rounded > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_amax_equals_modelopt(dtype):
    w = _weight("outliers", (48, 80), dtype, 3)
    ref = modelopt_fp8_weight(w, "max").weight_quantizer._amax
    assert torch.equal(fp8_max_amax(w), ref) and fp8_max_amax(w).dtype == dtype


@pytest.mark.parametrize("algorithm", ["max", {"method": "mse"}])
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
def test_export_tensors_equal_modelopt_export(kind, algorithm):
    """``(w / weight_scale).to(e4m3)`` in the weight dtype, ``weight_scale = fp32(amax) / 448``."""
    w = _weight(kind, (48, 80), torch.bfloat16, 5)
    lin = modelopt_fp8_weight(w, algorithm)
    amax = lin.weight_quantizer._amax.clone()
    _export_quantized_weight(lin, torch.bfloat16)
    ours_w, ours_scale = fp8_export_tensors(w, amax)
    assert lin.weight.dtype == ours_w.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.weight.view(torch.uint8), ours_w.view(torch.uint8))
    assert lin.weight_scale.dtype == ours_scale.dtype == torch.float32 and ours_scale.shape == ()
    assert torch.equal(lin.weight_scale, ours_scale)
