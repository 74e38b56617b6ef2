"""Issue acceptance for the KLD gates, on the trained toy after the default run.

Reference logits with their hash; five fresh-engine runs per candidate x KV dtype; aggregates with
verdicts; the BF16 self-check exactly 0; the searched placement beats uniform NVFP4; the table and plots;
a failing gate fails the workflow with one line and leaves the aggregates.
"""

from __future__ import annotations

import csv
import hashlib
import json

import pytest
from mixquant.keys.manifest import verify_manifest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
CANDIDATES = ("searched", "uniform-nvfp4", "bf16")
KV = ("bfloat16", "fp8")


def _dir(wd, paths, name):
    return wd.root / paths[name]["path"]


def test_reference_logits_and_their_hash(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    directory = _dir(wd, paths, "reference_logits")
    assert verify_manifest(directory) == []
    logits = load_file(str(directory / "logits.safetensors"))["logits"]
    document = json.loads((directory / "reference.json").read_text())
    prompt_len = wd.config()["prompt"]["seq_len"]
    assert tuple(logits.shape) == (prompt_len - 1, 2048) and str(logits.dtype) == "torch.float32"
    # the documented canonical encoding: float32 little-endian, row-major, no header
    assert document["sha256"] == hashlib.sha256(logits.numpy().astype("<f4").tobytes()).hexdigest()
    assert document["engine_settings"]["kv_cache_dtype"] == "bfloat16"
    assert document["engine"]["engine"] == "hf"


def test_runs_aggregates_and_verdicts(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    runs = [name for name in paths if name.startswith("kld/")]
    assert len(runs) == len(CANDIDATES) * len(KV)  # one job per candidate x KV dtype, 5 runs inside
    aggregates = {}
    for candidate in CANDIDATES:
        for kv in KV:
            directory = _dir(wd, paths, f"gate/{candidate}/{kv}")
            document = json.loads((directory / "aggregate.json").read_text())
            assert document["aggregate"]["runs"] == 5
            assert document["aggregate"]["identical_runs"] is True  # hf on CPU: deterministic
            assert document["verdict"]["passed"] is True, document["verdict"]
            aggregates[candidate, kv] = document
    # the BF16 self-check is exactly 0 with a BF16 KV cache; with FP8 KV only the cache is quantized
    assert aggregates["bf16", "bfloat16"]["aggregate"]["mean_kld_runs"] == [0.0] * 5
    assert 0 < aggregates["bf16", "fp8"]["aggregate"]["mean_kld"]
    assert aggregates["bf16", "bfloat16"]["suite"]["mean"]["mean"] == 0.0  # and on every suite window
    for kv in KV:
        searched, uniform = aggregates["searched", kv], aggregates["uniform-nvfp4", kv]
        assert searched["protocol"] == "suite" and searched["verdict"]["word"] == "pass"
        for protocol, own, base in (
            ("prompt", searched["aggregate"]["mean_kld"], uniform["aggregate"]["mean_kld"]),
            ("suite", searched["suite"]["mean"]["mean"], uniform["suite"]["mean"]["mean"]),
        ):
            assert own < base, protocol
        for improvement in (searched["improvement"], searched["suite"]["improvement"]):
            assert improvement["ci_low"] > 0 and improvement["reduction"] > improvement["ci_low"]
        suite = searched["suite"]["improvement"]
        assert set(suite["domains"]) == {"docs", "code", "chat"} and suite["windows"] == 24
        print(
            f"{kv} KV: searched {searched['suite']['mean']['mean']:.6f} vs uniform NVFP4 "
            f"{uniform['suite']['mean']['mean']:.6f} on the suite: reduction {suite['reduction']:.4f} "
            f"[{suite['ci_low']:.4f}, {suite['ci_high']:.4f}]"
        )

    report = _dir(wd, paths, "kld_report")
    rows = list(csv.DictReader((report / "kld_table.csv").open()))
    expected = [(c, kv, p) for kv in KV for c in CANDIDATES for p in ("prompt", "suite")]
    assert [(r["candidate"], r["kv_cache_dtype"], r["protocol"]) for r in rows] == expected
    assert (report / "kld_table.md").read_text().count("\n|") >= len(rows) + 1  # separator and rows
    for kv in KV:
        for name in (f"kl_cdf_{kv}.png", f"kl_per_position_{kv}.png", f"kl_cdf_domains_{kv}.png"):
            assert (report / name).read_bytes()[:4] == b"\x89PNG"
    document = json.loads((report / "report.json").read_text())
    (row,) = [
        r for r in document["decomposition"] if (r["candidate"], r["kv_cache_dtype"]) == ("bf16", "bfloat16")
    ]
    assert (row["weights_only"], row["deployment"], row["kv_only"]) == (0.0, 0.0, 0.0)
    assert document["suite"]["disjoint_from_calibration"]["shared"] == 0
    verdict = json.loads((_dir(wd, paths, "kld_verdict") / "verdict.json").read_text())
    assert verdict["passed"] is True and len(verdict["verdicts"]) == len(CANDIDATES) * len(KV)
    print((report / "kld_table.md").read_text())


def test_failing_gate_fails_with_one_line_and_keeps_the_aggregates(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["kld"]["gates"]["max_mean_kld"] = 1e-9
    name = wd.write_config("config/strict-gates.yaml", config)
    # (and the release, whose recipe holds the gates: never assembled past a failed gate)
    assert wd.plan(name) == {"gate_kld": 6, "kld_report": 1, "check_kld_gates": 1, "assemble_release": 1}
    result = wd.snakemake("--configfile", name, check=False)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("mixquant:")]
    assert len(lines) == 1 and "KLD gates failed: searched/bfloat16 fail: max_mean_kld" in lines[0], lines
    paths = wd.paths(name)
    assert all(paths[n]["done"] for n in paths if n.startswith("gate/")) and paths["kld_report"]["done"]
    assert not paths["kld_verdict"]["done"] and not paths["release"]["done"]
    failed = json.loads((_dir(wd, paths, "gate/searched/fp8") / "aggregate.json").read_text())
    assert failed["verdict"]["passed"] is False
