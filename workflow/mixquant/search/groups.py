"""What a placement is made of: groups (the routed experts of one MoE layer), each with its allowed formats
and their KL scores, the effective-bits budget, and the placement a solver returns.

Each *group* (the routed experts of one MoE layer) takes one of its allowed formats (``nvfp4_w4a16``,
``fp8``, ``bf16``); its KL sensitivity ``score[format]`` (mean KL per token with only that group
quantized to that format, ``bf16`` = 0) is what it costs in accuracy, ``numel * cost_weight * bits`` what
it costs in size. The budget is on the effective bits ``sum(numel*w*bits) / sum(numel*w)``: a placement
is feasible when its effective bits are ``<= target + BUDGET_TOL``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# Effective bits per weight of each format; the key order (cheapest first) is the canonical format order.
from mixquant.formats.facts import ROUTED_FORMAT_BITS as FORMAT_BITS

BUDGET_TOL = 1e-9
"""A placement fits a target when its effective bits are ``<= target + BUDGET_TOL``."""

OBJECTIVE_RTOL = 1e-12
"""Placements whose summed scores are within this relative distance of the optimum count as ties."""


class PlacementInfeasible(ValueError):
    """The target effective bits lie below what the groups' cheapest allowed formats achieve."""

    def __init__(
        self,
        message: str,
        minimum_effective_bits: float | None = None,
        target_effective_bits: float | None = None,
    ) -> None:
        super().__init__(message)
        self.minimum_effective_bits = minimum_effective_bits
        self.target_effective_bits = target_effective_bits


@dataclass(frozen=True)
class SearchGroup:
    """One placement unit: ``numel`` weights that take one format among the keys of ``scores``.

    ``scores`` maps each allowed format to its score (finite, >= 0); a single entry pins the group. It is
    stored as a plain dict in canonical format order (cheapest first). The group costs
    ``numel * cost_weight * bits`` (``cost_weight`` < 1 weights e.g. the active share of MoE experts).
    """

    name: str
    numel: int
    scores: Mapping[str, float]
    cost_weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"group name must be a non-empty string, got {self.name!r}")
        if isinstance(self.numel, bool):
            raise ValueError(f"group {self.name}: numel must be an integer, got {self.numel!r}")
        numel = operator.index(self.numel)
        if numel <= 0:
            raise ValueError(f"group {self.name}: numel must be positive, got {numel}")
        weight = float(self.cost_weight)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"group {self.name}: cost_weight must be finite and >= 0, got {weight}")
        if not self.scores:
            raise ValueError(f"group {self.name}: no allowed format")
        unknown = sorted(set(self.scores) - set(FORMAT_BITS))
        if unknown:
            raise ValueError(f"group {self.name}: unknown formats {unknown}; known: {list(FORMAT_BITS)}")
        scores: dict[str, float] = {}
        for fmt in FORMAT_BITS:
            if fmt in self.scores:
                score = float(self.scores[fmt])
                if not math.isfinite(score) or score < 0:
                    raise ValueError(f"group {self.name}: score[{fmt}] must be finite and >= 0, got {score}")
                scores[fmt] = score
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "cost_weight", weight)
        object.__setattr__(self, "scores", scores)

    def __hash__(self) -> int:
        return hash((self.name, self.numel, tuple(self.scores.items()), self.cost_weight))

    @property
    def formats(self) -> tuple[str, ...]:
        """Allowed formats, cheapest first."""
        return tuple(self.scores)


