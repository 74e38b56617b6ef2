"""Fast, memory-lean NVFP4 FP8-scale sweep: ModelOpt's ``mse`` + ``fp8_scale_sweep`` choice, bit for bit.

ModelOpt 0.47 (``NVFP4MSECalibrator``, ``modelopt/torch/quantization/calib/mse.py``) fits static NVFP4
weight scales like this: with ``weight_scale_2 = global_amax / (6 * 448)`` fixed, every 16-element block
tries the 126 positive finite E4M3 codes ``v`` (``fp8_scale_candidates()``: ``v / 448``, ascending) as its
block scale, i.e. the candidate per-block amax ``global_amax * v / 448``; each candidate fake-quantizes the
whole weight (in fp32) through the static NVFP4 quantizer, the loss of a block is
``torch.sum(F.mse_loss(x, xq, reduction="none"), dim=1)`` and the block keeps
``argmin`` over the stacked ``[126, n_blocks]`` losses (first minimum wins). Off CUDA this "reference"
sweep runs 126 full fake-quant passes and keeps all ``126 * n_blocks`` fp32 losses alive (~16x a bf16
weight).

:func:`sweep_nvfp4_block_amax` returns the identical per-block amax with far less work and memory:

* the 126 candidate scales are produced by ModelOpt's own export helpers (so they equal, bit for bit,
  the ``E4M3(scale) * weight_scale_2`` products the fake quantizer uses);
* each element's quantization error is computed with exactly the reference's fp32 operations --
  ``t = |x| / s``; E2M1 round-half-to-even saturating at 6; ``xq = q * s``; ``(|x| - xq)**2`` (equal to
  ``(x - xq)**2`` because the sign is symmetric); ``torch.sum`` over the contiguous 16-element last dim,
  the same reduction (hence summation order) as the reference's -- with the E2M1 rounding done
  arithmetically (exact, see :func:`_round_e2m1_`) instead of ModelOpt's searchsorted/pack/unpack/gather;
* candidates that provably cannot win are skipped without changing the result: the error term of a
  block's largest element is one of the non-negative summands of the block's fp32 loss, and a
  floating-point sum of non-negative terms is never smaller than any of its terms, so every candidate
  whose largest-element term exceeds the exact loss of a probe candidate loses strictly. Candidates whose
  scale quantizes the whole block to zero all share one loss, so only the first of them is kept. The
  survivors (typically 10-25 of 126) are evaluated exactly and the first minimum is taken;
* the weight is processed in row chunks so the temporaries stay below ~the weight's size.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates import fp8_scale_candidates
from modelopt.torch.quantization.qtensor import NVFP4QTensor
from modelopt.torch.quantization.utils import reduce_block_padding

from mixquant.formats.facts import NVFP4_GROUP_SIZE

from .cpu_fake_quant import cpu_nvfp4_fake_quant, static_nvfp4_scales

__all__ = [
    "BLOCK_SIZE",
    "fp8_sweep_candidates",
    "modelopt_reference_block_amax",
    "nvfp4_w4a16_static_config",
    "nvfp4_export_tensors",
    "shared_global_amax",
    "sweep_nvfp4_block_amax",
]

BLOCK_SIZE = NVFP4_GROUP_SIZE
_EXPONENT_MASK = 0x7F800000
_MAGIC = 0.75 * 2.0**23  # (t + _MAGIC * p) - _MAGIC * p rounds t half-to-even to a multiple of p / 2
_E2M1_MAX = 6.0
_E2M1_ZERO_BOUND = 0.25  # |t| <= 0.25 rounds to 0 (ModelOpt's first e2m1 bound, searchsorted left)
# Probe candidates relative to the first one with 6 * scale >= block amax: the winner is usually within
# one code of it or 3-5 codes above (largest element landing on E2M1 value 4 instead of 6).
_PROBE_OFFSETS = (-1, 0, 1, 4)
# Budgeted extra bytes per 16-element block of a chunk (candidate table + survivors) when sizing chunks;
# the measured peak is ~5.5 KB per block.
_BYTES_PER_BLOCK_IN_FLIGHT = 8192


def shared_global_amax(*weights: torch.Tensor) -> torch.Tensor:
    """fp32 max |w| over ``weights``: the ``global_amax`` ModelOpt shares among fused gate/up or q/k/v."""
    return torch.stack([w.detach().abs().amax().float() for w in weights]).amax()


def fp8_sweep_candidates(global_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(candidate_amax[126], candidate_scale[126])`` in fp32, ascending, for a fixed ``global_amax``.

    ``candidate_amax`` is what ``NVFP4MSECalibrator`` stores for a block choosing that candidate
    (``global_amax * v / 448``); ``candidate_scale`` is the dequantization scale the static NVFP4 fake
    quantizer derives from it (``float(E4M3 weight_scale) * weight_scale_2``), via ModelOpt's export code.
    """
    g = global_amax.detach().to(torch.float32).reshape(())
    cand_amax = g * fp8_scale_candidates(g.device)
    wsf, wsf2 = static_nvfp4_scales(
        torch.empty(cand_amax.numel(), BLOCK_SIZE, device=g.device), cand_amax.view(-1, 1), g, BLOCK_SIZE
    )
    return cand_amax, (wsf.to(torch.float32) * wsf2).view(-1)


