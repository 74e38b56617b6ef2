"""Statistics over evaluation windows: a paired bootstrap that resamples whole windows, stratified by domain.

A KL value per token position is not an independent draw: positions of one window share its text, and
windows of one domain share its kind of text. A bootstrap over positions then measures how stable the mean
is over *these* windows' positions, and its interval is too narrow for a statement about other text of the
same kind. Resampling whole windows (the cluster bootstrap), separately within each domain (stratified, so
every resample keeps the suite's mix of domains), carries the between-window and the within-window
dependence into the interval.

The reduction of a candidate against a baseline is the ratio estimator ``1 - sum(cand) / sum(base)`` over
the resampled windows' positions (each window weighted by its positions, as the mean KL over the suite is),
on the same windows for both (paired: a window's difficulty cancels).

A verdict compares an interval with a threshold: ``pass`` when the whole interval clears it, ``fail`` when
none of it does, ``repeat-required`` when it straddles the threshold (more windows would decide).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

Verdict = Literal["pass", "fail", "repeat-required"]


def window_sums(
    cand_kl: Sequence[float] | np.ndarray, base_kl: Sequence[float] | np.ndarray, windows: Sequence[Any]
) -> tuple[list[Any], np.ndarray]:
    """(window ids in first-seen order, ``[W, 2]`` float64 sums of the candidate's and the baseline's KL per
    window); ``windows`` names each position's window."""
    cand = np.asarray(cand_kl, dtype=np.float64)
    base = np.asarray(base_kl, dtype=np.float64)
    if cand.shape != base.shape or cand.ndim != 1 or len(windows) != cand.size:
        raise ValueError(
            f"candidate, baseline and window ids must name the same positions: "
            f"{cand.shape}, {base.shape}, {len(windows)}"
        )
    ids = list(dict.fromkeys(windows))
    index = {window: i for i, window in enumerate(ids)}
    rows = np.fromiter((index[w] for w in windows), dtype=np.int64, count=len(windows))
    sums = np.zeros((len(ids), 2), dtype=np.float64)
    np.add.at(sums[:, 0], rows, cand)
    np.add.at(sums[:, 1], rows, base)
    return ids, sums


def _reduction(sums: np.ndarray) -> float:
    """``1 - sum(cand) / sum(base)`` of ``[..., 2]`` window sums (0 when both are 0, -inf when only the
    baseline is)."""
    cand, base = float(sums[..., 0].sum()), float(sums[..., 1].sum())
    if base > 0:
        return 1.0 - cand / base
    return 0.0 if cand == 0 else -math.inf


def _resampled_reductions(strata: Sequence[np.ndarray], samples: int, rng: np.random.Generator) -> np.ndarray:
    """The reduction of ``samples`` resamples: each stratum's windows drawn with replacement, as many as it
    has, then pooled."""
    totals = np.zeros((samples, 2), dtype=np.float64)
    for sums in strata:
        picks = rng.integers(0, len(sums), size=(samples, len(sums)))
        totals += sums[picks].sum(axis=1)
    cand, base = totals[:, 0], totals[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(base > 0, cand / np.where(base > 0, base, 1.0), np.where(cand > 0, np.inf, 1.0))
    return 1.0 - ratio


def _strata(
    ids: Sequence[Any], sums: np.ndarray, domains: Mapping[Any, str] | None
) -> tuple[list[str], list[np.ndarray]]:
    """(domain names in first-seen order, each domain's rows of ``sums``); one stratum ``all`` without
    domains."""
    domain_of = {window: (domains[window] if domains is not None else "all") for window in ids}
    names = list(dict.fromkeys(domain_of[window] for window in ids))
    return names, [sums[[i for i, w in enumerate(ids) if domain_of[w] == name]] for name in names]


def _interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [alpha, 1.0 - alpha], method="linear")
    return float(low), float(high)


