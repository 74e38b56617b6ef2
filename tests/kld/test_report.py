"""Run aggregation, paired bootstrap, gates, comparison table and plots of the KL gate."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
import torch
from mixquant.kld import report
from mixquant.kld.plots import plot_kl_cdf, plot_per_position
from mixquant.kld.report import (
    TABLE_COLUMNS,
    aggregate_runs,
    aggregate_to_json,
    comparison_table,
    evaluate_gates,
    paired_improvement,
    table_markdown,
    write_table,
)
from mixquant.kld.stats import summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N = 2047


def _kl(seed: int, n: int = N, scale: float = 1e-2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 1.5) * scale


def _run(kl: torch.Tensor) -> dict:
    n = kl.numel()
    per_position = {
        "kl": kl,
        "top1_same": torch.ones(n, dtype=torch.bool),
        "p_ref": torch.full((n,), 0.5, dtype=torch.float64),
        "p_cand": torch.full((n,), 0.5, dtype=torch.float64),
        "ref_nll": torch.full((n,), math.log(2), dtype=torch.float64),
        "cand_nll": torch.full((n,), math.log(2), dtype=torch.float64),
    }
    return {"summary": summarize(per_position), "kl": kl}


def agg_summary(kl: torch.Tensor) -> dict:
    return _run(kl)["summary"]


def _png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert len(data) > 5_000
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []  # no temp file
    return struct.unpack(">II", data[16:24])


def test_aggregate_identical_and_varying_runs():
    kl = _kl(0)
    agg = aggregate_runs([_run(kl.clone()) for _ in range(5)])
    assert agg["runs"] == 5 and agg["identical_runs"] is True
    assert agg["run_spread"] == 0.0 and agg["run_std"] == 0.0
    assert agg["mean_kld"] == pytest.approx(float(kl.mean()), rel=1e-12)
    assert agg["mean_kld_runs"] == [agg["mean_kld"]] * 5
    assert torch.equal(agg["kl"], kl)
    assert agg["summary"] == agg_summary(kl) and isinstance(agg["summary"]["positions"], int)
    assert "kl" not in aggregate_to_json(agg)
    json.dumps(aggregate_to_json(agg))

    kls = [kl * (1 + 0.01 * i) for i in range(5)]
    agg = aggregate_runs([_run(k) for k in kls])
    means = [float(k.mean()) for k in kls]
    assert agg["identical_runs"] is False
    assert agg["run_spread"] == pytest.approx(max(means) - min(means), rel=1e-9)
    assert agg["mean_kld"] == pytest.approx(sum(means) / 5, rel=1e-12)
    assert agg["run_std"] == pytest.approx(float(torch.tensor(means, dtype=torch.float64).std()), rel=1e-9)
    torch.testing.assert_close(agg["kl"], torch.stack(kls).mean(0))
    single = aggregate_runs([_run(kl)])
    assert single["run_std"] == 0.0 and single["identical_runs"] is True

    with pytest.raises(ValueError, match="no runs"):
        aggregate_runs([])
    with pytest.raises(ValueError, match="differ in positions"):
        aggregate_runs([_run(kl), _run(kl[:-1])])


def test_paired_improvement_uniform_30_percent():
    base = _kl(1)
    g = torch.Generator().manual_seed(2)
    cand = base * 0.7 * torch.exp(0.05 * torch.randn(N, generator=g, dtype=torch.float64))
    t0 = time.perf_counter()
    imp = paired_improvement(cand, base, samples=10000, seed=0)
    elapsed = time.perf_counter() - t0
    expected = 1 - float(cand.mean() / base.mean())
    assert imp["reduction"] == pytest.approx(expected, rel=1e-12) and abs(imp["reduction"] - 0.3) < 0.01
    assert imp["ci_low"] < imp["reduction"] < imp["ci_high"]
    assert 0.0 < imp["ci_low"] and imp["ci_high"] - imp["ci_low"] < 0.05  # paired: a narrow CI, far from 0
    assert imp["wins"] == 1.0 and imp["p_not_better"] == 0.0
    assert imp["mean_diff"] == pytest.approx(float((cand - base).mean()))
    assert imp["mean_diff_se"] == pytest.approx(float((cand - base).std() / math.sqrt(N)))
    assert (imp["samples"], imp["seed"], imp["confidence"], imp["positions"]) == (10000, 0, 0.95, N)
    assert elapsed < 2.0, f"bootstrap took {elapsed:.2f} s"

    # unpaired noise: no real difference -> CI straddles 0
    other = _kl(3)
    null = paired_improvement(other, base, samples=2000)
    assert null["ci_low"] < 0 < null["ci_high"] or abs(null["reduction"]) > 0.05


def test_bootstrap_determinism():
    base, cand = _kl(4), _kl(5) * 0.9
    a = paired_improvement(cand, base, samples=3000, seed=7)
    b = paired_improvement(cand.clone(), base.clone(), samples=3000, seed=7)
    c = paired_improvement(cand, base, samples=3000, seed=8)
    assert a == b
    assert (a["ci_low"], a["ci_high"]) != (c["ci_low"], c["ci_high"])
    assert a["reduction"] == c["reduction"]


def test_paired_improvement_edge_cases():
    base = _kl(6, n=100)
    cand = base.clone()
    cand[3] = math.inf
    imp = paired_improvement(cand, base, samples=100)
    assert imp["reduction"] == imp["ci_low"] == imp["ci_high"] == -math.inf
    with pytest.raises(ValueError, match="baseline mean"):
        paired_improvement(base, torch.zeros(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="not finite"):
        paired_improvement(base, cand)
    with pytest.raises(ValueError, match="same positions"):
        paired_improvement(base, base[:-1])
    # a mostly-zero baseline: some resamples have a zero baseline sum; nothing crashes or turns NaN
    sparse = torch.zeros(100, dtype=torch.float64)
    sparse[0] = 1.0
    imp = paired_improvement(sparse * 0.5, sparse, samples=500)
    assert imp["reduction"] == 0.5 and not math.isnan(imp["ci_low"]) and not math.isnan(imp["ci_high"])


def test_gates_pass_fail_skip():
    agg = aggregate_runs([_run(_kl(7) * (1 + 0.001 * i)) for i in range(5)])
    imp = {"reduction": 0.3, "ci_low": 0.25, "ci_high": 0.35}
    gates = {"max_mean_kld": 1.0, "max_run_spread": 1.0, "min_improvement": 0.2, "require_exact_zero": False}
    res = evaluate_gates(agg, gates, imp)
    assert res["passed"] is True
    assert [c["name"] for c in res["checks"]] == ["max_mean_kld", "max_run_spread", "min_improvement"]
    assert res["checks"][2]["value"] == 0.25 and res["checks"][2]["limit"] == 0.2
    assert all(set(c) == {"name", "value", "limit", "passed"} for c in res["checks"])

    res = evaluate_gates(agg, {**gates, "max_mean_kld": 1e-6}, imp)
    assert res["passed"] is False
    assert [c["passed"] for c in res["checks"]] == [False, True, True]
    # judged on the CI's lower bound: a 30 % reduction whose CI reaches down to 15 % fails a 20 % gate
    res = evaluate_gates(agg, {"min_improvement": 0.2}, {"reduction": 0.3, "ci_low": 0.15, "ci_high": 0.4})
    assert res["passed"] is False
    res = evaluate_gates(agg, {"min_improvement": 0.2}, None)
    assert res["passed"] is False and res["checks"][0]["value"] is None
    res = evaluate_gates(agg, {"max_mean_kld": None, "max_run_spread": None, "min_improvement": None}, None)
    assert res == {"passed": True, "checks": []}
    res = evaluate_gates(agg, {"max_run_spread": 0.0}, None)
    assert res["passed"] is False
    with pytest.raises(ValueError, match="unknown gates"):
        evaluate_gates(agg, {"max_mean_kl": 1.0}, None)
    nan_agg = {**agg, "mean_kld": math.nan}
    assert evaluate_gates(nan_agg, {"max_mean_kld": 1.0}, None)["passed"] is False


def test_exact_zero_self_check():
    zeros = torch.zeros(N, dtype=torch.float64)
    agg = aggregate_runs([_run(zeros.clone()) for _ in range(5)])
    res = evaluate_gates(agg, {"require_exact_zero": True, "max_run_spread": 0.0}, None)
    assert res["passed"] is True and res["checks"][1] == {
        "name": "require_exact_zero",
        "value": 0.0,
        "limit": 0.0,
        "passed": True,
    }
    tiny = zeros.clone()
    tiny[100] = 1e-300
    agg = aggregate_runs([_run(zeros)] * 4 + [_run(tiny)])
    res = evaluate_gates(agg, {"require_exact_zero": True}, None)
    assert res["passed"] is False and res["checks"][0]["value"] > 0.0


def _rows() -> list[dict]:
    base_agg = aggregate_runs([_run(_kl(8) * (1 + 0.001 * i)) for i in range(5)])
    cand_agg = aggregate_runs([_run(_kl(8) * 0.7) for _ in range(5)])
    self_agg = aggregate_runs([_run(torch.zeros(N, dtype=torch.float64)) for _ in range(5)])
    imp = paired_improvement(cand_agg["kl"], base_agg["kl"], samples=500)
    gates = {"max_mean_kld": 0.1, "min_improvement": 0.2}
    return [
        {"candidate": "bf16", "kv_cache_dtype": "auto", "aggregate": self_agg, "improvement": None,
         "gates": evaluate_gates(self_agg, {"require_exact_zero": True}, None)},
        {"candidate": "uniform|nvfp4", "kv_cache_dtype": "fp8", "aggregate": base_agg, "improvement": None,
         "gates": None},
        {"candidate": "mixed", "kv_cache_dtype": "fp8", "aggregate": cand_agg, "improvement": imp,
         "gates": evaluate_gates(cand_agg, gates, imp)},
    ]  # fmt: skip


def test_comparison_table_and_files(tmp_path):
    df = comparison_table(_rows())
    assert list(df.columns) == list(TABLE_COLUMNS)
    assert list(df["candidate"]) == ["bf16", "uniform|nvfp4", "mixed"]
    assert list(df["verdict"]) == ["pass", "n/a", "pass"]
    assert df.loc[0, "mean_kld"] == 0.0 and bool(df.loc[0, "identical_runs"])
    assert math.isnan(df.loc[1, "reduction"]) and df.loc[2, "reduction"] == pytest.approx(0.3, abs=0.01)
    assert df.loc[2, "reduction_ci_low"] <= df.loc[2, "reduction"] <= df.loc[2, "reduction_ci_high"]

    md = table_markdown(df)
    lines = md.strip().split("\n")
    assert len(lines) == 2 + 3
    assert all(line.startswith("| ") or line.startswith("|:") for line in lines)
    assert len({line.count("|") - line.count("\\|") for line in lines}) == 1  # same column count everywhere
    assert "uniform\\|nvfp4" in md and "PASS" in md and "—" in md and "± " in md and "(identical)" in md

    csv_path, md_path = tmp_path / "out" / "kld.csv", tmp_path / "out" / "kld.md"
    write_table(df, csv_path, md_path)
    assert sorted(p.name for p in csv_path.parent.iterdir()) == ["kld.csv", "kld.md"]
    assert md_path.read_text(encoding="utf-8") == md
    import pandas as pd

    back = pd.read_csv(csv_path)
    assert list(back.columns) == list(TABLE_COLUMNS) and len(back) == 3
    assert back.loc[2, "mean_kld"] == pytest.approx(df.loc[2, "mean_kld"], rel=1e-15)
    with pytest.raises(ValueError, match="missing columns"):
        table_markdown(df.drop(columns=["verdict"]))


def test_the_table_names_the_protocol_and_the_gate_word():
    """A suite row carries its protocol; a verdict with a word (pass / fail / repeat-required) shows it, one
    without shows pass or fail from ``passed``; rows without a protocol are the prompt's."""
    rows = _rows()
    repeat = {"word": "repeat-required", "passed": False, "checks": []}
    suite_row = dict(rows[2], protocol="suite", gates=repeat)
    failed = dict(rows[2], gates={"passed": False, "checks": []})
    df = comparison_table([*rows, suite_row, failed])
    assert list(df.columns[:3]) == ["candidate", "kv_cache_dtype", "protocol"]
    assert list(df["protocol"]) == ["prompt", "prompt", "prompt", "suite", "prompt"]
    assert list(df["verdict"]) == ["pass", "n/a", "pass", "repeat-required", "fail"]
    lines = table_markdown(df).strip().split("\n")
    assert lines[0].startswith("| candidate | KV cache | protocol | runs |")
    assert lines[5].startswith("| mixed | fp8 | suite | 5 |") and lines[5].endswith("| REPEAT-REQUIRED |")
    assert lines[6].endswith("| FAIL |") and lines[3].endswith("| n/a |")


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    df = comparison_table(_rows())
    target = tmp_path / "t.md"
    target.write_text("old", encoding="utf-8")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_table(df, tmp_path / "t.csv", target)
    assert target.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.md"]


