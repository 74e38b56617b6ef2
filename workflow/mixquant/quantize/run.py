"""Stage entry points for collect_activation_stats and quantize_layer (rule scripts and the CLI)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import resolve_model_dir

log = logging.getLogger(__name__)


def run_collect_activation_stats(
    out_dir: str | Path,
    *,
    model: str | Path,
    calibration: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """One BF16 forward over the calibration tokens recording expert-input and K/V amax."""
    from mixquant.calibration.tokens import load_token_ids
    from mixquant.quantize.activations import collect_activation_stats, save_activation_stats
    from mixquant.quantize.layer import check_checkpoint_shards

    ids = load_token_ids(Path(calibration) / "calibration.safetensors")
    model_dir = resolve_model_dir(model)
    check_checkpoint_shards(model_dir)
    stats = collect_activation_stats(model_dir, ids, batch_size=settings["batch_size"])
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_activation_stats(stats, tmp)
        summary.update(sequences=int(ids.shape[0]), tokens=int(ids.numel()))
    return Path(out_dir)


def activation_amax_for_layer(activations: str | Path, layer: int) -> dict[str, Any]:
    """The layer-shared FP8 input amax values (and per-expert routed counts) of one MoE layer."""
    from mixquant.quantize.activations import load_activation_stats

    stats = load_activation_stats(Path(activations))
    return {
        "gate_up": stats["gate_up_input_amax"][layer],
        "down": stats["down_input_amax"][layer],
        "routed_tokens": stats["routed_tokens"][layer],
    }


def run_quantize_layer(
    out_dir: str | Path,
    *,
    model: str | Path,
    activations: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """Quantize one MoE layer's routed experts into one format, streamed from the source shards."""
    from mixquant.quantize.layer import quantize_layer, save_layer_result

    layer, fmt = settings["layer"], settings["format"]
    activation_amax = activation_amax_for_layer(activations, layer) if fmt == "fp8" else None
    tensors, audit = quantize_layer(
        resolve_model_dir(model), layer, fmt, settings["params"], activation_amax=activation_amax
    )
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_layer_result(tensors, audit, tmp)
        summary.update(layer=layer, format=fmt, tensors=len(tensors), totals=audit.get("totals"))
    log.info("layer %d -> %s: %d tensors", layer, fmt, len(tensors))
    return Path(out_dir)
