"""Predict the structure of a ModelOpt mixed-precision export from config.json and a placement alone.

What ModelOpt 0.47's ``export_hf_checkpoint`` writes for a MoE model of any family of
:mod:`mixquant.model.families` whose routed experts are placed per MoE layer on NVFP4 W4A16 / FP8 / BF16
(everything else BF16), per routed projection (weight ``[N, K]``, named as the family's checkpoint names
it, e.g. ``model.layers.L.mlp.experts.E.{gate,up,down}_proj``):

=============  ==================================================================  =======  ===========
format         tensors                                                             tensors  nominal bits
=============  ==================================================================  =======  ===========
nvfp4_w4a16    ``weight`` U8 ``[N, K/2]`` (two E2M1 per byte), ``weight_scale``      3        4.5
               F8_E4M3 ``[N, K/16]``, ``weight_scale_2`` F32 ``[]``
fp8            ``weight`` F8_E4M3 ``[N, K]``, ``weight_scale`` F32 ``[]``,             3        8
               ``input_scale`` F32 ``[]`` (static per-layer activation scale)
bf16           ``weight`` BF16 ``[N, K]``                                           1        16
=============  ==================================================================  =======  ===========

NVFP4 counts 4.5 bits: 4 bits per element plus one 8-bit E4M3 scale per 16-element block (the
per-tensor ``weight_scale_2`` is not counted), as ModelOpt's auto_quantize cost model and recipes do.
Effective routed-expert bits are numel-weighted over the MoE layers: ``sum(bits * numel) / sum(numel)``.

With an FP8 KV cache (``kv_cache_quant_algo: FP8``) ModelOpt adds, for every attention layer,
``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (F32 scalars: the k/v_bmm quantizer amax /
448; ``modelopt/torch/export/quant_utils.py`` ``_KV_CACHE_REPLACEMENTS``). Laguna-S-2.1's release count
of 101,377 tensors includes these 96 = 2 x 48 scalars; this project's own export quantizes no KV cache, so
pass ``kv_cache_quant=None`` for it.

Non-expert tensors (embeddings, attention, norms, router gate and its ``e_score_correction_bias``, shared
expert, dense layer 0, lm_head) keep the checkpoint dtype of config.json (``dtype``/``torch_dtype``,
bfloat16 by default); for Laguna-S-2.1 that is 673 tensors.

A placement (:mod:`mixquant.export.placement`) maps MoE layers to formats; MoE layers not named stay BF16.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mixquant.checkpoint.headers import DTYPE_BYTES
from mixquant.export.placement import PlacementError
from mixquant.formats.facts import BF16, FORMATS, FP8, NVFP4, NVFP4_GROUP_SIZE, ROUTED_FORMAT_BITS
from mixquant.model.families import DEFAULT_MODEL_TYPE, PROJECTIONS, architecture

__all__ = [
    "BF16",
    "DTYPE_BYTES",
    "FORMATS",
    "FP8",
    "KV_CACHE_QUANT_ALGOS",
    "NVFP4",
    "NVFP4_GROUP_SIZE",
    "PROJECTIONS",
    "ROUTED_FORMAT_BITS",
    "PlacementError",
    "TensorEntry",
    "checkpoint_tensors",
    "format_prediction",
    "moe_layers",
    "predict_structure",
    "resolve_placement",
    "routed_effective_bits",
]

# KV-cache algorithms whose export is exactly one F32 k_scale and one v_scale per attention layer.
KV_CACHE_QUANT_ALGOS = ("FP8",)
KV_SCALE_NAMES = ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_CATEGORIES = ("routed", "non_expert", "kv_scales")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the exported checkpoint: name, safetensors dtype, shape, category and format.

    ``category`` is "routed", "non_expert" or "kv_scales"; ``format`` is the routed format (else None);
    ``numel`` is the number of *weight elements* it represents (unpacked: a packed NVFP4 U8 weight of
    ``[N, K/2]`` represents ``N * K``; scales represent 0).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    category: str
    format: str | None = None
    numel: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


# ----------------------------------------------------------------------------------------- config


def _architecture(model_config: Mapping[str, Any]):
    """The model's architecture (mixquant.model.families), its family's transformers class on the meta
    device: names and shapes as the checkpoint holds them. A config.json without its model_type is read
    as the default family's (:data:`mixquant.model.families.DEFAULT_MODEL_TYPE`)."""
    config = dict(model_config)
    config.setdefault("model_type", DEFAULT_MODEL_TYPE)
    try:
        return architecture(config)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"config.json: not a model config transformers can build ({exc})") from exc


def moe_layers(model_config: Mapping[str, Any]) -> list[int]:
    """Indices of the layers with routed experts (as the model's class builds them)."""
    return list(_architecture(model_config).moe_layers)


