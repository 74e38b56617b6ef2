"""Outputs are readable by the group that shares a results store: every file mixquant writes has the mode a
plain ``open`` gives under the process's umask (a temporary file renamed into place included), under the
usual 022 and the group-sharing 002."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Each writer mixquant renames into place, or creates in place, run in a child process under the umask.
WRITERS = r"""
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

from mixquant.calibration.tokens import save_token_ids
from mixquant.checkpoint.atomic import atomic_directory, atomic_open, write_bytes_atomic, write_text_atomic
from mixquant.checkpoint.writer import save_file_sorted
from mixquant.jsonio import write_json_atomic
from mixquant.search.plots import _save
from mixquant.store import hold_results_store, release_results_store

out = Path(sys.argv[1])
write_json_atomic(out / "doc.json", {"a": 1})
with atomic_open(out / "table.md", "w", encoding="utf-8") as handle:
    handle.write("| x |")
save_token_ids(out / "ids.safetensors", torch.arange(4), {})
save_file_sorted({"w": torch.zeros(2)}, out / "w.safetensors", {"format": "pt"})
write_text_atomic(out / "stats.json", "{}")
_save(Figure(figsize=(1, 1)), out / "plot.png")
write_bytes_atomic(out / "blob.bin", b"x")
with atomic_directory(out / "published") as tmp:
    (tmp / "inside.txt").write_text("x")
hold_results_store(out / "store")
release_results_store(out / "store")
"""


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_writer_leaves_the_mode_the_umask_gives(umask, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    subprocess.run(
        [sys.executable, "-c", f"import os; os.umask({umask}); exec({WRITERS!r})", str(tmp_path)],
        check=True,
        env=env,
    )
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 9, files
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert stat.S_IMODE((tmp_path / "published").stat().st_mode) == 0o777 & ~umask
    assert not [p for p in tmp_path.rglob("*.tmp")] and not [p for p in tmp_path.glob(".tmp-*")]