def _round_e2m1_(t: torch.Tensor) -> torch.Tensor:
    """In place: non-negative fp32 ``t`` -> nearest E2M1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even.

    Same result as ``NVFP4QTensor._cast_fp4`` + lookup (searchsorted on the bounds 0.25/0.75/1.25/1.75/
    2.5/3.5/5 with ties at 0.75/1.75/3.5 rounding up): after saturating at 6, the E2M1 grid step is
    ``p / 2`` where ``p = max(1, 2**floor(log2 t))``, and adding then subtracting ``1.5 * 2**23 * step``
    rounds to that step half-to-even exactly in fp32.
    """
    t.clamp_(max=_E2M1_MAX)
    magic = t.view(torch.int32).bitwise_and(_EXPONENT_MASK).view(torch.float32)
    magic.clamp_(min=1.0).mul_(_MAGIC)
    return t.add_(magic).sub_(magic)


def _sq_err(absx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element squared NVFP4 error ``(|x| - q(|x|/s) * s)**2``, with the reference's fp32 roundings."""
    t = _round_e2m1_(absx / scale)
    t.mul_(scale)  # xq = e2m1 value * scale, as NVFP4QTensor.dequantize
    t.neg_().add_(absx)  # |x| - xq  (== |x - sign(x) * xq|, so identical to mse_loss's x - xq up to sign)
    return t.mul_(t)  # mse_loss's diff * diff


def _sweep_chunk(absx: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Index of the winning candidate for each row of ``absx`` ([B, 16] fp32 magnitudes)."""
    n_cand = scales.numel()
    device = absx.device
    amax = absx.amax(dim=1, keepdim=True)  # [B, 1]: largest element of each block

    # Error term of the largest element for every candidate: a lower bound of each candidate's loss.
    lower = _sq_err(amax, scales.view(1, -1))  # [B, C]
    # Candidates whose scale sends the largest element (hence the whole block) to 0 form a suffix with
    # one common loss (sum of x**2); only the first of them can be the first minimum.
    all_zero = (amax / scales.view(1, -1)) <= _E2M1_ZERO_BOUND
    allowed = all_zero.logical_not_()
    allowed[:, 1:] |= allowed[:, :-1].clone()
    allowed[:, 0] = True

    # Exact loss of a few probe candidates near the natural scale (6 * s >= amax) bounds the minimum.
    natural = torch.searchsorted(scales * _E2M1_MAX, amax).clamp_(max=n_cand - 1)
    probes = (natural + torch.tensor(_PROBE_OFFSETS, device=device)).clamp_(0, n_cand - 1)  # [B, P]
    probe_loss = _sq_err(absx.unsqueeze(1), scales[probes].unsqueeze(-1)).sum(dim=-1)
    upper = probe_loss.amin(dim=1, keepdim=True)
    del probe_loss, probes, natural

    keep = torch.le(lower, upper, out=lower.new_empty(lower.shape, dtype=torch.bool))
    keep &= allowed
    del lower, allowed
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: candidates ascending within each block
    del keep

    # Exact losses of the survivors, summed over the 16 elements exactly like the reference.
    loss = _sq_err(absx.index_select(0, rows), scales.index_select(0, cols).unsqueeze(-1)).sum(dim=-1)
    return _first_minimum(rows, cols, loss, absx.shape[0])


def _first_minimum(rows: torch.Tensor, cols: torch.Tensor, loss: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Per block, the lowest candidate ``cols`` among its minimal ``loss`` values: the reference's argmin.

    ``rows`` / ``cols`` are a row-major ``nonzero`` of the survivors (blocks ascending, candidates ascending
    within each block) and every block has at least one (the best probe, or the first all-zero candidate,
    whose loss it shares). No scatter-min: on CUDA, ``scatter_reduce`` with "amin" has no deterministic
    kernel, so it raises under ``torch.use_deterministic_algorithms`` (``numerics.CUDA_PROFILE``). Instead
    block b's losses fill, in candidate order, the first ``survivors[b]`` slots of row b of a +inf-padded
    table whose ``min(dim=1)`` returns the first minimal slot (documented), i.e. the lowest candidate among
    equal losses. A padding slot comes after every real one, so it never wins, not even a tie with an
    infinite loss. Every op here has a deterministic CUDA kernel: ``bincount`` without weights (since
    PyTorch 2.1), ``masked_scatter_``, an integer ``cumsum``, a reduction (tests/workflow/test_device_ops.py
    checks the device stages' ops against the list PyTorch documents).
    """
    survivors = torch.bincount(rows, minlength=n_blocks)
    slots = torch.arange(int(survivors.max()), device=rows.device) < survivors.unsqueeze(1)
    table = torch.full(slots.shape, math.inf, device=loss.device).masked_scatter_(slots, loss)
    first_survivor = survivors.cumsum(0).sub_(survivors)  # offset of each block's survivors in ``cols``
    return cols.index_select(0, first_survivor.add_(table.min(dim=1).indices))


@torch.no_grad()
def sweep_nvfp4_block_amax(
    weight: torch.Tensor,
    global_amax: torch.Tensor | float | None = None,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Per-block amax chosen by ModelOpt's NVFP4 ``mse`` + ``fp8_scale_sweep`` calibration, computed fast.

    Args:
        weight: ``[..., K]`` weight (any float dtype); blocks are 16 consecutive elements of the last dim
            (zero-padded to a multiple of 16 like ModelOpt's static block quantizer).
        global_amax: the per-tensor amax fixing ``weight_scale_2 = global_amax / (6 * 448)``; defaults to
            ``max |weight|``. Pass :func:`shared_global_amax` of gate/up (or q/k/v) for fused siblings.
        chunk_rows: rows of the ``[-1, K]`` view processed at once; default keeps the temporaries at
            about half the weight's size (at least ~2 MiB).

    Returns:
        fp32 ``[n_blocks, 1]`` per-block amax, the layout of ``StaticBlockScaleQuantizer._amax``
        (identical to what ModelOpt's reference calibration stores).
    """
    k = weight.shape[-1]
    rows_view = weight.detach().reshape(-1, k)
    if global_amax is None:
        global_amax = rows_view.abs().amax()
    global_amax = torch.as_tensor(global_amax, device=weight.device)
    n_rows, blocks_per_row = rows_view.shape[0], -(-k // BLOCK_SIZE)
    out = torch.zeros(n_rows * blocks_per_row, 1, dtype=torch.float32, device=weight.device)
    if global_amax == 0:  # the reference yields 0 (= 0 * candidate) for every block
        return out
    cand_amax, scales = fp8_sweep_candidates(global_amax)
    if chunk_rows is None:
        budget = max(weight.numel() * weight.element_size() // 2, 2 << 20)
        chunk_rows = budget // (_BYTES_PER_BLOCK_IN_FLIGHT * blocks_per_row)
    chunk_rows = max(1, int(chunk_rows))
    for r0 in range(0, n_rows, chunk_rows):
        chunk = reduce_block_padding(rows_view[r0 : r0 + chunk_rows], block_sizes={-1: BLOCK_SIZE})
        absx = chunk.to(torch.float32).abs().reshape(-1, BLOCK_SIZE)
        best = _sweep_chunk(absx, scales)
        out[r0 * blocks_per_row : r0 * blocks_per_row + best.numel(), 0] = cand_amax[best]
    return out


def nvfp4_export_tensors(
    weight: torch.Tensor,
    block_amax: torch.Tensor,
    global_amax: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's exported NVFP4 tensors for ``weight`` with static per-block amax ``block_amax``.

    Returns ``(weight [uint8, ..., K/2], weight_scale [float8_e4m3fn, ..., K/16], weight_scale_2 [fp32])``
    computed by ``NVFP4QTensor`` exactly as ``export_hf_checkpoint`` does for a calibrated static NVFP4
    weight quantizer (``get_weights_scaling_factor[_2]_from_quantizer`` then ``NVFP4QTensor.quantize``).
    """
    global_amax = torch.as_tensor(global_amax, dtype=torch.float32, device=weight.device)
    weight = reduce_block_padding(weight, block_sizes={-1: BLOCK_SIZE})
    weight_scale, weight_scale_2 = static_nvfp4_scales(weight, block_amax, global_amax, BLOCK_SIZE)
    packed, _, _ = NVFP4QTensor.quantize(weight, BLOCK_SIZE, weight_scale, weight_scale_2)
    return packed._quantized_data, weight_scale, weight_scale_2


def nvfp4_w4a16_static_config(algorithm: Any = "max") -> dict[str, Any]:
    """A deep copy of ModelOpt's ``W4A16_NVFP4_CFG`` with *static* weight block scales and ``algorithm``.

    The preset's weights use dynamic block scales (``block_sizes.type: dynamic``), which ModelOpt's
    ``fp8_scale_sweep`` skips; static is what ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG`` uses for weights.
    """
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.W4A16_NVFP4_CFG)
    for entry in cfg["quant_cfg"]:
        block_sizes = (entry.get("cfg") or {}).get("block_sizes") if isinstance(entry, dict) else None
        if entry.get("quantizer_name") == "*weight_quantizer" and block_sizes:
            block_sizes["type"] = "static"
    cfg["algorithm"] = copy.deepcopy(algorithm)
    return cfg


_SIBLING_NAMES = {1: ("proj",), 2: ("gate_proj", "up_proj"), 3: ("q_proj", "k_proj", "v_proj")}


@torch.no_grad()
def modelopt_reference_block_amax(*weights: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """ModelOpt's own result: ``mtq.quantize``, static NVFP4 W4A16, mse + fp8_scale_sweep algorithm.

    The 2-D ``weights`` become ``nn.Linear`` layers named ``proj`` (one), ``gate_proj``/``up_proj`` (two) or
    ``q_proj``/``k_proj``/``v_proj`` (three), so ModelOpt's own shared-input grouping gives siblings one
    ``global_amax``. Runs ModelOpt's reference sweep (slow; CPU via :mod:`.cpu_fake_quant`). Returns the
    per-block ``_amax`` of each weight quantizer and the (shared) ``global_amax``.
    """
    import modelopt.torch.quantization as mtq

    model = torch.nn.Module()
    for name, w in zip(_SIBLING_NAMES[len(weights)], weights, strict=True):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
        linear.weight.copy_(w)
        setattr(model, name, linear)
    with cpu_nvfp4_fake_quant():
        mtq.quantize(model, nvfp4_w4a16_static_config({"method": "mse", "fp8_scale_sweep": True}), None)
    quantizers = [getattr(model, name).weight_quantizer for name in _SIBLING_NAMES[len(weights)]]
    return [q._amax.detach().clone() for q in quantizers], quantizers[0].global_amax.detach().clone()
