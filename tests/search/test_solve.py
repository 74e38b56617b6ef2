"""Placement solvers: ILP optimality vs enumeration, tie-breaking, frontier, ModelOpt minimax equivalence."""

from __future__ import annotations

import itertools
import json
import math
import random
import warnings
from collections import defaultdict
from fractions import Fraction

import pytest
from mixquant.search.groups import (
    BUDGET_TOL,
    FORMAT_BITS,
    PlacementInfeasible,
    PlacementSolution,
    SearchGroup,
    effective_bits,
    max_effective_bits,
    min_effective_bits,
)
from mixquant.search.ilp import solve_ilp
from mixquant.search.minimax import solve_minimax
from mixquant.search.solve import FRONTIER_POINTS, frontier, solve_placement

FORMATS = list(FORMAT_BITS)
NV, FP8, BF16 = FORMATS


def _random_score(rng: random.Random, fmt: str) -> float:
    if fmt == BF16:
        return 0.0
    r = rng.random()
    if r < 0.15:
        return 0.0
    if r < 0.35:
        return rng.choice([0.25, 0.5, 1.0])  # exact ties across groups and formats
    if r < 0.6:
        return 10 ** rng.uniform(-8, 0)  # scores many orders of magnitude apart
    return rng.random()


def _random_groups(rng: random.Random, n: int) -> list[SearchGroup]:
    groups = []
    for i in range(n):
        formats = sorted(rng.sample(FORMATS, rng.choice([1, 2, 2, 3, 3, 3])), key=FORMATS.index)
        scores = {f: _random_score(rng, f) for f in formats}
        numel = rng.choice([16, 48, 1000, 4096, rng.randint(1, 10**6)])
        weight = rng.choice([1.0, 1.0, 0.125, 0.37, 1 / 3])  # dyadic (integral row) and not (real row)
        groups.append(SearchGroup(f"model.layers.{i}.mlp.experts", numel, scores, weight))
    return groups


def _exhaustive(groups: list[SearchGroup], target: float) -> tuple[float, dict[str, str]]:
    """Optimum by enumeration, ties (1e-12 relative) broken by fewer bits then lexicographic ranks."""
    weights = [Fraction(g.numel) * Fraction(g.cost_weight) for g in groups]
    limit = (Fraction(target) + Fraction(BUDGET_TOL)) * sum(weights)
    feasible = []
    for combo in itertools.product(*(g.formats for g in groups)):
        cost = sum(w * Fraction(FORMAT_BITS[f]) for w, f in zip(weights, combo, strict=True))
        if cost <= limit:
            score = math.fsum(g.scores[f] for g, f in zip(groups, combo, strict=True))
            ranks = [g.formats.index(f) for g, f in zip(groups, combo, strict=True)]
            feasible.append((score, cost, ranks, combo))
    optimum = min(c[0] for c in feasible)
    best = min((c for c in feasible if c[0] <= optimum * (1 + 1e-12)), key=lambda c: (c[1], c[2]))
    return optimum, {g.name: f for g, f in zip(groups, best[3], strict=True)}


def _targets(rng: random.Random, groups: list[SearchGroup]) -> list[float]:
    lo, hi = min_effective_bits(groups), max_effective_bits(groups)
    return [rng.choice([lo, hi, rng.uniform(lo, hi)]), rng.uniform(lo, hi)]


# ------------------------------------------------------------------------------------------ basics


def test_search_group_validates_and_orders_formats() -> None:
    group = SearchGroup("g", 10, {BF16: 0, NV: 0.5, FP8: 0.1})
    assert list(group.scores) == [NV, FP8, BF16] and group.formats == (NV, FP8, BF16)
    assert FORMAT_BITS == {"nvfp4_w4a16": 4.5, "fp8": 8.0, "bf16": 16.0}
    with pytest.raises(ValueError, match="unknown formats"):
        SearchGroup("g", 10, {"int4": 1.0})
    with pytest.raises(ValueError, match="finite and >= 0"):
        SearchGroup("g", 10, {NV: -1e-3})
    with pytest.raises(ValueError, match="no allowed format"):
        SearchGroup("g", 10, {})
    with pytest.raises(ValueError, match="numel"):
        SearchGroup("g", 0, {NV: 1.0})
    with pytest.raises(ValueError, match="duplicate"):
        solve_ilp([SearchGroup("g", 1, {NV: 1.0}), SearchGroup("g", 1, {NV: 1.0})], 16)


