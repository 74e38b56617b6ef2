"""Pure-torch CPU stand-ins for the two CUDA/Triton-only NVFP4 fake-quant call sites of ModelOpt 0.47.

ModelOpt's NVFP4 *export* numerics (``NVFP4QTensor.quantize`` / ``.dequantize``) are pure torch and
run on CPU, but its NVFP4 *fake quantization* -- what ``mtq.quantize`` calibration, ``auto_quantize``
(kl_div and gradient scores), ``mse`` + ``fp8_scale_sweep`` and every quantized forward use -- goes
through exactly two call sites that cannot run without CUDA (line numbers: modelopt 0.47.0):

1. ``modelopt/torch/quantization/tensor_quant.py:485`` -- ``_dynamic_block_quantize_forward`` (the
   forward of ``DynamicBlockQuantizationFunction``, i.e. ``tensor_quant.dynamic_block_quant``, called
   from ``TensorQuantizer._fake_quantize`` at ``nn/modules/tensor_quantizer.py:910``) calls the module
   global ``dynamic_block_quantize_op(inputs, block_size, amax, num_bits, exponent_bits,
   scale_num_bits, scale_exponent_bits)`` (bound at ``tensor_quant.py:270`` to the torch.library op
   ``tensorrt::dynamic_block_quantize_op`` whose CPU/CUDA kernel is ``_dynamic_block_quantize_impl``,
   ``tensor_quant.py:157``). For NVFP4 (E2M1 values, E4M3 scales) that impl asserts
   ``amax.is_cuda`` (``:172``) and then runs the Triton kernel ``fp4_fake_quant_block`` or the CUDA
   extension ``fused_amax_convert`` (``:184``). Semantics: *dynamic* NVFP4 -- ``amax`` is the
   per-tensor (global) amax (reduced with ``amax.amax()`` if it is not a scalar), the per-16-element
   block scales are computed from the input itself. Used by the ``W4A16_NVFP4_CFG`` weights
   (``block_sizes.type: dynamic``) and by NVFP4 activations.
2. ``modelopt/torch/quantization/nn/modules/tensor_quantizer.py:1749`` --
   ``StaticBlockScaleQuantizer._fake_quantize`` (a.k.a. ``NVFP4StaticQuantizer``; what static NVFP4
   weight quantizers are promoted to after calibration) calls ``static_blockwise_fp4_fake_quant(x,
   amax, global_amax, quantize_block_scales, fp8_max_for_normalization, out_dtype,
   pass_through_bwd)`` (imported at ``tensor_quantizer.py:63``; it is
   ``StaticBlockwiseFP4FakeQuantFunction.apply``, ``tensor_quant.py:571``), whose forward raises
   unless Triton is available (``tensor_quant.py:586``). Semantics: *static* NVFP4 -- ``amax`` holds
   one pre-computed amax per block (``x.numel() // amax.numel()`` consecutive elements form a block),
   ``global_amax`` the per-tensor amax that fixes ``weight_scale_2``. This is the function the
   ``mse`` calibrators (multiplier search and the ``fp8_scale_sweep`` reference sweep of
   ``NVFP4MSECalibrator``) evaluate once per candidate.

Replacement: on a machine without CUDA, :func:`install_cpu_nvfp4_fake_quant` rebinds exactly those two
names -- ``tensor_quant.dynamic_block_quantize_op`` and ``tensor_quantizer.static_blockwise_fp4_fake_quant``
-- to functions that compute ``NVFP4QTensor.quantize(...)`` followed by ``.dequantize(...)``, i.e.
ModelOpt's own export numerics, with the scale factors obtained from ModelOpt's own export helpers:

* dynamic: ``weight_scale_2 = amax / (6 * 448)`` (the ``get_weights_scaling_factor_2_from_quantizer``
  formula for a dynamic quantizer), per-block scales by ``NVFP4QTensor.get_weights_scaling_factor``
  inside ``NVFP4QTensor.quantize``;
* static: both scales from ``NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer`` and
  ``NVFP4QTensor.get_weights_scaling_factor_from_quantizer`` (the static-quantizer branch used by the
  HF export), fed a minimal stand-in quantizer carrying ``_amax``/``global_amax``/``block_sizes``.

Nothing numerical is re-implemented here: E2M1 rounding (round-half-to-even, saturating at 6), E4M3
casting of the block scales with the ``[2**-9, 448]`` clamp, zero blocks -> scale 1.0 and the packing
all come from ``NVFP4QTensor``, so the fake-quantized tensor equals ``dequantize(quantize(...))`` of the
exported checkpoint bit for bit. Everything else (calibrators, scale formulas, FP8 per-tensor
quantization, ``export_hf_checkpoint``) is ModelOpt's unmodified code. ``register_quant_backend`` is no
alternative: it only reaches dynamic quantizers, not the static call site.

Deliberate deviations from the CUDA kernels (which are not the export numerics either): the Triton
kernels use no ``2**-9`` scale clamp (underflowing scales become zero / 1.0) and produce ``-0.0`` for
negative values that round to zero, whereas export writes ``+0`` nibbles; we follow export. One guard
is added: a *dynamic* call with a zero global amax returns zeros (export arithmetic would give NaN
from ``0 / 0``; the CUDA kernel clamps the global scale to ``1e-12``, which also yields zeros for the
all-zero tensor such an amax describes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import torch
from modelopt.torch.quantization import tensor_quant as _tq
from modelopt.torch.quantization.nn.modules import tensor_quantizer as _tqr
from modelopt.torch.quantization.qtensor import NVFP4QTensor
from modelopt.torch.quantization.utils import reduce_amax, reduce_block_padding
from modelopt.torch.quantization.utils.numeric_utils import E2M1_MAX, E4M3_MAX, E4M3_MAX_46

__all__ = [
    "cpu_nvfp4_fake_quant",
    "install_cpu_nvfp4_fake_quant",
    "is_installed",
    "nvfp4_dynamic_qdq",
    "nvfp4_qdq",
    "nvfp4_static_qdq",
    "static_nvfp4_scales",
    "uninstall_cpu_nvfp4_fake_quant",
]

# The callables the two call sites resolve to before any patching.
_ORIG_DYNAMIC_OP = _tq.dynamic_block_quantize_op
_ORIG_STATIC_FN = _tqr.static_blockwise_fp4_fake_quant

# (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) as _dynamic_block_quantize_forward
# passes them for E2M1 values with E4M3 block scales.
_NVFP4_OP_BITS = (4, 2, 8, 4)


def nvfp4_qdq(
    x: torch.Tensor,
    block_size: int,
    weights_scaling_factor_2: torch.Tensor,
    weights_scaling_factor: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``NVFP4QTensor.quantize`` then ``.dequantize``: ModelOpt's export round trip, on any device."""
    out_dtype = out_dtype or x.dtype
    k = x.shape[-1]
    x = reduce_block_padding(x.contiguous(), block_sizes={-1: block_size})  # zero-pad a ragged last dim
    packed, wsf, wsf2 = NVFP4QTensor.quantize(x, block_size, weights_scaling_factor, weights_scaling_factor_2)
    out = packed.dequantize(dtype=out_dtype, scale=wsf, double_scale=wsf2, block_sizes={-1: block_size})
    return out if out.shape[-1] == k else out[..., :k].contiguous()


