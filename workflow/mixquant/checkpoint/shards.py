"""Reading a sharded safetensors checkpoint a few tensors at a time, with validated headers.

:class:`ShardReader` maps tensor names to shards (:func:`mixquant.checkpoint.headers.checkpoint_weight_map`),
validates each shard's header once (:func:`~mixquant.checkpoint.headers.read_safetensors_header`), and
reads tensors with ``pread`` straight into owned tensors -- no memory map, so what a stage holds is exactly
what it asked for (the layer-streaming forward passes rely on that to bound their resident memory) --
optionally into pinned memory for a fast host-to-device copy, or into tensors the caller provides (slices
of a larger buffer: the layer streaming reads each expert straight into its place in a fused parameter).
It counts what it reads: bytes, tensors and, per decoder layer, how many times the layer's tensors were
read (the streaming tests check each layer is read exactly once per pass, and the cost model's bytes read).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.headers import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    check_inside,
    check_links_inside,
    checkpoint_weight_map,
    layer_of,
    read_header,
    read_safetensors_header,
)

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "ShardReader",
    "check_inside",
    "check_links_inside",
    "glibc",
    "layer_of",
    "read_safetensors_header",
]

# safetensors dtype -> (torch dtype, element bytes)
TORCH_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I16": (torch.int16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "F64": (torch.float64, 8),
}


class ShardReader:
    """Tensors of one checkpoint directory by name, read on demand (thread-safe counters).

    ``names`` are the checkpoint's own (disk) names. Each shard's header is validated the first time a
    tensor of it is read. ``reads[layer]`` counts calls of :meth:`read` that touched decoder layer
    ``layer`` (one per streamed load of that layer), ``bytes_read`` the tensor bytes read.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"{self.model_dir}: checkpoint directory does not exist")
        self.weight_map, self.where = checkpoint_weight_map(self.model_dir)
        self._headers: dict[str, tuple[dict[str, dict[str, Any]], int]] = {}
        self._lock = threading.Lock()
        self.reads: Counter[int] = Counter()
        self.bytes_read = 0
        self.tensors_read = 0

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def layer_names(self, layer: int) -> list[str]:
        prefix = f"model.layers.{int(layer)}."
        return [name for name in self.weight_map if name.startswith(prefix)]

    def non_layer_names(self) -> list[str]:
        return [name for name in self.weight_map if layer_of(name) is None]

    def check_all(self) -> int:
        """Validate every shard's header and size (a broken shard stops here, one line naming it)."""
        for file in sorted(set(self.weight_map.values())):
            self._header(file)
        return len(set(self.weight_map.values()))

    def _header(self, file: str) -> tuple[dict[str, dict[str, Any]], int]:
        with self._lock:
            header = self._headers.get(file)
        if header is None:
            header = read_header(self.model_dir / file)
            with self._lock:
                self._headers[file] = header
        return header

    def spec(self, name: str) -> dict[str, Any]:
        """``{"dtype", "shape", "data_offsets"}`` of one tensor (its shard's header)."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.where}: no tensor {name}")
        info = self._header(file)[0].get(name)
        if info is None:
            raise CheckpointError(
                f"{self.model_dir / file}: tensor {name} is not in it (listed in {self.where})"
            )
        return info

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.spec(n)["data_offsets"][1] - self.spec(n)["data_offsets"][0] for n in names)

    def stored(self, name: str) -> tuple[torch.dtype | None, tuple[int, ...]]:
        """(torch dtype, shape) of one tensor as stored; the dtype is None where mixquant does not read it."""
        info = self.spec(name)
        dtype = TORCH_DTYPES.get(str(info["dtype"]))
        return (dtype[0] if dtype else None), tuple(int(d) for d in info["shape"])

    def read(
        self,
        names: Iterable[str],
        *,
        pin_memory: bool = False,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` read from the shards with pread (owned CPU tensors; pinned on request).

        ``into`` names a destination for some of ``names``: a contiguous CPU tensor of the stored dtype and
        shape, typically a slice of a larger buffer; the bytes are read straight into it (no copy) and the
        result holds that tensor. Counters count it like any other read. Every destination is allocated
        before the first read, so that a second thread can fault their pages in just ahead of the reads
        (:func:`_prefault`).
        """
        names = list(names)
        into = into or {}
        by_file: dict[str, list[str]] = {}
        for name in names:
            self.spec(name)  # every name known and its shard valid before anything is read
            by_file.setdefault(self.weight_map[name], []).append(name)
        order = [
            (file, sorted(members, key=lambda n: self.spec(n)["data_offsets"][0]))
            for file, members in sorted(by_file.items())
        ]
        out = {
            name: self._destination(name, into.get(name), pin_memory) for _, group in order for name in group
        }
        progress = _ReadProgress()
        at, faulting = 0, []  # (where it starts in the read, tensor): pinned memory is resident already
        for tensor in out.values():
            if not tensor.is_pinned():
                faulting.append((at, tensor))
            at += tensor.nbytes
        helper = threading.Thread(target=_prefault, args=(faulting, progress), name="mixquant-prefault")
        helper.start()
        try:
            for file, members in order:
                path = self.model_dir / file
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot read shard ({exc.strerror or exc})") from exc
                try:
                    for name in members:
                        self._pread(fd, path, name, out[name])
                        progress.advance(out[name].nbytes)
                finally:
                    os.close(fd)
        finally:
            progress.finish()
            helper.join()
        total = sum(tensor.nbytes for tensor in out.values())
        layers = {layer for name in names if (layer := layer_of(name)) is not None}
        with self._lock:
            self.bytes_read += total
            self.tensors_read += len(names)
            for layer in layers:
                self.reads[layer] += 1
        return {name: out[name] for name in names}

    def _destination(self, name: str, given: torch.Tensor | None, pin_memory: bool) -> torch.Tensor:
        """Where ``name`` is read to: ``given`` (checked: the stored dtype and shape) or a new tensor."""
        dtype, shape = self.stored(name)
        if dtype is None:
            raise CheckpointError(
                f"{self.model_dir / self.weight_map[name]}: {name} has dtype {self.spec(name)['dtype']}, "
                "which mixquant does not read"
            )
        if given is None:
            return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        if not (
            given.dtype == dtype
            and tuple(given.shape) == shape
            and given.is_contiguous()
            and given.device.type == "cpu"
        ):
            raise ValueError(
                f"{name}: cannot read {self.spec(name)['dtype']} {list(shape)} into a {given.dtype} "
                f"{list(given.shape)} tensor on {given.device} (needs a contiguous CPU tensor of the stored "
                "dtype and shape)"
            )
        return given

    def _pread(self, fd: int, path: Path, name: str, destination: torch.Tensor) -> None:
        begin, end = (int(v) for v in self.spec(name)["data_offsets"])
        size = end - begin
        raw = destination.reshape(-1).view(torch.uint8)  # the destination's own bytes (it is contiguous)
        view = memoryview(raw.numpy()) if size else memoryview(b"")
        offset, done = self._header(self.weight_map[name])[1] + begin, 0
        while done < size:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read {name} ({exc.strerror or exc})") from exc
            if got <= 0:
                raise CheckpointError(f"{path}: {name} ends early (read {done} of {size} bytes)")
            done += got


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in, writable, without writing it
_PREFAULT_STEP = 32 << 20
_PREFAULT_AHEAD = 256 << 20  # how far the faulting runs ahead of the reads: a quarter second of disk


