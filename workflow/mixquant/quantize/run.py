"""Stage entry points for collect_activation_stats and quantize_layer (rule scripts and the CLI).

A quantize_layer job covers one format and one fixed window of MoE layers (``quantize.layers_per_job``):
its keyed directory holds one ``layer_<L>/`` subdirectory per layer (``layer.safetensors`` +
``audit.json``, :func:`mixquant.quantize.layer.save_layer_result`), which is what export_checkpoint and
score_sensitivity read (:func:`layer_result_dir`). One process per window pays the Python, torch and
ModelOpt imports once instead of once per layer.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mixquant import faults
from mixquant.calibration.tokens import load_token_ids
from mixquant.checkpoint.shards import ShardReader
from mixquant.formats.facts import FP8
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import resolve_model_dir
from mixquant.quantize.activations import (
    collect_activation_stats,
    load_activation_stats,
    save_activation_stats,
)
from mixquant.quantize.expert_inputs import expert_inputs_file
from mixquant.quantize.layer import quantize_layer, save_layer_result

log = logging.getLogger(__name__)


def run_collect_activation_stats(
    out_dir: str | Path,
    *,
    model: str | Path,
    calibration: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """One layer-streamed BF16 forward over the calibration tokens recording expert-input and K/V amax."""
    ids = load_token_ids(Path(calibration) / "calibration.safetensors")
    reader = ShardReader(resolve_model_dir(model))
    reader.check_all()  # a broken shard stops here with one line naming it
    device = settings.get("numerics", {}).get("device", "cpu")
    stats = collect_activation_stats(
        reader.model_dir, ids, batch_size=settings["batch_size"], device=device, reader=reader
    )
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_activation_stats(stats, tmp)
        summary.update(
            sequences=int(ids.shape[0]),
            tokens=int(ids.numel()),
            layer_loads={str(k): v for k, v in sorted(reader.reads.items())},
        )
    return Path(out_dir)


def activation_amax_for_layer(activations: str | Path | dict[str, Any], layer: int) -> dict[str, Any]:
    """The layer-shared FP8 input amax values (and per-expert routed counts) of one MoE layer, from the
    activation statistics' directory or the statistics already loaded from it."""
    stats = activations if isinstance(activations, dict) else load_activation_stats(Path(activations))
    return {
        "gate_up": stats["gate_up_input_amax"][layer],
        "down": stats["down_input_amax"][layer],
        "routed_tokens": stats["routed_tokens"][layer],
    }


def layer_result_dir(window_dir: str | Path, layer: int) -> Path:
    """The directory of one layer x format result inside its quantize_layer window's output."""
    return Path(window_dir) / f"layer_{int(layer)}"


def run_quantize_layer(
    out_dir: str | Path,
    *,
    model: str | Path,
    activations: str | Path | None = None,
    expert_inputs: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """Quantize the routed experts of every MoE layer of one window into one format, one layer at a time
    (streamed from the source shards; only one layer's result is held in memory)."""
    fmt, layers = settings["format"], [int(layer) for layer in settings["layers"]]
    model_dir = resolve_model_dir(model)
    stats = None
    if fmt == FP8:
        stats = load_activation_stats(Path(activations))
    summary: dict[str, Any] = {}
    per_layer: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        for layer in layers:
            started = time.perf_counter()
            activation_amax = activation_amax_for_layer(stats, layer) if stats is not None else None
            tensors, audit = quantize_layer(
                model_dir,
                layer,
                fmt,
                settings["params"],
                activation_amax=activation_amax,
                expert_inputs=None if expert_inputs is None else expert_inputs_file(expert_inputs, layer),
                device=settings.get("numerics", {}).get("device", "cpu"),
            )
            save_layer_result(tensors, audit, layer_result_dir(tmp, layer))
            faults.point("layer-saved", "quantize_layer")
            per_layer[str(layer)] = {"tensors": len(tensors), "totals": audit.get("totals")}
            log.info(
                "layer %d -> %s: %d tensors (%.2f s)", layer, fmt, len(tensors), time.perf_counter() - started
            )
            del tensors, audit
        summary.update(format=fmt, layers=per_layer)
    return Path(out_dir)
