"""A second clone of the default, started from a shell that exported settings the numerics profile
overrides, reproduces the first byte for byte: every keyed directory (manifests included), the four
published hashes, every gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mixquant.keys.manifest import verify_manifest

pytestmark = pytest.mark.slow

# What a user's shell may export: another ATen dispatch (no SIMD), MKL's host-dependent mode, more
# threads, dynamic MKL, oneDNN's widest ISA. The profile sets its own before torch is imported.
HOSTILE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AUTO",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    "MKL_DYNAMIC": "TRUE",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
}


def _run(root, *args):
    result = subprocess.run(
        args, cwd=root, env={**os.environ, **HOSTILE}, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_a_second_clone_under_a_hostile_shell_gives_the_same_bytes(built_workdir, workdir):
    first, second = built_workdir, workdir  # two clones at two absolute paths
    _run(second.root, sys.executable, "-m", "snakemake", "--cores", "2")  # rule all: gates and verify

    verified = json.loads(_run(second.root, sys.executable, "-m", "mixquant.cli", "verify", "--json").stdout)
    assert verified["ok"] is True and verified["counts"] == {"match": 4, "mismatch": 0, "not pinned": 0}
    paths = second.paths()
    assert paths == first.paths()  # same keys, all done
    assert all(row["done"] for row in paths.values())
    verdict = json.loads((second.root / paths["kld_verdict"]["path"] / "verdict.json").read_text())
    assert verdict["passed"] is True

    compared = 0
    for stage_dir in sorted((second.root / "results").iterdir()):
        if stage_dir.name in ("logs", "benchmarks") or not stage_dir.is_dir():
            continue  # timings of the run and the store's lock file (mixquant.store), not keyed outputs
        for keyed in sorted(stage_dir.iterdir()):
            assert verify_manifest(keyed) == []
            other = first.root / "results" / stage_dir.name / keyed.name
            names = sorted(p.relative_to(keyed) for p in keyed.rglob("*") if p.is_file())
            assert names == sorted(p.relative_to(other) for p in other.rglob("*") if p.is_file()), keyed
            for name in names:
                assert (keyed / name).read_bytes() == (other / name).read_bytes(), f"{keyed}/{name}"
                compared += 1
    assert compared > 100
    numerics = json.loads((second.root / paths["reference_logits"]["path"] / "manifest.json").read_text())
    decisive = numerics["environment"]["numerics"]
    assert (decisive["cpu_capability"], decisive["mkl_cbwr"], decisive["threads"]) == (
        "AVX2",
        "COMPATIBLE",
        1,
    )
