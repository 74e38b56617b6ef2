"""Error-compensating NVFP4 rounding (GPTQ) under fixed block scales.

Round-to-nearest gives every E2M1 element the code nearest to ``w / s`` (``s`` its block's dequantization
scale). GPTQ (Frantar et al. 2022, arXiv:2210.17323; the form of llm-compressor's ``quantize_weight``)
rounds the input columns one after another and feeds each column's rounding error forward onto the columns
not yet rounded, through the inverse Hessian ``H = X^T X`` of the layer's inputs, so that the layer's
*output* error on those inputs is small rather than each weight's own error.

Here the per-16-block scales are chosen first, by the rebuild's calibration (ModelOpt's ``mse`` +
``fp8_scale_sweep``, :mod:`mixquant.formats.nvfp4`) on the BF16 weight, and held fixed: GPTQ only decides
which E2M1 code each element takes. The tensors, their shapes and dtypes, ``weight_scale`` and
``weight_scale_2`` are exactly those of round-to-nearest, so the checkpoint's format and what vLLM loads do
not change. MR-GPTQ (Egiazarian et al. 2025, arXiv:2509.23202) studies GPTQ for NVFP4 and MXFP4 with a
format-specific scale search; the rotations it adds are not applied (they would change the served weights'
basis).

:func:`gptq_nvfp4` returns the *compensated weights* -- each column as it stood when its turn came, before
rounding -- in fp32. ModelOpt's own export (``NVFP4QTensor.quantize``, :func:`mixquant.formats.nvfp4.
nvfp4_export_tensors`) then rounds them to the nearest code of the fixed scales, which is exactly the code
GPTQ chose for them: the rounding here is ModelOpt's (E2M1 round-half-to-even saturating at 6, on
``w / (E4M3 scale * weight_scale_2)`` in fp32, :func:`mixquant.formats.nvfp4._round_e2m1_`). On an identity
Hessian no error is fed forward and the compensated weights are the weights: the export equals
round-to-nearest bit for bit.

Settings (``quantize.nvfp4_w4a16.gptq``): ``damping`` (a fraction of the Hessian's mean diagonal added to
it, llm-compressor's ``dampening_frac``), ``block_size`` (columns per lazy batch update: the result does
not depend on it beyond float rounding), ``order`` (``natural`` column order or ``activation``: descending
Hessian diagonal, llm-compressor's ``actorder: weight`` -- the scales stay with their columns). Columns no
input ever reached (zero Hessian diagonal) are rounded to nearest and feed nothing forward.

Every op is deterministic on CUDA (matmul, Cholesky, triangular inverse, indexing): no atomics.
"""

from __future__ import annotations

from typing import Literal

import torch

from mixquant.formats.facts import NVFP4_GROUP_SIZE as BLOCK_SIZE
from mixquant.formats.nvfp4 import _round_e2m1_

__all__ = ["GPTQ_ORDERS", "gptq_nvfp4", "nvfp4_grid", "nvfp4_rtn", "nvfp4_scales", "output_error"]

GPTQ_ORDERS = ("natural", "activation")
Order = Literal["natural", "activation"]


def nvfp4_scales(weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Per-element fp32 dequantization scale ``[N, K]`` from the exported ``weight_scale`` ``[N, K/16]``
    (E4M3) and ``weight_scale_2``: ``float(weight_scale) * weight_scale_2``, the product ModelOpt's
    ``NVFP4QTensor`` quantizes and dequantizes with."""
    block = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)
    return block.repeat_interleave(BLOCK_SIZE, dim=-1)


def nvfp4_rtn(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The grid value ModelOpt's export gives ``weight`` (fp32) under the per-element ``scale``:
    ``sign(w) * e2m1(|w| / s) * s``, E2M1 round-half-to-even saturating at 6 (``NVFP4QTensor``)."""
    weight = weight.to(torch.float32)
    t = _round_e2m1_(weight.abs() / scale)
    return t.mul_(scale).copysign_(weight)


def nvfp4_grid(scale: torch.Tensor) -> torch.Tensor:
    """The 15 values of the NVFP4 grid of each element's scale: ``[..., 15]`` (E2M1 codes times ``s``)."""
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=scale.device)
    codes = torch.cat([-codes.flip(0)[:-1], codes])
    return scale.unsqueeze(-1) * codes


