"""Placement of a format per MoE layer under an effective-bits budget: exact ILP and ModelOpt's minimax.

Each *group* (the routed experts of one MoE layer) takes one of its allowed formats (``nvfp4_w4a16``,
``fp8``, ``bf16``); its KL sensitivity ``score[format]`` (mean KL per token with only that group
quantized to that format, ``bf16`` = 0) is what it costs in accuracy, ``numel * cost_weight * bits`` what
it costs in size. The budget is on the effective bits ``sum(numel*w*bits) / sum(numel*w)``: a placement
is feasible when its effective bits are ``<= target + BUDGET_TOL``.

``solve_ilp`` minimises the summed scores exactly (CBC through PuLP, one binary per allowed
(group, format), one format per group). To make the result exact in practice and deterministic:

* the budget row is integral whenever the exact costs ``numel * w * bits`` (floats are dyadic rationals)
  scale to moderate integers -- always for cost weights 1, 1/2, 1/8, 1/16, ...; otherwise it is scaled so
  that CBC's 1e-7 feasibility tolerance is ~1e-11 of the budget (answers are then checked to
  ``target + 2 * BUDGET_TOL``);
* the scores are divided by an upper bound on the optimum (a greedy placement's score, then the optimum
  found if that is below half the bound, re-solving) and formats whose score alone exceeds the bound are
  dropped, so CBC's absolute tolerances (1e-7; zero gaps, 1e-12 cutoff increment) resolve ~1e-11 of the
  optimum. Dividing by the largest score instead misses optima by up to ~1e-6 of it (seen in testing);
* ties among optimal placements (summed scores within ``OBJECTIVE_RTOL`` relative) are broken, in this
  order, by (1) fewer total bits -- a second ILP minimising the cost subject to ``score <= optimum*(1 +
  1e-12)`` -- and then (2) the lexicographically first placement in group order, each group's formats
  ranked cheapest first (``FORMAT_BITS`` order), i.e. earlier groups get the cheaper format -- ILPs with an
  integral lexicographic objective over blocks of up to 18 groups, subject to the optimal score and the
  minimal cost. Both are skipped where every group already has the cheapest format an optimal placement
  may give it. Every answer CBC returns is re-checked in exact arithmetic; a tie-break answer that fails
  the check is dropped (``RuntimeWarning``) in favour of the previous stage's placement.

``solve_minimax`` replicates ModelOpt 0.47's ``AutoQuantizeKLDivSearcher.run_search_with_stats``
(threshold bisection on the per-group score, first format whose score is within the threshold) on
ModelOpt's candidate stats, for comparison. Formats are in ModelOpt's recipe order (compression ascending:
nvfp4_w4a16, fp8, bf16) with each score clamped to ``min(score, previous)``. Quirk kept: ModelOpt returns
the *last* bisection iterate, which misses the budget whenever the bisection ends on the float just below
the lowest feasible threshold (the midpoint of two adjacent floats rounds to either); ModelOpt only flags
``is_satisfied=False``, we set ``status="threshold_unsatisfied"``.
"""

from __future__ import annotations

import math
import operator
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pulp

__all__ = [
    "BUDGET_TOL",
    "FORMAT_BITS",
    "FRONTIER_POINTS",
    "OBJECTIVE_RTOL",
    "PlacementInfeasible",
    "PlacementSolution",
    "SearchGroup",
    "effective_bits",
    "frontier",
    "max_effective_bits",
    "min_effective_bits",
    "solve_ilp",
    "solve_minimax",
    "solve_placement",
]

FORMAT_BITS: dict[str, float] = {"nvfp4_w4a16": 4.5, "fp8": 8.0, "bf16": 16.0}
"""Effective bits per weight of each format; the key order (cheapest first) is the canonical format order."""

BUDGET_TOL = 1e-9
"""A placement fits a target when its effective bits are ``<= target + BUDGET_TOL``."""

OBJECTIVE_RTOL = 1e-12
"""Placements whose summed scores are within this relative distance of the optimum count as ties."""

