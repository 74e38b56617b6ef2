"""The deterministic safetensors writer: a file's bytes are a function of its tensors and metadata.

:func:`write_safetensors` streams :class:`TensorRecord` s into a new file: only the header is built in
memory; tensor bytes are copied from their files (raw byte ranges located through a validated header,
:func:`mixquant.checkpoint.headers.read_safetensors_header`) with ``os.copy_file_range`` (in-kernel; plain
``pread``/``write`` through one 8 MiB buffer where the kernel or file system refuses), or written from
memory (:func:`tensor_record`), so memory stays flat whatever the model size. The byte layout is
safetensors' own (``safetensors.torch.save_file`` gives the same bytes for the same tensors;
tests/checkpoint/test_writer.py checks it):

* 8 bytes: little-endian u64 ``N``, the length of the header;
* ``N`` bytes: compact JSON (no spaces) ``{"__metadata__":{"format":"pt"},"<name>":{"dtype":"BF16",
  "shape":[...],"data_offsets":[begin,end]},...}`` with the tensors in *data order* -- sorted by
  dtype, widest alignment first (safetensors' ``Dtype`` enum order, descending: U64, I64, F64, C64,
  F32, U32, I32, BF16, F16, U16, I16, F8_E8M0, F8_E4M3, F8_E5M2, I8, U8, ..., BOOL), then by name --
  padded with spaces to a multiple of 8 bytes;
* the tensors' raw little-endian bytes back to back in that order (``data_offsets`` are relative to
  the end of the header).

:func:`save_file_sorted` is ``safetensors.torch.save_file`` with the metadata in sorted key order (the
stages' small tensor files: token IDs, activation statistics).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.headers import CheckpointError

__all__ = [
    "SAFETENSORS_METADATA",
    "RangeCopier",
    "TensorRecord",
    "safetensors_header",
    "save_file_sorted",
    "tensor_record",
    "write_safetensors",
]

# The metadata transformers writes into every shard of a checkpoint.
SAFETENSORS_METADATA = {"format": "pt"}

# safetensors' Dtype enum, in its (ascending alignment) order; data is laid out in descending order.
_ST_DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_ST_RANK = {name: i for i, name in enumerate(_ST_DTYPE_ORDER)}
_TORCH_TO_ST = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
if hasattr(torch, "float8_e8m0fnu"):
    _TORCH_TO_ST[torch.float8_e8m0fnu] = "F8_E8M0"

_COPY_BUFFER_BYTES = 8 << 20
_COPY_CHUNK_BYTES = 1 << 30  # per copy_file_range call
# copy_file_range errors that mean "not supported here": fall back to pread/write.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP, errno.EPERM}


@dataclass(frozen=True)
class TensorRecord:
    """One tensor to write: safetensors dtype string, shape, byte size and where its raw bytes are.

    Either ``path`` + ``offset`` (absolute file offset of the first byte) or ``data`` (bytes in memory).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: Path | None = None
    offset: int = 0
    data: bytes | None = None


def tensor_record(name: str, tensor: torch.Tensor) -> TensorRecord:
    """An in-memory :class:`TensorRecord` of a CPU tensor (its contiguous little-endian bytes)."""
    t = tensor.detach().to("cpu").contiguous()
    dtype = _TORCH_TO_ST.get(t.dtype)
    if dtype is None:
        raise ValueError(f"{name}: dtype {t.dtype} has no safetensors equivalent here")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return TensorRecord(name, dtype, tuple(t.shape), len(data), data=data)


def _data_order(records: Iterable[TensorRecord]) -> list[TensorRecord]:
    records = list(records)
    unknown = sorted({r.dtype for r in records} - set(_ST_RANK))
    if unknown:
        raise ValueError(f"unknown safetensors dtype(s) {unknown}")
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    # safetensors: descending dtype (alignment) order, then name (Rust str order == code point order)
    return sorted(records, key=lambda r: (-_ST_RANK[r.dtype], r.name))


