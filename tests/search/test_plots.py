"""Placement plots: valid PNGs, written atomically, for edge-case inputs (zeros, one group, 47 groups)."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from mixquant.search import plots
from mixquant.search.groups import FORMAT_BITS, SearchGroup
from mixquant.search.ilp import solve_ilp
from mixquant.search.plots import plot_frontier, plot_score_heatmap
from mixquant.search.solve import frontier

NV, FP8, BF16 = FORMAT_BITS
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert len(data) > 5_000  # a real figure, not an empty canvas
    return struct.unpack(">II", data[16:24])


def _only(path: Path) -> None:
    """The output is the only file in its directory: no temp file left behind."""
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def _scores(n: int, seed: int = 0) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        base = 10 ** rng.uniform(-4, -1)
        out[f"model.layers.{i + 1}.mlp.experts"] = {NV: base, FP8: base * rng.uniform(0.01, 0.3), BF16: 0.0}
    return out


def test_frontier_plot_from_solver_rows(tmp_path: Path) -> None:
    scores = _scores(12)
    groups = [SearchGroup(name, 1024, s) for name, s in scores.items()]
    rows = frontier(groups)
    chosen = solve_ilp(groups, 6.0)
    out = plot_frontier(
        rows,
        tmp_path / "frontier.png",
        chosen=chosen.to_json(),
        baselines={"uniform nvfp4": (4.5, rows[0]["objective"]), "minimax": (6.0, chosen.objective * 1.5)},
        title="test frontier",
    )
    assert out == tmp_path / "frontier.png"
    width, height = _png_size(out)
    assert width > 400 and height > 300
    _only(out)
    # The solution object itself and a frontier row also work as the chosen point.
    assert _png_size(plot_frontier(rows, tmp_path / "b.png", chosen=chosen)) == _png_size(
        plot_frontier(rows, tmp_path / "c.png", chosen=rows[3])
    )


def test_frontier_plot_zero_and_single_rows(tmp_path: Path) -> None:
    zero = [{"effective_bits": 16.0, "objective": 0.0}, {"effective_bits": 8.0, "objective": 0.0}]
    _png_size(plot_frontier(zero, tmp_path / "zero.png", chosen=zero[0]))
    mixed = [{"effective_bits": 4.5, "objective": 0.2}, {"effective_bits": 16.0, "objective": 0.0}]
    _png_size(plot_frontier(mixed, tmp_path / "mixed.png", baselines={"bf16": (16.0, 0.0)}))
    _png_size(plot_frontier([{"effective_bits": 4.5, "objective": 0.3}], tmp_path / "one.png"))
    with pytest.raises(ValueError, match="no frontier rows"):
        plot_frontier([], tmp_path / "none.png")


def test_heatmap_47_groups_with_choice(tmp_path: Path) -> None:
    scores = _scores(47)
    scores["model.layers.4.mlp.experts"] = {BF16: 0.0}  # pinned: other cells n/a
    chosen = {name: (NV if i % 5 else FP8) for i, name in enumerate(scores)}
    chosen["model.layers.4.mlp.experts"] = BF16
    out = plot_score_heatmap(scores, tmp_path / "sub" / "heat.png", chosen=chosen)
    width, height = _png_size(out)
    assert height > width > 300  # one row per group
    _only(out)


def test_heatmap_zero_scores_and_one_group(tmp_path: Path) -> None:
    _png_size(
        plot_score_heatmap({"only": {NV: 0.0, FP8: 0.0, BF16: 0.0}}, tmp_path / "z.png", chosen={"only": FP8})
    )
    _png_size(plot_score_heatmap({"only": {NV: 0.02, FP8: 0.02}}, tmp_path / "one.png"))
    with pytest.raises(ValueError, match="no scores"):
        plot_score_heatmap({}, tmp_path / "none.png")


def test_writes_are_atomic_and_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scores = _scores(5)
    target = tmp_path / "heat.png"
    replaced: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def spy(src, dst) -> None:
        replaced.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(plots.os, "replace", spy)
    plot_score_heatmap(scores, target)
    first = target.read_bytes()
    plot_score_heatmap(scores, target)
    assert target.read_bytes() == first  # byte-identical rewrite
    assert len(replaced) == 2
    for src, dst in replaced:
        assert dst == target and src.parent == target.parent and src != target
    _only(target)

    # A failing save leaves the previous file untouched and no temp file behind.
    def broken(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_score_heatmap(_scores(3, seed=1), target)
    assert target.read_bytes() == first
    _only(target)
