"""The KL gate's plots: PNGs on an Agg canvas (no pyplot, no global backend switch), written atomically with
no ``Software`` metadata, so equal inputs give equal bytes for a given matplotlib version.

* :func:`plot_kl_cdf` -- the empirical CDF of the per-position KL, one curve per candidate.
* :func:`plot_kl_cdf_by_domain` -- the same per evaluation domain: one panel per candidate, one curve per
  domain (a domain keeps its colour in every panel).
* :func:`plot_per_position` -- the per-position KL along the prompt with its rolling mean.

Zeros sit at the left edge of a log axis (a decade below the smallest positive KL; a CDF starts at their
fraction); ``inf`` values are off the right edge (a CDF tops out below 1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mixquant.checkpoint.atomic import atomic_open
from mixquant.kld.report import _kl_tensor

if TYPE_CHECKING:
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DPI", "ROLLING_POSITIONS", "plot_kl_cdf", "plot_kl_cdf_by_domain", "plot_per_position"]

DPI = 120
ROLLING_POSITIONS = 64  # the per-position plot's rolling mean: ~30 windows along a 2,048-token prompt
PANEL_COLUMNS = 3  # the per-domain CDF's grid: at most this many candidate panels per row


def _new_figure(width: float, height: float) -> Figure:
    # lazy: imports matplotlib, only where a plot is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_path: str | os.PathLike[str]) -> Path:
    with atomic_open(out_path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    return Path(out_path)


def _curves_np(curves: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if not curves:
        raise ValueError("no curves to plot")
    out = {}
    for name, values in curves.items():
        x = _kl_tensor(values).numpy()
        if x.size == 0:
            raise ValueError(f"curve {name!r} is empty")
        if np.isnan(x).any():
            raise ValueError(f"curve {name!r} has NaN")
        out[str(name)] = x
    return out


def _x_range(positive: np.ndarray) -> tuple[float, float]:
    """The CDF's x limits: a decade either side of the positive finite values (zeros at the left edge), or
    [-1, 1] on a linear axis when nothing is positive."""
    if not positive.size:
        return -1.0, 1.0
    lo, hi = float(positive.min()), float(positive.max())
    return lo / 10.0, hi * 10.0 if hi > lo else hi * 100.0


def _cdf_step(
    ax: Axes, x: np.ndarray, left: float, right: float, log_x: bool, label: str, **style: Any
) -> None:
    """One empirical CDF as a step line; ``label`` gets the mean, the zeros and the infinities."""
    n = x.size
    zeros, infs = int((x == 0).sum()), int(np.isinf(x).sum())
    finite_pos = np.sort(x[(x > 0) & np.isfinite(x)])
    xs = np.concatenate([[left], finite_pos, [right]])
    ys = np.concatenate([[zeros / n], (zeros + np.arange(1, finite_pos.size + 1)) / n, [(n - infs) / n]])
    if not log_x:
        xs, ys = np.array([left, 0.0, right]), np.array([0.0, zeros / n, zeros / n])
    notes = [f"mean {np.mean(x):.3g}" if math.isfinite(float(np.mean(x))) else "mean inf"]
    if zeros:
        notes.append(f"{zeros} zero" + ("s" if zeros > 1 else ""))
    if infs:
        notes.append(f"{infs} inf")
    ax.step(xs, ys, where="post", linewidth=1.4, label=f"{label} ({', '.join(notes)})", **style)


def plot_kl_cdf(
    curves: Mapping[str, torch.Tensor],
    out_path: str | os.PathLike[str],
    *,
    title: str = "Per-position KL(BF16 || candidate): empirical CDF",
) -> Path:
    """Empirical CDF of the per-position KL of each named curve, log x over the positive values.

    Zeros sit at the left edge (a decade below the smallest positive KL; the CDF starts at their
    fraction); ``inf`` values are off the right edge (the CDF tops out below 1). Curves with no positive
    value at all (a BF16 self-check) are drawn as a step at 0 on a linear axis when nothing is positive.
    """
    data = _curves_np(curves)
    positive = np.concatenate([x[(x > 0) & np.isfinite(x)] for x in data.values()])
    fig = _new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    left, right = _x_range(positive)
    if positive.size:
        ax.set_xscale("log")
    for name, x in data.items():
        _cdf_step(ax, x, left, right, bool(positive.size), name)
    ax.set_xlim(left, right)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("KL per position (nats)" + (", log scale; zeros at the left edge" if positive.size else ""))
    ax.set_ylabel("fraction of positions ≤ x")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out_path)


def plot_kl_cdf_by_domain(
    curves: Mapping[str, Any],
    position_domains: np.ndarray,
    out_path: str | os.PathLike[str],
    *,
    title: str = "Per-position KL(BF16 || candidate) per domain: empirical CDF",
) -> Path:
    """Empirical CDF of the per-position KL per evaluation domain: one panel per candidate (a grid with
    shared axes), one curve per domain in each panel, in the same colour in every panel, the domain's mean
    KL in the legend. ``position_domains`` names each position's domain (one per position, as long as
    every curve); domains keep their first-seen order. Zeros and ``inf`` as in :func:`plot_kl_cdf`.
    """
    data = _curves_np(curves)
    domains_of = np.asarray(position_domains).astype(str)
    if domains_of.ndim != 1:
        raise ValueError(f"position_domains must be one name per position, got shape {domains_of.shape}")
    for name, x in data.items():
        if x.size != domains_of.size:
            raise ValueError(
                f"curve {name!r} has {x.size} positions but position_domains names {domains_of.size}: "
                "pass the domain of every position of the suite"
            )
    domains = list(dict.fromkeys(domains_of.tolist()))
    masks = {domain: domains_of == domain for domain in domains}
    positive = np.concatenate([x[(x > 0) & np.isfinite(x)] for x in data.values()])
    left, right = _x_range(positive)
    columns = min(PANEL_COLUMNS, len(data))
    rows = math.ceil(len(data) / columns)
    fig = _new_figure(4.6 * columns, 3.6 * rows + 0.6)
    axes = fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False).ravel()
    for ax, (name, x) in zip(axes, data.items(), strict=False):
        if positive.size:
            ax.set_xscale("log")
        for index, domain in enumerate(domains):
            _cdf_step(ax, x[masks[domain]], left, right, bool(positive.size), domain, color=f"C{index % 10}")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="major", alpha=0.35)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes[len(data) :]:
        ax.set_visible(False)
    axes[0].set_xlim(left, right)
    axes[0].set_ylim(0.0, 1.02)
    for column in range(columns):  # x labels under the lowest panel of each column
        lowest = axes[max(i for i in range(column, len(data), columns))]
        lowest.tick_params(labelbottom=True)
        lowest.set_xlabel("KL per position (nats)" + (", log; zeros at left" if positive.size else ""))
    for ax in axes[::columns]:
        ax.set_ylabel("fraction of positions ≤ x")
    fig.suptitle(title)
    return _save(fig, out_path)


def _rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """The mean of the finite values among the ``window`` positions centred on each position (NaN where
    there are none)."""
    finite = np.isfinite(x)
    kernel = np.ones(max(1, window))
    sums = np.convolve(np.where(finite, x, 0.0), kernel, mode="same")
    counts = np.convolve(finite.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_per_position(
    curves: Mapping[str, torch.Tensor],
    out_path: str | os.PathLike[str],
    *,
    title: str = "Per-position KL(BF16 || candidate) along the prompt",
) -> Path:
    """Per-position KL along the prompt, per named curve (same length not required): each position faintly
    and its rolling mean over ``ROLLING_POSITIONS`` positions as the line to read (a few thousand noisy
    points of several curves are unreadable on their own).

    y is log when every finite value is positive, symlog when some are 0, linear when none is positive;
    ``inf`` values are not drawn (nor averaged) but counted in the legend.
    """
    data = _curves_np(curves)
    finite = np.concatenate([x[np.isfinite(x)] for x in data.values()])
    positive = finite[finite > 0]
    fig = _new_figure(10.0, 4.8)
    ax = fig.add_subplot()
    if positive.size and positive.size == finite.size:
        ax.set_yscale("log")
        scale = "log"
    elif positive.size:
        ax.set_yscale("symlog", linthresh=float(positive.min()))
        scale = "symlog"
    else:
        scale = "linear"
    for name, x in data.items():
        infs = int(np.isinf(x).sum())
        shown = np.where(np.isinf(x), np.nan, x)
        label = name + (f" ({infs} inf)" if infs else "")
        (points,) = ax.plot(np.arange(x.size), shown, linewidth=0.5, alpha=0.25)
        window = min(ROLLING_POSITIONS, x.size)
        ax.plot(
            np.arange(x.size),
            _rolling_mean(shown, window),
            linewidth=1.6,
            color=points.get_color(),
            label=label,
        )
    ax.set_xlabel(
        f"prompt position t (predicting token t + 1); lines: mean over {ROLLING_POSITIONS} positions"
    )
    ax.set_ylabel(f"KL (nats, {scale} scale)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, out_path)