def window_bootstrap(
    cand_kl: Sequence[float] | np.ndarray,
    base_kl: Sequence[float] | np.ndarray,
    windows: Sequence[Any],
    domains: Mapping[Any, str] | None = None,
    *,
    samples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """The candidate's KL reduction vs the baseline with a paired bootstrap interval over windows, stratified
    by domain, and the same per domain.

    ``windows``: each position's window id; ``domains``: window id -> domain (one stratum when ``None``).
    Returns ``{"reduction", "ci_low", "ci_high", "windows", "positions", "confidence", "samples", "seed",
    "domains": {domain: {"reduction", "ci_low", "ci_high", "windows"}}}``; a domain's interval resamples its
    own windows only. Equal inputs and seed give equal results (numpy's PCG64 generator).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if int(samples) < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    ids, sums = window_sums(cand_kl, base_kl, windows)
    if not np.isfinite(sums[:, 1]).all():
        raise ValueError("baseline KL is not finite everywhere")
    if np.isnan(sums[:, 0]).any():
        raise ValueError("candidate KL has NaN")
    names, strata = _strata(ids, sums, domains)
    rng = np.random.default_rng(int(seed))
    low, high = _interval(_resampled_reductions(strata, int(samples), rng), confidence)
    per_domain = {}
    for name, stratum in zip(names, strata, strict=True):
        d_low, d_high = _interval(_resampled_reductions([stratum], int(samples), rng), confidence)
        per_domain[name] = {
            "reduction": _reduction(stratum),
            "ci_low": d_low,
            "ci_high": d_high,
            "windows": len(stratum),
        }
    return {
        "reduction": _reduction(sums),
        "ci_low": low,
        "ci_high": high,
        "windows": len(ids),
        "positions": len(windows),
        "confidence": float(confidence),
        "samples": int(samples),
        "seed": int(seed),
        "domains": per_domain,
    }


def verdict(ci_low: float, ci_high: float, threshold: float, *, higher_is_better: bool = True) -> Verdict:
    """``pass`` when the interval clears ``threshold`` entirely, ``fail`` when it misses it entirely, else
    ``repeat-required`` (it straddles: the evidence decides neither way). With ``higher_is_better`` False
    (a limit on KL itself) the interval must lie at or below the threshold to pass."""
    if any(math.isnan(x) for x in (ci_low, ci_high, threshold)):
        return "fail"
    if ci_low > ci_high:
        raise ValueError(f"interval [{ci_low}, {ci_high}] is reversed")
    if higher_is_better:
        if ci_low >= threshold:
            return "pass"
        return "fail" if ci_high < threshold else "repeat-required"
    if ci_high <= threshold:
        return "pass"
    return "fail" if ci_low > threshold else "repeat-required"


def window_mean(
    kl: Sequence[float] | np.ndarray,
    windows: Sequence[Any],
    domains: Mapping[Any, str] | None = None,
    *,
    samples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """The mean KL over the suite's positions with a bootstrap interval over windows, stratified by domain
    (as :func:`window_bootstrap`), and each domain's mean with its own interval.

    Returns ``{"mean", "ci_low", "ci_high", "windows", "positions", "domains": {domain: {"mean", "ci_low",
    "ci_high", "windows", "positions"}}}``.
    """
    kl = np.asarray(kl, dtype=np.float64)
    ids, sums = window_sums(kl, np.ones_like(kl), windows)  # [:, 1] counts each window's positions
    names, strata = _strata(ids, sums, domains)
    rng = np.random.default_rng(int(seed))

    def means(groups: Sequence[np.ndarray]) -> np.ndarray:
        return 1.0 - _resampled_reductions(groups, int(samples), rng)  # sum(kl) / sum(positions)

    low, high = _interval(means(strata), confidence)
    out: dict[str, Any] = {
        "mean": float(sums[:, 0].sum() / sums[:, 1].sum()),
        "ci_low": low,
        "ci_high": high,
        "windows": len(ids),
        "positions": int(sums[:, 1].sum()),
        "domains": {},
    }
    for name, stratum in zip(names, strata, strict=True):
        d_low, d_high = _interval(means([stratum]), confidence)
        out["domains"][name] = {
            "mean": float(stratum[:, 0].sum() / stratum[:, 1].sum()),
            "ci_low": d_low,
            "ci_high": d_high,
            "windows": len(stratum),
            "positions": int(stratum[:, 1].sum()),
        }
    return out
