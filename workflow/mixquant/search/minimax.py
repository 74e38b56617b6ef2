"""ModelOpt's placement, for comparison: the largest per-group score minimised by threshold bisection.

``solve_minimax`` replicates ModelOpt 0.47's ``AutoQuantizeKLDivSearcher.run_search_with_stats``
(threshold bisection on the per-group score, first format whose score is within the threshold) on
ModelOpt's candidate stats, for comparison. Formats are in ModelOpt's recipe order (compression ascending:
nvfp4_w4a16, fp8, bf16) with each score clamped to ``min(score, previous)``. Quirk kept: ModelOpt returns
the *last* bisection iterate, which misses the budget whenever the bisection ends on the float just below
the lowest feasible threshold (the midpoint of two adjacent floats rounds to either); ModelOpt only flags
``is_satisfied=False``, we set ``status="threshold_unsatisfied"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mixquant.search.groups import (
    FORMAT_BITS,
    PlacementSolution,
    SearchGroup,
    checked_groups,
    checked_target,
    make_solution,
    require_feasible,
)

MINIMAX_ITERATIONS = 100  # ModelOpt's fixed bisection length


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
    groups = checked_groups(groups)
    target = checked_target(target_effective_bits)
    require_feasible(groups, target)
    stats = _modelopt_candidate_stats(groups)
    total_weight_size = 0
    for stat in stats:  # _get_total_weight_size_from_candidate_stats
        total_weight_size += stat["uncompressed_cost"]
    max_weight_size = total_weight_size * (target / 16.0)
    selected, satisfied = _modelopt_threshold_search(stats, max_weight_size)
    choice = {g.name: stat["formats"][idx] for g, stat, idx in zip(groups, stats, selected, strict=True)}
    return make_solution(
        groups, choice, target, "threshold" if satisfied else "threshold_unsatisfied", "minimax"
    )
