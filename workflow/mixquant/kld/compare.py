"""Stage entry point kld_report: every gate side by side -- the tables, the decomposition, the per-domain
rows, the plots and the verdicts (``report.json``, which the model card and check_kld_gates read).

``report.json``: ``baseline``; ``protocol`` (what gated: ``suite`` or ``prompt``); ``verdicts`` (per
candidate x KV dtype: ``word`` pass | fail | repeat-required, ``passed``, the failed checks); ``suite`` (the
evaluation suite: domains with their source, windows and tokens, the disjointness check, the floors) or
None; ``decomposition`` (per candidate x KV dtype: weights-only = the candidate with a BF16 KV cache,
deployment = the candidate with that KV dtype, KV-only = the BF16 model with that KV dtype; on the suite when
there is one); ``domains`` (per candidate x KV dtype x domain: mean KLD and its interval, the reduction vs
the baseline and its interval); ``pairwise`` (each searched candidate against every other quantized one,
ModelOpt's own placement among them: the reduction on the suite with its window-level interval);
``interval_widths`` (the searched candidate's reduction interval on the
prompt, over positions, against the suite's, over windows: their widths and ratio).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

from mixquant.calibration.eval_suite import EVAL_JSON
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.kld.capture import load_windows
from mixquant.kld.plots import plot_kl_cdf, plot_kl_cdf_by_domain, plot_per_position
from mixquant.kld.report import comparison_table, paired_improvement, table_markdown, write_table
from mixquant.kld.run import AGGREGATE_JSON, MEAN_FILE, REPORT_JSON, _write_json
from mixquant.kld.suite_tables import comparison_rows, decomposition, domain_rows, write_rows
from mixquant.kld.windows import window_bootstrap

log = logging.getLogger(__name__)
BF16_KV = "bfloat16"


def _gate_documents(settings: dict[str, Any], gates: dict[str, str]) -> dict[tuple[str, str], dict]:
    out = {}
    for kv in settings["kv_cache_dtypes"]:
        for name in settings["candidates"]:
            directory = Path(gates[f"gate_{name}_{kv}"])
            document = json.loads((directory / AGGREGATE_JSON).read_text(encoding="utf-8"))
            document["_curves"] = load_file(str(directory / MEAN_FILE))
            out[(name, kv)] = document
    return out


def _width(improvement: dict[str, Any] | None) -> dict[str, Any] | None:
    if not improvement:
        return None
    low, high = float(improvement["ci_low"]), float(improvement["ci_high"])
    return {"reduction": improvement["reduction"], "ci_low": low, "ci_high": high, "width": high - low}


def _interval_widths(
    documents: dict[tuple[str, str], dict], settings: dict[str, Any]
) -> dict[str, Any] | None:
    """A searched candidate's reduction interval vs the baseline (BF16 KV) three ways: the prompt with its
    positions resampled (the one-prompt protocol), the suite with its windows resampled (what gates), and the
    suite with its positions resampled (what the one-prompt method would claim on the same data); the ratios
    of the suite's window-level width to the other two, and how far the reduction moves between domains."""
    baseline = settings["baseline"]
    for (name, kv), document in documents.items():
        if kv != BF16_KV or settings["sources"].get(name) != "searched" or document["suite"] is None:
            continue
        prompt, suite = _width(document["improvement"]), _width(document["suite"]["improvement"])
        if prompt is None or suite is None or (baseline, kv) not in documents:
            continue
        positions = _width(
            paired_improvement(
                documents[(name, kv)]["_curves"]["suite_kl"],
                documents[(baseline, kv)]["_curves"]["suite_kl"],
                samples=settings["gates"]["bootstrap_samples"],
                confidence=settings["gates"]["confidence"],
            )
        )
        domains = {d: row["reduction"] for d, row in document["suite"]["improvement"]["domains"].items()}
        return {
            "candidate": name,
            "baseline": baseline,
            "kv_cache_dtype": kv,
            "prompt": prompt,
            "suite": suite,
            "suite_positions": positions,
            "ratio": suite["width"] / prompt["width"] if prompt["width"] > 0 else math.inf,
            "ratio_to_positions": suite["width"] / positions["width"] if positions["width"] > 0 else math.inf,
            "domain_reductions": domains,
            "domain_spread": max(domains.values()) - min(domains.values()),
        }
    return None