@dataclass(frozen=True)
class PlacementSolution:
    """A placement: ``choice`` (group name -> format, in group order) and its figures."""

    choice: dict[str, str]
    objective: float
    effective_bits: float
    target_effective_bits: float
    status: str
    method: str

    def counts(self) -> dict[str, int]:
        """Number of groups per format (every format of ``FORMAT_BITS``, zeros included)."""
        counts = dict.fromkeys(FORMAT_BITS, 0)
        for fmt in self.choice.values():
            counts[fmt] += 1
        return counts

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form (plain types only)."""
        return {
            "method": self.method,
            "status": self.status,
            "target_effective_bits": self.target_effective_bits,
            "effective_bits": self.effective_bits,
            "objective": self.objective,
            "counts": self.counts(),
            "choice": dict(self.choice),
        }


def checked_groups(groups: Iterable[SearchGroup]) -> tuple[SearchGroup, ...]:
    groups = tuple(groups)
    if not groups:
        raise ValueError("no groups to place")
    names = set()
    for group in groups:
        if not isinstance(group, SearchGroup):
            raise TypeError(f"expected SearchGroup, got {type(group).__name__}")
        if group.name in names:
            raise ValueError(f"duplicate group name {group.name!r}")
        names.add(group.name)
    if sum(group_weight(g) for g in groups) <= 0:
        raise ValueError("total cost weight (sum of numel * cost_weight) is zero")
    return groups


def checked_target(target: float) -> float:
    target = float(target)
    if not math.isfinite(target):
        raise ValueError(f"target effective bits must be finite, got {target}")
    return target


def group_weight(group: SearchGroup) -> Fraction:
    return Fraction(group.numel) * Fraction(group.cost_weight)


def group_cost(group: SearchGroup, fmt: str) -> Fraction:
    return group_weight(group) * Fraction(FORMAT_BITS[fmt])


def total_weight(groups: Sequence[SearchGroup]) -> Fraction:
    return sum((group_weight(g) for g in groups), Fraction(0))


def choice_cost(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> Fraction:
    return sum((group_cost(g, choice[g.name]) for g in groups), Fraction(0))


def budget_limit(groups: Sequence[SearchGroup], target: float, tol: float = BUDGET_TOL) -> Fraction:
    """Largest feasible total cost, exactly."""
    return (Fraction(target) + Fraction(tol)) * total_weight(groups)


def summed_score(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> float:
    return math.fsum(g.scores[choice[g.name]] for g in groups)


def check_choice(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> None:
    names = {g.name for g in groups}
    extra = sorted(set(choice) - names)
    if extra:
        raise ValueError(f"choice names unknown groups: {extra}")
    for group in groups:
        if group.name not in choice:
            raise ValueError(f"choice lacks group {group.name!r}")
        if choice[group.name] not in group.scores:
            raise ValueError(
                f"group {group.name}: format {choice[group.name]!r} not allowed ({list(group.scores)})"
            )


def effective_bits(groups: Iterable[SearchGroup], choice: Mapping[str, str]) -> float:
    """``sum(numel*w*bits) / sum(numel*w)`` of a placement (computed exactly, then rounded once)."""
    groups = checked_groups(groups)
    check_choice(groups, choice)
    return float(choice_cost(groups, choice) / total_weight(groups))


def cheapest_choice(groups: Sequence[SearchGroup]) -> dict[str, str]:
    return {g.name: g.formats[0] for g in groups}


def min_effective_bits(groups: Iterable[SearchGroup]) -> float:
    """Effective bits with every group at its cheapest allowed format."""
    groups = checked_groups(groups)
    return effective_bits(groups, cheapest_choice(groups))


def max_effective_bits(groups: Iterable[SearchGroup]) -> float:
    """Effective bits with every group at its most expensive allowed format."""
    groups = checked_groups(groups)
    return effective_bits(groups, {g.name: g.formats[-1] for g in groups})


def require_feasible(groups: Sequence[SearchGroup], target: float) -> None:
    if choice_cost(groups, cheapest_choice(groups)) > budget_limit(groups, target):
        minimum = min_effective_bits(groups)
        raise PlacementInfeasible(
            f"effective-bits target {target:.10g} is infeasible: the minimum achievable effective bits is "
            f"{minimum:.10g} (every group at its cheapest allowed format)",
            minimum,
            target,
        )


def make_solution(
    groups: Sequence[SearchGroup], choice: dict[str, str], target: float, status: str, method: str
) -> PlacementSolution:
    return PlacementSolution(
        choice=choice,
        objective=summed_score(groups, choice),
        effective_bits=effective_bits(groups, choice),
        target_effective_bits=target,
        status=status,
        method=method,
    )