def test_effective_bits_weighted() -> None:
    groups = [
        SearchGroup("a", 100, {NV: 1.0, BF16: 0.0}),
        SearchGroup("b", 300, {FP8: 1.0, BF16: 0.0}, cost_weight=0.5),
    ]
    assert effective_bits(groups, {"a": NV, "b": FP8}) == (100 * 4.5 + 150 * 8) / 250
    assert min_effective_bits(groups) == (100 * 4.5 + 150 * 8) / 250
    assert max_effective_bits(groups) == 16.0
    with pytest.raises(ValueError, match="not allowed"):
        effective_bits(groups, {"a": FP8, "b": FP8})
    with pytest.raises(ValueError, match="lacks"):
        effective_bits(groups, {"a": NV})


# ------------------------------------------------------------------------------------------ ILP


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no tie-break stage may fall back
def test_ilp_matches_exhaustive_enumeration() -> None:
    rng = random.Random(20240611)
    checked = 0
    for _ in range(40):
        groups = _random_groups(rng, rng.randint(2, 7))
        for target in _targets(rng, groups):
            sol = solve_ilp(groups, target)
            optimum, expected = _exhaustive(groups, target)
            assert sol.method == "ilp" and sol.status == "Optimal"
            assert sol.effective_bits <= target + BUDGET_TOL
            assert sol.effective_bits == effective_bits(groups, sol.choice)
            assert sol.objective == math.fsum(g.scores[sol.choice[g.name]] for g in groups)
            assert sol.objective <= optimum * (1 + 1e-9), (groups, target)
            assert sol.choice == expected, (groups, target)  # same optimum *and* same tie-break
            checked += 1
    assert checked == 80


def _dp_optimum(groups: list[SearchGroup], target: float) -> float:
    """Exact optimum by dynamic programming over integral costs (2*bits*numel, cost weight 1)."""
    limit = math.floor((Fraction(target) + Fraction(BUDGET_TOL)) * 2 * sum(g.numel for g in groups))
    best = {0: 0.0}
    for g in groups:
        nxt: dict[int, float] = {}
        for cost, score in best.items():
            for fmt, s in g.scores.items():
                c = cost + int(2 * FORMAT_BITS[fmt]) * g.numel
                if c <= limit and (c not in nxt or score + s < nxt[c]):
                    nxt[c] = score + s
        best = nxt
    return min(best.values())


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_ilp_matches_dynamic_programming_at_model_size() -> None:
    rng = random.Random(7)
    for _ in range(6):
        groups = []
        for i in range(47):
            base = 10 ** rng.uniform(-4, -1)
            scores = {NV: base, FP8: base * rng.uniform(0.01, 0.5), BF16: 0.0}
            if rng.random() < 0.3:
                scores = {k: round(v, 3) for k, v in scores.items()}  # many exact ties
            if rng.random() < 0.1:
                scores = {rng.choice(FORMATS): scores[NV]}  # pinned
            groups.append(SearchGroup(f"model.layers.{i}.mlp.experts", rng.choice([1, 2, 3]), scores))
        target = rng.uniform(min_effective_bits(groups), max_effective_bits(groups))
        sol = solve_ilp(groups, target)
        reference = _dp_optimum(groups, target)
        assert sol.effective_bits <= target + BUDGET_TOL
        assert abs(sol.objective - reference) <= 1e-9 * reference


def test_ilp_objective_monotone_in_budget() -> None:
    rng = random.Random(3)
    groups = _random_groups(rng, 9)
    lo, hi = min_effective_bits(groups), max_effective_bits(groups)
    budgets = sorted([lo, hi, *(rng.uniform(lo, hi) for _ in range(10))])
    objectives = [solve_ilp(groups, b).objective for b in budgets]
    for smaller, larger in itertools.pairwise(objectives):
        assert larger <= smaller * (1 + 1e-12)
    assert objectives[0] > objectives[-1]


def test_infeasible_budget_raises_with_minimum() -> None:
    groups = [SearchGroup("a", 100, {FP8: 0.1, BF16: 0.0}), SearchGroup("b", 100, {NV: 0.3, BF16: 0.0})]
    minimum = min_effective_bits(groups)
    assert minimum == 6.25
    for solver in (solve_ilp, solve_minimax, solve_placement):
        with pytest.raises(PlacementInfeasible) as info:
            solver(groups, 6.0)
        assert "target 6 is infeasible" in str(info.value) and "effective bits is 6.25" in str(info.value)
        assert info.value.minimum_effective_bits == minimum and info.value.target_effective_bits == 6.0
        assert isinstance(info.value, ValueError)
    # Within the tolerance is feasible; a target below every budget is skipped by the frontier.
    assert solve_ilp(groups, minimum - 0.5 * BUDGET_TOL).choice == {"a": FP8, "b": NV}
    assert frontier(groups, [1.0, 6.0]) == []


