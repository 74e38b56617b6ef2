"""CPU NVFP4 fake quant == ModelOpt's export numerics, bit for bit, through ModelOpt's own call paths."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.formats import cpu_fake_quant as cfq  # noqa: E402
from modelopt.torch.quantization import tensor_quant  # noqa: E402
from modelopt.torch.quantization.config import QuantizerAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import StaticBlockScaleQuantizer, TensorQuantizer  # noqa: E402
from modelopt.torch.quantization.nn.modules import tensor_quantizer  # noqa: E402
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU replacement is only installed without CUDA"
)

# Global amax whose weight_scale_2 = amax / (6 * 448) is exactly 2**-10, so chosen block scales are exact.
G = 2688.0 * 2.0**-10
WSF2 = 2.0**-10
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


@pytest.fixture(autouse=True)
def _patched():
    with cfq.cpu_nvfp4_fake_quant() as active:
        assert active
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)
    assert torch.equal(_bits(a), _bits(b)), "equal values but different bit patterns (signed zeros?)"


def special_blocks(dtype: torch.dtype) -> torch.Tensor:
    """16-element blocks covering the corner cases; all values exactly representable in bf16."""
    s8 = 8 * WSF2  # a block whose amax is 6 * s8 gets E4M3 scale code 8.0 exactly: x / scale is exact
    ties = torch.tensor([6.0, *TIES, *[-t for t in TIES], -0.0]) * s8
    blocks = [
        torch.zeros(16),  # zero block
        torch.tensor([-0.0, 0.0] * 8),  # zero block with negative zeros
        ties,  # values exactly halfway between E2M1 grid points after scaling
        torch.tensor([6.0, 0.1, -0.1, 0.24, 0.26, -0.74, 0.76, 3.0, 4.0, 5.5, -6.0, 1.0, 1.5, 2.0, -0.0, 0.5])
        * s8,
        # fp8(8.4) = 8 rounds the scale down: the largest elements exceed 6 * scale and saturate
        torch.linspace(-1.0, 1.0, 16) * 6 * 8.4 * WSF2,
        torch.linspace(0.0, 1.0, 16) * 1e-6 * G,  # tiny vs the global amax: scale clamped up to 2**-9
        torch.linspace(0.0, 1.0, 16) * 1e-5 * G,  # small: E4M3 subnormal scale, largest values saturate
        torch.linspace(-1.0, 0.5, 16) * 6 * 3 * 2.0**-9 * WSF2,  # E4M3 subnormal scale code (3 * 2**-9)
        torch.linspace(-1.0, 0.3, 16) * 6 * 0.02 * WSF2,  # scale code in the subnormal range, rounded
        torch.full((16,), G),  # the global max itself: scale code 448
        torch.tensor([1e-30] + [0.0] * 15),  # a lone denormal-ish value
    ]
    return torch.stack(blocks).to(dtype)


def nasty_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random Gaussian blocks with the special blocks written over the first ones."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 0.2 * G).clamp(-G, G).to(dtype)
    flat = x.view(-1, 16)
    special = special_blocks(dtype)
    n = min(len(special), flat.shape[0])
    perm = torch.randperm(flat.shape[0], generator=gen)[:n]
    flat[perm] = special[:n]
    return x


SHAPES = [(16,), (1, 16), (3, 32), (7, 48), (2, 3, 64), (5, 4, 128), (64, 256)]
DTYPES = [torch.bfloat16, torch.float32]


def dynamic_quantizer(amax: float) -> TensorQuantizer:
    q = TensorQuantizer(
        QuantizerAttributeConfig(
            num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
        )
    )
    q.amax = torch.tensor(amax)
    return q


def export_reference(q, x: torch.Tensor) -> torch.Tensor:
    """dequantize(NVFP4QTensor.quantize(...)) with the scales HF export derives from quantizer ``q``."""
    wsf2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(q)
    wsf, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(q, x, wsf2)
    packed, wsf, wsf2 = NVFP4QTensor.quantize(x, 16, wsf, wsf2)
    return packed.dequantize(dtype=x.dtype, scale=wsf, double_scale=wsf2, block_sizes={-1: 16})


def static_quantizer(x: torch.Tensor, global_amax: float | None = None) -> StaticBlockScaleQuantizer:
    """A max-calibrated static NVFP4 quantizer for ``x``, promoted like ModelOpt does after calibration."""
    q = TensorQuantizer(
        QuantizerAttributeConfig(
            num_bits=(2, 1), block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3)}
        )
    )
    q.enable_calib()
    q.disable_quant()
    q(x)
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()
    g = torch.tensor(G if global_amax is None else global_amax)
    return StaticBlockScaleQuantizer.from_tensor_quantizer(q, global_amax=g)


def test_install_is_idempotent_and_reversible():
    cfq.uninstall_cpu_nvfp4_fake_quant()
    assert tensor_quant.dynamic_block_quantize_op is cfq._ORIG_DYNAMIC_OP
    assert tensor_quantizer.static_blockwise_fp4_fake_quant is cfq._ORIG_STATIC_FN
    assert not cfq.is_installed()
    assert cfq.install_cpu_nvfp4_fake_quant() is True
    assert cfq.install_cpu_nvfp4_fake_quant() is True
    assert cfq.is_installed()
    with cfq.cpu_nvfp4_fake_quant() as active:  # nested: already installed, stays installed on exit
        assert active
    assert cfq.is_installed()
    cfq.uninstall_cpu_nvfp4_fake_quant()
    with cfq.cpu_nvfp4_fake_quant():
        assert cfq.is_installed()
    assert not cfq.is_installed()
    cfq.install_cpu_nvfp4_fake_quant()


def test_unpatched_modelopt_cannot_fake_quant_nvfp4_on_cpu():
    x = nasty_tensor((4, 32), torch.float32, 0)
    cfq.uninstall_cpu_nvfp4_fake_quant()
    try:
        with pytest.raises((AssertionError, RuntimeError)):
            dynamic_quantizer(G)(x)
        q = static_quantizer(x)
        with pytest.raises(RuntimeError, match="triton"):
            q(x)
    finally:
        cfq.install_cpu_nvfp4_fake_quant()


def test_e2m1_rounding_ties_saturation_and_signed_zero():
    """Hand-checked E2M1 (scale exactly 1.0): RNE ties, saturation at 6, -0 and tiny negatives -> +0."""
    x = torch.tensor(
        [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, -0.25, -1.75, -0.1, -0.0, 2.9]
    )
    expected = torch.tensor([6, 0, 1, 1, 2, 2, 4, 4, 0.5, 0.5, 6, 0, -2, 0, 0, 3.0])
    q = dynamic_quantizer(336.0)  # weight_scale_2 = 336 / 2688 = 1/8; block amax 6 -> E4M3 code 8 -> scale 1
    out = q(x.view(1, 16)).view(-1)
    assert_bit_equal(out, expected)
    assert_bit_equal(out, export_reference(q, x.view(1, 16)).view(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_matches_export(shape, dtype):
    x = nasty_tensor(shape, dtype, seed=len(shape) * 100 + shape[-1])
    q = dynamic_quantizer(G)
    out = q(x)  # TensorQuantizer._fake_quantize -> dynamic_block_quant -> dynamic_block_quantize_op
    assert_bit_equal(out, export_reference(q, x))
    # The functional entry point behind the quantizer, called directly.
    direct = tensor_quant.dynamic_block_quant(x, 16, torch.tensor(G), None, (2, 1), (4, 3), None, None, True)
    assert_bit_equal(direct, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_saturates_when_inputs_exceed_amax(dtype):
    """Activation-style use: inputs far above the calibrated amax -> scales clamp at 448, values saturate."""
    x = nasty_tensor((8, 64), dtype, seed=7)
    q = dynamic_quantizer(G / 50)
    out = q(x)
    assert_bit_equal(out, export_reference(q, x))
    top = 6 * 448 * (G / 50) / 2688  # 6 * the largest block scale (E4M3 448 * weight_scale_2)
    assert abs(out.abs().max().item() - top) <= 1e-2 * top
    assert (out.abs() == out.abs().max()).float().mean() > 0.5  # most values saturated


def test_dynamic_ragged_last_dim_is_zero_padded():
    x = nasty_tensor((5, 48), torch.float32, seed=3)[:, :40].contiguous()
    out = dynamic_quantizer(G)(x)
    padded = torch.nn.functional.pad(x, (0, 8))
    assert_bit_equal(out, export_reference(dynamic_quantizer(G), padded)[:, :40].contiguous())


def test_dynamic_zero_global_amax_gives_zeros():
    x = torch.zeros(2, 32)
    assert_bit_equal(dynamic_quantizer(0.0)(x), torch.zeros(2, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_static_matches_export(shape, dtype):
    x = nasty_tensor(shape, dtype, seed=len(shape) * 1000 + shape[-1])
    q = static_quantizer(x)
    out = q(x)  # StaticBlockScaleQuantizer._fake_quantize -> static_blockwise_fp4_fake_quant
    assert_bit_equal(out, export_reference(q, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_precomputed_amax_saturation_and_tiny_scales(dtype):
    """Per-block amax set by hand (as MSE calibration does): below, above and far below the block max."""
    x = nasty_tensor((16, 64), dtype, seed=11)
    q = static_quantizer(x)
    gen = torch.Generator().manual_seed(0)
    factors = torch.tensor([0.3, 0.77, 1.0, 1.9, 1e-7])[torch.randint(0, 5, q.amax.shape, generator=gen)]
    q.amax = q.amax * factors  # < 1: saturation; 1e-7: scale hits the 2**-9 clamp
    out = q(x)
    assert_bit_equal(out, export_reference(q, x))
    # The patched call site, called directly with ModelOpt's argument order.
    direct = tensor_quantizer.static_blockwise_fp4_fake_quant(
        x, q.amax, q.global_amax, True, 448.0, dtype, False
    )
    assert_bit_equal(direct, out)


def test_static_global_amax_above_tensor_max():
    """A shared (sibling) global amax larger than this tensor's own max, as for gate/up."""
    x = nasty_tensor((8, 64), torch.bfloat16, seed=5) * 0.1
    q = static_quantizer(x, global_amax=G * 3.7)
    assert_bit_equal(q(x), export_reference(q, x))


def test_static_backward_is_modelopts_ste():
    x = nasty_tensor((4, 32), torch.float32, seed=2).requires_grad_(True)
    q = static_quantizer(x.detach())
    q.amax = q.amax * 0.5
    q(x).sum().backward()
    if q._pass_through_bwd:
        expected = torch.ones_like(x)
    else:  # straight-through with clipping at the per-block amax
        expected = (x.detach().view(-1, 16).abs() <= q.amax).to(x.dtype).view_as(x)
    assert torch.equal(x.grad, expected)
