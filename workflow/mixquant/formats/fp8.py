"""Standalone FP8 (E4M3, per-tensor) weight/activation numerics of ModelOpt 0.47, bit for bit.

What ModelOpt does for a per-tensor FP8 weight quantizer (``FP8_DEFAULT_CFG``: ``num_bits=(4, 3)``,
``axis=None``), line numbers for modelopt 0.47.0:

* **max** (``MaxCalibrator``, ``calib/max.py``; ``utils/core_utils.py:147`` ``reduce_amax``):
  ``amax = max(|max(w)|, |min(w)|)`` as a 0-dim tensor *in the weight's dtype* (bf16 for a bf16 model).
  That tensor becomes the quantizer's ``_amax`` buffer and fixes its dtype for good.
* **mse** (``MseCalibrator``, ``calib/mse.py:31``; driven by ``model_calib._mse_calibrate_weights``):
  starting from the max amax ``a0``, candidates are ``a0 * m`` for the multipliers
  ``m = torch.linspace(0.25, 4.0, steps=ceil((4.0 - 0.25) / 0.1) + 1)`` -- 39 fp32 values, **not** exact
  multiples of 0.1 -- evaluated in ascending order. ``a0 * m`` is a 0-dim bf16 times a 0-dim fp32 tensor,
  i.e. computed and kept in fp32. For each candidate the weight, cast to fp32, is fake-quantized by
  ``tensor_quant._fp8_eager`` (``tensor_quant.py:46``; the CUDA kernel ``fake_e4m3fy`` does the same
  elementwise arithmetic): ``scale = 448 / amax`` (amax <= 2**-24 -> 1), ``scale_inv = 1 / scale``,
  ``q = float8_e4m3fn(clamp(x * scale, -448, 448))``, ``xq = float(q) * scale_inv``; the loss is
  ``torch.sum(F.mse_loss(x, xq, reduction="none"))`` over the whole tensor (fp32). The winner is
  ``torch.argmin`` over the 39 losses (first minimum on ties), the result ``a0 * m_best`` in fp32, which
  ``TensorQuantizer.amax``'s setter ``copy_``-s into the existing ``_amax`` buffer -- so it is **rounded
  to the weight's dtype** (bf16 for a bf16 model, round to nearest even).
* **export** (``export/unified_export_hf.py:631-642`` and ``quant_utils.py:881``):
  ``weight_scale = fp32(amax) / 448`` (0-dim fp32) and ``weight = (w / weight_scale).to(float8_e4m3fn)``
  where ``w / weight_scale`` is a bf16 tensor for a bf16 weight (the 0-dim fp32 scale does not promote),
  so the value is rounded to bf16 before the (saturating, round-to-nearest-even) E4M3 cast.
  Activations: ``input_scale = fp32(input amax) / 448`` with the input amax a max over the calibration
  activations in the model dtype.

Routed experts (``_QuantFusedExperts``): one weight quantizer per expert covers the fused ``[2I, H]``
gate+up slice (``gate_up_proj[e]``: gate rows first), so gate and up share one amax: pass
``torch.cat([gate, up])`` to :func:`fp8_mse_weight_amax` -- the loss is a sum over that exact tensor, so
the concatenation order matters for bit-exactness.

Bit-exactness caveat: the loss is a ``torch.sum`` over the whole weight; its floating-point summation
order is that of PyTorch's reduction kernel for that shape, device and (above 32768 elements on CPU)
thread count. Computing it here with the same call on the same device and thread settings reproduces
ModelOpt exactly; a different reduction order can only flip exact/near ties between candidates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixquant.formats.facts import FP8_E4M3_MAX

__all__ = [
    "FP8_E4M3_MAX",
    "MSE_START_MULTIPLIER",
    "MSE_STEP_SIZE",
    "MSE_STOP_MULTIPLIER",
    "fp8_export_tensors",
    "fp8_fake_quant",
    "fp8_max_amax",
    "fp8_mse_weight_amax",
    "fp8_scale",
    "mse_multipliers",
]

MSE_STEP_SIZE = 0.1  # MseCalibConfig defaults
MSE_START_MULTIPLIER = 0.25
MSE_STOP_MULTIPLIER = 4.0
_ZERO_AMAX = 1.0 / (1 << 24)  # _fp8_eager: amax <= 2**-24 is treated as 1


def mse_multipliers(
    step_size: float = MSE_STEP_SIZE,
    start_multiplier: float = MSE_START_MULTIPLIER,
    stop_multiplier: float = MSE_STOP_MULTIPLIER,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """ModelOpt's MSE amax multipliers (``MseCalibrator._generate_candidates``): fp32, ascending."""
    steps = math.ceil((stop_multiplier - start_multiplier) / step_size) + 1
    return torch.linspace(start_multiplier, stop_multiplier, steps=steps, device=device)


