"""Predict the structure of a ModelOpt mixed-precision export from config.json and a placement alone.

What ModelOpt 0.47's ``export_hf_checkpoint`` writes for a Laguna model whose routed experts are placed per
MoE layer on NVFP4 W4A16 / FP8 / BF16 (everything else BF16), per routed projection
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj``, weight ``[N, K]``):

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

Placement file (``--placement``, JSON), written by hand or by a placement stage::

    {"layers": {"1": "nvfp4_w4a16", "2": "fp8", "3": "bf16", ...}, "metadata": {...}}

``layers`` maps MoE layer indices (decimal strings, as JSON requires) to one of ``nvfp4_w4a16``, ``fp8``,
``bf16``; MoE layers not named stay BF16 (as in
:func:`mixquant.quantize.reference.modelopt_reference_export`).
``metadata`` is optional, free-form and ignored (provenance); any other top-level key is an error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

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
    "estimate_metadata_bytes",
    "format_prediction",
    "load_placement",
    "moe_layers",
    "parse_placement",
    "parse_placement_counts",
    "predict_structure",
    "resolve_placement",
    "routed_effective_bits",
]

# The same spellings as mixquant.quantize.reference (kept here so that predicting needs no torch/ModelOpt).
NVFP4 = "nvfp4_w4a16"
FP8 = "fp8"
BF16 = "bf16"
FORMATS = (NVFP4, FP8, BF16)
# Nominal storage bits per routed weight element (ModelOpt recipe convention: NVFP4 = 4 + 8/16).
ROUTED_FORMAT_BITS: dict[str, float] = {NVFP4: 4.5, FP8: 8.0, BF16: 16.0}
NVFP4_GROUP_SIZE = 16
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# KV-cache algorithms whose export is exactly one F32 k_scale and one v_scale per attention layer.
KV_CACHE_QUANT_ALGOS = ("FP8",)
KV_SCALE_NAMES = ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")
# Element sizes of safetensors dtypes.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_COUNT_ITEM_RE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*([+-]?\d+)\s*$")
_CATEGORIES = ("routed", "non_expert", "kv_scales")


class PlacementError(ValueError):
    """A bad placement (counts string, placement file, layer map); the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


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


_TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _architecture(model_config: Mapping[str, Any]):
    """The model's architecture (mixquant.model.families), its family's transformers class on the meta
    device: names and shapes as the checkpoint holds them. A config.json without its model_type is read
    as Laguna's (the layout this module first described)."""
    from mixquant.model.families import architecture

    config = dict(model_config)
    config.setdefault("model_type", "laguna")
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
        on_disk = source_dtypes.get(name) or _TORCH_DTYPES.get(dtype, dtype.upper())
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


