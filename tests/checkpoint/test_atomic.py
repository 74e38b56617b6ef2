"""The one write-then-rename (mixquant.checkpoint.atomic): a reader sees the old file or the new one, and
nothing is left behind when the write fails (file modes: tests/test_file_modes.py)."""

from __future__ import annotations

import os

import pytest
from mixquant.checkpoint import atomic
from mixquant.checkpoint.atomic import (
    atomic_directory,
    atomic_open,
    atomic_path,
    temporary_dir_beside,
    write_bytes_atomic,
    write_text_atomic,
)


def test_writes_replace_the_file_and_leave_no_temporary(tmp_path):
    target = tmp_path / "sub" / "doc.txt"
    write_text_atomic(target, "one")
    write_bytes_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".doc.txt.") and tmp.suffix == ".tmp"
        tmp.write_text("three")
        assert target.read_text() == "two"  # not yet renamed
    assert target.read_text() == "three"
    assert sorted(p.name for p in target.parent.iterdir()) == ["doc.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "doc.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="half way"), atomic_open(target, "w") as handle:
        handle.write("new, partly")
        raise RuntimeError("half way")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]


def test_a_failed_rename_removes_the_temporary(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", disk_full)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(tmp_path / "doc.txt", "x")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_publishes_whole_or_not_at_all(tmp_path):
    with atomic_directory(tmp_path / "done") as tmp:
        assert tmp.name.startswith(f".tmp-done-{os.getpid()}-")
        (tmp / "a.txt").write_text("a")
    assert (tmp_path / "done" / "a.txt").read_text() == "a"
    with pytest.raises(ValueError, match="stop"), atomic_directory(tmp_path / "failed") as tmp:
        (tmp / "a.txt").write_text("a")
        raise ValueError("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]


def test_temporary_dir_beside_names_the_tag_and_process(tmp_path):
    made = temporary_dir_beside(tmp_path / "out" / "key", tag="abc")
    assert made.parent == tmp_path / "out" and made.is_dir() and not any(made.iterdir())
    assert made.name.startswith(f".tmp-abc-{os.getpid()}-")
    assert int(made.name.split("-")[2]) == os.getpid()  # what a later run reads to clean up after a kill
