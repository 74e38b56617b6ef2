"""What the routed-expert formats are, without their numerics: names, nominal bits, the NVFP4 group size,
the FP8 range. Torch-free, so planning, the config and the checkpoint audit read the same facts as the
quantizer.

The three formats a MoE layer's routed experts can be placed on, in ModelOpt 0.47's terms:

* ``nvfp4_w4a16`` (ModelOpt ``W4A16_NVFP4_CFG``): E2M1 weights, one E4M3 scale per 16-element block and
  one FP32 per-tensor scale; activations stay BF16;
* ``fp8`` (``FP8_DEFAULT_CFG``): per-tensor E4M3 weights and a static per-tensor E4M3 input scale;
* ``bf16``: not quantized.

NVFP4 counts 4.5 bits: 4 bits per element plus one 8-bit E4M3 scale per 16-element block (the per-tensor
``weight_scale_2`` is not counted), as ModelOpt's auto_quantize cost model and recipes do.
"""

from __future__ import annotations

__all__ = [
    "BF16",
    "FORMATS",
    "FP8",
    "FP8_E4M3_MAX",
    "KV_CACHE_FORMATS",
    "NVFP4",
    "NVFP4_GROUP_SIZE",
    "QUANTIZED_FORMATS",
    "ROUTED_FORMAT_BITS",
]

NVFP4 = "nvfp4_w4a16"
FP8 = "fp8"
BF16 = "bf16"
# Every routed-expert format, cheapest first (the order of every per-format table and report).
FORMATS = (NVFP4, FP8, BF16)
QUANTIZED_FORMATS = (NVFP4, FP8)
# Nominal storage bits per routed weight element (ModelOpt recipe convention: NVFP4 = 4 + 8/16).
ROUTED_FORMAT_BITS: dict[str, float] = {NVFP4: 4.5, FP8: 8.0, BF16: 16.0}
# Elements per NVFP4 block: one E4M3 block scale each.
NVFP4_GROUP_SIZE = 16
# The largest finite E4M3 value: ModelOpt's FP8 scales are amax / 448.
FP8_E4M3_MAX = 448.0
# KV-cache formats the export writes (a k_scale and a v_scale per attention layer).
KV_CACHE_FORMATS = (FP8,)