def _checkpoint_dtype(config: Mapping[str, Any]) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if name not in _CONFIG_DTYPES:
        raise ValueError(
            f"config.json: unsupported checkpoint dtype {name!r} (known: {sorted(_CONFIG_DTYPES)})"
        )
    return _CONFIG_DTYPES[name]


def non_expert_tensors(
    model_config: Mapping[str, Any], source_dtypes: Mapping[str, str] | None = None
) -> list[TensorEntry]:
    """Every tensor outside the routed experts, with names, shapes and dtypes as the model's transformers
    class and its reverse conversion (what ``save_pretrained`` writes) define them.

    The export copies these tensors from the source as they are, and publishers do not always write them in
    the dtype transformers' class holds them in (DeepSeek-V3 ships its routers' weights in BF16, which
    ``DeepseekV3TopkRouter`` holds in float32): ``source_dtypes`` (tensor name -> safetensors dtype, from
    the source's shard headers) overrides the class's dtype where the source is known."""
    arch = _architecture(model_config)
    _checkpoint_dtype(model_config)  # one line for an unsupported checkpoint dtype
    source_dtypes = source_dtypes or {}
    entries = []
    for name, (shape, dtype) in arch.non_expert_tensors().items():
        on_disk = source_dtypes.get(name) or _CONFIG_DTYPES.get(dtype, dtype.upper())
        entries.append(TensorEntry(name, on_disk, shape, "non_expert"))
    return entries


