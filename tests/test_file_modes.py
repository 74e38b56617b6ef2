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
from mixquant.export.checkpoint import save_file_sorted
from mixquant.jsonio import write_json_atomic
from mixquant.kld.report import _write_atomic
from mixquant.quantize.activations import _atomic_write
from mixquant.search.plots import _save
from mixquant.store import hold_results_store, release_results_store

out = Path(sys.argv[1])
write_json_atomic(out / "doc.json", {"a": 1})
_write_atomic(out / "table.md", lambda handle: handle.write("| x |"), "w")
save_token_ids(out / "ids.safetensors", torch.arange(4), {})
save_file_sorted({"w": torch.zeros(2)}, out / "w.safetensors", {"format": "pt"})
_atomic_write(out / "stats.json", lambda tmp: Path(tmp).write_text("{}"))
_save(Figure(figsize=(1, 1)), out / "plot.png")
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
    assert len(files) == 7, files
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert not [p for p in tmp_path.rglob("*.tmp")]
