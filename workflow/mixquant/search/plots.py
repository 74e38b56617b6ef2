"""Placement search plots: the accuracy/size frontier and the per-layer score heatmap (PNG, Agg).

Figures are built with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch) and
written atomically (temp file in the target directory, then ``os.replace``) with no ``Software`` metadata,
so equal inputs give byte-identical files for a given matplotlib version.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mixquant.checkpoint.atomic import atomic_open
from mixquant.search.groups import FORMAT_BITS

__all__ = ["plot_frontier", "plot_refinement", "plot_score_heatmap"]

DPI = 120


def _save(fig: Figure, out_path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as PNG to ``out_path`` atomically (:mod:`mixquant.checkpoint.atomic`)."""
    with atomic_open(out_path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    return Path(out_path)


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _get(obj: Any, key: str) -> Any:
    """``obj[key]`` for mappings, ``obj.key`` otherwise (a PlacementSolution works as ``chosen``)."""
    return obj[key] if isinstance(obj, Mapping) else getattr(obj, key)


def _counts(obj: Any) -> dict[str, int] | None:
    if isinstance(obj, Mapping):
        if isinstance(obj.get("counts"), Mapping):
            return dict(obj["counts"])
        if all(f in obj for f in FORMAT_BITS):
            return {f: int(obj[f]) for f in FORMAT_BITS}
        return None
    counts = getattr(obj, "counts", None)
    return counts() if callable(counts) else None


def _set_value_scale(ax: Any, values: Sequence[float]) -> str:
    """Log y when every value is positive, symlog when some are 0, linear when none is positive."""
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values):
        ax.set_yscale("log")
        return "log"
    if positive:
        ax.set_yscale("symlog", linthresh=min(positive))
        return "symlog"
    return "linear"


