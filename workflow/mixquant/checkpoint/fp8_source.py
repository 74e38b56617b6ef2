"""A block-scaled FP8 source checkpoint (DeepSeek-V3/R1, Kimi-K2.x, MiniMax-M2) turned into the BF16 one.

mixquant quantizes from a BF16 source, but these publishers ship their weights as float8_e4m3fn with one
float32 ``<weight>_scale_inv`` per 128x128 block. The BF16 source is then *defined* by the publisher's own
dequantization, DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant_kernel`` (lines 61-86 at 9b4e978), run
by ``inference/fp8_cast_bf16.py`` (lines 32, 71-88) under ``torch.set_default_dtype(torch.bfloat16)``::

    y[i, j] = bfloat16( float32(x[i, j]) * s[i // 128, j // 128] )

one float32 multiply (the fp8 value widens exactly) rounded once, to nearest even, to bf16; the last row and
column blocks are partial (the kernel masks them) and still use their own scale, so ``s`` has shape
``[ceil(M / 128), ceil(N / 128)]`` (README_WEIGHTS.md lines 83-90). :func:`dequantize_block_fp8` computes
exactly that in plain torch (CPU or CUDA, no Triton), bit for bit.

:func:`dequantize_checkpoint` streams a checkpoint directory one shard at a time into a BF16 directory: the
same shard file names and tensor names minus the ``*_scale_inv`` tensors (as fp8_cast_bf16.py does), a new
index, config.json without ``quantization_config`` and every other file copied. Unlike fp8_cast_bf16.py,
which warns and copies an FP8 weight whose scale is missing, everything the conversion could get wrong is
refused before anything is written: an unpaired weight or scale, a scale grid of the wrong shape, a
non-finite scale, a quantization config other than dynamic block FP8 (e4m3).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.atomic import atomic_path
from mixquant.checkpoint.fp8_config import Fp8SourceError, block_size, is_block_fp8
from mixquant.checkpoint.headers import CONFIG_FILE, INDEX_FILE
from mixquant.checkpoint.shards import ShardReader
from mixquant.checkpoint.writer import tensor_record, write_safetensors
from mixquant.jsonio import read_json

__all__ = [
    "SCALE_SUFFIX",
    "Fp8SourceError",
    "block_size",
    "dequantize_block_fp8",
    "dequantize_checkpoint",
    "is_block_fp8",
]

SCALE_SUFFIX = "_scale_inv"  # fp8_cast_bf16.py: f"{weight_name}_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16")  # all widen exactly to the float32 the kernel multiplies in


# ------------------------------------------------------------------------------------- one tensor


def scale_grid(shape: tuple[int, ...] | list[int], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape a weight of ``shape`` needs: leading dims kept, ``ceil`` over the last two
    (the partial edge blocks get a scale of their own)."""
    *lead, rows, cols = (int(d) for d in shape)
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, name: str = "weight"
) -> torch.Tensor:
    """BF16 ``weight`` as DeepSeek-V3's ``weight_dequant`` computes it: ``bf16(f32(x) * s[i//bm, j//bn])``.

    The fp8 values widen exactly to float32, each is multiplied once by its block's float32 scale and the
    product is rounded once to bf16 (round to nearest even, like the kernel's store). The scale is
    broadcast through views -- expanded over rows only -- so no second weight-sized float32 tensor is
    made. ``weight`` is ``[..., M, N]`` (leading dims: stacked experts), ``scale_inv``
    ``[..., ceil(M/bm), ceil(N/bn)]``; both on the same device (CPU or CUDA give the same bits).
    """
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise Fp8SourceError(f"{name}: dtype {weight.dtype} is not float8; nothing to dequantize")
    if scale_inv.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # these widen exactly
        raise Fp8SourceError(f"{name}: scale_inv dtype {scale_inv.dtype} is not float32/bfloat16/float16")
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise Fp8SourceError(f"{name}: block {block!r} is not two positive integers")
    if weight.dim() < 2:
        raise Fp8SourceError(f"{name}: weight of shape {list(weight.shape)} is not a matrix")
    expected = scale_grid(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise Fp8SourceError(
            f"{name}: scale_inv shape {list(scale_inv.shape)} does not match weight {list(weight.shape)} "
            f"in {block[0]}x{block[1]} blocks (expected {list(expected)})"
        )
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(device=weight.device, dtype=torch.float32)
    out = weight.to(torch.float32)
    row_scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]  # [..., M, ceil(N/bn)]
    full, rest = divmod(cols, block[1])
    if full:
        out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(row_scale[..., :full, None])
    if rest:
        out[..., full * block[1] :].mul_(row_scale[..., full:])
    return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------- checkpoint


def _plan(reader: ShardReader, block: tuple[int, int]) -> dict[str, str]:
    """``{fp8 weight: its scale}`` for the whole checkpoint, from the headers alone; every pairing, dtype
    and grid problem refused here, before anything is read or written."""
    names = set(reader.names)
    pairs: dict[str, str] = {}
    for name in sorted(names):
        spec = reader.spec(name)
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            if weight_name not in names:
                raise Fp8SourceError(f"{name}: scale without its weight {weight_name}")
            if reader.spec(weight_name)["dtype"] not in FP8_DTYPES:
                raise Fp8SourceError(
                    f"{weight_name}: has a scale {name} but is {reader.spec(weight_name)['dtype']}, not FP8"
                )
            continue
        if spec["dtype"] not in FP8_DTYPES:
            continue
        scale_name = name + SCALE_SUFFIX
        if scale_name not in names:
            raise Fp8SourceError(f"{name}: FP8 weight without its scale {scale_name}")
        if spec["dtype"] != "F8_E4M3":
            raise Fp8SourceError(f"{name}: dtype {spec['dtype']}, but quantization_config declares e4m3")
        scale = reader.spec(scale_name)
        if scale["dtype"] not in SCALE_DTYPES:
            raise Fp8SourceError(f"{scale_name}: dtype {scale['dtype']} is not F32/BF16/F16")
        if len(spec["shape"]) < 2:
            raise Fp8SourceError(f"{name}: FP8 weight of shape {spec['shape']} is not a matrix")
        expected = scale_grid(spec["shape"], block)
        if tuple(scale["shape"]) != expected:
            raise Fp8SourceError(
                f"{scale_name}: shape {list(scale['shape'])} does not match weight {list(spec['shape'])} "
                f"in {block[0]}x{block[1]} blocks (expected {list(expected)})"
            )
        pairs[name] = scale_name
    return pairs