FRONTIER_POINTS = 25
MINIMAX_ITERATIONS = 100  # ModelOpt's fixed bisection length

_ROW_SCALE = 1e4  # real-valued rows are scaled to ~1e4 so CBC's 1e-7 tolerance is ~1e-11 relative
_INT_ROW_MAX = 2**40  # largest integral budget row activity handed to CBC
_LEX_BLOCK = 18  # groups per lexicographic tie-break ILP: 3**18 < 2**30 keeps the objective exact
_CHECK_RTOL = 1e-10  # accepted drift of a re-solve's summed score from the optimum


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


# --------------------------------------------------------------------------------------------- helpers


def _check_groups(groups: Iterable[SearchGroup]) -> tuple[SearchGroup, ...]:
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
    if sum(_weight(g) for g in groups) <= 0:
        raise ValueError("total cost weight (sum of numel * cost_weight) is zero")
    return groups


def _check_target(target: float) -> float:
    target = float(target)
    if not math.isfinite(target):
        raise ValueError(f"target effective bits must be finite, got {target}")
    return target


def _weight(group: SearchGroup) -> Fraction:
    return Fraction(group.numel) * Fraction(group.cost_weight)


def _cost(group: SearchGroup, fmt: str) -> Fraction:
    return _weight(group) * Fraction(FORMAT_BITS[fmt])


def _total_weight(groups: Sequence[SearchGroup]) -> Fraction:
    return sum((_weight(g) for g in groups), Fraction(0))


