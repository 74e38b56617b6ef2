"""The rebuild's artifacts: activation statistics, the quantize_layer windows, the placement search
(score_sensitivity, solve_placement) and the exported checkpoint."""

from __future__ import annotations

from typing import Any

from mixquant.config import MixquantConfig
from mixquant.facts import moe_layers, placement_pins, quantize_window, score_jobs, scored_formats
from mixquant.formats.facts import BF16, FP8, NVFP4
from mixquant.graph.artifact import GraphBuilder
from mixquant.graph.inputs import add_holdout, tokenizer_identity
from mixquant.producer import default_producer


def layer_artifact_name(cfg: MixquantConfig, layer: int, fmt: str) -> str:
    """The quantize_layer artifact holding MoE ``layer`` in ``fmt``: its window's job in that format."""
    window = quantize_window(cfg, layer)
    return f"layers/{fmt}/{window[0]}-{window[-1]}"


def add_activations(graph: GraphBuilder) -> None:
    batch = {"batch_size": graph.cfg.quantize.activation_batch_size}
    graph.add(
        "activations",
        "collect_activation_stats",
        batch,
        batch,
        {"model": "model", "calibration": "calibration"},
    )


def add_expert_inputs(graph: GraphBuilder) -> None:
    """collect_expert_inputs: the calibration tokens each routed expert received (for GPTQ rounding), on
    the activation statistics' batches."""
    batch = {"batch_size": graph.cfg.quantize.activation_batch_size}
    graph.add(
        "expert_inputs",
        "collect_expert_inputs",
        batch,
        batch,
        {"model": "model", "calibration": "calibration"},
    )


def gptq_rounding(cfg: MixquantConfig) -> bool:
    """Whether the NVFP4 rebuild rounds with GPTQ (and so reads the experts' calibration inputs)."""
    return cfg.quantize.nvfp4_w4a16.rounding == "gptq"


def rebuild_params(cfg: MixquantConfig, fmt: str) -> dict[str, Any]:
    """The ``quantize`` settings of one format (what quantize_layer ships)."""
    return {
        NVFP4: cfg.quantize.nvfp4_w4a16.rebuild_params(),
        FP8: cfg.quantize.fp8.model_dump(mode="json"),
        BF16: {},
    }[fmt]


def add_layer(graph: GraphBuilder, layer: int, fmt: str) -> str:
    """The quantize_layer artifact holding ``layer`` in ``fmt`` (added once, shared by every consumer).

    One job per (format, window of MoE layers): it quantizes every layer of its window in that format,
    needed by this plan or not, so its key -- the format, that format's params, the window's layers, the
    model (for FP8 W8A8 the activation statistics, for GPTQ rounding the experts' calibration inputs) -- is
    exactly the union of what its layer x
    format results depend on, and never the placement. A new placement or budget therefore reuses every
    window already computed, and an NVFP4 knob moves only NVFP4 windows.
    """
    cfg = graph.cfg
    name = layer_artifact_name(cfg, layer, fmt)
    if name not in graph.artifacts:
        window_slice = {
            "format": fmt,
            "layers": quantize_window(cfg, layer),
            "params": rebuild_params(cfg, fmt),
        }
        upstream = {"model": "model", **({"activations": "activations"} if fmt == FP8 else {})}
        if fmt == NVFP4 and gptq_rounding(cfg):
            if "expert_inputs" not in graph.artifacts:
                add_expert_inputs(graph)
            upstream["expert_inputs"] = "expert_inputs"
        graph.add(name, "quantize_layer", window_slice, window_slice, upstream)
    return name


def add_rebuild(graph: GraphBuilder, placement: dict[int, str]) -> None:
    """The quantize_layer windows that hold the placed (MoE layer, format) results.

    Each layer x format result is the ``layer_<L>`` subdirectory of its window's output
    (:func:`mixquant.quantize.run.layer_result_dir`). The source model enters by its key, which covers
    every layer's weights (conservative: a change to one layer's weights reruns all windows).
    """
    for layer, fmt in sorted(placement.items()):
        add_layer(graph, layer, fmt)