def glibc() -> ctypes.CDLL | None:
    """The C library (glibc's allocator and madvise), None where it is another one."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


class _ReadProgress:
    """The bytes one :meth:`ShardReader.read` has read so far, for its prefault helper to follow."""

    def __init__(self):
        self._changed = threading.Condition()
        self._done = 0
        self._finished = False

    def advance(self, nbytes: int) -> None:
        with self._changed:
            self._done += nbytes
            self._changed.notify()

    def finish(self) -> None:
        with self._changed:
            self._finished = True
            self._changed.notify()

    def reached(self, position: int) -> bool:
        """Wait until the reads have passed ``position`` bytes; False once they are over."""
        with self._changed:
            self._changed.wait_for(lambda: self._finished or self._done >= position)
            return not self._finished


def _prefault(tensors: list[tuple[int, torch.Tensor]], progress: _ReadProgress) -> None:
    """Fault in the pages of ``tensors`` (new memory; each with where it starts in the read) a little ahead
    of the reads that fill them.

    A read into fresh anonymous memory faults it in a page at a time; on a virtual machine that returns free
    memory to its host that costs about as much as reading the bytes from disk (about 1 GB/s, measured by
    benchmarks/bench_layer_load.py), and in the reading thread it comes on top of the read. Here, in a
    second thread, it overlaps the reads. It stays at most ``_PREFAULT_AHEAD`` bytes ahead of them, so the
    memory resident during a read grows with the read, as without it. Stops when the reads are over or at
    the first refusal (another C library, a kernel before 5.14): the reads then fault the remaining pages
    themselves, as they always could.
    """
    libc = glibc()
    if libc is None:
        return
    page = mmap.PAGESIZE
    for at, tensor in tensors:
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.nbytes) // page * page
        while start < end:
            if not progress.reached(at + start - tensor.data_ptr() - _PREFAULT_AHEAD):
                return
            size = min(_PREFAULT_STEP, end - start)
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) != 0:
                return
            start += size
