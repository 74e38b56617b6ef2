"""save_file_sorted: the bytes of a safetensors file with several metadata keys are the same in every process
(safetensors' own writer orders metadata by a per-process HashMap) and load back like save_file's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from mixquant.checkpoint.writer import save_file_sorted
from safetensors import safe_open
from safetensors.torch import load_file

METADATA = {f"key{i}": f"value{i}" for i in range(12)}

SORTED = """
import sys, torch
from mixquant.checkpoint.writer import save_file_sorted
tensors = {"b": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a": torch.ones(4, dtype=torch.float32)}
save_file_sorted(tensors, sys.argv[1], {f"key{i}": f"value{i}" for i in range(12)})
"""
# safetensors' own writer, through its numpy front end (the same Rust writer, without torch's import time)
PLAIN = """
import sys, numpy as np
from safetensors.numpy import save_file
tensors = {"b": np.arange(6, dtype=np.int64).reshape(2, 3), "a": np.ones(4, dtype=np.float32)}
save_file(tensors, sys.argv[1], metadata={f"key{i}": f"value{i}" for i in range(12)})
"""


def write_in_fresh_process(script: str, path: Path) -> bytes:
    subprocess.run([sys.executable, "-c", script, str(path)], check=True)
    return path.read_bytes()


def test_bytes_are_the_same_in_every_process(tmp_path):
    sorted_files = {write_in_fresh_process(SORTED, tmp_path / f"s{i}.safetensors") for i in range(3)}
    assert len(sorted_files) == 1
    # the reason it exists: safetensors' own writer gives different bytes from process to process
    plain_files = {write_in_fresh_process(PLAIN, tmp_path / f"p{i}.safetensors") for i in range(8)}
    assert len(plain_files) > 1


def test_loads_back_like_save_file(tmp_path):
    tensors = {"w": torch.randn(3, 5).to(torch.bfloat16), "ids": torch.arange(7, dtype=torch.int32)}
    path = tmp_path / "x.safetensors"
    save_file_sorted(tensors, path, dict(reversed(list(METADATA.items()))))
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == METADATA
