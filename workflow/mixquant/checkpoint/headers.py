"""A safetensors checkpoint directory's layout and headers, read without torch (planning reads them too).

:func:`read_safetensors_header` parses one shard's header without reading tensor data and checks that
every declared byte range fits its shape and the file (a truncated download or a corrupt header stops
with one line naming the shard). :func:`checkpoint_weight_map` maps tensor names to shards (the index, or
the single ``model.safetensors``); :func:`check_inside` refuses a file or link that leaves the model
directory.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from mixquant.jsonio import loads_strict, read_json

__all__ = [
    "CONFIG_FILE",
    "DTYPE_BYTES",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "check_inside",
    "check_links_inside",
    "checkpoint_weight_map",
    "layer_of",
    "read_header",
    "read_safetensors_header",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# Element sizes of the safetensors dtypes.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as declared; the message is one line naming the file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (``model.layers.L.``), None for the rest."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Parse and sanity-check a safetensors header without reading tensor data.

    Returns ``{name: {"dtype", "shape", "data_offsets"}}``. Raises :class:`CheckpointError` naming the
    file if it is missing, shorter than its header, has an unparsable header, or is shorter than the data
    the header declares (a truncated download), or if a tensor's byte range does not fit its shape.
    """
    return read_header(Path(path))[0]


MAX_RANK = 8  # more dimensions than any checkpoint tensor has


def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """(header, offset of the data section) of one shard, validated (:func:`read_safetensors_header`).

    As the safetensors format defines it: a JSON object of tensors (names unique) with a known dtype, a
    shape of at most 8 non-negative dimensions and a byte range of exactly that many elements; the
    ranges tile the data section from 0 to the end of the file, without overlap or gap. Everything is
    checked on the header alone (no tensor byte is read, nothing is allocated for a declared size).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header of {header_len} bytes, "
                    f"file of {size} bytes)"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read shard ({exc.strerror or exc})") from exc
    try:
        header = loads_strict(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(exc)[:200]})") from exc
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ is not a map of strings")
    data_start, ranges = 8 + header_len, []
    for name, info in header.items():
        shown = name if len(name) <= 120 else name[:120] + "..."
        try:
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise TypeError
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
                raise TypeError
            if not all(type(v) is int and v >= 0 for v in (*shape, *offsets)):
                raise TypeError
        except TypeError as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {shown}") from exc
        itemsize = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if itemsize is None:
            raise CheckpointError(f"{path}: corrupt safetensors header: {shown} has unknown dtype {dtype!r}")
        if len(shape) > MAX_RANK:
            raise CheckpointError(f"{path}: corrupt safetensors header: {shown} has {len(shape)} dimensions")
        begin, end = offsets
        if end < begin or end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: {shown} ({dtype} {shape}) "
                f"has byte range [{begin}, {end})"
            )
        ranges.append((begin, end, shown))
    ranges.sort()
    data_end = max((end for _, end, _ in ranges), default=0)
    if data_start + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: header declares {data_start + data_end} bytes, "
            f"file has {size}"
        )
    previous, previous_name = 0, None
    for begin, end, name in ranges:
        if begin != previous:
            what = (
                f"overlaps {previous_name}"
                if begin < previous
                else f"leaves a gap of {begin - previous} bytes"
            )
            raise CheckpointError(
                f"{path}: corrupt safetensors header: {name}'s byte range [{begin}, {end}) {what}"
            )
        previous, previous_name = end, name
    if data_start + data_end != size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file: {size - data_start - data_end} bytes after the last tensor"
        )
    return header, data_start


def check_inside(model_dir: str | Path, path: str | Path, what: str = "file") -> Path:
    """``path`` (in ``model_dir``) if it resolves inside ``model_dir``, else one line naming it.

    A symlink may point into the Hugging Face cache's ``blobs/`` beside a ``snapshots/<revision>``
    directory (the Hub cache layout, where every file is one); anything else that leaves the model
    directory -- an absolute path, ``..``, a link elsewhere -- is refused before it is opened.
    """
    model_dir = Path(model_dir)
    path = Path(path)
    root = model_dir.resolve()
    target = (model_dir / path).resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    if not any(target == base or target.is_relative_to(base) for base in allowed):
        raise CheckpointError(f"{model_dir}: {what} {path} leaves the model directory (-> {target})")
    return model_dir / path


def check_links_inside(directory: str | Path) -> None:
    """Every symlinked file below ``directory`` stays inside it (or its Hub cache's blobs/): one line
    naming the first that leaves (:func:`check_inside`), before anything is read through it."""
    directory = Path(directory)
    for root, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            path = Path(root) / name
            if path.is_symlink():
                check_inside(directory, path.relative_to(directory), "file")


def checkpoint_weight_map(model_dir: Path) -> tuple[dict[str, str], Path]:
    """``({tensor name: shard file name}, where it was read)``: the index, else the single file.

    Every shard the index names is a relative path that stays inside ``model_dir`` (:func:`check_inside`).
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists() or index.is_symlink():
        check_inside(model_dir, INDEX_FILE, "index")
        data = read_json(index, "safetensors index", error=CheckpointError)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: corrupt safetensors index (no weight_map of file names)")
        for shard in sorted(set(weight_map.values())):
            if not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(
                    f"{index}: names shard {shard[:120]!r}, which is not a file in {model_dir}"
                )
            check_inside(model_dir, shard, "shard")
        return {str(k): str(v) for k, v in weight_map.items()}, index
    single = model_dir / SINGLE_FILE
    if single.exists() or single.is_symlink():
        check_inside(model_dir, SINGLE_FILE, "shard")
        return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE), single
    raise CheckpointError(f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