def parse_placement_counts(text: str) -> dict[str, int]:
    """``"nvfp4_w4a16=39,fp8=3,bf16=5"`` -> ``{"nvfp4_w4a16": 39, "fp8": 3, "bf16": 5}``.

    Formats not named count 0. Raises :class:`PlacementError` (one line) for an empty string, an item
    that is not ``format=count``, an unknown format, a negative count or a format named twice.
    """
    if not str(text).strip():
        raise PlacementError("placement counts: empty (expected e.g. 'nvfp4_w4a16=39,fp8=3,bf16=5')")
    counts = dict.fromkeys(FORMATS, 0)
    seen: set[str] = set()
    for item in str(text).split(","):
        match = _COUNT_ITEM_RE.match(item)
        if not match:
            raise PlacementError(f"placement counts: {item.strip()!r} is not format=count (in {text!r})")
        fmt, count = match.group(1), int(match.group(2))
        if fmt not in counts:
            raise PlacementError(f"placement counts: unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
        if fmt in seen:
            raise PlacementError(f"placement counts: {fmt} given twice (in {text!r})")
        if count < 0:
            raise PlacementError(f"placement counts: {fmt}={count} is negative")
        seen.add(fmt)
        counts[fmt] = count
    return counts


def parse_placement(data: Any, source: str = "placement") -> dict[int, str]:
    """Validate a placement document (see the module docstring) and return ``{layer: format}``."""
    if not isinstance(data, Mapping):
        raise PlacementError(
            f"{source}: expected a JSON object with a 'layers' map, got {type(data).__name__}"
        )
    extra = sorted(set(data) - {"layers", "metadata"})
    if extra:
        raise PlacementError(f"{source}: unknown top-level keys {extra} (allowed: 'layers', 'metadata')")
    layers = data.get("layers")
    if not isinstance(layers, Mapping):
        raise PlacementError(f"{source}: 'layers' must be an object mapping layer index to format")
    out: dict[int, str] = {}
    for key, fmt in layers.items():
        if not re.fullmatch(r"\d+", str(key)):
            raise PlacementError(f"{source}: layer key {key!r} is not a non-negative integer")
        if fmt not in FORMATS:
            raise PlacementError(
                f"{source}: layer {key}: unknown format {fmt!r} (formats: {', '.join(FORMATS)})"
            )
        if int(key) in out:
            raise PlacementError(f"{source}: layer {int(key)} given twice")
        out[int(key)] = fmt
    return dict(sorted(out.items()))


def load_placement(path: str | Path) -> dict[int, str]:
    """Read a placement JSON file (see the module docstring); errors are one line naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlacementError(f"{path}: cannot read placement ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise PlacementError(f"{path}: not valid JSON ({exc})") from exc
    return parse_placement(data, str(path))


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


def _tally(entries: Iterable[TensorEntry]) -> tuple[dict[str, Any], dict[str, Any]]:
    tensors: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    nbytes: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    for e in entries:
        if e.category == "routed":
            tensors["routed"][e.format] = tensors["routed"].get(e.format, 0) + 1
            nbytes["routed"][e.format] = nbytes["routed"].get(e.format, 0) + e.nbytes
        else:
            tensors[e.category] += 1
            nbytes[e.category] += e.nbytes
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
    entries = checkpoint_tensors(model_config, formats, kv_cache_quant=kv, source_dtypes=source_dtypes)
    tensors, nbytes = _tally(entries)
    shapes = _routed_shapes(model_config)
    arch = _architecture(model_config)
    num_experts = arch.num_experts
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


# ------------------------------------------------------------------------------ metadata estimate


def _greedy_shards(entries: list[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """transformers' ``split_torch_state_dict_into_shards``: fill in order, start a new shard when the
    next tensor would exceed ``max_shard_bytes``."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _safetensors_header_bytes(entries: list[TensorEntry], metadata: Mapping[str, str] | None) -> int:
    """Exact size (8-byte length prefix + JSON, padded to 8) of the header safetensors writes: compact
    JSON, tensors laid out by descending element size, then name (safetensors' ``prepare``)."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for e in sorted(entries, key=lambda e: (-DTYPE_BYTES[e.dtype], e.name)):
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return 8 + len(text) + (-len(text)) % 8


def estimate_metadata_bytes(
    entries: list[TensorEntry],
    *,
    max_shard_bytes: int = 10 * 10**9,
    metadata: Mapping[str, str] | None = None,
    total_parameters: int | None = None,
) -> dict[str, Any]:
    """On-disk bytes that are not tensor payload, for ``entries`` saved the way ``export_hf_checkpoint``
    saves them (``save_pretrained(max_shard_size="10GB")``: greedy shards in state-dict order, safetensors
    headers with ``{"format": "pt"}`` metadata, an index ``json.dumps(indent=2, sort_keys=True)``).

    The tensor order inside the state dict is approximated by ``entries``' order, so shard boundaries and
    offset digit counts are an estimate; the header text per tensor is exact. Returns ``shards`` (number),
    ``shard_header_bytes`` (total and per shard), ``index_bytes`` and their sum.
    """
    metadata = {"format": "pt"} if metadata is None else metadata
    shards = _greedy_shards(list(entries), max_shard_bytes)
    n = len(shards)
    per_shard = [_safetensors_header_bytes(s, metadata) for s in shards]
    index_bytes = 0
    if n > 1:
        names = {
            e.name: f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            for i, shard in enumerate(shards)
            for e in shard
        }
        params = (
            total_parameters if total_parameters is not None else sum(math.prod(e.shape) for e in entries)
        )
        index = {
            "metadata": {"total_parameters": params, "total_size": sum(e.nbytes for e in entries)},
            "weight_map": names,
        }
        index_bytes = len((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return {
        "shards": n,
        "shard_header_bytes": sum(per_shard),
        "shard_header_bytes_per_shard": per_shard,
        "index_bytes": index_bytes,
        "total": sum(per_shard) + index_bytes,
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
