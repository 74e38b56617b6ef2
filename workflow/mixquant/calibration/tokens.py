"""Canonical token-ID encoding, hashing and safetensors storage.

Canonical byte encoding (used by :func:`token_ids_sha256` and therefore by every pinned prompt / calibration
hash in this project):

* the token IDs are converted to **little-endian signed 32-bit integers** (numpy dtype ``'<i4'``),
* laid out in **C (row-major) order**,
* concatenated with **no header**: neither the shape, the dtype nor the length is hashed.

So a ``[N, T]`` calibration batch hashes exactly like its flattened ``[N*T]`` vector, and a ``[T]`` prompt and
a ``[1, T]`` prompt have the same hash; callers that care about the shape must record it separately. IDs must
be integers within the int32 range; anything else raises ``ValueError``.

Storage is safetensors only (``{"input_ids": int32 tensor}`` plus string metadata), never pickle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mixquant.checkpoint.atomic import atomic_path
from mixquant.checkpoint.writer import save_file_sorted
from mixquant.keys.hashing import bytes_sha256

INPUT_IDS_KEY = "input_ids"
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
_INTEGER_DTYPES = {
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
}


def as_int32_ids(ids: torch.Tensor, what: str = "token IDs") -> torch.Tensor:
    """Return `ids` as a contiguous CPU int32 tensor, refusing non-integer dtypes and out-of-range values."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor of integer token IDs, got {type(ids).__name__}")
    if ids.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{what}: expected an integer tensor, got dtype {ids.dtype}")
    array = ids.detach().cpu().numpy()  # numpy: torch has no min/max for uint16/32/64
    if array.size:
        lo, hi = int(array.min()), int(array.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{what}: values [{lo}, {hi}] are outside the int32 range")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))


def token_ids_bytes(ids: torch.Tensor) -> bytes:
    """The canonical encoding: little-endian int32, C order, no header (see the module docstring)."""
    return as_int32_ids(ids).numpy().astype("<i4", copy=False).tobytes(order="C")


def token_ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 (lowercase hex) of the canonical encoding of `ids`.

    Encoding: the IDs as little-endian int32 in C (row-major) order with no header. The shape is NOT part
    of the hash: a ``[N, T]`` batch and its flattened ``[N*T]`` vector hash the same, as do a ``[T]`` prompt
    and a ``[1, T]`` prompt -- calibration batches and prompts use this same rule. `ids` must be an integer
    tensor with values in the int32 range, else ``ValueError``.
    """
    return bytes_sha256(token_ids_bytes(ids))


def save_token_ids(path: str | Path, ids: torch.Tensor, metadata: dict[str, str]) -> str:
    """Write ``{"input_ids": int32}`` plus string `metadata` to a safetensors file; return the IDs' SHA-256.

    The file is written to a temporary name in the same directory and renamed into place, so a reader never
    sees a half-written file. The returned hash is :func:`token_ids_sha256` of the IDs (not the file's hash).
    """
    ids32 = as_int32_ids(ids)
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata: expected dict[str, str], got {type(metadata).__name__}")
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata: safetensors needs str keys and values; offending keys {bad!r}")
    with atomic_path(path) as tmp:
        save_file_sorted({INPUT_IDS_KEY: ids32}, tmp, metadata)
    return token_ids_sha256(ids32)


def load_token_ids(path: str | Path) -> torch.Tensor:
    """Read the ``input_ids`` tensor of a safetensors file as int32 (shape preserved)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: token-ID file not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            ids = handle.get_tensor(INPUT_IDS_KEY) if INPUT_IDS_KEY in keys else None
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        raise ValueError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    if ids is None:
        raise ValueError(f"{path}: no '{INPUT_IDS_KEY}' tensor (it has {sorted(keys)})")
    return as_int32_ids(ids, what=f"{path}: {INPUT_IDS_KEY}")


def load_token_ids_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored by :func:`save_token_ids`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def calibration_batches(calibration_ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """``calibration_ids`` ([N, T] token ids) as int64 batches of ``batch_size`` sequences, in order: the
    batches every forward stage runs (their size decides GEMM shapes, so bits)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = calibration_ids.detach().to(torch.long)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(
            f"calibration_ids must be a non-empty [num_sequences, seq_len], got {tuple(ids.shape)}"
        )
    return [ids[start : start + batch_size] for start in range(0, ids.shape[0], batch_size)]
