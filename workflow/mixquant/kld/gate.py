"""Stage entry points gate_kld and check_kld_gates: the runs of one (candidate, KV dtype) aggregated and
judged, and the verdict of every gate.

``gate_kld`` writes ``aggregate.json``:

* ``aggregate`` / ``improvement`` -- the pinned prompt (the published-hash protocol): the runs' aggregate and
  the paired bootstrap over its positions vs the baseline (:func:`mixquant.kld.report.paired_improvement`).
* ``suite`` (with ``kld.eval``) -- the evaluation suite: the aggregate, the mean KLD with its window-level
  interval and per-domain means (:func:`mixquant.kld.windows.window_mean`), the reduction vs the baseline
  with the paired bootstrap over windows stratified by domain and per-domain intervals
  (:func:`mixquant.kld.windows.window_bootstrap`), the noise floor (repeated reference captures) and the
  engine floor (the BF16 model through this engine, BF16 KV, against the reference).
* ``protocol`` -- what the gates judged: ``suite`` when there is one, else ``prompt``; ``verdict``:
  ``{"word": pass | fail | repeat-required, "passed", "checks"}`` (:mod:`mixquant.kld.suite_gates`).

and ``per_position_mean.safetensors`` (``kl``: the prompt's mean per-position KL over runs; ``suite_kl``).
``check_kld_gates`` publishes ``verdict.json`` only when every gate says pass.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from mixquant.checkpoint.writer import save_file_sorted
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.kld.capture import load_windows
from mixquant.kld.report import aggregate_runs, aggregate_to_json, evaluate_gates, paired_improvement
from mixquant.kld.run import (
    AGGREGATE_JSON,
    MEAN_FILE,
    PER_POSITION_FILE,
    REFERENCE_JSON,
    REPORT_JSON,
    RUN_JSON,
    RUNS_DIR,
    SUITE_DIR,
    VERDICT_JSON,
    KldGateFailure,
    KldRunError,
    _write_json,
    run_dir,
)
from mixquant.kld.suite_gates import overall, suite_checks
from mixquant.kld.windows import window_bootstrap, window_mean

log = logging.getLogger(__name__)


def load_runs(directory: str | Path, protocol: str = "prompt") -> list[dict[str, Any]]:
    """Every run of a run_kld output, in run order (``runs/0``, ``runs/1``, ...), for the prompt or the
    suite (``runs/<i>/suite``)."""
    root = Path(directory) / RUNS_DIR
    found = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []
    if not found or found != list(range(len(found))):
        raise KldRunError(f"{root}: expected runs 0..n-1, found {found}")
    runs = []
    for run in found:
        path = run_dir(directory, run) / (SUITE_DIR if protocol == "suite" else "")
        if not (path / RUN_JSON).is_file():
            raise KldRunError(f"{path}: no {RUN_JSON} ({protocol} results missing)")
        document = json.loads((path / RUN_JSON).read_text(encoding="utf-8"))
        kl = load_file(str(path / PER_POSITION_FILE))["kl"]
        runs.append({"summary": document["summary"], "kl": kl, "engine": document["engine"]})
    return runs


def _suite(
    own: list[dict[str, Any]],
    base: list[dict[str, Any]],
    suite: str | Path,
    suite_reference: str | Path | None,
    floor_runs: str | Path | None,
    settings: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the suite's aggregate with its tensors, the JSON part of the suite's results)."""
    gates = settings["gates"]
    windows = load_windows(suite)
    position_window = windows.window_of_position()
    domain_of = dict(enumerate(windows.domains))
    aggregate = aggregate_runs(own)
    mean = window_mean(
        aggregate["kl"].numpy(),
        position_window,
        domain_of,
        samples=gates["bootstrap_samples"],
        confidence=gates["confidence"],
    )
    improvement = baseline_mean = None
    if base:
        baseline = aggregate_runs(base)
        baseline_mean = float(baseline["mean_kld"])
        improvement = window_bootstrap(
            aggregate["kl"].numpy(),
            baseline["kl"].numpy(),
            position_window,
            domain_of,
            samples=gates["bootstrap_samples"],
            confidence=gates["confidence"],
        )
    noise_floor = None
    if suite_reference is not None:
        noise_floor = json.loads((Path(suite_reference) / REFERENCE_JSON).read_text(encoding="utf-8"))[
            "noise_floor"
        ]
    engine_floor = None
    if floor_runs is not None:
        engine_floor = float(aggregate_runs(load_runs(floor_runs, "suite"))["mean_kld"])
    document = {
        "aggregate": aggregate_to_json(aggregate),
        "mean": mean,
        "improvement": improvement,
        "baseline_mean_kld": baseline_mean,
        "noise_floor": noise_floor,
        "engine_floor": engine_floor,
        "windows": int(windows.ids.shape[0]),
        "window_tokens": int(windows.ids.shape[1]),
        "positions": windows.positions,
    }
    return aggregate, document


