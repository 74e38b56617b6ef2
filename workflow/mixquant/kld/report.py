"""KL gate reporting: aggregate repeated runs, paired bootstrap vs a baseline, gates and the comparison table.

* :func:`aggregate_runs` -- the fresh-engine runs of one (candidate, KV-cache dtype): mean of the run
  means, their spread, whether the runs were bit-identical, and the mean per-position KL.
* :func:`paired_improvement` -- KL reduction of a candidate vs a baseline over the same positions, with a
  paired percentile bootstrap CI (positions resampled with replacement, the same indices for both).
* :func:`evaluate_gates` -- the configured thresholds, each one a named check.
* :func:`comparison_table` / :func:`write_table` -- one row per (candidate, KV-cache dtype, protocol), as CSV
  and Markdown (written by hand: no ``tabulate`` dependency).

The plots are in :mod:`mixquant.kld.plots`; the suite's decomposition and per-domain tables in
:mod:`mixquant.kld.suite_tables`.

Percentiles (bootstrap CI) use the same linear-interpolation definition as
:func:`mixquant.kld.stats.percentiles` (llama.cpp's, NumPy's default).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mixquant.checkpoint.atomic import atomic_open
from mixquant.kld.stats import percentiles

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "GATE_KEYS",
    "TABLE_COLUMNS",
    "aggregate_runs",
    "aggregate_to_json",
    "comparison_table",
    "evaluate_gates",
    "paired_improvement",
    "table_markdown",
    "write_table",
]

GATE_KEYS = ("max_mean_kld", "max_run_spread", "min_improvement", "require_exact_zero")
VERDICT_WORDS = ("pass", "fail", "repeat-required")  # a gate's words; the table shows them upper case
TABLE_COLUMNS = (
    "candidate",
    "kv_cache_dtype",
    "protocol",
    "runs",
    "mean_kld",
    "mean_kld_se",
    "run_spread",
    "identical_runs",
    "same_top_pct",
    "rms_dp",
    "ppl_ratio",
    "reduction",
    "reduction_ci_low",
    "reduction_ci_high",
    "verdict",
)
_BOOTSTRAP_CHUNK = 512  # resamples per vectorised step: 512 x N int64 indices (8 MB at N = 2,047)


# --------------------------------------------------------------------------------------------------------
# runs -> aggregate
# --------------------------------------------------------------------------------------------------------


def _kl_tensor(x: Any) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.detach().to(device="cpu", dtype=torch.float64).reshape(-1)


def aggregate_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate the runs of one (candidate, KV-cache dtype): each ``{"summary": summarize(...), "kl": [N]}``.

    Returns ``runs``, ``mean_kld`` (mean over runs of the run means), ``mean_kld_runs``, ``run_spread``
    (max - min of the run means), ``run_std`` (sample std of the run means), ``identical_runs`` (every
    run's per-position KL bit-identical to the first's), ``summary`` (the mean over runs of each numeric
    summary statistic) and ``kl`` (the mean per-position KL over runs, a float64 tensor: not JSON, see
    :func:`aggregate_to_json`). Means of equal values are exactly that value (identical runs reproduce
    the run's own numbers, spread and std exactly 0.0).
    """
    if not runs:
        raise ValueError("no runs to aggregate")
    kls = [_kl_tensor(r["kl"]) for r in runs]
    n = kls[0].numel()
    if n == 0 or any(k.numel() != n for k in kls):
        raise ValueError(f"runs differ in positions (or are empty): {[k.numel() for k in kls]}")
    summaries = [r["summary"] for r in runs]
    means = [float(s["mean_kld"]) for s in summaries]
    first_bits = kls[0].view(torch.int64)
    identical = all(torch.equal(k.view(torch.int64), first_bits) for k in kls[1:])
    keys = [
        k
        for k, v in summaries[0].items()
        if isinstance(v, int | float) and not isinstance(v, bool) and all(k in s for s in summaries)
    ]
    summary = {k: _mean([s[k] for s in summaries]) for k in keys}
    return {
        "runs": len(runs),
        "mean_kld": _mean(means),
        "mean_kld_runs": means,
        "run_spread": 0.0 if max(means) == min(means) else float(max(means) - min(means)),
        "run_std": float(np.std(means, ddof=1)) if max(means) > min(means) else 0.0,
        "identical_runs": bool(identical),
        "summary": summary,
        "kl": kls[0].clone() if identical else torch.stack(kls).mean(dim=0),
    }


