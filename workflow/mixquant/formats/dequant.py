"""ModelOpt's dequantization of exported routed-expert tensors (NVFP4, FP8), in fp32, cast once.

:func:`dequantize_tensors` turns the tensors of an export (``weight`` + its scales, under the exported
names) back into weights: what the audit compares with the source, what the scorer and the dequantizing
loader (:mod:`mixquant.model.dequant`) compute with.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mixquant.formats.facts import NVFP4_GROUP_SIZE as BLOCK_SIZE

__all__ = ["dequantize_tensors"]

_WEIGHT_SUFFIX = ".weight"


def dequantize_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """``{weight name: dequantized weight}`` for every ``*.weight`` in ``tensors`` (exported layout).

    ModelOpt's own dequantization, computed in fp32 and then cast to ``dtype``:

    * NVFP4 (uint8 ``weight`` + ``weight_scale`` + ``weight_scale_2``): ``NVFP4QTensor.dequantize``;
    * FP8 (float8_e4m3fn ``weight`` + ``weight_scale``): ``FP8QTensor.dequantize`` (``fp8 * scale``);
    * anything else: the weight itself (bf16 passthrough), cast to ``dtype``.

    ModelOpt is imported only when a quantized weight is met (a BF16 layer needs none of it).
    """
    out: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        if not name.endswith(_WEIGHT_SUFFIX):
            continue
        base = name[: -len(_WEIGHT_SUFFIX)]
        scale = tensors.get(f"{base}.weight_scale")
        if weight.dtype == torch.uint8 and scale is not None and f"{base}.weight_scale_2" in tensors:
            from modelopt.torch.quantization.qtensor import NVFP4QTensor

            shape = (*weight.shape[:-1], weight.shape[-1] * 2)
            qtensor = NVFP4QTensor(torch.Size(shape), torch.float32, weight)
            deq = qtensor.dequantize(
                dtype=torch.float32,
                scale=scale,
                double_scale=tensors[f"{base}.weight_scale_2"],
                block_sizes={-1: BLOCK_SIZE},
            )
        elif weight.dtype == torch.float8_e4m3fn and scale is not None:
            from modelopt.torch.quantization.qtensor import FP8QTensor

            deq = FP8QTensor(weight.shape, torch.float32, weight).dequantize(dtype=torch.float32, scale=scale)
        else:
            deq = weight
        out[name] = deq.to(dtype)
    return out