def _choice_cost(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> Fraction:
    return sum((_cost(g, choice[g.name]) for g in groups), Fraction(0))


def _budget_limit(groups: Sequence[SearchGroup], target: float, tol: float = BUDGET_TOL) -> Fraction:
    """Largest feasible total cost, exactly."""
    return (Fraction(target) + Fraction(tol)) * _total_weight(groups)


def _objective(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> float:
    return math.fsum(g.scores[choice[g.name]] for g in groups)


def _check_choice(groups: Sequence[SearchGroup], choice: Mapping[str, str]) -> None:
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
    groups = _check_groups(groups)
    _check_choice(groups, choice)
    return float(_choice_cost(groups, choice) / _total_weight(groups))


def _cheapest(groups: Sequence[SearchGroup]) -> dict[str, str]:
    return {g.name: g.formats[0] for g in groups}


def min_effective_bits(groups: Iterable[SearchGroup]) -> float:
    """Effective bits with every group at its cheapest allowed format."""
    groups = _check_groups(groups)
    return effective_bits(groups, _cheapest(groups))


def max_effective_bits(groups: Iterable[SearchGroup]) -> float:
    """Effective bits with every group at its most expensive allowed format."""
    groups = _check_groups(groups)
    return effective_bits(groups, {g.name: g.formats[-1] for g in groups})


def _require_feasible(groups: Sequence[SearchGroup], target: float) -> None:
    if _choice_cost(groups, _cheapest(groups)) > _budget_limit(groups, target):
        minimum = min_effective_bits(groups)
        raise PlacementInfeasible(
            f"effective-bits target {target:.10g} is infeasible: the minimum achievable effective bits is "
            f"{minimum:.10g} (every group at its cheapest allowed format)",
            minimum,
            target,
        )


def _solution(
    groups: Sequence[SearchGroup], choice: dict[str, str], target: float, status: str, method: str
) -> PlacementSolution:
    return PlacementSolution(
        choice=choice,
        objective=_objective(groups, choice),
        effective_bits=effective_bits(groups, choice),
        target_effective_bits=target,
        status=status,
        method=method,
    )


# ------------------------------------------------------------------------------------------------- ILP

_Key = tuple[int, str]  # (group index, format)
_Row = tuple[dict[_Key, float], float]  # coefficients <= rhs


class _Cbc:
    """Builds and solves one-format-per-group binary programs with CBC, files in a private temp dir."""

    def __init__(self, n_groups: int, tmp_dir: str) -> None:
        self.n_groups = n_groups
        self.tmp_dir = tmp_dir

    def solve(
        self, alive: Sequence[_Key], objective: Mapping[_Key, float], rows: Sequence[_Row], *, increment: bool
    ) -> tuple[str, dict[int, str] | None]:
        """Minimise ``objective`` over the ``alive`` pairs subject to ``rows``; (status, group -> format)."""
        prob = pulp.LpProblem("placement", pulp.LpMinimize)
        fmt_index = {fmt: j for j, fmt in enumerate(FORMAT_BITS)}
        x = {key: prob.add_variable(f"x_{key[0]}_{fmt_index[key[1]]}", 0, 1, cat="Binary") for key in alive}
        prob += pulp.lpSum(objective[k] * v for k, v in x.items() if objective.get(k, 0))
        per_group: dict[int, list[pulp.LpVariable]] = {}
        for (i, _), var in x.items():
            per_group.setdefault(i, []).append(var)
        if len(per_group) != self.n_groups:
            raise RuntimeError("internal error: a group has no format left")
        for i in sorted(per_group):
            prob += pulp.lpSum(per_group[i]) == 1, f"one_{i}"
        for r, (coefs, rhs) in enumerate(rows):
            prob += pulp.lpSum(c * x[k] for k, c in coefs.items() if k in x and c) <= rhs, f"row_{r}"
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning
            )
            solver = pulp.PULP_CBC_CMD(
                msg=False,
                gapRel=0,
                gapAbs=0,
                threads=1,
                keepFiles=False,
                options=["increment 1e-12"] if increment else None,
            )
        solver.tmpDir = self.tmp_dir
        status = pulp.LpStatus[prob.solve(solver)]
        if status != "Optimal":
            return status, None
        picked: dict[int, str] = {}
        for (i, fmt), var in x.items():
            value = var.value()
            if value is not None and value > 0.5:
                if i in picked:
                    raise RuntimeError(f"CBC picked two formats for group {i}")
                picked[i] = fmt
        if len(picked) != self.n_groups:
            raise RuntimeError("CBC left a group without a format")
        return status, picked


class _Ilp:
    """The staged exact solve (see the module docstring)."""

    def __init__(self, groups: tuple[SearchGroup, ...], target: float, cbc: _Cbc) -> None:
        self.groups = groups
        self.target = target
        self.cbc = cbc
        self.keys: list[_Key] = [(i, f) for i, g in enumerate(groups) for f in g.formats]
        self.score = {(i, f): groups[i].scores[f] for i, f in self.keys}
        self.cost = {(i, f): _cost(groups[i], f) for i, f in self.keys}
        self.limit = _budget_limit(groups, target)
        # Integral costs when the exact rationals scale to moderate integers (always for dyadic weights).
        scale = math.lcm(*(c.denominator for c in self.cost.values()))
        ints = {k: int(c * scale) for k, c in self.cost.items()}
        divisor = math.gcd(*ints.values()) or 1
        ints = {k: v // divisor for k, v in ints.items()}
        top = sum(max(ints[(i, f)] for f in g.formats) for i, g in enumerate(groups))
        self.integral = top <= _INT_ROW_MAX
        self.int_cost = ints
        self.int_scale = Fraction(scale, divisor)  # exact cost * int_scale == integral cost
        if self.integral:
            self.budget_row: _Row = (
                {k: float(v) for k, v in ints.items()},
                float(math.floor(self.limit * self.int_scale)),
            )
        else:
            self.budget_row = (
                {k: float(c / self.limit) * _ROW_SCALE for k, c in self.cost.items()},
                _ROW_SCALE,
            )

    # -- exact checks
    def choice_of(self, picked: Mapping[int, str]) -> dict[str, str]:
        return {g.name: picked[i] for i, g in enumerate(self.groups)}

    def fits(self, choice: Mapping[str, str]) -> bool:
        cost = _choice_cost(self.groups, choice)
        if self.integral:
            return cost <= self.limit
        # Real-valued row: CBC's tolerance may overshoot the limit by ~1e-11 relative.
        return cost <= _budget_limit(self.groups, self.target, 2 * BUDGET_TOL)

    def score_row(self, alive: Sequence[_Key], optimum: float) -> list[_Row]:
        if optimum <= 0:
            return []  # every positive-score pair was pruned
        coefs = {k: self.score[k] / optimum * _ROW_SCALE for k in alive}
        return [(coefs, _ROW_SCALE * (1 + OBJECTIVE_RTOL))]

    def cost_row(self, alive: Sequence[_Key], cost: Fraction) -> _Row:
        if self.integral:
            return {k: float(self.int_cost[k]) for k in alive}, float(cost * self.int_scale)
        return {k: float(self.cost[k] / cost) * _ROW_SCALE for k in alive}, _ROW_SCALE * (1 + 1e-12)

    def greedy(self) -> dict[str, str]:
        """A feasible placement: from the cheapest formats, repeatedly take the upgrade that fits and buys
        the largest score decrease per extra bit (an upper bound on the optimum for scaling only)."""
        current = {i: g.formats[0] for i, g in enumerate(self.groups)}
        spare = self.limit - sum((self.cost[(i, f)] for i, f in current.items()), Fraction(0))
        while True:
            move, rate = None, 0.0
            for i, g in enumerate(self.groups):
                now = (i, current[i])
                for f in g.formats:
                    extra = self.cost[(i, f)] - self.cost[now]
                    gain = self.score[now] - self.score[(i, f)]
                    if gain > 0 and extra <= spare:
                        r = math.inf if extra <= 0 else gain / float(extra)
                        if r > rate:
                            move, rate = (i, f), r
            if move is None:
                return self.choice_of(current)
            spare -= self.cost[move] - self.cost[(move[0], current[move[0]])]
            current[move[0]] = move[1]

    def at_first_alive(self, choice: Mapping[str, str], alive: Sequence[_Key], groups: Iterable[int]) -> bool:
        """Whether each of ``groups`` has the first (cheapest) of its ``alive`` formats in ``choice``."""
        first: dict[int, str] = {}
        for i, f in alive:  # keys are in group order, formats cheapest first
            first.setdefault(i, f)
        return all(choice[self.groups[i].name] == first[i] for i in groups)

    # -- stages
    def minimise_score(self) -> tuple[str, dict[str, str]]:
        """A minimum summed score placement and CBC's status.

        Every score is divided by an upper bound ``U`` on the optimum and multiplied by ``_ROW_SCALE``
        (pairs whose score alone exceeds ``U`` are dropped), so CBC's absolute 1e-7 tolerances resolve
        ~1e-11 of ``U``. ``U`` starts as the score of a greedy placement; when the optimum found is below
        ``U / 2`` the solve is repeated with ``U`` = that optimum (at most twice).
        """
        best = self.greedy()
        upper = _objective(self.groups, best)
        status = "Optimal"  # a placement scoring 0 needs no proof
        for _ in range(3):
            if upper == 0:
                break
            alive = [k for k in self.keys if self.score[k] <= upper]
            objective = {k: self.score[k] / upper * _ROW_SCALE for k in alive}
            solved, picked = self.cbc.solve(alive, objective, [self.budget_row], increment=True)
            if picked is None:
                raise RuntimeError(f"CBC failed on a feasible placement problem: status {solved}")
            status = solved
            found = self.choice_of(picked)
            if not self.fits(found):
                raise RuntimeError("CBC returned a placement over the budget")
            found_score = _objective(self.groups, found)
            if found_score < _objective(self.groups, best):
                best = found
            if not found_score < upper / 2:
                break
            upper = found_score
        return status, best

    def acceptable(self, choice: Mapping[str, str], optimum: float, cost_cap: Fraction | None) -> bool:
        """Exact re-check of a tie-break answer: optimal score (to ``_CHECK_RTOL``), in budget, cost cap."""
        if _objective(self.groups, choice) > optimum * (1 + _CHECK_RTOL) or not self.fits(choice):
            return False
        return cost_cap is None or _choice_cost(self.groups, choice) <= cost_cap

    def run(self) -> tuple[str, dict[str, str]]:
        status, best = self.minimise_score()
        optimum = _objective(self.groups, best)
        # Pairs whose score alone exceeds the optimum cannot be part of an optimal placement.
        alive = [k for k in self.keys if self.score[k] <= optimum * (1 + OBJECTIVE_RTOL)]
        score_rows = self.score_row(alive, optimum)

        if self.at_first_alive(best, alive, range(len(self.groups))):
            # Every group has the cheapest format any optimal placement may give it: fewest bits and
            # lexicographically first already.
            return status, best

        # (1) Fewest bits among the optimal placements.
        if self.integral:
            cost_objective = {k: float(self.int_cost[k]) for k in alive}
        else:
            total = _total_weight(self.groups)
            cost_objective = {k: float(self.cost[k] / total) for k in alive}
        cbc_status, picked = self.cbc.solve(
            alive, cost_objective, [self.budget_row, *score_rows], increment=not self.integral
        )
        cheaper = None if picked is None else self.choice_of(picked)
        if cheaper is not None and self.acceptable(cheaper, optimum, None):
            if _choice_cost(self.groups, cheaper) <= _choice_cost(self.groups, best):
                best = cheaper
        else:
            _warn_fallback("fewest-bits", cbc_status)

        # (2) Lexicographically first placement among those (group order, cheapest format first), solved
        # for blocks of groups in turn with an integral objective, then fixed.
        cost = _choice_cost(self.groups, best)
        base = max(len(g.formats) for g in self.groups)
        n = len(self.groups)
        for start in range(0, n, _LEX_BLOCK):
            block = range(start, min(n, start + _LEX_BLOCK))
            rank = {(i, f): j for i in block for j, f in enumerate(self.groups[i].formats)}
            current = [rank[(i, best[self.groups[i].name])] for i in block]
            if not self.at_first_alive(best, alive, block):
                lex = {(i, f): float(r * base ** (block[-1] - i)) for (i, f), r in rank.items() if r}
                lex_status, picked = self.cbc.solve(
                    alive, lex, [self.cost_row(alive, cost), *score_rows], increment=False
                )
                first = None if picked is None else self.choice_of(picked)
                if first is not None and self.acceptable(first, optimum, cost):
                    if [rank[(i, first[self.groups[i].name])] for i in block] < current:
                        best = first
                else:
                    _warn_fallback("lexicographic", lex_status)
            fixed = {i: best[self.groups[i].name] for i in block}
            alive = [k for k in alive if k[0] not in fixed or fixed[k[0]] == k[1]]
        return status, best


def _warn_fallback(stage: str, status: str) -> None:
    warnings.warn(
        f"placement ILP: the {stage} tie-break answer (CBC status {status}) failed the exact re-check; "
        "kept the previous stage's placement",
        RuntimeWarning,
        stacklevel=3,
    )


def solve_ilp(groups: Iterable[SearchGroup], target_effective_bits: float) -> PlacementSolution:
    """Minimum summed score placement within the budget (exact; ties broken as the module docstring says)."""
    groups = _check_groups(groups)
    target = _check_target(target_effective_bits)
    _require_feasible(groups, target)
    with tempfile.TemporaryDirectory(prefix="mixquant-ilp-") as tmp_dir:
        status, choice = _Ilp(groups, target, _Cbc(len(groups), tmp_dir)).run()
    return _solution(groups, choice, target, status, "ilp")


# -------------------------------------------------------------------------------------------- minimax


def _modelopt_candidate_stats(groups: Sequence[SearchGroup]) -> list[dict[str, Any]]:
    """``initialize_candidate_stats``: formats by compression (bits) ascending, scores clamped monotone."""
    stats = []
    for group in groups:
        weight_size = group.numel * group.cost_weight  # _get_total_weight_size([module]) * cost_weight
        formats, scores, costs = [], [], []
        prev_score = float("inf")
        for fmt in group.formats:  # QuantRecipe order: (compression, signature) ascending
            score = min(group.scores[fmt], prev_score)
            formats.append(fmt)
            scores.append(score)
            costs.append(weight_size * (FORMAT_BITS[fmt] / 16))
            prev_score = score
        stats.append(
            {"formats": formats, "scores": scores, "costs": costs, "uncompressed_cost": weight_size * 1.0}
        )
    return stats


def _modelopt_threshold_search(
    stats: Sequence[dict[str, Any]], max_weight_size: float
) -> tuple[list[int], bool]:
    """``AutoQuantizeKLDivSearcher.run_search_with_stats``, statement for statement."""
    all_scores = [score for stat in stats for score in stat["scores"]]
    min_score, max_score = min(all_scores), max(all_scores)
    threshold = (min_score + max_score) / 2.0
    lower_bound, upper_bound = min_score, max_score
    selected: list[int] = []
    total_weight_size = 0.0
    for _ in range(MINIMAX_ITERATIONS):
        selected, total_weight_size = [], 0.0
        for stat in stats:
            selected_idx = 0
            for idx, score in enumerate(stat["scores"]):
                if score <= threshold:
                    selected_idx = idx
                    break
            selected.append(selected_idx)
            total_weight_size += stat["costs"][selected_idx]
        if total_weight_size <= max_weight_size:
            upper_bound = threshold
        else:
            lower_bound = threshold
        threshold = (lower_bound + upper_bound) / 2.0
    return selected, total_weight_size <= max_weight_size


def solve_minimax(groups: Iterable[SearchGroup], target_effective_bits: float) -> PlacementSolution:
    """ModelOpt 0.47's KL-div threshold search (minimise the largest per-group score), replicated exactly.

    Like ModelOpt, the answer is the last bisection iteration's placement even when that one misses the
    budget; ``status`` is then ``"threshold_unsatisfied"`` instead of ``"threshold"`` -- ModelOpt's
    ``is_satisfied``, its float comparison of summed costs (so a placement exactly on the target can read
    unsatisfied). ``objective`` sums the raw (unclamped) scores of the chosen formats. Unlike ModelOpt,
    targets above 16 bits are accepted.
    """
    groups = _check_groups(groups)
    target = _check_target(target_effective_bits)
    _require_feasible(groups, target)
    stats = _modelopt_candidate_stats(groups)
    total_weight_size = 0
    for stat in stats:  # _get_total_weight_size_from_candidate_stats
        total_weight_size += stat["uncompressed_cost"]
    max_weight_size = total_weight_size * (target / 16.0)
    selected, satisfied = _modelopt_threshold_search(stats, max_weight_size)
    choice = {g.name: stat["formats"][idx] for g, stat, idx in zip(groups, stats, selected, strict=True)}
    return _solution(groups, choice, target, "threshold" if satisfied else "threshold_unsatisfied", "minimax")


# ------------------------------------------------------------------------------------------- dispatch


def solve_placement(
    groups: Iterable[SearchGroup], target_effective_bits: float, method: str = "ilp"
) -> PlacementSolution:
    """Solve with ``method`` ("ilp" or "minimax"); raises ``PlacementInfeasible`` below the minimum bits."""
    solvers = {"ilp": solve_ilp, "minimax": solve_minimax}
    if method not in solvers:
        raise ValueError(f"unknown placement method {method!r}; expected one of {sorted(solvers)}")
    groups = _check_groups(groups)
    target = _check_target(target_effective_bits)
    _require_feasible(groups, target)
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
    groups = _check_groups(groups)
    if budgets is None:
        budgets = _grid(min_effective_bits(groups), max_effective_bits(groups), FRONTIER_POINTS)
    rows = []
    for target in sorted({_check_target(b) for b in budgets}):
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