def _check_scales_finite(reader: ShardReader, pairs: Mapping[str, str], shards: list[str]) -> None:
    """Read every scale (a few hundred MB for a 671B model), one shard's worth at a time, and refuse a
    non-finite one: inf/nan would turn a whole block of the BF16 source into inf/nan."""
    for shard in shards:
        scale_names = sorted(s for s in pairs.values() if reader.weight_map[s] == shard)
        for scale_name, scale in reader.read(scale_names).items():
            if not bool(torch.isfinite(scale).all()):
                raise Fp8SourceError(f"{scale_name}: non-finite scale (inf or nan) in {shard}")


def _other_files(src_dir: Path, shards: set[str]) -> list[Path]:
    """Source files to copy as they are (tokenizer, generation config, remote code, ...), relative paths:
    everything but the safetensors, the index, config.json and hidden entries (.cache, .git...)."""
    out = []
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if path.suffix == ".safetensors" or rel.as_posix() in {INDEX_FILE, CONFIG_FILE, *shards}:
            continue
        out.append(rel)
    return out


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def dequantize_checkpoint(
    src_dir: str | Path, out_dir: str | Path, *, progress: bool = False
) -> dict[str, Any]:
    """Write the BF16 checkpoint a block-FP8 ``src_dir`` stands for into ``out_dir`` (absent or empty).

    Streams one source shard at a time (its tensors, plus the scales of its FP8 weights wherever they
    are): each FP8 weight becomes :func:`dequantize_block_fp8` of it, every other tensor is copied bit for
    bit, the ``*_scale_inv`` tensors are dropped, and the shard is written under its own file name
    (a shard left empty is not written). Then model.safetensors.index.json (weight_map sorted,
    ``metadata.total_size``), config.json without ``quantization_config`` and with ``dtype`` /
    ``torch_dtype`` "bfloat16", and every other file copied byte for byte. Same input, same output bytes.
    Returns a summary: shard and tensor counts and the tensor bytes read and written.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    config = read_json(src_dir / CONFIG_FILE, "config.json", error=Fp8SourceError)
    if not isinstance(config, dict) or not is_block_fp8(config):
        raise Fp8SourceError(f"{src_dir / CONFIG_FILE}: no quantization_config; not a block-FP8 checkpoint")
    block = block_size(config)
    src_resolved, out_resolved = src_dir.resolve(), out_dir.resolve()
    if out_resolved == src_resolved or src_resolved in out_resolved.parents:
        raise Fp8SourceError(f"{out_dir}: output directory is (inside) the source {src_dir}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise Fp8SourceError(f"{out_dir}: output directory exists and is not empty")

    reader = ShardReader(src_dir)
    reader.check_all()
    pairs = _plan(reader, block)
    shards = sorted(set(reader.weight_map.values()))
    _check_scales_finite(reader, pairs, shards)
    scales = set(pairs.values())
    kept_by_shard: dict[str, list[str]] = {shard: [] for shard in shards}
    for name, shard in reader.weight_map.items():
        if name not in scales:
            kept_by_shard[shard].append(name)
    others = _other_files(src_dir, set(shards))

    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    bytes_out = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(shards), desc="dequantize FP8 source", unit="shard")
    for shard in shards:
        kept = sorted(kept_by_shard[shard])
        tensors = reader.read([*kept, *(pairs[n] for n in kept if n in pairs)])
        payload: dict[str, torch.Tensor] = {}
        for name in kept:
            tensor = tensors.pop(name)
            if name in pairs:
                tensor = dequantize_block_fp8(tensor, tensors.pop(pairs[name]), block, name=name)
            payload[name] = tensor.contiguous()
            weight_map[name] = shard
            bytes_out += tensor.numel() * tensor.element_size()
        del tensors
        if payload:
            with atomic_path(out_dir / shard) as partial:
                records = [tensor_record(name, tensor) for name, tensor in payload.items()]
                write_safetensors(partial, records, fsync=False)
                del records
        del payload
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    index = {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / INDEX_FILE, index)
    new_config = {k: v for k, v in config.items() if k != "quantization_config"}
    new_config["dtype"] = "bfloat16"
    new_config["torch_dtype"] = "bfloat16"  # pre-v5 readers (vLLM, older transformers) look for this spelling
    _write_json(out_dir / CONFIG_FILE, new_config)
    for rel in others:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_dir / rel, out_dir / rel)
    return {
        "block_size": list(block),
        "shards": len({*weight_map.values()}),
        "tensors_dequantized": len(pairs),
        "tensors_copied": len(weight_map) - len(pairs),
        "scales_dropped": len(scales),
        "files_copied": [rel.as_posix() for rel in others],
        "bytes_in": reader.nbytes(reader.names),
        "bytes_out": bytes_out,
    }
