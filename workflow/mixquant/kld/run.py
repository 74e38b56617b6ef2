"""Stage entry points of the KLD protocol: reference_logits, run_kld, gate_kld, kld_report, check_kld_gates.

Files:

* ``reference_logits``: ``logits.safetensors`` (``logits``: float32 [T-1, V], logits of prompt positions
  0..T-2 of the BF16 model with a BF16 KV cache) and ``reference.json``: engine settings and info, and the
  SHA-256 of the logits' canonical encoding -- the float32 values as little-endian IEEE-754 bytes in
  row-major order [T-1, V], no header (the bytes ``numpy.ascontiguousarray(x, "<f4").tobytes()`` gives).
* ``run_kld``: ``kld.json`` (the run's statistics, engine info) and ``per_position.safetensors`` (``kl``,
  ``p_ref``, ``p_cand``, ``ref_nll``, ``cand_nll`` float64 [T-1]; ``top1_same`` uint8).
* ``gate_kld``: ``aggregate.json`` -- the runs' aggregate, the paired comparison with the baseline, the
  gates and the verdict -- and ``per_position_mean.safetensors`` (the mean per-position KL over runs).
* ``kld_report``: ``kld_table.csv`` / ``kld_table.md`` (candidates x KV), ``kl_cdf_<kv>.png``,
  ``kl_per_position_<kv>.png`` and ``report.json`` (every verdict).
* ``check_kld_gates``: ``verdict.json``, written only when every gate passed; otherwise the stage fails with
  one line listing the failed checks (the aggregates and the report stay for inspection).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import resolve_model_dir

log = logging.getLogger(__name__)

LOGITS_FILE = "logits.safetensors"
REFERENCE_JSON = "reference.json"
RUN_JSON = "kld.json"
PER_POSITION_FILE = "per_position.safetensors"
AGGREGATE_JSON = "aggregate.json"
MEAN_FILE = "per_position_mean.safetensors"
REPORT_JSON = "report.json"
VERDICT_JSON = "verdict.json"
ENCODING = "float32 little-endian IEEE-754, row-major [T-1, V], no header"


class KldGateFailure(RuntimeError):
    """A KLD gate failed (one line naming the candidates, KV dtypes and checks)."""


def logits_sha256(logits) -> str:
    """SHA-256 of the canonical encoding of float32 logits (see the module docstring)."""
    import numpy as np

    array = np.ascontiguousarray(logits.detach().to("cpu").float().numpy(), dtype="<f4")
    return hashlib.sha256(array.tobytes()).hexdigest()


def _engine_settings(settings: dict[str, Any], kv: str, threads: int | None):
    from mixquant.kld.engines import EngineSettings

    return EngineSettings(**settings["engine"], kv_cache_dtype=kv, threads=threads)


def _prompt_ids(prompt: str | Path):
    from mixquant.calibration.tokens import load_token_ids

    return load_token_ids(Path(prompt) / "prompt.safetensors").reshape(-1).long()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=True) + "\n", encoding="utf-8")


def _logits(model_dir: Path, settings: dict[str, Any], kv: str, ids) -> tuple[Any, dict[str, Any], float]:
    from mixquant.kld.engines import open_engine
    from mixquant.quantize.layer import check_checkpoint_shards

    check_checkpoint_shards(model_dir)  # a broken shard stops here with one line naming it
    started = time.perf_counter()
    engine = open_engine(model_dir, _engine_settings(settings, kv, settings.get("threads")))
    try:
        logits = engine.prompt_logits(ids)
        info = engine.info()
    finally:
        engine.close()
    return logits, info, time.perf_counter() - started


def run_reference_logits(
    out_dir: str | Path,
    *,
    model: str | Path,
    prompt: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """The BF16 model's logits on the pinned prompt (BF16 KV cache), float32 [T-1, V]."""
    from safetensors.torch import save_file

    ids = _prompt_ids(prompt)
    logits, info, seconds = _logits(resolve_model_dir(model), settings, "bfloat16", ids)
    sha = logits_sha256(logits)
    document = {
        "sha256": sha,
        "encoding": ENCODING,
        "shape": list(logits.shape),
        "positions": int(logits.shape[0]),
        "engine_settings": {**settings["engine"], "kv_cache_dtype": "bfloat16"},
        "engine": info,
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_file({"logits": logits.contiguous()}, str(tmp / LOGITS_FILE), metadata={"sha256": sha})
        _write_json(tmp / REFERENCE_JSON, document)
        summary.update(sha256=sha, shape=list(logits.shape), seconds=round(seconds, 3), engine=info)
    log.info("reference logits %s, sha256 %s", tuple(logits.shape), sha)
    return Path(out_dir)


def run_kld(
    out_dir: str | Path,
    *,
    reference: str | Path,
    prompt: str | Path,
    candidate: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """One fresh-engine run: KL(reference || candidate) at every prompt position, full vocabulary."""
    import torch
    from safetensors.torch import load_file, save_file

    from mixquant.kld.stats import kld_statistics

    ids = _prompt_ids(prompt)
    ref = load_file(str(Path(reference) / LOGITS_FILE))["logits"]
    kv = settings["kv_cache_dtype"]
    logits, info, seconds = _logits(resolve_model_dir(candidate), settings, kv, ids)
    if logits.shape != ref.shape:
        raise ValueError(f"candidate logits {tuple(logits.shape)} vs reference {tuple(ref.shape)}")
    started = time.perf_counter()
    stats = kld_statistics(ref, logits, ids[1:])
    per = stats["per_position"]
    tensors = {name: per[name].to(torch.float64).contiguous() for name in ("kl", "p_ref", "p_cand")}
    tensors.update({name: per[name].to(torch.float64).contiguous() for name in ("ref_nll", "cand_nll")})
    tensors["top1_same"] = per["top1_same"].to(torch.uint8).contiguous()
    document = {
        "run": settings["run"],
        "kv_cache_dtype": kv,
        "summary": stats["summary"],
        "candidate_logits_sha256": logits_sha256(logits),
        "engine_settings": {**settings["engine"], "kv_cache_dtype": kv},
        "engine": info,
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_file(tensors, str(tmp / PER_POSITION_FILE))
        _write_json(tmp / RUN_JSON, document)
        summary.update(
            mean_kld=stats["summary"]["mean_kld"],
            engine_seconds=round(seconds, 3),
            stats_seconds=round(time.perf_counter() - started, 3),
        )
    log.info("run %d (%s KV): mean KLD %.6g", settings["run"], kv, stats["summary"]["mean_kld"])
    return Path(out_dir)


def _load_runs(paths: dict[str, Path]) -> list[dict[str, Any]]:
    from safetensors.torch import load_file

    runs = []
    for role in sorted(paths, key=lambda r: int(r.rsplit("_", 1)[1])):
        directory = Path(paths[role])
        document = json.loads((directory / RUN_JSON).read_text(encoding="utf-8"))
        kl = load_file(str(directory / PER_POSITION_FILE))["kl"]
        runs.append({"summary": document["summary"], "kl": kl, "engine": document["engine"]})
    return runs


def run_gate_kld(
    out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any], **runs: str
) -> Path:
    """Aggregate one (candidate, KV dtype)'s runs, compare with the baseline's runs, apply the gates."""
    from safetensors.torch import save_file

    from mixquant.kld.report import aggregate_runs, aggregate_to_json, evaluate_gates, paired_improvement

    own = _load_runs({r: Path(p) for r, p in runs.items() if r.startswith("run_")})
    base = _load_runs(
        {r.removeprefix("baseline_"): Path(p) for r, p in runs.items() if r.startswith("baseline_")}
    )
    aggregate = aggregate_runs(own)
    gates = settings["gates"]
    improvement = None
    if base:
        baseline = aggregate_runs(base)
        improvement = paired_improvement(
            aggregate["kl"],
            baseline["kl"],
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
    verdict = evaluate_gates(aggregate, applied, improvement)
    if settings["require_identical_runs"]:
        identical = bool(aggregate["identical_runs"])
        verdict["checks"].append(
            {"name": "identical_runs", "value": identical, "limit": True, "passed": identical}
        )
        verdict["passed"] = verdict["passed"] and identical
    document = {
        "candidate": settings["candidate"],
        "source": settings["source"],
        "kv_cache_dtype": settings["kv_cache_dtype"],
        "baseline": settings["baseline"],
        "aggregate": aggregate_to_json(aggregate),
        "improvement": improvement,
        "gates": applied,
        "verdict": verdict,
        "engine": own[0]["engine"],
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / AGGREGATE_JSON, document)
        save_file({"kl": aggregate["kl"].contiguous()}, str(tmp / MEAN_FILE))
        summary.update(mean_kld=aggregate["mean_kld"], passed=verdict["passed"])
    log.info(
        "%s (%s KV): mean KLD %.6g over %d runs, %s",
        settings["candidate"],
        settings["kv_cache_dtype"],
        aggregate["mean_kld"],
        aggregate["runs"],
        "pass" if verdict["passed"] else "FAIL",
    )
    return Path(out_dir)


def run_kld_report(
    out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any], **gates: str
) -> Path:
    """The comparison table (CSV, Markdown) of every candidate x KV dtype, the plots and the verdicts."""
    from safetensors.torch import load_file

    from mixquant.kld.report import (
        comparison_table,
        plot_kl_cdf,
        plot_per_position,
        table_markdown,
        write_table,
    )

    rows, curves, verdicts = [], {}, []
    for kv in settings["kv_cache_dtypes"]:
        curves[kv] = {}
        for name in settings["candidates"]:
            directory = Path(gates[f"gate_{name}_{kv}"])
            document = json.loads((directory / AGGREGATE_JSON).read_text(encoding="utf-8"))
            rows.append(
                {
                    "candidate": name,
                    "kv_cache_dtype": kv,
                    "aggregate": document["aggregate"],
                    "improvement": document["improvement"],
                    "gates": document["verdict"] if document["verdict"]["checks"] else None,
                }
            )
            curves[kv][name] = load_file(str(directory / MEAN_FILE))["kl"]
            failed = [c for c in document["verdict"]["checks"] if not c["passed"]]
            verdicts.append(
                {
                    "candidate": name,
                    "kv_cache_dtype": kv,
                    "passed": document["verdict"]["passed"],
                    "failed": failed,
                }
            )
    table = comparison_table(rows)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        write_table(table, tmp / "kld_table.csv", tmp / "kld_table.md")
        for kv, by_candidate in curves.items():
            plot_kl_cdf(
                by_candidate, tmp / f"kl_cdf_{kv}.png", title=f"KL(BF16 || candidate) CDF, {kv} KV cache"
            )
            plot_per_position(
                by_candidate, tmp / f"kl_per_position_{kv}.png", title=f"Per-position KL, {kv} KV cache"
            )
        _write_json(tmp / REPORT_JSON, {"baseline": settings["baseline"], "verdicts": verdicts})
        summary.update(passed=all(v["passed"] for v in verdicts))
    log.info("KLD table:\n%s", table_markdown(table))
    return Path(out_dir)


def run_check_kld_gates(
    out_dir: str | Path, *, report: str | Path, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Publish ``verdict.json`` when every gate passed; otherwise fail with one line naming the failures."""
    document = json.loads((Path(report) / REPORT_JSON).read_text(encoding="utf-8"))
    failed = [v for v in document["verdicts"] if not v["passed"]]
    if failed:
        parts = []
        for v in failed:
            checks = ", ".join(f"{c['name']} {c['value']!r} (limit {c['limit']!r})" for c in v["failed"])
            parts.append(f"{v['candidate']}/{v['kv_cache_dtype']}: {checks}")
        raise KldGateFailure(f"KLD gates failed: {'; '.join(parts)} (see {Path(report)})")
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / VERDICT_JSON, {"passed": True, "verdicts": document["verdicts"]})
        summary.update(passed=True, checked=len(document["verdicts"]))
    return Path(out_dir)