def safetensors_header(
    records: Iterable[TensorRecord], metadata: Mapping[str, str] | None = SAFETENSORS_METADATA
) -> tuple[bytes, list[TensorRecord]]:
    """``(8-byte length + padded JSON header, records in data order)`` exactly as safetensors writes them."""
    ordered = _data_order(records)
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for r in ordered:
        header[r.name] = {
            "dtype": r.dtype,
            "shape": list(r.shape),
            "data_offsets": [offset, offset + r.nbytes],
        }
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


class RangeCopier:
    """Raw byte-range copies into an fd: ``os.copy_file_range``, else ``pread`` + ``write`` (one buffer)."""

    def __init__(self) -> None:
        self.method = "copy_file_range" if hasattr(os, "copy_file_range") else "pread/write"
        self._buffer: bytearray | None = None
        self._sources: dict[Path, int] = {}

    def close(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()

    def _source_fd(self, path: Path) -> int:
        fd = self._sources.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            self._sources[path] = fd
        return fd

    def copy(self, path: Path, offset: int, count: int, dst: int) -> None:
        src = self._source_fd(path)
        done = 0
        while done < count and self.method == "copy_file_range":
            try:
                n = os.copy_file_range(src, dst, min(count - done, _COPY_CHUNK_BYTES), offset + done)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE or done:
                    raise
                self.method = "pread/write"
                break
            if n == 0:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
            done += n
        if done < count:
            if self._buffer is None:
                self._buffer = bytearray(_COPY_BUFFER_BYTES)
            view = memoryview(self._buffer)
            while done < count:
                want = min(count - done, len(view))
                n = os.preadv(src, [view[:want]], offset + done)
                if n == 0:
                    raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
                _write_all(dst, view[:n])
                done += n


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_safetensors(
    path: Path,
    records: Iterable[TensorRecord],
    *,
    metadata: Mapping[str, str] | None = SAFETENSORS_METADATA,
    fsync: bool = True,
    copier: RangeCopier | None = None,
) -> int:
    """Stream ``records`` into a new safetensors file at ``path``; returns the file size.

    The bytes equal ``safetensors.torch.save_file`` of the same tensors with the same metadata (layout
    in the module docstring). Only the header is built in memory; tensor bytes are copied from their
    files (or written from ``record.data``), through ``copier`` if given (one per export: it keeps the source
    files open). ``fsync``: ``fdatasync`` the file before returning.
    """
    header, ordered = safetensors_header(records, metadata)
    own_copier = copier is None
    copier = copier or RangeCopier()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides, as for open()
    try:
        _write_all(fd, header)
        for r in ordered:
            if r.data is not None:
                if len(r.data) != r.nbytes:
                    raise ValueError(f"{r.name}: {len(r.data)} bytes of data for {r.nbytes} declared")
                _write_all(fd, r.data)
            elif r.nbytes:
                copier.copy(Path(r.path), r.offset, r.nbytes, fd)
        if fsync:
            os.fdatasync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
        if own_copier:
            copier.close()
    expected = len(header) + sum(r.nbytes for r in ordered)
    if size != expected:
        raise OSError(f"{path}: wrote {size} bytes, expected {expected}")
    return size


def save_file_sorted(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None
) -> int:
    """``safetensors.torch.save_file`` with the metadata in sorted key order, so the bytes are a function of
    the content: safetensors' own writer keeps metadata in a Rust HashMap, whose order changes from process
    to process once there are two or more keys (an identical result then hashes differently). ``None``:
    no metadata (the header has no ``__metadata__``, as ``save_file`` without metadata)."""
    records = [tensor_record(name, tensor) for name, tensor in tensors.items()]
    ordered_metadata = None if metadata is None else {str(k): str(v) for k, v in sorted(metadata.items())}
    return write_safetensors(Path(path), records, metadata=ordered_metadata, fsync=False)
