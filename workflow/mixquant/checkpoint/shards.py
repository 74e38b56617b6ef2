"""Reading a sharded safetensors checkpoint a few tensors at a time, with validated headers.

:func:`read_safetensors_header` parses one shard's header without reading tensor data and checks that
every declared byte range fits its shape and the file (a truncated download or a corrupt header stops
with one line naming the shard). :class:`ShardReader` maps tensor names to shards (the index, or the
single ``model.safetensors``), validates each shard's header once, and reads tensors with ``pread``
straight into owned tensors -- no memory map, so what a stage holds is exactly what it asked for (the
layer-streaming forward passes rely on that to bound their resident memory) -- optionally into pinned
memory for a fast host-to-device copy, or into tensors the caller provides (slices of a larger buffer: the
layer streaming reads each expert straight into its place in a fused parameter). It counts what it reads:
bytes, tensors and, per decoder layer, how many times the layer's tensors were read (the streaming tests
check each layer is read exactly once per pass, and the cost model's bytes read).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

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

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
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
DTYPE_BYTES = {name: size for name, (_, size) in TORCH_DTYPES.items()} | {
    "F8_E8M0": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
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
    return _read_header(Path(path))[0]


MAX_RANK = 8  # more dimensions than any checkpoint tensor has


def _read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """(header, offset of the data section) of one shard, validated (:func:`read_safetensors_header`).

    As the safetensors format defines it: a JSON object of tensors (names unique) with a known dtype, a
    shape of at most 8 non-negative dimensions and a byte range of exactly that many elements; the
    ranges tile the data section from 0 to the end of the file, without overlap or gap. Everything is
    checked on the header alone (no tensor byte is read, nothing is allocated for a declared size).
    """
    from mixquant.jsonio import loads_strict

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
        from mixquant.jsonio import read_json

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
            header = _read_header(self.model_dir / file)
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
