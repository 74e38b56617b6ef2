"""What a config means, before anything runs: the pure functions every planner reads.

The model's MoE layers, pins, the explicit placement, the scored formats, where each stage computes, the
source's FP8 block, the planning geometry (:mod:`mixquant.facts.geometry`) and the score-job sizing
(:mod:`mixquant.facts.jobs`). Nothing here reads a stage's output or knows about clusters: the artifact
graph, the cost model and the planning checks import it.
"""

from mixquant.facts.geometry import (
    FALLBACK_REQUEST,
    Geometry,
    geometry_from_hf_config,
    geometry_missing_line,
    model_geometry,
    planning_geometry,
    planning_model_config,
    source_fp8_block,
    toy_geometry,
)
from mixquant.facts.jobs import STACK_LIMIT, fitted_macro_batch, score_jobs, score_macro_batch, scored_pairs
from mixquant.facts.layers import (
    SCORED,
    compute_device,
    explicit_placement,
    moe_layers,
    placement_from_config,
    placement_pins,
    quantize_window,
    quantize_windows,
    scored_formats,
)

__all__ = [
    "FALLBACK_REQUEST",
    "SCORED",
    "STACK_LIMIT",
    "Geometry",
    "compute_device",
    "explicit_placement",
    "fitted_macro_batch",
    "geometry_from_hf_config",
    "geometry_missing_line",
    "model_geometry",
    "moe_layers",
    "placement_from_config",
    "placement_pins",
    "planning_geometry",
    "planning_model_config",
    "quantize_window",
    "quantize_windows",
    "score_jobs",
    "score_macro_batch",
    "scored_formats",
    "scored_pairs",
    "source_fp8_block",
    "toy_geometry",
]