def _pairwise(
    documents: dict[tuple[str, str], dict],
    settings: dict[str, Any],
    suite: str | Path,
    sources: dict[str, str],
) -> list[dict[str, Any]]:
    """Every searched candidate against every other quantized candidate (ModelOpt's placement, uniform, ...)
    on the suite: the reduction with its window-level interval, per KV dtype, with each side's bits."""
    windows = load_windows(suite)
    position_window = windows.window_of_position()
    domain_of = dict(enumerate(windows.domains))
    gates = settings["gates"]
    rows = []
    for name in [n for n in settings["candidates"] if sources.get(n) == "searched"]:
        for other in settings["candidates"]:
            if other == name or sources.get(other) == "bf16":
                continue
            for kv in settings["kv_cache_dtypes"]:
                cand = documents[(name, kv)]["_curves"]["suite_kl"].numpy()
                base = documents[(other, kv)]["_curves"]["suite_kl"].numpy()
                result = window_bootstrap(
                    cand,
                    base,
                    position_window,
                    domain_of,
                    samples=gates["bootstrap_samples"],
                    confidence=gates["confidence"],
                )
                rows.append(
                    {
                        "candidate": name,
                        "against": other,
                        "kv_cache_dtype": kv,
                        "mean_kld": float(cand.mean()),
                        "against_mean_kld": float(base.mean()),
                        "identical": bool(np.array_equal(cand, base)),
                        "reduction": result["reduction"],
                        "ci_low": result["ci_low"],
                        "ci_high": result["ci_high"],
                        "domains": result["domains"],
                    }
                )
    return rows


def _suite_facts(suite: str | Path, documents: dict[tuple[str, str], dict]) -> dict[str, Any]:
    facts = json.loads((Path(suite) / EVAL_JSON).read_text(encoding="utf-8"))
    first = next(iter(documents.values()))["suite"]
    engine_floors = sorted(
        {d["suite"]["engine_floor"] for d in documents.values() if d["suite"]["engine_floor"] is not None}
    )
    return {
        "domains": facts["domains"],
        "window_tokens": facts["window_tokens"],
        "windows": len(facts["windows"]),
        "tokens": sum(d["tokens"] for d in facts["domains"]),
        "positions": first["positions"],
        "token_ids_sha256": facts["token_ids_sha256"],
        "disjoint_from_calibration": facts["disjoint_from_calibration"],
        "noise_floor": first["noise_floor"],
        "engine_floor": engine_floors[0] if engine_floors else None,
    }


def run_kld_report(
    out_dir: str | Path,
    *,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    suite: str | Path | None = None,
    **gates: str,
) -> Path:
    """The comparison tables (CSV, Markdown) of every candidate x KV dtype, the plots and the verdicts."""
    documents = _gate_documents(settings, gates)
    table = comparison_table(comparison_rows(documents.values()))
    verdicts = [
        {
            "candidate": name,
            "kv_cache_dtype": kv,
            "word": document["verdict"]["word"],
            "passed": document["verdict"]["passed"],
            "failed": [c for c in document["verdict"]["checks"] if not c["passed"]],
        }
        for (name, kv), document in documents.items()
    ]
    report: dict[str, Any] = {
        "baseline": settings["baseline"],
        "protocol": "prompt" if suite is None else "suite",
        "verdicts": verdicts,
        "suite": None if suite is None else _suite_facts(suite, documents),
        "decomposition": decomposition(documents, settings.get("bf16_candidate")),
        "domains": domain_rows(documents) if suite is not None else [],
        "interval_widths": _interval_widths(documents, settings),
        "pairwise": [] if suite is None else _pairwise(documents, settings, suite, settings["sources"]),
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        write_table(table, tmp / "kld_table.csv", tmp / "kld_table.md")
        write_rows(report["decomposition"], tmp / "decomposition")
        if report["domains"]:
            write_rows(report["domains"], tmp / "domains")
        for kv in settings["kv_cache_dtypes"]:
            prompt_curves = {name: documents[(name, kv)]["_curves"]["kl"] for name in settings["candidates"]}
            plot_per_position(
                prompt_curves,
                tmp / f"kl_per_position_{kv}.png",
                title=f"Per-position KL on the prompt, {kv} KV cache",
            )
            if suite is None:
                plot_kl_cdf(
                    prompt_curves, tmp / f"kl_cdf_{kv}.png", title=f"KL(BF16 || candidate) CDF, {kv} KV cache"
                )
                continue
            suite_curves = {
                name: documents[(name, kv)]["_curves"]["suite_kl"] for name in settings["candidates"]
            }
            plot_kl_cdf(
                suite_curves,
                tmp / f"kl_cdf_{kv}.png",
                title=f"KL(BF16 || candidate) CDF on the suite, {kv} KV cache",
            )
            windows = load_windows(suite)
            position_domains = np.repeat(np.asarray(windows.domains), windows.positions_per_window)
            plot_kl_cdf_by_domain(
                suite_curves,
                position_domains,
                tmp / f"kl_cdf_domains_{kv}.png",
                title=f"KL(BF16 || candidate) CDF per domain, {kv} KV cache",
            )
        _write_json(tmp / REPORT_JSON, report)
        summary.update(passed=all(v["passed"] for v in verdicts))
    log.info("KLD table:\n%s", table_markdown(table))
    return Path(out_dir)
