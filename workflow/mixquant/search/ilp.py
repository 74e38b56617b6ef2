"""The exact placement: the minimum summed score within the budget.

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
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

import pulp

from mixquant.search.groups import (
    BUDGET_TOL,
    FORMAT_BITS,
    OBJECTIVE_RTOL,
    PlacementInfeasible,
    PlacementSolution,
    SearchGroup,
    budget_limit,
    checked_groups,
    checked_target,
    choice_cost,
    group_cost,
    make_solution,
    require_feasible,
    summed_score,
    total_weight,
)

_ROW_SCALE = 1e4  # real-valued rows are scaled to ~1e4 so CBC's 1e-7 tolerance is ~1e-11 relative
_INT_ROW_MAX = 2**40  # largest integral budget row activity handed to CBC
_LEX_BLOCK = 18  # groups per lexicographic tie-break ILP: 3**18 < 2**30 keeps the objective exact
_CHECK_RTOL = 1e-10  # accepted drift of a re-solve's summed score from the optimum


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

    def __init__(
        self,
        groups: tuple[SearchGroup, ...],
        target: float,
        cbc: _Cbc,
        excluded: Sequence[Mapping[str, str]] = (),
    ) -> None:
        self.groups = groups
        self.target = target
        self.cbc = cbc
        self.keys: list[_Key] = [(i, f) for i, g in enumerate(groups) for f in g.formats]
        self.score = {(i, f): groups[i].scores[f] for i, f in self.keys}
        self.cost = {(i, f): group_cost(groups[i], f) for i, f in self.keys}
        self.limit = budget_limit(groups, target)
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
        # no-good cuts: each excluded placement (group name -> format) differs from the answer somewhere
        index = {g.name: i for i, g in enumerate(groups)}
        self.excluded = [dict(choice) for choice in excluded]
        self.exclusion_rows: list[_Row] = [
            ({(index[name], fmt): 1.0 for name, fmt in choice.items()}, float(len(groups) - 1))
            for choice in self.excluded
        ]

    def solve(
        self, alive: Sequence[_Key], objective: Mapping[_Key, float], rows: Sequence[_Row], *, increment: bool
    ) -> tuple[str, dict[int, str] | None]:
        """CBC on ``rows`` and the exclusion cuts."""
        return self.cbc.solve(alive, objective, [*rows, *self.exclusion_rows], increment=increment)

    # -- exact checks
    def choice_of(self, picked: Mapping[int, str]) -> dict[str, str]:
        return {g.name: picked[i] for i, g in enumerate(self.groups)}

    def fits(self, choice: Mapping[str, str]) -> bool:
        cost = choice_cost(self.groups, choice)
        if self.integral:
            return cost <= self.limit
        # Real-valued row: CBC's tolerance may overshoot the limit by ~1e-11 relative.
        return cost <= budget_limit(self.groups, self.target, 2 * BUDGET_TOL)

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
        upper = summed_score(self.groups, best)
        status = "Optimal"  # a placement scoring 0 needs no proof
        if self.excluded:
            # the greedy placement may be excluded, and the best one left may score above it: bound by the
            # worst placement instead, and keep only what CBC finds
            upper = sum(max(g.scores.values()) for g in self.groups)
            best = None
        for _ in range(3):
            if upper == 0 and best is not None:
                break
            alive = [k for k in self.keys if self.score[k] <= upper]
            scale = upper if upper > 0 else 1.0
            objective = {k: self.score[k] / scale * _ROW_SCALE for k in alive}
            solved, picked = self.solve(alive, objective, [self.budget_row], increment=True)
            if picked is None and best is None:
                raise PlacementInfeasible(f"no placement left within the budget (CBC status {solved})")
            if picked is None:
                raise RuntimeError(f"CBC failed on a feasible placement problem: status {solved}")
            status = solved
            found = self.choice_of(picked)
            if not self.fits(found):
                raise RuntimeError("CBC returned a placement over the budget")
            found_score = summed_score(self.groups, found)
            if best is None or found_score < summed_score(self.groups, best):
                best = found
            if not found_score < upper / 2:
                break
            upper = found_score
        return status, best

    def acceptable(self, choice: Mapping[str, str], optimum: float, cost_cap: Fraction | None) -> bool:
        """Exact re-check of a tie-break answer: optimal score (to ``_CHECK_RTOL``), in budget, cost cap,
        not excluded."""
        if summed_score(self.groups, choice) > optimum * (1 + _CHECK_RTOL) or not self.fits(choice):
            return False
        if any(dict(choice) == excluded for excluded in self.excluded):
            return False
        return cost_cap is None or choice_cost(self.groups, choice) <= cost_cap

    def run(self) -> tuple[str, dict[str, str]]:
        status, best = self.minimise_score()
        optimum = summed_score(self.groups, best)
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
            total = total_weight(self.groups)
            cost_objective = {k: float(self.cost[k] / total) for k in alive}
        cbc_status, picked = self.solve(
            alive, cost_objective, [self.budget_row, *score_rows], increment=not self.integral
        )
        cheaper = None if picked is None else self.choice_of(picked)
        if cheaper is not None and self.acceptable(cheaper, optimum, None):
            if choice_cost(self.groups, cheaper) <= choice_cost(self.groups, best):
                best = cheaper
        else:
            _warn_fallback("fewest-bits", cbc_status)

        # (2) Lexicographically first placement among those (group order, cheapest format first), solved
        # for blocks of groups in turn with an integral objective, then fixed.
        cost = choice_cost(self.groups, best)
        base = max(len(g.formats) for g in self.groups)
        n = len(self.groups)
        for start in range(0, n, _LEX_BLOCK):
            block = range(start, min(n, start + _LEX_BLOCK))
            rank = {(i, f): j for i in block for j, f in enumerate(self.groups[i].formats)}
            current = [rank[(i, best[self.groups[i].name])] for i in block]
            if not self.at_first_alive(best, alive, block):
                lex = {(i, f): float(r * base ** (block[-1] - i)) for (i, f), r in rank.items() if r}
                lex_status, picked = self.solve(
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
    groups = checked_groups(groups)
    target = checked_target(target_effective_bits)
    require_feasible(groups, target)
    with tempfile.TemporaryDirectory(prefix="mixquant-ilp-") as tmp_dir:
        status, choice = _Ilp(groups, target, _Cbc(len(groups), tmp_dir)).run()
    return make_solution(groups, choice, target, status, "ilp")


def k_best_ilp(
    groups: Iterable[SearchGroup], target_effective_bits: float, k: int
) -> list[PlacementSolution]:
    """The ``k`` placements of lowest summed score within the budget, best first (fewer when fewer exist).

    The first is :func:`solve_ilp`'s; each next one is the exact optimum with every earlier one excluded by
    a no-good cut (``sum_i x[i, f_i] <= n - 1``), ties broken the same way. Each answer is re-checked in
    exact arithmetic (in budget, distinct)."""
    groups = checked_groups(groups)
    target = checked_target(target_effective_bits)
    require_feasible(groups, target)
    solutions: list[PlacementSolution] = []
    with tempfile.TemporaryDirectory(prefix="mixquant-ilp-") as tmp_dir:
        for _ in range(int(k)):
            excluded = [s.choice for s in solutions]
            try:
                status, choice = _Ilp(groups, target, _Cbc(len(groups), tmp_dir), excluded).run()
            except PlacementInfeasible:
                break
            if choice in excluded:
                raise RuntimeError("placement ILP: the k-best solve returned an excluded placement")
            solutions.append(make_solution(groups, choice, target, status, "ilp"))
    return solutions