def plot_frontier(
    rows: Sequence[Mapping[str, Any]],
    out_path: str | os.PathLike[str],
    *,
    chosen: Mapping[str, Any] | Any | None = None,
    baselines: Mapping[str, tuple[float, float]] | None = None,
    title: str = "Placement frontier: predicted KL vs effective bits",
) -> Path:
    """Predicted summed KL (``objective``) against ``effective_bits`` for frontier ``rows``.

    ``chosen`` (a frontier row, ``PlacementSolution.to_json()`` or the solution itself) is marked with its
    format counts; ``baselines`` are extra named points, e.g. ``{"uniform nvfp4": (4.5, obj)}``.
    """
    if not rows:
        raise ValueError("no frontier rows to plot")
    points = sorted((float(r["effective_bits"]), float(r["objective"])) for r in rows)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    baselines = dict(baselines or {})
    values = ys + [float(v) for _, v in baselines.values()]
    if chosen is not None:
        values.append(float(_get(chosen, "objective")))

    fig = _new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    scale = _set_value_scale(ax, values)
    ax.plot(xs, ys, "o-", color="tab:blue", markersize=4, linewidth=1.5, label="ILP frontier", zorder=2)
    markers = "sD^vP*X"
    for k, (name, (bx, by)) in enumerate(baselines.items()):
        ax.scatter(
            [float(bx)], [float(by)], marker=markers[k % len(markers)], s=55, zorder=3, label=str(name)
        )
    if chosen is not None:
        cx, cy = float(_get(chosen, "effective_bits")), float(_get(chosen, "objective"))
        label = f"chosen: {cx:.3f} bits, KL {cy:.3g}"
        counts = _counts(chosen)
        if counts:
            label += "\n" + ", ".join(f"{f} {n}" for f, n in counts.items())
        ax.scatter([cx], [cy], marker="*", s=220, color="tab:red", edgecolor="black", zorder=4, label=label)
    ax.set_xlabel("effective bits per routed-expert weight")
    ax.set_ylabel(f"predicted KL per token (sum of layer scores, {scale} scale)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, out_path)


def _cell_text(value: float) -> str:
    return "0" if value == 0 else f"{value:.2g}"


def plot_score_heatmap(
    scores: Mapping[str, Mapping[str, float]],
    out_path: str | os.PathLike[str],
    *,
    chosen: Mapping[str, str] | None = None,
    title: str = "KL sensitivity per layer and format",
) -> Path:
    """Heatmap of ``scores[group][format]``: one row per group (given order), one column per format.

    Positive scores are coloured on a log scale and every cell is annotated; zero scores are white,
    formats a group may not take are hatched grey. ``chosen`` (group -> format) outlines the chosen cell.
    """
    if not scores:
        raise ValueError("no scores to plot")
    groups = list(scores)
    extra = [f for g in groups for f in scores[g] if f not in FORMAT_BITS]
    formats = [f for f in FORMAT_BITS if any(f in scores[g] for g in groups)] + list(dict.fromkeys(extra))
    values = np.full((len(groups), len(formats)), np.nan)
    for r, g in enumerate(groups):
        for c, f in enumerate(formats):
            if f in scores[g]:
                values[r, c] = float(scores[g][f])
    positive = values[np.isfinite(values) & (values > 0)]

    n_rows = len(groups)
    fontsize = 8 if n_rows <= 24 else 6.5
    fig = _new_figure(2.6 + 1.5 * len(formats), 1.4 + 0.27 * max(n_rows, 3))
    ax = fig.add_subplot()
    norm = None
    if positive.size:
        lo, hi = float(positive.min()), float(positive.max())
        if lo == hi:
            lo, hi = lo / math.sqrt(10), hi * math.sqrt(10)
        norm = LogNorm(vmin=lo, vmax=hi)
        shown = np.ma.masked_where(~(np.isfinite(values) & (values > 0)), values)
        image = ax.imshow(shown, cmap="viridis", norm=norm, aspect="auto", interpolation="nearest")
        shrink = 1.0 if n_rows <= 16 else 0.45
        fig.colorbar(image, ax=ax, label="score (mean KL per token)", fraction=0.05, pad=0.03, shrink=shrink)
    else:
        ax.imshow(np.zeros_like(values), cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for r in range(n_rows):
        for c in range(len(formats)):
            v = values[r, c]
            if not np.isfinite(v):
                ax.add_patch(
                    Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="0.85", hatch="///", edgecolor="0.6")
                )
                ax.text(c, r, "n/a", ha="center", va="center", fontsize=fontsize, color="0.35")
                continue
            dark = norm is not None and v > 0 and norm(v) < 0.55
            ax.text(
                c,
                r,
                _cell_text(v),
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if dark else "black",
            )
    if chosen:
        for r, g in enumerate(groups):
            if g in chosen and chosen[g] in formats:
                c = formats.index(chosen[g])
                ax.add_patch(
                    Rectangle(
                        (c - 0.48, r - 0.48), 0.96, 0.96, fill=False, edgecolor="tab:red", linewidth=2.2
                    )
                )
    ax.set_xticks(range(len(formats)), formats)
    ax.set_yticks(range(n_rows), groups, fontsize=fontsize)
    ax.set_xlim(-0.5, len(formats) - 0.5)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.tick_params(axis="x", top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.set_title(title + ("  (red: chosen)" if chosen else ""), fontsize=10)
    return _save(fig, out_path)


def plot_refinement(
    candidates: Sequence[Mapping[str, Any]],
    out_path: str | os.PathLike[str],
    *,
    chosen: int,
    title: str = "Refinement: predicted vs measured KL of the K best placements",
) -> Path:
    """Measured KL (all placed layers quantized, held-out sequences) against predicted KL (summed layer
    scores) for each candidate, labelled by predicted rank; ``chosen`` (1-based) is starred, and the
    diagonal y = x shows where the prediction would be exact."""
    if not candidates:
        raise ValueError("no refinement candidates to plot")
    xs = [float(c["predicted"]) for c in candidates]
    ys = [float(c["measured"]) for c in candidates]
    fig = _new_figure(6.4, 4.8)
    ax = fig.add_subplot()
    ax.scatter(xs, ys, s=36, color="tab:blue", zorder=3, label="candidate (predicted rank)")
    for c, x, y in zip(candidates, xs, ys, strict=True):
        ax.annotate(str(c["predicted_rank"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    pick = candidates[chosen - 1]
    ax.scatter(
        [float(pick["predicted"])],
        [float(pick["measured"])],
        marker="*",
        s=220,
        color="tab:red",
        edgecolor="black",
        zorder=4,
        label=f"kept: predicted rank {pick['predicted_rank']}, measured {float(pick['measured']):.3g}",
    )
    lo, hi = min(xs + ys), max(xs + ys)
    ax.plot([lo, hi], [lo, hi], "--", color="grey", linewidth=1, label="measured = predicted")
    ax.set_xlabel("predicted KL per token (sum of layer scores, scored sequences)")
    ax.set_ylabel("measured KL per token (held-out sequences)")
    ax.set_title(title)
    ax.grid(True, alpha=0.35)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, out_path)
