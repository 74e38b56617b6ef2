"""ModelOpt's own AutoQuantize placement, as a stage: ``mtq.auto_quantize(method="kl_div")`` picks each MoE
layer's routed-expert format at mixquant's budget, and the stages downstream rebuild and export that
placement exactly as they do the searched one.

ModelOpt runs its own search end to end (:func:`mixquant.search.reference.modelopt_kl_div_scores`: max
calibration per preset, its KL scores, its threshold bisection on the clamped scores); only the budget is
made mixquant's: the constraint's cost denominator is the routed experts alone (every other module excluded
from the cost by exact name) under the same cost model, so ModelOpt's ``effective_bits`` is mixquant's
routed effective bits (:func:`mixquant.search.groups.effective_bits`). ModelOpt always keeps no-quant
(``bf16``) as a choice, so ``bf16`` must be among the formats; pins are not ModelOpt's to honour.
ModelOpt's bisection can end over the budget and would apply that placement silently; the stage fails.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from mixquant import faults
from mixquant.calibration.tokens import load_token_ids
from mixquant.formats.facts import BF16, FORMATS
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.families import experts_module_name
from mixquant.model.fetch import resolve_model_dir
from mixquant.model.layer_reader import check_checkpoint_shards
from mixquant.numerics import torch_threads
from mixquant.search.groups import (
    BUDGET_TOL,
    PlacementInfeasible,
    SearchGroup,
    effective_bits,
    require_feasible,
)
from mixquant.search.reference import MODELOPT_COST_MODELS, MODELOPT_FORMATS, modelopt_kl_div_scores
from mixquant.search.run import PLACEMENT_FILE, PlacementSearchError, routed_group_size
from mixquant.search.score import load_search_model

__all__ = [
    "AUTOQUANTIZE_FILE",
    "SOURCE",
    "modelopt_autoquantize_placement",
    "run_autoquantize_placement",
]

log = logging.getLogger(__name__)

AUTOQUANTIZE_FILE = "autoquantize.json"
SOURCE = "modelopt_autoquantize"
METHOD = "kl_div"  # ModelOpt's gradient method needs a loss and backward passes; kl_div is its LLM search
MODELOPT_MAX_EFFECTIVE_BITS = 16.0  # auto_quantize asserts 0 < effective_bits <= 16


def _routed_groups(model: torch.nn.Module, layers: list[int], formats: list[str], cost_model: str) -> list:
    """The solve's groups (mixquant's budget): one per MoE layer, its numel and active-MoE cost weight."""
    numel, active = routed_group_size(model.config.to_dict())
    weight = active if cost_model == "active_moe" else 1.0
    return [
        SearchGroup(experts_module_name(layer), numel, dict.fromkeys(formats, 0.0), weight)
        for layer in layers
    ]


def modelopt_autoquantize_placement(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    *,
    layers: list[int],
    formats: list[str],
    batch_size: int,
    target_effective_bits: float,
    cost_model: str,
    in_place: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """ModelOpt's ``auto_quantize(method="kl_div")`` placement of the routed experts of ``layers`` over
    ``formats`` (which must hold ``bf16``, ModelOpt's implicit no-quant) at ``target_effective_bits`` of
    mixquant's routed effective bits under ``cost_model`` (``numel`` | ``active_moe``).

    Returns ``{"selection": {layer: format}, "routed_effective_bits": float, "audit": {...}}``; the audit
    holds ModelOpt's raw and clamped scores and its costs per layer and format, its own effective bits,
    ``is_satisfied``, the constraints it was given, its version, tokens and batches. Raises
    :class:`~mixquant.search.groups.PlacementInfeasible` for a target below every layer at its cheapest
    format (before anything runs) and ``ValueError`` for bad arguments.
    """
    if cost_model not in MODELOPT_COST_MODELS:
        raise ValueError(f"cost_model must be one of {sorted(MODELOPT_COST_MODELS)}, got {cost_model!r}")
    if BF16 not in formats:
        raise ValueError(
            f"formats {formats} lack bf16: ModelOpt's auto_quantize always keeps no-quant (bf16)"
        )
    searched = [fmt for fmt in FORMATS if fmt in formats and fmt != BF16]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not searched:
        raise ValueError(f"formats must name some of {sorted(MODELOPT_FORMATS)} besides bf16, got {formats}")
    layers = sorted({int(layer) for layer in layers})
    target = float(target_effective_bits)
    groups = _routed_groups(model, layers, [*searched, BF16], cost_model)
    require_feasible(groups, target)
    ratio = groups[0].cost_weight if cost_model == "active_moe" else None
    result = modelopt_kl_div_scores(
        model,
        calibration_ids,
        layers=layers,
        formats=searched,
        batch_size=batch_size,
        effective_bits=min(target, MODELOPT_MAX_EFFECTIVE_BITS),
        cost_model=cost_model,
        active_moe_expert_ratio=ratio,
        in_place=in_place,
        progress=progress,
    )
    selection = {int(layer): fmt for layer, fmt in sorted(result["selection"].items())}
    routed = effective_bits(groups, {experts_module_name(layer): fmt for layer, fmt in selection.items()})
    per_layer = ("scores", "clamped_scores", "costs")
    audit = {
        "source": SOURCE,
        "method": METHOD,
        "modelopt_version": result["modelopt_version"],
        "target_effective_bits": target,
        "cost_model": cost_model,
        "constraints": result["constraints"],
        "formats": [*searched, BF16],
        "batch_size": int(batch_size),
        "tokens": result["tokens"],
        "batches": result["batches"],
        "routed_effective_bits": routed,
        "modelopt_effective_bits": result["effective_bits"],
        "is_satisfied": result["selection_satisfied"],
        "cost_denominator": result["cost_denominator"],
        "counts": {fmt: sum(1 for f in selection.values() if f == fmt) for fmt in FORMATS},
        "selection": {str(layer): fmt for layer, fmt in selection.items()},
        **{
            key: {str(layer): dict(value) for layer, value in sorted(result[key].items())}
            for key in per_layer
        },
        "groups": [{"name": g.name, "numel": g.numel, "cost_weight": g.cost_weight} for g in groups],
    }
    return {"selection": selection, "routed_effective_bits": routed, "audit": audit}


def run_autoquantize_placement(
    out_dir: str | Path,
    *,
    model: str | Path,
    calibration: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """ModelOpt's AutoQuantize placement of the model's MoE layers on the calibration sample, published as
    ``placement.json`` (what :func:`mixquant.export.placement.load_placement` reads, ``metadata.source``
    ``modelopt_autoquantize``) and ``autoquantize.json`` (the audit).

    ``settings``: ``moe_layers``, ``formats``, ``target_effective_bits``, ``cost_model``, ``method``
    (``kl_div``), ``batch_size``, ``numerics`` (its ``device``) and the job's ``threads``. An infeasible
    target or a selection over it stops with one line."""
    if settings["method"] != METHOD:
        raise PlacementSearchError(
            f"autoquantize method {settings['method']!r} is not supported; use {METHOD}"
        )
    target = float(settings["target_effective_bits"])
    device = settings.get("numerics", {}).get("device", "cpu")
    ids = load_token_ids(Path(calibration) / "calibration.safetensors")
    model_dir = resolve_model_dir(model)
    check_checkpoint_shards(model_dir)  # a broken shard stops here with one line naming it
    started = time.perf_counter()
    with torch_threads(settings.get("threads")):
        loaded = load_search_model(model_dir, device=device)
        faults.point("model-loaded", "autoquantize_placement")  # before ModelOpt calibrates and scores
        try:
            placement = modelopt_autoquantize_placement(
                loaded,
                ids,
                layers=[int(layer) for layer in settings["moe_layers"]],
                formats=list(settings["formats"]),
                batch_size=int(settings["batch_size"]),
                target_effective_bits=target,
                cost_model=settings["cost_model"],
                in_place=True,  # the stage's own copy: no second model in memory
            )
        except PlacementInfeasible as exc:
            raise PlacementSearchError(f"placement.target_effective_bits: {exc}") from exc
        except ValueError as exc:
            raise PlacementSearchError(f"autoquantize placement: {exc}") from exc
    audit, routed = placement["audit"], placement["routed_effective_bits"]
    if not audit["is_satisfied"] or routed > target + BUDGET_TOL:
        raise PlacementSearchError(
            f"ModelOpt's auto_quantize threshold search ended over budget ({routed:.4f} > {target} routed "
            f"effective bits, is_satisfied {audit['is_satisfied']}); ModelOpt would apply it silently"
        )
    document = {
        "layers": {str(layer): fmt for layer, fmt in placement["selection"].items()},
        "metadata": {
            "source": SOURCE,
            "method": METHOD,
            "target_effective_bits": target,
            "routed_effective_bits": routed,
            "effective_bits": routed,
            "modelopt_effective_bits": audit["modelopt_effective_bits"],
            "cost_model": settings["cost_model"],
            "modelopt_version": audit["modelopt_version"],
        },
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / PLACEMENT_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        (tmp / AUTOQUANTIZE_FILE).write_text(json.dumps(audit, indent=2) + "\n", encoding="utf-8")
        summary.update(counts=audit["counts"], effective_bits=routed, seconds=time.perf_counter() - started)
    log.info(
        "ModelOpt auto_quantize placement: %s at %.4f routed effective bits (target %.4f)",
        audit["counts"],
        routed,
        target,
    )
    return Path(out_dir)
