"""The checks of a checkpoint audit (:mod:`mixquant.export.inspect`): one routed projection's format from
its tensors, the index against the shard headers, hf_quant_config.json against the tensors."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixquant.export.files import QUANT_CONFIG_FILE
from mixquant.formats.facts import BF16, FP8, NVFP4, NVFP4_GROUP_SIZE, ROUTED_FORMAT_BITS
from mixquant.model.families import Architecture
from mixquant.model.families.naming import experts_module_layer, experts_module_names

__all__ = [
    "FORMAT_BITS",
    "FORMAT_QUANT_ALGOS",
    "NVFP4_W4A4",
    "QUANT_ALGO_FORMATS",
    "check_index",
    "check_quant_config",
    "classify_projection",
    "examples",
]

NVFP4_W4A4 = "nvfp4"  # ModelOpt "NVFP4": NVFP4 weights and activations (an input_scale per projection)
FORMAT_BITS = {**ROUTED_FORMAT_BITS, NVFP4_W4A4: 4.5}
# hf_quant_config quant_algo -> routed format, and back.
QUANT_ALGO_FORMATS = {"W4A16_NVFP4": NVFP4, "NVFP4": NVFP4_W4A4, "FP8": FP8}
FORMAT_QUANT_ALGOS = {fmt: algo for algo, fmt in QUANT_ALGO_FORMATS.items()}
MAX_LISTED = 5  # examples shown per kind of disagreement


def examples(items: list[Any]) -> str:
    """The first few of ``items``, and how many there are in all."""
    shown = ", ".join(str(i) for i in items[:MAX_LISTED])
    return shown + (f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else "")


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def classify_projection(tensors: Mapping[str, Mapping[str, Any]]) -> tuple[str, int, str | None]:
    """``(format, weight_numel, problem)`` of one routed projection from its ``{suffix: header entry}``.

    ``weight_numel`` is the unpacked element count of the weight (``N * K``; a packed NVFP4 ``[N, K/2]``
    U8 weight holds ``N * K``); ``problem`` describes an inconsistency (e.g. an NVFP4 block size other than
    16, a non-scalar per-tensor scale) or is None.
    """
    keys = set(tensors)
    dtypes = {k: v["dtype"] for k, v in tensors.items()}
    shapes = {k: [int(d) for d in v["shape"]] for k, v in tensors.items()}

    def scalar(key: str) -> bool:
        return dtypes.get(key) == "F32" and _numel(shapes[key]) == 1

    weight = shapes.get("weight")
    if weight is None or len(weight) != 2:
        return "unknown", 0, f"tensors {sorted(keys)} (no 2-D weight)"
    n, cols = weight
    nvfp4_keys = {"weight", "weight_scale", "weight_scale_2"}
    if keys in (nvfp4_keys, nvfp4_keys | {"input_scale"}) and dtypes["weight"] == "U8":
        fmt = NVFP4 if keys == nvfp4_keys else NVFP4_W4A4
        k = 2 * cols
        problem = None
        scale = shapes["weight_scale"]
        if dtypes["weight_scale"] != "F8_E4M3" or not scalar("weight_scale_2"):
            problem = f"NVFP4 scales have dtypes {dtypes['weight_scale']}/{dtypes['weight_scale_2']}"
        elif fmt == NVFP4_W4A4 and not scalar("input_scale"):
            problem = "NVFP4 input_scale is not an F32 scalar"
        elif len(scale) != 2 or scale[0] != n or scale[1] * NVFP4_GROUP_SIZE != k:
            want = [n, k // NVFP4_GROUP_SIZE]
            problem = f"NVFP4 weight [{n}, {cols}] (K={k}) has weight_scale {scale}, not {want}"
        return fmt, n * k, problem
    if keys == {"weight", "weight_scale", "input_scale"} and dtypes["weight"] == "F8_E4M3":
        problem = (
            None if scalar("weight_scale") and scalar("input_scale") else "FP8 scales are not F32 scalars"
        )
        return FP8, n * cols, problem
    if keys == {"weight"} and dtypes["weight"] == "BF16":
        return BF16, n * cols, None
    return "unknown", n * cols, f"tensors {sorted(f'{k}:{dtypes[k]}' for k in keys)}"


def check_index(
    index: Mapping[str, Any] | None, headers: Mapping[str, Mapping[str, Any]], root: Path, payload: int
) -> dict[str, Any]:
    """The index against the shard headers: ``ok`` and the problems, one line each."""
    if index is None:
        return {"present": False, "ok": None, "problems": [], "total_size": None, "total_parameters": None}
    problems: list[str] = []
    weight_map: Mapping[str, str] = index["weight_map"]
    metadata = index.get("metadata") or {}
    missing_files = sorted({s for s in weight_map.values() if not (root / s).is_file()})
    if missing_files:
        problems.append(f"weight_map names missing shards: {examples(missing_files)}")
    located: dict[str, str] = {}
    duplicates: list[str] = []
    for shard, tensors in headers.items():
        for name in tensors:
            if name in located:
                duplicates.append(name)
            located[name] = shard
    if duplicates:
        problems.append(f"tensors in more than one shard: {examples(sorted(duplicates))}")
    absent = sorted(n for n, s in weight_map.items() if s not in missing_files and n not in located)
    if absent:
        problems.append(f"weight_map tensors absent from the shards: {examples(absent)}")
    unindexed = sorted(n for n in located if n not in weight_map)
    if unindexed:
        problems.append(f"shard tensors not in weight_map: {examples(unindexed)}")
    misplaced = sorted(n for n, s in located.items() if n in weight_map and weight_map[n] != s)
    if misplaced:
        problems.append(
            f"weight_map points to the wrong shard for: "
            f"{examples([f'{n} ({weight_map[n]}, is in {located[n]})' for n in misplaced])}"
        )
    total_size = metadata.get("total_size")
    if total_size is None:
        problems.append("index metadata has no total_size")
    elif int(total_size) != payload:
        problems.append(f"index total_size {int(total_size):,} != shard tensor bytes {payload:,}")
    return {
        "present": True,
        "ok": not problems,
        "problems": problems,
        "entries": len(weight_map),
        "total_size": total_size,
        "total_parameters": metadata.get("total_parameters"),
    }


def _expected_from_quant_config(
    quant: Mapping[str, Any], moe_layers: list[int], disagreements: list[str], arch: Architecture | None
) -> dict[int, str] | None:
    """Routed format per MoE layer that hf_quant_config.json declares (None if it cannot say)."""
    algo = quant.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = quant.get("quantized_layers") or {}
        out = {}
        for layer in moe_layers:
            entry = next((layers[k] for k in experts_module_names(layer, arch) if k in layers), None)
            if entry is None:
                out[layer] = BF16
                continue
            fmt = QUANT_ALGO_FORMATS.get(str(entry.get("quant_algo")).upper())
            if fmt is None:
                disagreements.append(f"layer {layer}: unsupported quant_algo {entry.get('quant_algo')!r}")
            elif fmt in (NVFP4, NVFP4_W4A4) and entry.get("group_size") != NVFP4_GROUP_SIZE:
                disagreements.append(
                    f"layer {layer}: group_size {entry.get('group_size')!r}, tensors have {NVFP4_GROUP_SIZE}"
                )
            out[layer] = fmt or "unknown"
        return out
    if algo is None:
        return dict.fromkeys(moe_layers, BF16)
    fmt = QUANT_ALGO_FORMATS.get(str(algo).upper())
    if fmt is None:
        disagreements.append(f"unsupported quant_algo {algo!r}")
        return None
    excludes = quant.get("exclude_modules") or []

    def excluded(layer: int) -> bool:
        modules = [
            m for module in experts_module_names(layer, arch) for m in (module, f"{module}.0.gate_proj")
        ]
        return any(fnmatch.fnmatchcase(m, p) for p in excludes for m in modules)

    return {layer: BF16 if excluded(layer) else fmt for layer in moe_layers}


def check_quant_config(
    hf_quant_config: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    layer_formats: Mapping[int, str],
    kv_layers: Mapping[int, set[str]],
    num_layers: int,
    non_expert_quantized: Mapping[str, str],
    arch: Architecture | None,
) -> dict[str, Any]:
    """hf_quant_config.json (and config.json's copy of it) against what the tensors are: ``ok`` and the
    disagreements, one line each."""
    disagreements: list[str] = []
    quantized_tensors = any(f != BF16 for f in layer_formats.values()) or kv_layers or non_expert_quantized
    if hf_quant_config is None:
        if quantized_tensors:
            disagreements.append(f"no {QUANT_CONFIG_FILE}, but the checkpoint has quantized tensors")
        return {"present": False, "ok": not disagreements, "disagreements": disagreements}
    quant = hf_quant_config.get("quantization")
    if not isinstance(quant, Mapping):
        disagreements.append(f"{QUANT_CONFIG_FILE} has no 'quantization' object")
        return {"present": True, "ok": False, "disagreements": disagreements}
    moe_layers = sorted(layer_formats)
    expected = _expected_from_quant_config(quant, moe_layers, disagreements, arch)
    if expected is not None:
        for layer in moe_layers:
            if expected[layer] != layer_formats[layer]:
                disagreements.append(
                    f"layer {layer}: {QUANT_CONFIG_FILE} says {expected[layer]}, "
                    f"tensors are {layer_formats[layer]}"
                )
    if quant.get("quant_algo") == "MIXED_PRECISION":
        for module, entry in sorted((quant.get("quantized_layers") or {}).items()):
            layer = experts_module_layer(module, arch)
            if layer is not None and layer not in layer_formats:
                disagreements.append(f"quantized_layers names {module}, which has no routed-expert tensors")
            elif layer is None and module not in non_expert_quantized:
                disagreements.append(f"quantized_layers names {module}, whose tensors are not quantized")
            elif layer is None:
                declared = QUANT_ALGO_FORMATS.get(str((entry or {}).get("quant_algo")).upper(), "unknown")
                actual = non_expert_quantized[module]
                if declared != actual:
                    disagreements.append(
                        f"{module}: {QUANT_CONFIG_FILE} says {declared}, tensors are {actual}"
                    )
        listed = set(quant.get("quantized_layers") or {})
        unlisted = [m for m in non_expert_quantized if m not in listed]
        if unlisted:
            disagreements.append(
                f"quantized non-expert modules not in quantized_layers: {examples(unlisted)}"
            )
    elif quant.get("quant_algo") is not None:  # one algorithm for every module not excluded
        fmt = QUANT_ALGO_FORMATS.get(str(quant.get("quant_algo")).upper())
        excludes = quant.get("exclude_modules") or []
        for module, actual in non_expert_quantized.items():
            if any(fnmatch.fnmatchcase(module, p) for p in excludes):
                disagreements.append(f"{module}: in exclude_modules, but its tensors are {actual}")
            elif fmt is not None and actual != fmt:
                disagreements.append(f"{module}: {QUANT_CONFIG_FILE} says {fmt}, tensors are {actual}")
    kv_algo = quant.get("kv_cache_quant_algo")
    if kv_algo is None and kv_layers:
        disagreements.append(
            f"kv_cache_quant_algo is null, but {len(kv_layers)} layers carry KV-cache scales"
        )
    elif kv_algo is not None:
        incomplete = [layer for layer in range(num_layers) if kv_layers.get(layer) != {"k", "v"}]
        if incomplete:
            disagreements.append(
                f"kv_cache_quant_algo {kv_algo}, but layers lack a k_scale or v_scale: {examples(incomplete)}"
            )
    if config is not None and isinstance(config.get("quantization_config"), Mapping):
        embedded = config["quantization_config"]
        for key in ("quant_algo", "kv_cache_quant_algo", "quantized_layers", "producer"):
            theirs = hf_quant_config.get("producer") if key == "producer" else quant.get(key)
            if key in embedded and embedded[key] != theirs:
                disagreements.append(
                    f"config.json quantization_config.{key} differs from {QUANT_CONFIG_FILE}"
                )
    return {
        "present": True,
        "ok": not disagreements,
        "quant_algo": quant.get("quant_algo"),
        "kv_cache_quant_algo": kv_algo,
        "disagreements": disagreements,
    }