def _mean(values: Sequence[float]) -> float | int:
    """Mean of ``values``; exactly the common value (an int stays an int) when they are all equal."""
    first = values[0]
    if all(v == first for v in values):
        return int(first) if isinstance(first, int) else float(first)
    return float(np.mean([float(v) for v in values]))


def aggregate_to_json(aggregate: Mapping[str, Any]) -> dict[str, Any]:
    """``aggregate`` without its tensors (``kl``): the JSON-serialisable part."""
    return {k: v for k, v in aggregate.items() if not isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------------------------------------
# paired bootstrap
# --------------------------------------------------------------------------------------------------------


def paired_improvement(
    cand_kl: torch.Tensor,
    base_kl: torch.Tensor,
    *,
    samples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """KL reduction of a candidate vs a baseline on the same positions, with a paired bootstrap CI.

    ``reduction = 1 - mean(cand) / mean(base)`` (0.3: the candidate's mean KL is 30 % lower). The CI is
    the percentile interval of the reduction over ``samples`` resamples of the position indices (with
    replacement; the same indices for both, so position difficulty cancels), drawn from a
    ``torch.Generator`` seeded with ``seed``: equal inputs give equal results. Also ``wins`` (fraction of
    positions with cand < base), ``mean_diff`` = mean(cand - base) with its SE, and ``p_not_better``
    (fraction of resamples with reduction <= 0).

    A candidate with ``inf`` KL somewhere gets ``reduction = ci_low = ci_high = -inf`` (it cannot pass a
    ``min_improvement`` gate); an ``inf`` / NaN baseline or a baseline mean of 0 raise ``ValueError``.
    A resample whose baseline sum is 0 counts as reduction 0 if its candidate sum is 0 too, else ``-inf``.
    """
    cand = _kl_tensor(cand_kl)
    base = _kl_tensor(base_kl)
    n = cand.numel()
    if n == 0 or base.numel() != n:
        raise ValueError(f"candidate and baseline KL must have the same positions: {n} vs {base.numel()}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if int(samples) < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not bool(torch.isfinite(base).all()):
        raise ValueError("baseline KL is not finite everywhere")
    if bool(torch.isnan(cand).any()):
        raise ValueError("candidate KL has NaN")
    mean_cand, mean_base = float(cand.mean()), float(base.mean())
    if mean_base <= 0.0:
        raise ValueError(f"baseline mean KL is {mean_base}: no reduction can be defined")

    diff = cand - base
    out: dict[str, Any] = {
        "positions": n,
        "mean_cand": mean_cand,
        "mean_base": mean_base,
        "wins": float((cand < base).double().mean()),
        "mean_diff": float(diff.mean()),
        "mean_diff_se": float(diff.std(correction=1) / math.sqrt(n)) if n > 1 else math.nan,
        "confidence": float(confidence),
        "samples": int(samples),
        "seed": int(seed),
    }
    if not math.isfinite(mean_cand):
        out.update(reduction=-math.inf, ci_low=-math.inf, ci_high=-math.inf, p_not_better=1.0)
        out["mean_diff_se"] = math.nan
        return out

    reductions = _bootstrap_reductions(cand, base, int(samples), int(seed))
    alpha = (1.0 - confidence) / 2.0
    lo, hi = percentiles(reductions, [alpha, 1.0 - alpha])
    out.update(
        reduction=1.0 - mean_cand / mean_base,
        ci_low=lo,
        ci_high=hi,
        p_not_better=float((reductions <= 0.0).mean()),
    )
    return out


def _bootstrap_reductions(cand: torch.Tensor, base: torch.Tensor, samples: int, seed: int) -> np.ndarray:
    """``1 - sum(cand[idx]) / sum(base[idx])`` for ``samples`` index resamples, in fixed-size chunks."""
    n = cand.numel()
    values = torch.stack([cand, base], dim=1)  # [N, 2]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = np.empty(samples, dtype=np.float64)
    for start in range(0, samples, _BOOTSTRAP_CHUNK):
        k = min(_BOOTSTRAP_CHUNK, samples - start)
        idx = torch.randint(0, n, (k * n,), generator=gen)
        sums = values.index_select(0, idx).view(k, n, 2).sum(dim=1)
        s_cand, s_base = sums[:, 0], sums[:, 1]
        ratio = torch.where(
            s_base > 0, s_cand / s_base.clamp_min(1e-300), torch.where(s_cand > 0, math.inf, 1.0)
        )
        out[start : start + k] = (1.0 - ratio).numpy()
    return out


# --------------------------------------------------------------------------------------------------------
# gates
# --------------------------------------------------------------------------------------------------------


def evaluate_gates(
    aggregate: Mapping[str, Any], gates: Mapping[str, Any], improvement: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Check ``aggregate`` (and ``improvement``) against ``gates``; ``None`` / ``False`` gates are skipped.

    ``max_mean_kld``: ``mean_kld <= limit``. ``max_run_spread``: ``run_spread <= limit``.
    ``min_improvement``: the CI *lower bound* of the reduction vs the baseline ``>= limit`` (fails with
    value ``None`` when no ``improvement`` is given). ``require_exact_zero`` (a self-check): every run's
    mean KL is exactly 0.0 (value: the largest run mean). NaN values fail. Returns
    ``{"passed": all checks passed, "checks": [{"name", "value", "limit", "passed"}]}``; with every gate
    skipped there are no checks and ``passed`` is True. Unknown gate names raise ``ValueError``.
    """
    unknown = sorted(set(gates) - set(GATE_KEYS))
    if unknown:
        raise ValueError(f"unknown gates {unknown}; known: {list(GATE_KEYS)}")
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, limit: float, ok: bool) -> None:
        checks.append({"name": name, "value": value, "limit": limit, "passed": bool(ok)})

    limit = gates.get("max_mean_kld")
    if limit is not None:
        value = float(aggregate["mean_kld"])
        check("max_mean_kld", value, float(limit), value <= float(limit))
    limit = gates.get("max_run_spread")
    if limit is not None:
        value = float(aggregate["run_spread"])
        check("max_run_spread", value, float(limit), value <= float(limit))
    limit = gates.get("min_improvement")
    if limit is not None:
        if improvement is None:
            check("min_improvement", None, float(limit), False)
        else:
            value = float(improvement["ci_low"])
            check("min_improvement", value, float(limit), value >= float(limit))
    if gates.get("require_exact_zero"):
        means = [float(m) for m in aggregate["mean_kld_runs"]]
        worst = max(means, key=lambda m: (math.isnan(m), abs(m)))
        check("require_exact_zero", worst, 0.0, all(m == 0.0 for m in means))
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


# --------------------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------------------


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per (candidate, KV-cache dtype, protocol), in the given order, columns :data:`TABLE_COLUMNS`.

    Each input row: ``{"candidate": str, "kv_cache_dtype": str, "protocol": "prompt" | "suite" (default
    "prompt"), "aggregate": aggregate_runs(...), "improvement": paired_improvement(...) | None, "gates":
    evaluate_gates(...) or a gate document's verdict | None}``. Numbers are raw: ``mean_kld_se`` is the mean
    over runs of the per-run SE, ``same_top_pct`` a percentage, ``rms_dp`` and ``reduction*`` fractions;
    ``verdict`` is the gates' ``word`` when they have one (pass, fail, repeat-required), else "pass" or
    "fail", and "n/a" without gates. Missing values: NaN.
    """
    import pandas as pd

    records = []
    for row in rows:
        agg = row["aggregate"]
        summary = agg.get("summary", {})
        imp = row.get("improvement")
        gates = row.get("gates")
        if gates is None:
            verdict = "n/a"
        else:
            verdict = str(gates.get("word") or ("pass" if gates["passed"] else "fail"))
        records.append(
            {
                "candidate": str(row["candidate"]),
                "kv_cache_dtype": str(row["kv_cache_dtype"]),
                "protocol": str(row.get("protocol", "prompt")),
                "runs": int(agg["runs"]),
                "mean_kld": float(agg["mean_kld"]),
                "mean_kld_se": float(summary.get("mean_kld_se", math.nan)),
                "run_spread": float(agg["run_spread"]),
                "identical_runs": bool(agg["identical_runs"]),
                "same_top_pct": float(summary.get("same_top_pct", math.nan)),
                "rms_dp": float(summary.get("rms_dp", math.nan)),
                "ppl_ratio": float(summary.get("ppl_ratio", math.nan)),
                "reduction": float(imp["reduction"]) if imp else math.nan,
                "reduction_ci_low": float(imp["ci_low"]) if imp else math.nan,
                "reduction_ci_high": float(imp["ci_high"]) if imp else math.nan,
                "verdict": verdict,
            }
        )
    return pd.DataFrame.from_records(records, columns=list(TABLE_COLUMNS))


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _fmt_g(x: Any, digits: int = 4) -> str:
    return "—" if _missing(x) else f"{float(x):.{digits}g}"


def _fmt_pct(x: Any, decimals: int = 1) -> str:
    return "—" if _missing(x) else f"{100.0 * float(x):.{decimals}f} %"


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt_reduction(r: Mapping[str, Any]) -> str:
    if _missing(r["reduction"]):
        return "—"
    ci = f"[{_fmt_pct(r['reduction_ci_low'])}, {_fmt_pct(r['reduction_ci_high'])}]"
    return f"{_fmt_pct(r['reduction'])} {ci}"


# Markdown columns: (header, alignment, formatter of a table row).
_MD_COLUMNS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("candidate", "l", lambda r: str(r["candidate"])),
    ("KV cache", "l", lambda r: str(r["kv_cache_dtype"])),
    ("protocol", "l", lambda r: str(r["protocol"])),
    ("runs", "r", lambda r: str(r["runs"])),
    (
        "mean KLD ± SE",
        "r",
        lambda r: (
            _fmt_g(r["mean_kld"]) + ("" if _missing(r["mean_kld_se"]) else f" ± {r['mean_kld_se']:.2g}")
        ),
    ),
    (
        "run spread",
        "r",
        lambda r: _fmt_g(r["run_spread"], 3) + (" (identical)" if r["identical_runs"] else ""),
    ),
    ("top-1 same", "r", lambda r: "—" if _missing(r["same_top_pct"]) else f"{r['same_top_pct']:.2f} %"),
    ("RMS Δp", "r", lambda r: _fmt_pct(r["rms_dp"], 3)),
    ("PPL ratio", "r", lambda r: "—" if _missing(r["ppl_ratio"]) else f"{r['ppl_ratio']:.5f}"),
    ("reduction vs baseline [CI]", "r", _fmt_reduction),
    (
        "verdict",
        "l",
        lambda r: str(r["verdict"]).upper() if r["verdict"] in VERDICT_WORDS else str(r["verdict"]),
    ),
)


def table_markdown(df: pd.DataFrame) -> str:
    """The comparison table as GitHub Markdown (formatted, one row per DataFrame row)."""
    missing = [c for c in TABLE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"not a comparison table: missing columns {missing}")
    header = "| " + " | ".join(h for h, _, _ in _MD_COLUMNS) + " |"
    rule = "|" + "|".join(":---" if a == "l" else "---:" for _, a, _ in _MD_COLUMNS) + "|"
    lines = [header, rule]
    for rec in df.to_dict(orient="records"):
        lines.append("| " + " | ".join(_md_cell(fmt(rec)) for _, _, fmt in _MD_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, csv_path: str | os.PathLike[str], md_path: str | os.PathLike[str]) -> None:
    """Write ``df`` as CSV (raw numbers, full precision) and as formatted Markdown, each atomically."""
    csv_text = df.to_csv(index=False, lineterminator="\n")
    md_text = table_markdown(df)
    for path, text in ((csv_path, csv_text), (md_path, md_text)):
        with atomic_open(path, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