def test_plots_valid_pngs_and_deterministic(tmp_path):
    base, cand = _kl(9), _kl(10) * 0.7
    cand_inf = cand.clone()
    cand_inf[5] = math.inf
    with_zeros = cand.clone()
    with_zeros[:100] = 0.0
    curves = {"uniform nvfp4": base, "mixed": with_zeros, "broken": cand_inf}
    a = plot_kl_cdf(curves, tmp_path / "a" / "cdf.png")
    b = plot_kl_cdf(curves, tmp_path / "b" / "cdf.png")
    assert _png(a)[0] > 400 and a.read_bytes() == b.read_bytes()
    assert _png(plot_per_position(curves, tmp_path / "c" / "pos.png"))[0] > 600

    zeros = {"bf16 self-check": torch.zeros(N, dtype=torch.float64)}
    _png(plot_kl_cdf(zeros, tmp_path / "d" / "cdf.png"))
    _png(plot_per_position(zeros, tmp_path / "e" / "pos.png"))
    positive = {"one": base}
    _png(plot_per_position(positive, tmp_path / "f" / "pos.png"))
    _png(plot_kl_cdf({"one value": torch.tensor([0.5], dtype=torch.float64)}, tmp_path / "g" / "cdf.png"))
    with pytest.raises(ValueError, match="no curves"):
        plot_kl_cdf({}, tmp_path / "h.png")
    with pytest.raises(ValueError, match="NaN"):
        plot_per_position({"x": torch.tensor([math.nan])}, tmp_path / "i.png")


def test_the_per_position_plot_reads_a_rolling_mean_that_skips_infinities():
    """The line drawn over the noisy positions is a centred rolling mean of the finite values only."""
    import numpy as np
    from mixquant.kld.plots import _rolling_mean

    x = np.array([1.0, 3.0, np.inf, 5.0, 7.0])
    got = _rolling_mean(np.where(np.isinf(x), np.nan, x), 3)
    assert np.allclose(got, [2.0, 2.0, 4.0, 6.0, 6.0])
    assert np.isnan(_rolling_mean(np.array([np.nan, np.nan]), 2)).all()
