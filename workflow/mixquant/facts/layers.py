"""What a config says about the model's layers: which are MoE layers, where each stage computes, which
formats are pinned or scored, the explicit placement and the fixed quantize windows."""

from __future__ import annotations

from typing import Any

from mixquant.config import MixquantConfig, parse_layer_ranges
from mixquant.formats.facts import QUANTIZED_FORMATS
from mixquant.keys.stages import stage_device

__all__ = [
    "SCORED",
    "compute_device",
    "explicit_placement",
    "moe_layers",
    "placement_from_config",
    "placement_pins",
    "quantize_window",
    "quantize_windows",
    "scored_formats",
]

SCORED = QUANTIZED_FORMATS  # bf16 is the reference: its score is 0 by definition


def moe_layers(cfg: MixquantConfig) -> list[int]:
    """MoE layer indices: from the toy geometry, or as the config names them for a real model."""
    if cfg.model.source == "toy":
        arch = cfg.model.toy.arch
        return list(range(arch.num_dense_layers, arch.num_hidden_layers))
    assert cfg.model.moe_layers is not None
    return parse_layer_ranges(cfg.model.moe_layers)


def compute_device(cfg: MixquantConfig, stage: str) -> str:
    """Where ``stage`` computes: numerics.device for the forward stages and the rebuild (the KLD stages
    only with the hf engine: vLLM places itself), else the CPU (the stage registry's device rule)."""
    return stage_device(stage, cfg.numerics.device, cfg.kld.engine)


def placement_from_config(cfg: MixquantConfig) -> dict[int, str]:
    """MoE layer -> routed-expert format, from the explicit placement (every MoE layer listed)."""
    return explicit_placement(cfg, cfg.placement.explicit)


def explicit_placement(cfg: MixquantConfig, explicit: Any, layers: Any = None) -> dict[int, str]:
    """MoE layer -> format of an explicit placement (``placement.explicit`` or a KLD candidate's):
    ``default_format`` on every MoE layer (``layers``, default the config's), then each entry's."""
    layers = moe_layers(cfg) if layers is None else list(layers)
    placement = dict.fromkeys(layers, explicit.default_format)
    for entry in explicit.layers:
        for layer in parse_layer_ranges(entry.layers):
            if layer not in placement:
                raise ValueError(f"placement.explicit names layer {layer}, which is not a MoE layer {layers}")
            placement[layer] = entry.format
    return placement


def quantize_windows(cfg: MixquantConfig) -> list[list[int]]:
    """The fixed windows of MoE layers that quantize_layer jobs cover (``quantize.layers_per_job`` each;
    null: one window of every MoE layer). Fixed by layer index, never by the placement."""
    layers = moe_layers(cfg)
    size = cfg.quantize.layers_per_job or len(layers)
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def quantize_window(cfg: MixquantConfig, layer: int) -> list[int]:
    """The window of MoE layers whose quantize_layer job holds ``layer``."""
    for window in quantize_windows(cfg):
        if layer in window:
            return window
    raise ValueError(f"layer {layer} is not a MoE layer {moe_layers(cfg)}")


def placement_pins(cfg: MixquantConfig) -> dict[int, str]:
    """MoE layer -> pinned format (``placement.search.pins``)."""
    layers = set(moe_layers(cfg))
    pins: dict[int, str] = {}
    for pin in cfg.placement.search.pins:
        for layer in parse_layer_ranges(pin.layers):
            if layer not in layers:
                raise ValueError(f"placement.search.pins names layer {layer}, which is not a MoE layer")
            pins[layer] = pin.format
    return pins


def scored_formats(cfg: MixquantConfig) -> dict[int, list[str]]:
    """MoE layer -> the formats the search scores it in: every scored candidate format, or only its
    pinned one (a layer pinned to bf16 needs no score)."""
    pins = placement_pins(cfg)
    scored = [fmt for fmt in cfg.placement.formats if fmt in SCORED]
    out = {}
    for layer in moe_layers(cfg):
        formats = [fmt for fmt in scored if pins.get(layer, fmt) == fmt]
        if formats:
            out[layer] = formats
    return out