def test_pinned_groups_keep_their_format() -> None:
    groups = [
        SearchGroup("pinned_bf16", 100, {BF16: 0.0}),
        SearchGroup("free", 100, {NV: 1.0, FP8: 0.5, BF16: 0.0}),
        SearchGroup("pinned_nv", 100, {NV: 5.0}),
    ]
    tight = min_effective_bits(groups)
    for target in (tight, 10.0, 16.0):
        for method in ("ilp", "minimax"):
            sol = solve_placement(groups, target, method)
            assert sol.choice["pinned_bf16"] == BF16 and sol.choice["pinned_nv"] == NV
    assert solve_ilp(groups, tight).choice["free"] == NV
    assert solve_ilp(groups, 16.0).choice["free"] == BF16


def test_ties_break_to_fewer_bits_then_earlier_groups() -> None:
    same = {NV: 1.0, FP8: 0.5, BF16: 0.0}
    groups = [SearchGroup(f"g{i}", 100, same) for i in range(4)]
    # Room for exactly one FP8 group: all four placements tie; the last group takes it.
    sol = solve_ilp(groups, (3 * 4.5 + 8) / 4)
    assert sol.choice == {"g0": NV, "g1": NV, "g2": NV, "g3": FP8}
    # Equal scores at different bits: the cheaper format, however generous the budget.
    flat = [SearchGroup("z", 10, {NV: 0.0, FP8: 0.0, BF16: 0.0}), SearchGroup("y", 10, {FP8: 0.2, BF16: 0.2})]
    assert solve_ilp(flat, 16.0).choice == {"z": NV, "y": FP8}
    assert solve_ilp(flat, 16.0).effective_bits == (4.5 + 8) / 2
    # Scores within 1e-12 relative count as tied; the order scores are given in does not matter.
    near = [
        SearchGroup("p", 10, {BF16: 0.0, FP8: 0.3, NV: 0.7}),
        SearchGroup("q", 10, {NV: 0.7 * (1 + 1e-13), FP8: 0.3, BF16: 0.0}),
    ]
    first = solve_ilp(near, (4.5 + 8) / 2)
    assert first.choice == {"p": NV, "q": FP8}
    assert all(solve_ilp(near, (4.5 + 8) / 2) == first for _ in range(3))


def test_all_zero_scores_pick_cheapest() -> None:
    groups = [SearchGroup(f"g{i}", 64, {NV: 0.0, FP8: 0.0, BF16: 0.0}) for i in range(5)]
    sol = solve_ilp(groups, 16.0)
    assert sol.choice == {f"g{i}": NV for i in range(5)} and sol.objective == 0.0
    assert sol.status == "Optimal"