def _inverse_hessian_factor(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damping * mean(diag H) * I)^-1`` (float64), GPTQ's ``Hinv``; any
    leading batch dimensions."""
    h = hessian.to(torch.float64).clone()
    diag = h.diagonal(dim1=-2, dim2=-1)  # a view: writes go to h
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)  # an input no token reached: its column is rounded to nearest, feeds nothing
    diag.add_(damping * diag.mean(dim=-1, keepdim=True))
    lower = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True)


def _permuted(x: torch.Tensor, perm: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with its ``dim`` (-1 or -2) reordered by the per-batch permutation ``perm`` ``[..., K]``."""
    index = perm.unsqueeze(-2) if dim == -1 else perm.unsqueeze(-1)
    return torch.take_along_dim(x, index, dim=dim)


@torch.no_grad()
def gptq_nvfp4(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    *,
    damping: float = 0.01,
    block_size: int = 128,
    order: Order = "natural",
) -> torch.Tensor:
    """GPTQ-compensated weights of ``weight`` ``[..., N, K]`` for NVFP4 rounding under fixed scales.

    Leading dimensions are a batch of independent problems (the experts of a layer, each with its own
    Hessian): one column step runs on all of them, so the error-feedback loop issues ``K`` steps, not
    ``experts x K`` (on a GPU the loop is launch-bound otherwise).

    Args:
        weight: the BF16 (or fp32) weight, rows = outputs, columns = inputs.
        hessian: ``[..., K, K]`` ``X^T X`` of the inputs (any positive scale: damping is relative).
        scale: ``[..., N, K]`` fp32 per-element dequantization scale (:func:`nvfp4_scales`), fixed.
        damping: fraction of the mean diagonal added to the diagonal.
        block_size: columns per lazy batch update.
        order: ``natural`` or ``activation`` (descending diagonal of ``hessian``, per problem).

    Returns:
        fp32 ``[..., N, K]``: every column as it stood when rounded (the original column for the first
        one); :func:`nvfp4_rtn` of it is the chosen grid value, and ModelOpt's export rounds it to that code.
    """
    if order not in GPTQ_ORDERS:
        raise ValueError(f"GPTQ order must be one of {GPTQ_ORDERS}, got {order!r}")
    cols = weight.shape[-1]
    batch = weight.shape[:-2]
    if hessian.shape != (*batch, cols, cols) or scale.shape != weight.shape:
        raise ValueError(
            f"GPTQ: weight {tuple(weight.shape)} needs a [..., {cols}, {cols}] Hessian and a scale of its "
            f"shape, got {tuple(hessian.shape)} and {tuple(scale.shape)}"
        )
    perm = None
    if order == "activation":
        diag = hessian.diagonal(dim1=-2, dim2=-1)
        perm = torch.argsort(diag, dim=-1, descending=True, stable=True)
        weight, scale = _permuted(weight, perm, -1), _permuted(scale, perm, -1)
        hessian = _permuted(_permuted(hessian, perm, -2), perm, -1)
    hinv = _inverse_hessian_factor(hessian, damping)
    work = weight.to(torch.float64).clone()
    compensated = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    scale = scale.to(torch.float32)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        block = work[..., i1:i2].clone()
        errors = torch.empty_like(block)
        hinv_block = hinv[..., i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = block[..., i].to(torch.float32)  # what the export will round
            compensated[..., i1 + i] = column
            rounded = nvfp4_rtn(column, scale[..., i1 + i]).to(torch.float64)
            err = (block[..., i] - rounded) / hinv_block[..., i, i].unsqueeze(-1)
            block[..., i:] -= err.unsqueeze(-1) * hinv_block[..., i, i:].unsqueeze(-2)
            errors[..., i] = err
        work[..., i2:] -= errors @ hinv[..., i1:i2, i2:]
    if perm is not None:
        compensated = _permuted(compensated, torch.argsort(perm, dim=-1), -1)
    return compensated


def output_error(weight: torch.Tensor, quantized: torch.Tensor, inputs: torch.Tensor) -> float:
    """Summed squared output error ``||X W^T - X Q^T||^2`` (float64) of ``quantized`` against ``weight`` on
    the rows of ``inputs`` ``[T, K]``."""
    x = inputs.to(torch.float64)
    diff = weight.to(torch.float64) - quantized.to(torch.float64)
    return float((x @ diff.T).square().sum())
