"""Stage entry points for score_sensitivity and solve_placement (rule scripts and the CLI call them)."""

from __future__ import annotations

import csv
import io
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from mixquant.formats.facts import BF16, FORMATS, FP8, ROUTED_FORMAT_BITS
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.families import (
    DEFAULT_MODEL_TYPE,
    UnsupportedArchitecture,
    architecture,
    experts_module_name,
)
from mixquant.model.fetch import resolve_model_dir
from mixquant.preemption import stop_at_checkpoints
from mixquant.search.groups import (
    PlacementInfeasible,
    SearchGroup,
    effective_bits,
    max_effective_bits,
    min_effective_bits,
)

log = logging.getLogger(__name__)

SCORES_FILE = "scores.json"
PLACEMENT_FILE = "placement.json"
AUDIT_FILE = "placement_audit.json"
FRONTIER_CSV = "frontier.csv"
FRONTIER_PNG = "frontier.png"
HEATMAP_PNG = "scores_heatmap.png"
NORMALISATION = (
    "kl_per_token = sum over calibration tokens t and vocabulary v of p_ref(v|t) * (log p_ref - log p_q), "
    "divided by the number of tokens (every position of every calibration sequence)"
)


class PlacementSearchError(ValueError):
    """A search input or budget that cannot be solved (one line naming the culprit)."""