def routed_projection_tensors(
    prefix: str, out_features: int, in_features: int, fmt: str
) -> list[TensorEntry]:
    """The exported tensors of one routed projection ``prefix`` (weight ``[out, in]``) in format ``fmt``."""
    n, k = int(out_features), int(in_features)
    numel = n * k

    def entry(suffix: str, dtype: str, shape: tuple[int, ...], weight: bool = False) -> TensorEntry:
        return TensorEntry(f"{prefix}.{suffix}", dtype, shape, "routed", fmt, numel if weight else 0)

    if fmt == NVFP4:
        if k % NVFP4_GROUP_SIZE:
            raise ValueError(f"{prefix}: NVFP4 needs in_features divisible by {NVFP4_GROUP_SIZE}, got {k}")
        return [
            entry("weight", "U8", (n, k // 2), weight=True),
            entry("weight_scale", "F8_E4M3", (n, k // NVFP4_GROUP_SIZE)),
            entry("weight_scale_2", "F32", ()),
        ]
    if fmt == FP8:
        return [
            entry("weight", "F8_E4M3", (n, k), weight=True),
            entry("weight_scale", "F32", ()),
            entry("input_scale", "F32", ()),
        ]
    if fmt == BF16:
        return [entry("weight", "BF16", (n, k), weight=True)]
    raise PlacementError(f"unknown routed format {fmt!r} (formats: {', '.join(FORMATS)})")


def _routed_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    arch = _architecture(config)
    return {proj: tuple(arch.expert_shape(proj)) for proj in PROJECTIONS}


def kv_scale_tensors(model_config: Mapping[str, Any], kv_cache_quant: str | None) -> list[TensorEntry]:
    """``k_scale``/``v_scale`` F32 scalars of every attention layer for a quantized KV cache, else none."""
    if _normalise_kv(kv_cache_quant) is None:
        return []
    return [
        TensorEntry(f"model.layers.{layer}.{name}", "F32", (), "kv_scales")
        for layer in range(_architecture(model_config).num_hidden_layers)
        for name in KV_SCALE_NAMES
    ]


def _normalise_kv(kv_cache_quant: str | None) -> str | None:
    if kv_cache_quant is None:
        return None
    algo = str(kv_cache_quant).upper()
    if algo not in KV_CACHE_QUANT_ALGOS:
        raise ValueError(
            f"kv_cache_quant must be None or one of {KV_CACHE_QUANT_ALGOS}, got {kv_cache_quant!r}"
        )
    return algo


# -------------------------------------------------------------------------------------- placement


def resolve_placement(
    model_config: Mapping[str, Any],
    placement_counts: Mapping[str, int] | None = None,
    placement: Mapping[int, str] | None = None,
) -> tuple[dict[int, str], bool]:
    """``({moe_layer: format}, explicit)`` from a layer map and/or per-format counts.

    With ``placement``, MoE layers it does not name are BF16, and naming a layer without routed experts
    is an error; ``placement_counts``, if also given, must agree with it. With counts alone the counts must
    sum to the number of MoE layers, and a stand-in map is returned (``explicit`` False): formats in
    :data:`FORMATS` order over ascending layers -- counts, bytes and bits do not depend on which layer is
    which, since all MoE layers have the same geometry.
    """
    layers = moe_layers(model_config)
    if placement is None and placement_counts is None:
        raise PlacementError("give placement_counts or placement")
    counts = None
    if placement_counts is not None:
        unknown = sorted(set(placement_counts) - set(FORMATS))
        if unknown:
            raise PlacementError(
                f"placement counts: unknown formats {unknown} (formats: {', '.join(FORMATS)})"
            )
        counts = {fmt: int(placement_counts.get(fmt, 0)) for fmt in FORMATS}
        if any(c < 0 for c in counts.values()):
            raise PlacementError(f"placement counts must be >= 0, got {counts}")
    if placement is not None:
        mapping = {int(layer): fmt for layer, fmt in placement.items()}
        not_moe = sorted(set(mapping) - set(layers))
        if not_moe:
            raise PlacementError(f"placement names layers without routed experts: {not_moe}")
        for layer, fmt in mapping.items():
            if fmt not in FORMATS:
                raise PlacementError(f"layer {layer}: unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
        resolved = {layer: mapping.get(layer, BF16) for layer in layers}
        if counts is not None:
            actual = {fmt: sum(1 for f in resolved.values() if f == fmt) for fmt in FORMATS}
            if actual != counts:
                raise PlacementError(f"placement has counts {actual}, but placement_counts says {counts}")
        return resolved, True
    assert counts is not None
    if sum(counts.values()) != len(layers):
        raise PlacementError(
            f"placement counts sum to {sum(counts.values())}, but the model has {len(layers)} MoE layers"
        )
    order = [fmt for fmt in FORMATS for _ in range(counts[fmt])]
    return dict(zip(layers, order, strict=True)), False


# ---------------------------------------------------------------------------------------- predict


def checkpoint_tensors(
    model_config: Mapping[str, Any],
    layer_formats: Mapping[int, str],
    *,
    kv_cache_quant: str | None,
    source_dtypes: Mapping[str, str] | None = None,
) -> list[TensorEntry]:
    """Every tensor of the export: non-expert (dtypes: :func:`non_expert_tensors`), routed (per
    ``layer_formats``; MoE layers absent -> BF16), KV scales. Names are the hub names ModelOpt writes."""
    arch = _architecture(model_config)
    shapes = _routed_shapes(model_config)
    entries = non_expert_tensors(model_config, source_dtypes)
    for layer in arch.moe_layers:
        fmt = layer_formats.get(layer, BF16)
        for expert in range(arch.num_experts):
            for proj in PROJECTIONS:
                entries += routed_projection_tensors(
                    arch.expert_prefix(layer, expert, proj), *shapes[proj], fmt
                )
    return entries + kv_scale_tensors(model_config, kv_cache_quant)


def routed_effective_bits(layer_numel: Mapping[int, int], layer_formats: Mapping[int, str]) -> float | None:
    """Numel-weighted nominal bits of the routed experts: ``sum(bits * numel) / sum(numel)`` (None if no
    routed experts). Computed in exact rational arithmetic, then rounded once to a float."""
    total = sum(layer_numel.values())
    if not total:
        return None
    weighted = sum(Fraction(ROUTED_FORMAT_BITS[layer_formats[layer]]) * n for layer, n in layer_numel.items())
    return float(weighted / total)


def _tally(entries: Iterable[tuple[TensorEntry, int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensor counts and bytes per category (routed: per format) of ``(entry, times)`` pairs, with totals."""
    tensors: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    nbytes: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    for e, times in entries:
        if e.category == "routed":
            tensors["routed"][e.format] = tensors["routed"].get(e.format, 0) + times
            nbytes["routed"][e.format] = nbytes["routed"].get(e.format, 0) + times * e.nbytes
        else:
            tensors[e.category] += times
            nbytes[e.category] += times * e.nbytes
    for table in (tensors, nbytes):
        table["total"] = sum(table["routed"].values()) + table["non_expert"] + table["kv_scales"]
    return tensors, nbytes


def predict_structure(
    model_config: Mapping[str, Any],
    placement_counts: Mapping[str, int] | None = None,
    placement: Mapping[int, str] | None = None,
    *,
    kv_cache_quant: str | None = "FP8",
    source_dtypes: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Tensor counts, payload bytes and effective routed bits of the export, from config.json alone (and
    the source's non-expert dtypes where given: :func:`non_expert_tensors`).

    ``model_config`` is config.json's dict; give ``placement_counts`` (format -> number of MoE layers),
    ``placement`` (MoE layer -> format; absent MoE layers BF16) or both (they must agree).
    ``kv_cache_quant``: "FP8" (default, as in the Laguna-S-2.1 release) adds a k_scale and a v_scale per
    attention layer; None for an export without a quantized KV cache.

    Returns a JSON-serialisable dict: ``tensors`` and ``bytes`` (``routed`` per format, ``non_expert``,
    ``kv_scales``, ``total``), ``payload_bytes`` (sum of tensor bytes), ``routed_effective_bits``,
    ``placement_counts``, ``layer_formats`` (``{"L": format}`` for an explicit placement, else None),
    ``bytes_per_routed_projection``, ``tensors_per_routed_projection``, ``parameters`` (unquantized
    element counts: ``total``, ``routed``, ``non_expert``), ``kv_cache_quant`` and a ``model`` summary.
    """
    kv = _normalise_kv(kv_cache_quant)
    formats, explicit = resolve_placement(model_config, placement_counts, placement)
    shapes = _routed_shapes(model_config)
    arch = _architecture(model_config)
    num_experts = arch.num_experts
    # the tally of checkpoint_tensors' entries without listing every expert's (a 118B model has ~110,000):
    # each layer's projections counted once per format, times the experts
    entries = non_expert_tensors(model_config, source_dtypes) + kv_scale_tensors(model_config, kv)
    routed = [
        (e, num_experts)
        for layer in arch.moe_layers
        for proj in PROJECTIONS
        for e in routed_projection_tensors("p", *shapes[proj], formats.get(layer, BF16))
    ]
    tensors, nbytes = _tally([(e, 1) for e in entries] + routed)
    layer_numel = {layer: num_experts * sum(n * k for n, k in shapes.values()) for layer in formats}
    per_projection = {
        fmt: {
            proj: sum(e.nbytes for e in routed_projection_tensors("p", *shapes[proj], fmt))
            for proj in PROJECTIONS
        }
        for fmt in FORMATS
    }
    routed_params = sum(layer_numel.values())
    non_expert_params = sum(math.prod(e.shape) for e in entries if e.category == "non_expert")
    return {
        "model": {
            "model_type": arch.model_type,
            "num_hidden_layers": arch.num_hidden_layers,
            "moe_layers": sorted(formats),
            "num_experts": num_experts,
            "hidden_size": int(model_config["hidden_size"]),
            "moe_intermediate_size": shapes["gate_proj"][0],
            "dtype": _checkpoint_dtype(model_config),
        },
        "kv_cache_quant": kv,
        "placement_counts": {fmt: sum(1 for f in formats.values() if f == fmt) for fmt in FORMATS},
        "layer_formats": {str(layer): fmt for layer, fmt in formats.items()} if explicit else None,
        "tensors": tensors,
        "bytes": nbytes,
        "payload_bytes": nbytes["total"],
        "routed_effective_bits": routed_effective_bits(layer_numel, formats),
        "routed_format_bits": dict(ROUTED_FORMAT_BITS),
        "bytes_per_routed_projection": per_projection,
        "tensors_per_routed_projection": {
            fmt: len(routed_projection_tensors("p", *shapes["gate_proj"], fmt)) for fmt in FORMATS
        },
        "parameters": {
            "total": routed_params + non_expert_params,
            "routed": routed_params,
            "non_expert": non_expert_params,
        },
    }


# ---------------------------------------------------------------------------------------- report


def format_prediction(report: Mapping[str, Any]) -> str:
    """Human-readable summary of :func:`predict_structure`'s result."""
    t, b = report["tensors"], report["bytes"]
    counts = report["placement_counts"]
    lines = [
        f"placement: {', '.join(f'{fmt}={counts[fmt]}' for fmt in FORMATS)}"
        f"  (KV cache: {report['kv_cache_quant'] or 'not quantized'})",
        f"routed effective bits: {report['routed_effective_bits']:.4f}"
        if report["routed_effective_bits"] is not None
        else "routed effective bits: n/a (no MoE layers)",
        f"{'category':<22}{'tensors':>12}{'bytes':>20}",
    ]
    for fmt in FORMATS:
        lines.append(f"{'routed ' + fmt:<22}{t['routed'][fmt]:>12,}{b['routed'][fmt]:>20,}")
    lines += [
        f"{'non-expert':<22}{t['non_expert']:>12,}{b['non_expert']:>20,}",
        f"{'KV-cache scales':<22}{t['kv_scales']:>12,}{b['kv_scales']:>20,}",
        f"{'total':<22}{t['total']:>12,}{b['total']:>20,}",
        "bytes per routed projection: "
        + ", ".join(f"{fmt} {report['bytes_per_routed_projection'][fmt]['gate_proj']:,}" for fmt in FORMATS),
        f"parameters: {report['parameters']['total']:,} total, {report['parameters']['routed']:,} routed",
    ]
    if report.get("layer_formats"):
        lines.append("layers: " + " ".join(f"{k}:{v}" for k, v in report["layer_formats"].items()))
    return "\n".join(lines)
