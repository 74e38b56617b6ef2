"""SHA-256 helpers shared by every stage: files, byte strings, hex validation."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 8 * 1024 * 1024


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, streamed in 8 MiB chunks (shards are tens of GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_sha256_hex(value: object) -> bool:
    return isinstance(value, str) and bool(HEX64.fullmatch(value))


def require_sha256_hex(value: object, what: str) -> str:
    """Return value if it is 64 lowercase hex digits; otherwise raise naming `what`.

    Keys become directory names: anything but hex (a '/', '..', a NUL) must never reach a path.
    """
    if not is_sha256_hex(value):
        raise ValueError(f"{what}: expected 64 lowercase hex digits, got {value!r}")
    return value  # type: ignore[return-value]