def run_gate_kld(
    out_dir: str | Path,
    *,
    runs: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    baseline_runs: str | Path | None = None,
    suite: str | Path | None = None,
    suite_reference: str | Path | None = None,
    floor_runs: str | Path | None = None,
) -> Path:
    """Aggregate one (candidate, KV dtype)'s runs, compare them with the baseline's, apply the gates: on the
    suite when there is one, else on the prompt."""
    gates = settings["gates"]
    own = load_runs(runs)
    base = load_runs(baseline_runs) if baseline_runs is not None else []
    aggregate = aggregate_runs(own)
    improvement = None
    if base:
        improvement = paired_improvement(
            aggregate["kl"],
            aggregate_runs(base)["kl"],
            samples=gates["bootstrap_samples"],
            confidence=gates["confidence"],
        )
    applied: dict[str, Any] = {"require_exact_zero": settings["require_exact_zero"]}
    if settings["gated"]:
        applied.update(
            max_mean_kld=gates["max_mean_kld"],
            max_run_spread=gates["max_run_spread"],
            min_improvement=gates["min_improvement"] if base else None,
        )
    tensors = {"kl": aggregate["kl"].contiguous()}
    suite_document = None
    if suite is None:
        verdict = evaluate_gates(aggregate, applied, improvement)
        for check in verdict["checks"]:
            check["word"] = "pass" if check["passed"] else "fail"
    else:
        suite_aggregate, suite_document = _suite(
            load_runs(runs, "suite"),
            load_runs(baseline_runs, "suite") if baseline_runs is not None else [],
            suite,
            suite_reference,
            floor_runs,
            settings,
        )
        tensors["suite_kl"] = suite_aggregate["kl"].contiguous()
        if settings["gated"]:
            applied.update(
                max_domain_regression=gates.get("max_domain_regression") if base else None,
                max_engine_floor=gates.get("max_engine_floor"),
            )
        checks = suite_checks(
            applied,
            mean=suite_document["mean"],
            aggregate=suite_aggregate,
            improvement=suite_document["improvement"],
            baseline_mean=suite_document["baseline_mean_kld"],
            noise_floor=suite_document["noise_floor"] if settings["gated"] else None,
            engine_floor=suite_document["engine_floor"],
        )
        verdict = {"checks": checks}
        if settings["require_exact_zero"]:  # the self-check holds on the prompt too
            prompt_zero = evaluate_gates(aggregate, {"require_exact_zero": True}, None)["checks"][0]
            word = "pass" if prompt_zero["passed"] else "fail"
            verdict["checks"].append({**prompt_zero, "name": "require_exact_zero_prompt", "word": word})
    if settings["require_identical_runs"]:
        identical = bool(aggregate["identical_runs"]) and (
            suite_document is None or bool(suite_document["aggregate"]["identical_runs"])
        )
        word = "pass" if identical else "fail"
        verdict["checks"].append(
            {"name": "identical_runs", "value": identical, "limit": True, "passed": identical, "word": word}
        )
    verdict = overall(verdict["checks"])
    document = {
        "candidate": settings["candidate"],
        "source": settings["source"],
        "kv_cache_dtype": settings["kv_cache_dtype"],
        "baseline": settings["baseline"],
        "protocol": "prompt" if suite is None else "suite",
        "aggregate": aggregate_to_json(aggregate),
        "improvement": improvement,
        "suite": suite_document,
        "gates": applied,
        "verdict": verdict,
        "engine": own[0]["engine"],
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / AGGREGATE_JSON, document)
        save_file_sorted(tensors, tmp / MEAN_FILE, None)
        summary.update(mean_kld=aggregate["mean_kld"], word=verdict["word"])
    gated_mean = aggregate["mean_kld"] if suite_document is None else suite_document["mean"]["mean"]
    log.info(
        "%s (%s KV): mean KLD %.6g on the %s, %s",
        settings["candidate"],
        settings["kv_cache_dtype"],
        gated_mean,
        document["protocol"],
        verdict["word"],
    )
    return Path(out_dir)


def run_check_kld_gates(
    out_dir: str | Path, *, report: str | Path, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Publish ``verdict.json`` when every gate passed; otherwise fail with one line naming the failures and
    the repeat-required ones (intervals that straddle a limit: more windows would decide)."""
    document = json.loads((Path(report) / REPORT_JSON).read_text(encoding="utf-8"))
    failed = [v for v in document["verdicts"] if not v["passed"]]
    if failed:
        parts = []
        for v in failed:
            checks = ", ".join(
                f"{c['name']} {c['value']!r} (limit {c['limit']!r}: {c.get('word', 'fail')})"
                for c in v["failed"]
            )
            parts.append(f"{v['candidate']}/{v['kv_cache_dtype']} {v.get('word', 'fail')}: {checks}")
        advice = (
            "; repeat-required: the interval straddles the limit, add windows (kld.eval.domains[].windows)"
            if any(v.get("word") == "repeat-required" for v in failed)
            else ""
        )
        raise KldGateFailure(f"KLD gates failed: {'; '.join(parts)}{advice} (see {Path(report)})")
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / VERDICT_JSON, {"passed": True, "verdicts": document["verdicts"]})
        summary.update(passed=True, checked=len(document["verdicts"]))
    return Path(out_dir)