def run_score_sensitivity(
    out_dir: str | Path,
    *,
    model: str | Path,
    calibration: str | Path,
    activations: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    **layers: str | Path,
) -> Path:
    """KL(BF16 || only layer L's routed experts in format f) for every scored (L, f), on one macro-batch
    of calibration sequences: one layer-streamed, branch-parallel pass over the weights
    (:mod:`mixquant.search.branches`).

    Weights: the ``{fmt}_layer_{L}`` quantize_layer windows (``weights: rebuild``) or ModelOpt's own fake
    quant of the BF16 weights (``weights: max``, FP8 input amax from ``activations``). A killed job
    resumes from the hidden states it saved beside its output (``.partial-<key>``); on SIGTERM (SLURM's time
    limit, preemption) it saves them after the layer it is in and stops, for the retry to resume."""
    import torch
    from safetensors.torch import load_file

    # lazy: these import torch (planning imports this module for search_groups)
    from mixquant.calibration.tokens import load_token_ids
    from mixquant.checkpoint.shards import ShardReader
    from mixquant.model.streaming import StreamedModel
    from mixquant.quantize.layer import LAYER_FILE
    from mixquant.quantize.run import activation_amax_for_layer, layer_result_dir
    from mixquant.search.branches import branch_parallel_scores
    from mixquant.search.score import layer_quant_from_tensors, modelopt_search_quant

    first, stop = (int(v) for v in settings["sequences"])
    scored = {int(layer): list(formats) for layer, formats in settings["scored"].items()}
    weights = settings["weights"]
    windows = {
        (int(role.rsplit("_layer_", 1)[1]), role.rsplit("_layer_", 1)[0]): Path(path)
        for role, path in layers.items()
    }
    wanted = {(layer, fmt) for layer, formats in scored.items() for fmt in formats}
    if weights == "rebuild" and set(windows) != wanted:
        missing = sorted(wanted - set(windows))
        raise PlacementSearchError(
            f"score sequences {first}-{stop - 1}: no quantize_layer result for {missing[:3]}"
        )
    ids = load_token_ids(Path(calibration) / "calibration.safetensors")
    if not 0 <= first < stop <= ids.shape[0]:
        raise PlacementSearchError(f"score sequences {first}-{stop - 1}: the calibration has {ids.shape[0]}")
    device = settings.get("numerics", {}).get("device", "cpu")
    stats = None
    if weights == "max" and any(fmt == FP8 for _, fmt in wanted):
        from mixquant.quantize.activations import load_activation_stats  # lazy: imports torch

        stats = load_activation_stats(Path(activations))

    def quant_for(layer: int, fmt: str, loaded: torch.nn.Module):
        if weights == "rebuild":
            tensors = load_file(str(layer_result_dir(windows[(layer, fmt)], layer) / LAYER_FILE))
            return layer_quant_from_tensors(tensors, layer, fmt, arch=arch)
        amax = activation_amax_for_layer(stats, layer) if fmt == FP8 else None
        return modelopt_search_quant(stream.model, layer, fmt, amax)

    out_dir = Path(out_dir)
    state_dir = out_dir.parent / f".partial-{out_dir.name}"
    started = time.perf_counter()
    reader = ShardReader(resolve_model_dir(model))
    reader.check_all()  # a broken shard stops here with one line naming it
    arch = architecture(reader.model_dir)
    with stop_at_checkpoints(), StreamedModel(reader.model_dir, device=device, reader=reader) as stream:
        sums = branch_parallel_scores(
            stream,
            ids[first:stop],
            scored,
            quant_for,
            batch_size=int(settings["batch_size"]),
            stack=bool(settings["stack_branches"]),
            state_dir=state_dir,
            state_key=out_dir.name,
            checkpoint_interval_s=checkpoint_interval(settings),
            progress=True,
        )
    seconds = time.perf_counter() - started
    result = {
        "weights": weights,
        "normalisation": NORMALISATION,
        "batch_size": int(settings["batch_size"]),
        "sequences": [first, stop],
        "sequence_length": int(ids.shape[1]),
        "kl_sums": {
            fmt: {str(layer): values for layer, values in sorted(per_layer.items())}
            for fmt, per_layer in sorted(sums.items())
        },
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / SCORES_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        summary.update(
            sequences=[first, stop],
            scored=len(wanted),
            layer_loads={str(k): v for k, v in sorted(reader.reads.items())},
        )
    shutil.rmtree(state_dir, ignore_errors=True)
    log.info(
        "scored %d (layer, format) pairs on sequences %d-%d in %.1f s; read %d bytes",
        len(wanted),
        first,
        stop - 1,
        seconds,
        reader.bytes_read,
    )
    return out_dir


def checkpoint_interval(settings: dict[str, Any]) -> float:
    """Seconds between a score job's state saves: ``placement.search.checkpoint_interval_s``, or by default
    a quarter of the wall time the job was given (``runtime_min``, the rule's request; 10 min without one),
    so a job stopped at its limit loses at most a quarter of its work."""
    configured = settings.get("checkpoint_interval_s")
    if configured is not None:
        return float(configured)
    return float(settings.get("runtime_min") or 10) * 60 / 4


def routed_group_size(model_config: dict[str, Any]) -> tuple[int, float]:
    """(weights in one MoE layer's routed experts, active ratio top_k / num_experts) from config.json, as
    its family's architecture defines them (mixquant.model.families)."""
    config = dict(model_config)
    config.setdefault("model_type", DEFAULT_MODEL_TYPE)
    try:
        arch = architecture(config)
    except (UnsupportedArchitecture, KeyError, TypeError, ValueError) as exc:
        raise PlacementSearchError(f"model config.json: no MoE geometry ({exc})") from exc
    return arch.routed_params_per_layer, arch.experts_per_token / arch.num_experts


def _read_scores(paths: dict[str, Path]) -> list[dict[str, Any]]:
    results = []
    for _role, path in sorted(paths.items()):
        file = Path(path) / SCORES_FILE
        try:
            results.append(json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise PlacementSearchError(f"{file}: cannot read scores ({exc})") from exc
    return results


def search_groups(settings: dict[str, Any], table: dict[int, dict[str, float]], model_config: dict) -> list:
    """One :class:`SearchGroup` per MoE layer: allowed formats (a pin allows one) with their scores."""
    numel, active = routed_group_size(model_config)
    weight = active if settings["cost_model"] == "active_moe" else 1.0
    pins = {int(layer): fmt for layer, fmt in settings["pins"].items()}
    groups = []
    for layer in settings["moe_layers"]:
        allowed = [pins[layer]] if layer in pins else list(settings["formats"])
        scores = {}
        for fmt in allowed:
            if fmt == BF16:
                scores[fmt] = 0.0
            elif fmt in table.get(layer, {}):
                scores[fmt] = table[layer][fmt]
            else:
                raise PlacementSearchError(
                    f"layer {layer}: no {fmt} score among the score_sensitivity results"
                )
        groups.append(SearchGroup(experts_module_name(layer), numel, scores, weight))
    return groups


def _frontier_csv(rows: list[dict[str, Any]]) -> str:
    columns = ["target_effective_bits", "effective_bits", "objective", "status", *FORMATS]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _layer_of(name: str) -> int:
    return int(name.split(".")[2])


def uniform_baselines(formats: list[str], groups: list) -> dict[str, tuple[float, float]]:
    """``uniform <format>`` -> (effective bits, predicted objective) of every format all groups can take."""
    uniform = {}
    for fmt in formats:
        if all(fmt in g.scores for g in groups):
            choice = {g.name: fmt for g in groups}
            uniform[f"uniform {fmt}"] = (effective_bits(groups, choice), sum(g.scores[fmt] for g in groups))
    return uniform


def placement_audit(
    settings: dict[str, Any],
    solution: Any,
    groups: list,
    results: list[dict[str, Any]],
    uniform: dict[str, tuple[float, float]],
    counts: dict[str, int],
) -> dict[str, Any]:
    """placement_audit.json: the solver's status, the budget, every group's scores and choice, the uniform
    baselines and the score jobs the scores came from."""
    method, target = settings["method"], float(settings["target_effective_bits"])
    audit = {
        "method": method,
        "solver": solution.to_json(),
        "budget": {
            "target_effective_bits": target,
            "effective_bits": solution.effective_bits,
            "min_effective_bits": min_effective_bits(groups),
            "cost_model": settings["cost_model"],
            "format_bits": dict(ROUTED_FORMAT_BITS),
        },
        "objective": solution.objective,
        "normalisation": NORMALISATION,
        "counts": counts,
        "groups": [
            {
                "name": g.name,
                "layer": _layer_of(g.name),
                "numel": g.numel,
                "cost_weight": g.cost_weight,
                "scores": dict(g.scores),
                "pinned": len(g.scores) == 1,
                "chosen": solution.choice[g.name],
            }
            for g in groups
        ],
        "uniform": {name: {"effective_bits": b, "objective": o} for name, (b, o) in uniform.items()},
        "score_jobs": [{"sequences": r["sequences"], "formats": sorted(r["kl_sums"])} for r in results],
    }
    return audit


def run_solve_placement(
    out_dir: str | Path,
    *,
    model: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    **scores: str | Path,
) -> Path:
    """Exact placement under the bit budget, its audit, the bits-to-KL frontier and the plots."""
    # lazy: imports matplotlib, torch and pulp (planning imports this module)
    from mixquant.search.plots import plot_frontier, plot_score_heatmap
    from mixquant.search.score import scores_table
    from mixquant.search.solve import frontier, solve_placement

    model_config = json.loads((resolve_model_dir(model) / "config.json").read_text(encoding="utf-8"))
    results = _read_scores({role: Path(path) for role, path in scores.items()})
    table = scores_table(results)
    groups = search_groups(settings, table, model_config)
    target, method = float(settings["target_effective_bits"]), settings["method"]
    try:
        solution = solve_placement(groups, target, method=method)
    except PlacementInfeasible as exc:
        raise PlacementSearchError(f"placement.target_effective_bits: {exc}") from exc
    if solution.effective_bits > target + 1e-9:
        raise PlacementSearchError(
            f"placement.search.method {method}: ModelOpt's threshold search ended over budget "
            f"({solution.effective_bits:.4f} > {target} effective bits, status {solution.status}); "
            "ModelOpt would apply it silently -- use method: ilp"
        )
    placement = {_layer_of(name): fmt for name, fmt in solution.choice.items()}
    lo, hi, n = min_effective_bits(groups), max_effective_bits(groups), settings["frontier_points"]
    rows = frontier(groups, budgets=[lo + (hi - lo) * i / (n - 1) for i in range(n)], method=method)
    uniform = uniform_baselines(settings["formats"], groups)
    counts = {fmt: sum(1 for f in placement.values() if f == fmt) for fmt in FORMATS}
    audit = placement_audit(settings, solution, groups, results, uniform, counts)
    document = {
        "layers": {str(layer): fmt for layer, fmt in sorted(placement.items())},
        "metadata": {
            "source": "search",
            "method": method,
            "target_effective_bits": target,
            "effective_bits": solution.effective_bits,
            "objective": solution.objective,
        },
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / PLACEMENT_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        (tmp / AUDIT_FILE).write_text(json.dumps(audit, indent=2) + "\n", encoding="utf-8")
        (tmp / FRONTIER_CSV).write_text(_frontier_csv(rows), encoding="utf-8")
        plot_frontier(
            rows,
            tmp / FRONTIER_PNG,
            chosen={"effective_bits": solution.effective_bits, "objective": solution.objective},
            baselines=uniform,
            title=f"Predicted summed KL/token vs routed effective bits ({method})",
        )
        heat = {f"layer {_layer_of(g.name)}": dict(g.scores) for g in groups}
        chosen = {f"layer {_layer_of(g.name)}": solution.choice[g.name] for g in groups}
        plot_score_heatmap(
            heat, tmp / HEATMAP_PNG, chosen=chosen, title="KL/token when only that layer is quantized"
        )
        summary.update(counts=counts, effective_bits=solution.effective_bits, objective=solution.objective)
    log.info(
        "placement: %s at %.4f effective bits (target %.4f), predicted KL/token %.6g",
        counts,
        solution.effective_bits,
        target,
        solution.objective,
    )
    return Path(out_dir)
