"""Placement of a format per MoE layer under an effective-bits budget: exact ILP and ModelOpt's minimax.

One solve per method -- :func:`mixquant.search.ilp.solve_ilp` (exact) or
:func:`mixquant.search.minimax.solve_minimax` (ModelOpt's) -- on the groups of :mod:`mixquant.search.groups`,
and the bits-to-KL frontier over a range of budgets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mixquant.search.groups import (
    PlacementInfeasible,
    PlacementSolution,
    SearchGroup,
    checked_groups,
    checked_target,
    max_effective_bits,
    min_effective_bits,
    require_feasible,
)
from mixquant.search.ilp import solve_ilp
from mixquant.search.minimax import solve_minimax

FRONTIER_POINTS = 25


def solve_placement(
    groups: Iterable[SearchGroup], target_effective_bits: float, method: str = "ilp"
) -> PlacementSolution:
    """Solve with ``method`` ("ilp" or "minimax"); raises ``PlacementInfeasible`` below the minimum bits."""
    solvers = {"ilp": solve_ilp, "minimax": solve_minimax}
    if method not in solvers:
        raise ValueError(f"unknown placement method {method!r}; expected one of {sorted(solvers)}")
    groups = checked_groups(groups)
    target = checked_target(target_effective_bits)
    require_feasible(groups, target)
    return solvers[method](groups, target)


def _grid(lo: float, hi: float, points: int) -> list[float]:
    if hi <= lo or points < 2:
        return [lo]
    return [lo, *(lo + (hi - lo) * k / (points - 1) for k in range(1, points - 1)), hi]


def frontier(
    groups: Iterable[SearchGroup], budgets: Iterable[float] | None = None, method: str = "ilp"
) -> list[dict[str, Any]]:
    """Solutions over a range of budgets, ascending target; infeasible targets are skipped.

    Default budgets: ``FRONTIER_POINTS`` evenly spaced targets from the minimum to the maximum effective
    bits, both ends included. Each row: target_effective_bits, effective_bits, objective, status and the
    number of groups per format (one key per format).
    """
    groups = checked_groups(groups)
    if budgets is None:
        budgets = _grid(min_effective_bits(groups), max_effective_bits(groups), FRONTIER_POINTS)
    rows = []
    for target in sorted({checked_target(b) for b in budgets}):
        try:
            solution = solve_placement(groups, target, method)
        except PlacementInfeasible:
            continue
        rows.append(
            {
                "target_effective_bits": target,
                "effective_bits": solution.effective_bits,
                "objective": solution.objective,
                "status": solution.status,
                **solution.counts(),
            }
        )
    return rows
