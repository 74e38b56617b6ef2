"""Whether a source checkpoint is block-scaled FP8, from its config.json alone (torch-free: planning
asks it). :mod:`mixquant.checkpoint.fp8_source` undoes such a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixquant.checkpoint.headers import CheckpointError

__all__ = ["E4M3_FORMATS", "SCALE_FORMATS", "Fp8SourceError", "block_size", "is_block_fp8"]

# config "fmt" spellings of float8_e4m3fn: DeepSeek-V3 and Kimi-K2 write "e4m3", MiniMax-M2 "float8_e4m3fn"
E4M3_FORMATS = ("e4m3", "float8_e4m3fn")
# "ue8m0" (DeepSeek-V3.1) rounds *activation* scales to powers of two; weight scales stay float32 and
# fp8_cast_bf16.py dequantizes them the same way
SCALE_FORMATS = (None, "float", "ue8m0")


class Fp8SourceError(CheckpointError):
    """An FP8 source mixquant cannot dequantize exactly as its publisher does; one line naming why."""


def is_block_fp8(config: Mapping[str, Any]) -> bool:
    """Whether config.json declares block-scaled FP8 weights that
    :func:`mixquant.checkpoint.fp8_source.dequantize_checkpoint` can undo.

    False without a ``quantization_config`` (already a high-precision checkpoint). A quantization_config
    of any other kind raises, because such a checkpoint is no BF16 source either and silently treating
    it as one would quantize garbage.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return False
    block_size(config)
    return True


def block_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` as (rows, columns), after checking the variant is the
    dynamic block-FP8 e4m3 scheme the publishers' dequantization covers (one-line error naming the field)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        raise Fp8SourceError("config.json: quantization_config is missing or not an object; not block FP8")
    method = quant.get("quant_method")
    if method != "fp8":
        raise _unsupported("quant_method", method, "only 'fp8' (block-scaled) is supported")
    scheme = quant.get("activation_scheme", "dynamic")
    if str(scheme).lower() != "dynamic":
        raise _unsupported("activation_scheme", scheme, "only 'dynamic' is supported")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in E4M3_FORMATS:
        raise _unsupported("fmt", fmt, "only e4m3 weights are supported")
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise _unsupported("scale_fmt", scale_fmt, "only 'float' or 'ue8m0' is supported")
    expert_dtype = quant.get("expert_dtype", "fp8")
    if expert_dtype != "fp8":
        raise _unsupported("expert_dtype", expert_dtype, "only fp8 experts are supported")
    block = quant.get("weight_block_size")
    if block is None:
        raise _unsupported("weight_block_size", block, "per-tensor FP8 is not supported")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise _unsupported("weight_block_size", block, "expected two positive integers")
    return int(block[0]), int(block[1])


def _unsupported(field: str, value: Any, why: str) -> Fp8SourceError:
    return Fp8SourceError(f"config.json: quantization_config.{field} is {value!r}; {why}")