def add_search(graph: GraphBuilder) -> None:
    """score_sensitivity per macro-batch of calibration sequences, and the solve_placement checkpoint.

    A score key holds its sequences, the scored (layer, format) map, the scoring settings and the keys of
    the model, the calibration tokens and the layer x format results it scores -- not the budget or the
    solver, so a new budget reruns only the solve. Every pass carries every format, so a new candidate
    format reruns the score jobs (and only its own quantize windows).
    """
    cfg = graph.cfg
    search = cfg.placement.search
    scored = scored_formats(cfg)
    roles: dict[str, str] = {}
    for first, stop in score_jobs(cfg):
        upstream = {"model": "model", "calibration": "calibration"}
        for layer, formats in scored.items():
            for fmt in formats:
                if search.calibration == "rebuild":  # the very layer x format results the rebuild ships
                    upstream[f"{fmt}_layer_{layer}"] = add_layer(graph, layer, fmt)
                elif fmt == FP8:  # ModelOpt's own fake quant of the BF16 weights; FP8 inputs need amax
                    upstream["activations"] = "activations"
        score_slice = {
            "sequences": [first, stop],
            "scored": {str(layer): formats for layer, formats in scored.items()},
            "weights": search.calibration,
            "batch_size": search.batch_size,
            "stack_branches": search.stack_branches,
        }
        settings = {**score_slice, "checkpoint_interval_s": search.checkpoint_interval_s}
        name = f"scores/{first}-{stop - 1}"
        graph.add(name, "score_sensitivity", score_slice, settings, upstream)
        roles[f"scores_{first}"] = name
    solve_slice = {
        "moe_layers": moe_layers(cfg),
        "formats": list(cfg.placement.formats),
        "target_effective_bits": cfg.placement.target_effective_bits,
        "cost_model": cfg.placement.cost_model,
        "method": search.method,
        "pins": {str(layer): fmt for layer, fmt in sorted(placement_pins(cfg).items())},
        "frontier_points": search.frontier_points,
    }
    graph.add("placement", "solve_placement", solve_slice, solve_slice, {"model": "model", **roles})
    if search.refine is not None:
        add_refine(graph, solve_slice, roles)


def add_refine(graph: GraphBuilder, solve_slice: dict[str, Any], score_roles: dict[str, str]) -> None:
    """refine_placement: the K best placements under the solve's budget, measured end to end on held-out
    calibration sequences with the rebuild's own layer x format results (whatever
    ``placement.search.calibration`` scored), the best kept. Its key holds the solve's slice, the
    refinement's settings and the keys of the scores, the solved placement, the held-out sequences and
    every layer x format result a candidate may use."""
    cfg = graph.cfg
    add_holdout(graph)
    upstream = {"model": "model", "holdout": "holdout", "placement": "placement", **score_roles}
    for layer, formats in scored_formats(cfg).items():
        for fmt in formats:
            upstream[f"{fmt}_layer_{layer}"] = add_layer(graph, layer, fmt)
    refine_slice = {
        **solve_slice,
        "refine": cfg.placement.search.refine.model_dump(mode="json"),
        "batch_size": cfg.placement.search.batch_size,
    }
    graph.add("refined", "refine_placement", refine_slice, refine_slice, upstream)


def searched_placement_artifact(graph_artifacts: dict[str, Any]) -> str:
    """The artifact whose ``placement.json`` the rebuild of a search uses: the refined one if any."""
    return "refined" if "refined" in graph_artifacts else "placement"


def add_export(graph: GraphBuilder, placed: dict[int, str], name: str = "checkpoint") -> None:
    """The checkpoint: the source model plus every placed layer x format result (and KV amax).

    The placement enters by content (layer -> format), not by the placement artifact's key: a budget
    change that lands on the same placement finds the same checkpoint.
    """
    cfg = graph.cfg
    placement = {str(layer): fmt for layer, fmt in sorted(placed.items())}
    export = cfg.export.model_dump(mode="json")
    tokenizer_slice, _ = tokenizer_identity(cfg)
    config_slice = {
        "export": export,
        "placement": placement,
        "producer": default_producer(),
        "tokenizer": tokenizer_slice,
    }
    upstream = {"model": "model"}
    upstream.update(
        {f"layer_{layer}": layer_artifact_name(cfg, int(layer), fmt) for layer, fmt in placement.items()}
    )
    if export["kv_cache_quant"]:
        upstream["activations"] = "activations"
    graph.add(name, "export_checkpoint", config_slice, config_slice, upstream)