def nvfp4_dynamic_qdq(x: torch.Tensor, block_size: int, amax: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 fake quant: ``weight_scale_2`` from the global ``amax``, block scales from ``x``."""
    global_amax = amax.float().amax()  # as _dynamic_block_quantize_impl: amax.amax() if not a scalar
    if global_amax == 0:
        return torch.zeros_like(x)
    wsf2 = global_amax / (E2M1_MAX * E4M3_MAX)  # == get_weights_scaling_factor_2_from_quantizer
    return nvfp4_qdq(x, block_size, wsf2)


def nvfp4_static_qdq(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Static NVFP4 fake quant from per-block ``amax`` and ``global_amax``, via ModelOpt's export helpers.

    Like ``static_blockwise_fp4_fake_quant``: every ``x.numel() // amax.numel()`` consecutive elements
    form one block, ``global_amax=None`` means the max of ``amax``.
    """
    n_blocks = amax.numel()
    if n_blocks == 0 or x.numel() % n_blocks:
        raise ValueError(f"x.numel() ({x.numel()}) is not a multiple of amax.numel() ({n_blocks})")
    block_size = x.numel() // n_blocks
    if global_amax is None:
        global_amax = reduce_amax(amax, axis=None, keepdims=False, squeeze_scalar=True)
    blocks = x.reshape(n_blocks, block_size)
    wsf, wsf2 = static_nvfp4_scales(blocks, amax, global_amax, block_size, fp8_max_for_normalization)
    return nvfp4_qdq(blocks, block_size, wsf2, wsf, out_dtype).view(x.shape)


def static_nvfp4_scales(
    weight: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor,
    block_size: int = 16,
    fp8_max_for_normalization: float = E4M3_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_scale [E4M3, (*weight.shape[:-1], K / block)], weight_scale_2 [fp32])`` as HF export.

    Calls ``NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer`` and
    ``NVFP4QTensor.get_weights_scaling_factor_from_quantizer`` (static-quantizer branch) on a minimal
    stand-in for a calibrated static NVFP4 weight quantizer (``_amax`` = per-block amax, ``global_amax``).
    """
    stand_in = SimpleNamespace(
        _amax=amax,
        global_amax=global_amax,
        block_sizes={-1: block_size, "four_over_six": fp8_max_for_normalization == E4M3_MAX_46},
    )
    wsf2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(stand_in)
    wsf, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(stand_in, weight, wsf2)
    return wsf, wsf2


def _dynamic_block_quantize_op(
    inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits
):
    """Drop-in for ``tensor_quant.dynamic_block_quantize_op``; non-NVFP4 formats go to the original."""
    if (
        inputs.is_cuda
        or amax is None
        or (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) != _NVFP4_OP_BITS
    ):
        return _ORIG_DYNAMIC_OP(
            inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits
        )
    return nvfp4_dynamic_qdq(inputs, block_size, amax)


class _StaticBlockwiseFP4FakeQuantCPU(_tq.StaticBlockwiseFP4FakeQuantFunction):
    """``StaticBlockwiseFP4FakeQuantFunction`` with a CPU forward; ModelOpt's STE backward is inherited."""

    @staticmethod
    def forward(
        ctx,
        x,
        amax,
        global_amax=None,
        quantize_block_scales=True,
        fp8_max_for_normalization=E4M3_MAX,
        out_dtype=None,
        pass_through_bwd=False,
    ):
        _tq._save_for_backward_if_needed(ctx, pass_through_bwd, x, amax)
        return nvfp4_static_qdq(x, amax, global_amax, fp8_max_for_normalization, out_dtype)


def _static_blockwise_fp4_fake_quant(x, amax, global_amax=None, quantize_block_scales=True, *args):
    """Drop-in for ``tensor_quantizer.static_blockwise_fp4_fake_quant`` (same positional signature)."""
    if x.is_cuda or not quantize_block_scales:  # unquantized block scales: never used by ModelOpt 0.47
        return _ORIG_STATIC_FN(x, amax, global_amax, quantize_block_scales, *args)
    return _StaticBlockwiseFP4FakeQuantCPU.apply(x, amax, global_amax, quantize_block_scales, *args)


def is_installed() -> bool:
    """Whether both call sites currently resolve to the CPU replacements."""
    return (
        _tq.dynamic_block_quantize_op is _dynamic_block_quantize_op
        and _tqr.static_blockwise_fp4_fake_quant is _static_blockwise_fp4_fake_quant
    )


def install_cpu_nvfp4_fake_quant() -> bool:
    """Patch the two call sites when CUDA is unavailable; idempotent.

    Returns True if the CPU replacements are in effect after the call (installed now or before),
    False if CUDA is available (nothing is patched: ModelOpt's own kernels are used).
    """
    if torch.cuda.is_available():
        return False
    _tq.dynamic_block_quantize_op = _dynamic_block_quantize_op
    _tqr.static_blockwise_fp4_fake_quant = _static_blockwise_fp4_fake_quant
    return True


def uninstall_cpu_nvfp4_fake_quant() -> None:
    """Restore ModelOpt's original callables at both call sites."""
    _tq.dynamic_block_quantize_op = _ORIG_DYNAMIC_OP
    _tqr.static_blockwise_fp4_fake_quant = _ORIG_STATIC_FN


@contextlib.contextmanager
def cpu_nvfp4_fake_quant() -> Iterator[bool]:
    """Context manager form; yields whether the replacements are active, restores on exit if it installed."""
    was_installed = is_installed()
    active = install_cpu_nvfp4_fake_quant()
    try:
        yield active
    finally:
        if active and not was_installed:
            uninstall_cpu_nvfp4_fake_quant()
