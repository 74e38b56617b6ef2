"""mixquant's fast FP8-code sweep picks exactly the per-block scales of ModelOpt's reference calibration."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.formats.nvfp4 import (  # noqa: E402
    _round_e2m1_,
    modelopt_reference_block_amax,
    nvfp4_export_tensors,
    nvfp4_w4a16_static_config,
    shared_global_amax,
    sweep_nvfp4_block_amax,
)
from modelopt.torch.export.quant_utils import (  # noqa: E402
    get_quantization_format,
    get_weight_scaling_factor,
    get_weight_scaling_factor_2,
    to_quantized_weight,
)
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="reference runs through the CPU replacement"
)


def _weight(kind: str, shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # StudentT samples from the global generator
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    if kind == "outliers":
        w[torch.rand(shape, generator=gen) < 2e-3] *= 40.0
    elif kind == "heavy_tail":
        w = torch.distributions.StudentT(2.0).sample(shape) * 0.01
    elif kind == "zero_and_tiny_blocks":
        w[1, :32] = 0.0
        w[2, 16:32] = -0.0
        w[3, :16] *= 1e-6  # scale clamps at 2**-9: every candidate below some code gives the same loss
        w[4, :16] = 0.0
        w[4, 5] = 0.3  # single non-zero element: many candidates quantize it exactly (ties)
        w[5, :16] = torch.tensor([1.0, -1.0] * 8) * 0.01  # all elements equal in magnitude
    elif kind == "small_values":
        w *= 1e-4
    return w.to(dtype)


CASES = [
    ("gaussian", (64, 256), torch.bfloat16),
    ("outliers", (96, 128), torch.bfloat16),
    ("outliers", (64, 160), torch.float32),
    ("heavy_tail", (32, 512), torch.float32),
    ("zero_and_tiny_blocks", (16, 64), torch.bfloat16),
    ("gaussian", (48, 64), torch.float16),
    ("small_values", (32, 128), torch.bfloat16),
    ("gaussian", (24, 40), torch.bfloat16),  # ragged K: ModelOpt zero-pads the last block
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("kind", "shape", "dtype"), CASES)
def test_identical_to_modelopt_reference(kind, shape, dtype, seed):
    w = _weight(kind, shape, dtype, seed=seed)
    (ref_amax,), global_amax = modelopt_reference_block_amax(w)
    ours = sweep_nvfp4_block_amax(w, global_amax)
    assert ours.dtype == torch.float32 and ours.shape == ref_amax.shape
    assert torch.equal(ours, ref_amax)
    assert torch.equal(sweep_nvfp4_block_amax(w), ref_amax)  # default global amax = max |w|
    assert torch.equal(sweep_nvfp4_block_amax(w, global_amax, chunk_rows=1), ref_amax)
    assert torch.equal(sweep_nvfp4_block_amax(w, global_amax, chunk_rows=5), ref_amax)


def test_zero_blocks_pick_the_first_candidate():
    w = _weight("zero_and_tiny_blocks", (16, 64), torch.bfloat16, 0)
    amax = sweep_nvfp4_block_amax(w).view(16, 4)
    g = w.abs().amax().float()
    assert amax[1, 0] == amax[1, 1] == amax[2, 1] == g * (2.0**-9 / 448)  # all losses 0 -> argmin 0


def test_all_zero_weight():
    w = torch.zeros(8, 32)
    (ref_amax,), _ = modelopt_reference_block_amax(w)
    assert torch.equal(sweep_nvfp4_block_amax(w), ref_amax)
    assert not ref_amax.any()


@pytest.mark.parametrize("names", [2, 3])
def test_shared_global_amax_siblings(names):
    """gate/up (or q/k/v): ModelOpt gives the siblings one global amax before the sweep; so do we."""
    weights = [_weight("gaussian", (32, 64), torch.bfloat16, i) * (1 + i) for i in range(names)]
    ref_amaxes, global_amax = modelopt_reference_block_amax(*weights)
    assert torch.equal(shared_global_amax(*weights), global_amax)
    for w, ref in zip(weights, ref_amaxes, strict=True):
        assert torch.equal(sweep_nvfp4_block_amax(w, global_amax), ref)
    assert not torch.equal(sweep_nvfp4_block_amax(weights[0]), ref_amaxes[0])  # own amax would differ


def test_3d_expert_weights_are_row_blocks():
    w = _weight("outliers", (4 * 16, 64), torch.bfloat16, 3)
    g = w.abs().amax()
    assert torch.equal(sweep_nvfp4_block_amax(w.view(4, 16, 64), g), sweep_nvfp4_block_amax(w, g))


def test_round_e2m1_matches_modelopt_cast_fp4():
    """Arithmetic E2M1 rounding == NVFP4QTensor._cast_fp4 (searchsorted + tie fix) on a dense fp32 sweep."""
    top = torch.tensor(8.0).view(torch.int32).item()
    dense = torch.arange(0, top, 997, dtype=torch.int32).view(torch.float32)
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    near = [grid]
    for direction in (0.0, 100.0):
        t = grid.clone()
        for _ in range(4):
            t = torch.nextafter(t, torch.tensor(direction))
            near.append(t)
    special = torch.tensor([1e-45, 1e-38, 1e-10, 6.5, 100.0, 3e38, float("inf")])
    t = torch.cat([dense, *near, special]).abs()
    expected = NVFP4QTensor.get_e2m1_values("cpu")[NVFP4QTensor._cast_fp4(t.clone()).long()]
    ours = _round_e2m1_(t.clone())
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


def test_export_tensors_match_modelopt_export():
    """nvfp4_export_tensors(weight, our amax) == what the HF-export helpers write for ModelOpt's model."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=False).to(torch.bfloat16)
    model = torch.nn.Sequential(linear)
    with cpu_nvfp4_fake_quant():
        mtq.quantize(model, nvfp4_w4a16_static_config({"method": "mse", "fp8_scale_sweep": True}), None)
    quantizer = linear.weight_quantizer
    ours_amax = sweep_nvfp4_block_amax(linear.weight, quantizer.global_amax)
    assert torch.equal(ours_amax, quantizer._amax)

    packed, weight_scale, weight_scale_2 = nvfp4_export_tensors(
        linear.weight, ours_amax, quantizer.global_amax
    )
    ref_scale = get_weight_scaling_factor(linear)
    ref_scale_2 = get_weight_scaling_factor_2(linear)
    ref_packed = to_quantized_weight(
        linear.weight, ref_scale, get_quantization_format(linear), ref_scale_2, 16
    )
    assert packed.dtype == torch.uint8 and packed.shape == (48, 64)
    assert weight_scale.dtype == torch.float8_e4m3fn and weight_scale.shape == (48, 8)
    assert weight_scale_2.dtype == torch.float32 and weight_scale_2.ndim == 0
    assert torch.equal(packed, ref_packed)
    assert torch.equal(weight_scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(weight_scale_2, ref_scale_2)


def _load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nvfp4_sweep.py"
    spec = importlib.util.spec_from_file_location("bench_nvfp4_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extra_memory_below_weight_size():
    bench = _load_benchmark()
    w = bench.make_weight(2048, 1024, torch.bfloat16, seed=0)  # 4 MiB
    g = w.abs().amax().float()
    peak = bench.measure_tensor_memory(lambda: sweep_nvfp4_block_amax(w, g))
    assert 0 < peak <= w.numel() * w.element_size()


def test_tensor_memory_tracker_counts_fresh_storages_only():
    bench = _load_benchmark()
    base = torch.ones(1 << 20)

    def fn():
        a = torch.ones(1 << 18)  # 1 MiB
        b = base.view(-1)[: 1 << 10]  # a view of a pre-existing storage: not counted
        b.add_(1)
        c = a * 2  # +1 MiB while a is alive
        del a
        return c.sum()

    assert bench.measure_tensor_memory(fn) == 2 << 20
