"""The suite's gates and their verdict words: an interval that straddles a limit is repeat-required."""

from __future__ import annotations

import numpy as np
from mixquant.kld.suite_gates import overall, suite_checks
from mixquant.kld.windows import window_bootstrap, window_mean

GATES = {
    "max_mean_kld": 0.05,
    "max_run_spread": 0.0,
    "min_improvement": 0.10,
    "max_domain_regression": 0.0,
    "max_engine_floor": 0.0,
    "require_exact_zero": False,
}
AGGREGATE = {"run_spread": 0.0, "mean_kld_runs": [0.01, 0.01]}


def suite(reduction_per_window: np.ndarray, noise: float, seed: int = 0):
    """Candidate and baseline KL over 24 windows of 50 positions in three domains, the candidate's reduction
    per window drawn around ``reduction_per_window``."""
    rng = np.random.default_rng(seed)
    windows = np.repeat(np.arange(24), 50)
    domains = {w: ("docs", "code", "chat")[w % 3] for w in range(24)}
    base = rng.gamma(2.0, 0.005, size=windows.size)
    factor = 1.0 - reduction_per_window[windows] + rng.normal(0.0, noise, size=windows.size)
    cand = base * np.clip(factor, 0.0, None)
    return cand, base, windows, domains


def checks_for(cand, base, windows, domains, **overrides):
    improvement = window_bootstrap(cand, base, windows, domains, samples=2000)
    mean = window_mean(cand, windows, domains, samples=2000)
    return suite_checks(
        {**GATES, **overrides},
        mean=mean,
        aggregate=AGGREGATE,
        improvement=improvement,
        baseline_mean=float(base.mean()),
        noise_floor=0.0,
        engine_floor=0.0,
    )


def words(checks):
    return {c["name"]: c["word"] for c in checks}


def test_a_clear_improvement_passes():
    cand, base, windows, domains = suite(np.full(24, 0.6), 0.02)
    checks = checks_for(cand, base, windows, domains)
    assert words(checks) == {
        "max_mean_kld": "pass",
        "max_run_spread": "pass",
        "min_improvement": "pass",
        "above_noise_floor": "pass",
        "max_domain_regression": "pass",
        "max_engine_floor": "pass",
    }
    assert overall(checks) == {"word": "pass", "passed": True, "checks": checks}


def test_an_interval_that_straddles_the_gate_is_repeat_required():
    """Windows whose reductions scatter widely around the limit: the interval holds 0.10 inside it."""
    rng = np.random.default_rng(3)
    cand, base, windows, domains = suite(rng.normal(0.10, 0.5, size=24).clip(-0.5, 0.9), 0.05)
    checks = checks_for(cand, base, windows, domains, max_domain_regression=None)
    (improvement,) = [c for c in checks if c["name"] == "min_improvement"]
    bootstrap = window_bootstrap(cand, base, windows, domains, samples=2000)
    assert bootstrap["ci_low"] < 0.10 < bootstrap["ci_high"]
    assert improvement["word"] == "repeat-required" and not improvement["passed"]
    assert overall(checks)["word"] == "repeat-required"


def test_a_missed_limit_fails_and_fail_outranks_repeat_required():
    cand, base, windows, domains = suite(np.full(24, 0.02), 0.01)
    checks = checks_for(cand, base, windows, domains)
    assert words(checks)["min_improvement"] == "fail"
    assert overall(checks)["word"] == "fail"
    assert overall([{"word": "repeat-required"}, {"word": "fail"}])["word"] == "fail"


def test_a_domain_worse_than_the_baseline_fails_however_good_the_mean():
    per_window = np.array([0.8, 0.8, -0.3] * 8)  # chat (every third window) regresses
    cand, base, windows, domains = suite(per_window, 0.01)
    checks = checks_for(cand, base, windows, domains)
    (regression,) = [c for c in checks if c["name"] == "max_domain_regression"]
    assert regression["word"] == "fail" and regression["value"] < 0
    assert overall(checks)["word"] == "fail"


def test_the_engine_floor_and_noise_floor_gate_and_are_not_subtracted():
    cand, base, windows, domains = suite(np.full(24, 0.6), 0.02)
    improvement = window_bootstrap(cand, base, windows, domains, samples=500)
    mean = window_mean(cand, windows, domains, samples=500)
    checks = suite_checks(
        GATES,
        mean=mean,
        aggregate=AGGREGATE,
        improvement=improvement,
        baseline_mean=float(base.mean()),
        noise_floor=1.0,  # a floor above the gain: the gain is noise
        engine_floor=0.002,
    )
    assert words(checks)["above_noise_floor"] == "fail" and words(checks)["max_engine_floor"] == "fail"
    assert np.isclose(mean["mean"], cand.mean(), rtol=1e-12)  # reported as measured, nothing subtracted


def test_window_mean_interval_and_domains():
    cand, _, windows, domains = suite(np.full(24, 0.5), 0.02)
    mean = window_mean(cand, windows, domains, samples=1000)
    assert mean["ci_low"] < mean["mean"] < mean["ci_high"]
    assert mean["windows"] == 24 and mean["positions"] == cand.size
    assert set(mean["domains"]) == {"docs", "code", "chat"}
    for name, row in mean["domains"].items():
        picked = np.isin(windows, [w for w, d in domains.items() if d == name])
        assert np.isclose(row["mean"], cand[picked].mean()) and row["windows"] == 8


def test_check_kld_gates_stops_on_repeat_required_and_says_what_would_decide(tmp_path):
    import json

    import pytest
    from mixquant.keys.canonical import canonical_sha256
    from mixquant.kld.gate import run_check_kld_gates
    from mixquant.kld.run import REPORT_JSON, KldGateFailure

    word = "repeat-required"
    check = {"name": "min_improvement", "value": 0.2, "limit": 0.1, "word": word, "passed": False}
    verdicts = [{"candidate": "searched", "kv_cache_dtype": "fp8", "word": word, "passed": False}]
    verdicts[0]["failed"] = [check]
    (tmp_path / REPORT_JSON).write_text(json.dumps({"verdicts": verdicts}))
    preimage = {"stage": "check_kld_gates"}
    out = tmp_path / "verdict" / canonical_sha256(preimage)
    with pytest.raises(KldGateFailure) as error:
        run_check_kld_gates(out, report=tmp_path, settings={}, preimage=preimage)
    line = str(error.value)
    assert "\n" not in line
    assert "searched/fp8 repeat-required: min_improvement 0.2 (limit 0.1: repeat-required)" in line
    assert "add windows (kld.eval.domains[].windows)" in line
    assert not out.exists()  # nothing published past a gate that did not pass