def fp8_max_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor max amax as ModelOpt's ``reduce_amax(x, axis=None)``: 0-dim, in ``x``'s dtype."""
    x = x.detach()
    return torch.maximum(torch.abs(torch.max(x)), torch.abs(torch.min(x)))


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 E4M3 quantize-dequantize exactly as ``tensor_quant._fp8_eager`` (result in x.dtype)."""
    amax = amax.to(torch.float32)
    safe_amax = torch.where(amax <= _ZERO_AMAX, torch.ones_like(amax), amax)
    scale = FP8_E4M3_MAX / safe_amax
    scale_inv = 1 / scale
    q = (x.to(torch.float32) * scale).clamp(min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale_inv).to(x.dtype)


@torch.no_grad()
def fp8_mse_weight_amax(
    weight: torch.Tensor,
    *,
    step_size: float = MSE_STEP_SIZE,
    start_multiplier: float = MSE_START_MULTIPLIER,
    stop_multiplier: float = MSE_STOP_MULTIPLIER,
) -> torch.Tensor:
    """The per-tensor FP8 weight amax ModelOpt's ``mse`` calibration stores, bit for bit.

    Returns a 0-dim tensor in ``weight``'s dtype (the dtype of ModelOpt's ``_amax`` buffer, set by the
    max calibration that precedes the search). For fused gate/up pass ``torch.cat([gate, up])``.
    """
    weight = weight.detach()
    initial = fp8_max_amax(weight)  # 0-dim, weight dtype
    x = weight.to(torch.float32)
    multipliers = mse_multipliers(step_size, start_multiplier, stop_multiplier, device=weight.device)
    losses = []
    for m in multipliers:  # 0-dim fp32 each, as MseCalibrator.collect iterates them
        xq = fp8_fake_quant(x, initial * m)  # 0-dim (weight dtype) * 0-dim fp32 -> fp32
        losses.append(torch.sum(F.mse_loss(x, xq, reduction="none")))
    best = torch.argmin(torch.stack(losses), dim=0)
    best_amax = initial * multipliers[best]  # fp32
    return best_amax.to(initial.dtype)  # TensorQuantizer.amax setter: copy_ into the existing buffer


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Exported ``weight_scale`` / ``input_scale``: ``fp32(amax) / 448``, 0-dim fp32."""
    return amax.detach().to(torch.float32).reshape(()) / FP8_E4M3_MAX


def fp8_export_tensors(weight: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [float8_e4m3fn], weight_scale [fp32, 0-dim])`` as ``export_hf_checkpoint`` writes them.

    ``weight`` must be in the export dtype (the model dtype, bf16 for Laguna): the division happens in
    that dtype, exactly as ``to_quantized_weight`` computes ``(weight / weight_scale).to(float8_e4m3fn)``.
    """
    weight_scale = fp8_scale(amax)
    return (weight.detach() / weight_scale).to(torch.float8_e4m3fn), weight_scale
