"""The one write-then-rename of mixquant: a reader sees the old file or the new one, never a part.

Every file mixquant renames into place starts as a temporary file beside its target (same directory, so
the rename is atomic), named ``.<name>.<random>.tmp``, with the mode a plain ``open`` would give under the
process's umask (``tempfile.mkstemp`` makes it 0600, so a group sharing a results store could not read
what is renamed into it). The temporary file never survives a failure. A keyed directory is published the
same way: a temporary directory beside it (:func:`temporary_dir_beside`), renamed once it is complete.

Standard library only: every floor imports it, :mod:`mixquant.jsonio` included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_directory",
    "atomic_open",
    "atomic_path",
    "process_umask",
    "temporary_beside",
    "temporary_dir_beside",
    "write_bytes_atomic",
    "write_text_atomic",
]


def process_umask() -> int:
    """The process's file-mode creation mask, read without changing it (Linux reports it in
    /proc/self/status; elsewhere it is set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_beside(path: str | Path) -> tuple[int, str]:
    """``(fd, name)`` of a new file in ``path``'s directory, named after it, for a write that is renamed
    onto ``path``; its mode is what a plain ``open`` would give under the umask."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~process_umask())
    return fd, tmp


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield the path of a new, empty temporary file beside ``path`` (its directory is created) for the
    caller to write; when the block ends without an error it is renamed onto ``path``, otherwise removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_beside(path)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(path, mode, **kwargs)`` of a temporary file beside ``path``, renamed onto it when the block
    ends without an error (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as handle:
        yield handle


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file beside it and a rename."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def temporary_dir_beside(path: str | Path, tag: str | None = None) -> Path:
    """A new, empty directory in ``path``'s directory for a directory that is renamed onto ``path``:
    ``.tmp-<tag>-<pid>-<random>`` (``tag``: ``path``'s name unless given; the pid tells a later run
    whether the process that made it is gone), its mode what a plain ``mkdir`` gives under the umask."""
    path = Path(path)
    tag = path.name if tag is None else tag
    temporary = path.parent / f".tmp-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir(parents=True)
    return temporary


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a new temporary directory beside ``path`` (which must not exist) for the caller to fill;
    renamed onto ``path`` when the block ends without an error, otherwise removed with its content."""
    path = Path(path)
    temporary = temporary_dir_beside(path)
    try:
        yield temporary
        temporary.rename(path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