def test_ilp_writes_no_files_in_cwd(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    groups = _random_groups(random.Random(5), 6)
    solve_ilp(groups, max_effective_bits(groups))
    assert list(tmp_path.iterdir()) == []


def test_solution_to_json_and_dispatch() -> None:
    groups = [SearchGroup("a", 10, {NV: 1.0, FP8: 0.2, BF16: 0.0}), SearchGroup("b", 30, {NV: 0.1, FP8: 0.0})]
    sol = solve_placement(groups, 7.0)
    assert isinstance(sol, PlacementSolution)
    data = json.loads(json.dumps(sol.to_json()))
    assert data["choice"] == sol.choice and data["method"] == "ilp" and data["status"] == "Optimal"
    assert data["counts"] == {NV: 1, FP8: 1, BF16: 0} and sol.counts() == data["counts"]
    assert data["target_effective_bits"] == 7.0 and data["effective_bits"] == sol.effective_bits
    assert solve_placement(groups, 7.0, method="minimax").method == "minimax"
    with pytest.raises(ValueError, match="unknown placement method"):
        solve_placement(groups, 7.0, method="greedy")


# -------------------------------------------------------------------------------------- frontier


def test_frontier_rows_monotone_and_match_solve() -> None:
    groups = _random_groups(random.Random(11), 8)
    lo, hi = min_effective_bits(groups), max_effective_bits(groups)
    rows = frontier(groups)
    assert len(rows) == FRONTIER_POINTS
    assert rows[0]["target_effective_bits"] == lo and rows[-1]["target_effective_bits"] == hi
    keys = {"target_effective_bits", "effective_bits", "objective", "status", *FORMATS}
    for row in rows:
        assert set(row) == keys and row["status"] == "Optimal"
        assert row["effective_bits"] <= row["target_effective_bits"] + BUDGET_TOL
        assert sum(row[f] for f in FORMATS) == len(groups)
    targets = [r["target_effective_bits"] for r in rows]
    assert targets == sorted(targets)
    for a, b in itertools.pairwise(rows):
        assert b["objective"] <= a["objective"] * (1 + 1e-12)
    chosen = rows[7]["target_effective_bits"]
    sol = solve_ilp(groups, chosen)
    point = frontier(groups, [chosen, lo - 1.0])
    assert len(point) == 1
    assert point[0]["objective"] == sol.objective and point[0]["effective_bits"] == sol.effective_bits
    assert {f: point[0][f] for f in FORMATS} == sol.counts() and point[0] == rows[7]
    minimax = frontier(groups, [chosen], method="minimax")
    assert minimax[0]["status"].startswith("threshold") and minimax[0]["objective"] >= sol.objective


# ------------------------------------------------------------------------------ ModelOpt minimax

_RECIPES = {NV: "W4A16_NVFP4_CFG", FP8: "FP8_DEFAULT_CFG", BF16: None}


@pytest.fixture(scope="module")
def modelopt_algorithms():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization.algorithms")


def _modelopt_minimax(alg, monkeypatch, groups: list[SearchGroup], target: float) -> tuple[dict, bool]:
    """ModelOpt's own ``initialize_candidate_stats`` + ``run_search_with_stats`` on stub hparams."""
    recipe = {f: alg.QuantRecipe(quant_cfg=_RECIPES[f]) for f in FORMATS}
    fmt_of = {r: f for f, r in recipe.items()}

    class StubHparam(alg.QuantRecipeHparam):
        def __init__(self, group: SearchGroup) -> None:  # no modules: scores and costs come from the group
            self.group = group
            self.cost_weight = group.cost_weight
            self.allow_no_quant = BF16 in group.scores
            self.is_fixed = len(group.scores) == 1
            self.quant_module_names = [group.name]
            self.quant_module_replay_attrs = {}

        @property
        def solver_choices(self):
            return sorted({recipe[f] for f in self.group.scores})  # as QuantRecipeHparam.__init__ sorts

        def get_score(self, r) -> float:
            return self.group.scores[fmt_of[r]]

        def get_cost(self, r, cost_weight=None) -> float:
            weight_size = self.group.numel * (self.cost_weight if cost_weight is None else cost_weight)
            cost = 0
            cost += weight_size * r.compression
            return cost

    monkeypatch.setattr(
        alg, "named_hparams", lambda model, unique=True: [(g.name, StubHparam(g)) for g in groups]
    )
    searcher = alg.AutoQuantizeKLDivSearcher()
    searcher.model = None
    searcher.candidate_stats = defaultdict(dict)
    searcher.initialize_candidate_stats()
    total = searcher._get_total_weight_size_from_candidate_stats(searcher.candidate_stats)
    best, satisfied = searcher.run_search_with_stats(total * (target / 16.0))
    return {name: fmt_of[info["format"]] for name, info in best.items()}, satisfied


def test_modelopt_orders_formats_by_bits(modelopt_algorithms) -> None:
    recipes = {f: modelopt_algorithms.QuantRecipe(quant_cfg=_RECIPES[f]) for f in FORMATS}
    assert [r.compression * 16 for r in sorted(recipes.values())] == [4.5, 8.0, 16.0]
    assert sorted(recipes.values()) == [recipes[f] for f in FORMATS]


def test_minimax_matches_modelopt(modelopt_algorithms, monkeypatch) -> None:
    rng = random.Random(99)
    unsatisfied = 0
    for _ in range(40):
        groups = _random_groups(rng, rng.randint(1, 12))
        for target in _targets(rng, groups):
            target = min(target, 16.0)  # ModelOpt asserts effective_bits <= 16
            sol = solve_minimax(groups, target)
            expected, satisfied = _modelopt_minimax(modelopt_algorithms, monkeypatch, groups, target)
            assert sol.choice == expected, (groups, target)
            assert sol.status == ("threshold" if satisfied else "threshold_unsatisfied")
            assert sol.method == "minimax"
            unsatisfied += not satisfied
    assert unsatisfied > 0  # the quirk below is common, and replicated


def test_minimax_can_exceed_budget_like_modelopt(modelopt_algorithms, monkeypatch) -> None:
    # Bisection converges to adjacent floats around the feasible threshold 0.075 (b at FP8); the midpoint
    # rounds to the lower, infeasible one, and ModelOpt returns that last iterate: b goes to BF16.
    groups = [
        SearchGroup("a", 100, {NV: 0.1, FP8: 0.025, BF16: 0.0}),
        SearchGroup("b", 100, {NV: 0.3, FP8: 0.075, BF16: 0.0}),
    ]
    sol = solve_minimax(groups, 8.0)
    assert sol.choice == {"a": FP8, "b": BF16} and sol.effective_bits == 12.0
    assert sol.status == "threshold_unsatisfied"
    assert _modelopt_minimax(modelopt_algorithms, monkeypatch, groups, 8.0) == (sol.choice, False)
    assert solve_ilp(groups, 8.0).choice == {"a": FP8, "b": FP8}  # what fits 8 bits: summed 0.1
