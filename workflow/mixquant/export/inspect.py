"""Audit a ModelOpt-format checkpoint directory from its safetensors headers and JSON files alone.

:func:`inspect_checkpoint` never reads tensor data: every shard's header is parsed and validated
(:func:`mixquant.checkpoint.shards.read_safetensors_header`: a truncated shard or corrupt header stops it with
one line naming the file), and the tensors are classified by name and by the set of tensors present:

* routed-expert projection ``model.layers.L.mlp.experts.E.{gate,up,down}_proj`` by its tensors (see
  :mod:`mixquant.export.predict` for the table): ``nvfp4_w4a16`` (U8 weight, F8_E4M3 weight_scale,
  F32 weight_scale_2), ``nvfp4`` (the same plus an input_scale: ModelOpt's W4A4 NVFP4), ``fp8`` (F8_E4M3
  weight, F32 weight_scale and input_scale), ``bf16`` (a BF16 weight alone), else ``unknown``;
* KV-cache scales: ``model.layers.L.self_attn.{k_proj.k_scale, v_proj.v_scale}`` (ModelOpt's names; the
  bare ``self_attn.{k,v}_scale`` spelling is accepted too);
* everything else is non-expert (including the router's ``e_score_correction_bias``).

On-disk bytes are itemised so that they add up to the directory's total: tensor payload, shard headers
(8-byte length prefix + JSON header), slack inside shards (bytes neither header nor tensor), the index,
config files, tokenizer files and anything else (``.git`` and ``.cache`` folders are skipped).
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from mixquant.export.predict import BF16, FORMATS, FP8, NVFP4, NVFP4_GROUP_SIZE, ROUTED_FORMAT_BITS

__all__ = [
    "CONFIG_FILES",
    "INDEX_FILE",
    "QUANT_CONFIG_FILE",
    "TOKENIZER_FILES",
    "CheckpointInspectionError",
    "classify_projection",
    "format_inspection",
    "inspect_checkpoint",
]

INDEX_FILE = "model.safetensors.index.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"
CONFIG_FILES = frozenset({"config.json", "generation_config.json", QUANT_CONFIG_FILE})
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
SKIPPED_DIRS = frozenset({".git", ".cache"})
NVFP4_W4A4 = "nvfp4"  # ModelOpt "NVFP4": NVFP4 weights and activations (an input_scale per projection)
FORMAT_BITS = {**ROUTED_FORMAT_BITS, NVFP4_W4A4: 4.5}
# hf_quant_config quant_algo -> routed format, and back.
QUANT_ALGO_FORMATS = {"W4A16_NVFP4": NVFP4, "NVFP4": NVFP4_W4A4, "FP8": FP8}
FORMAT_QUANT_ALGOS = {fmt: algo for algo, fmt in QUANT_ALGO_FORMATS.items()}
MAX_LISTED = 5  # examples shown per kind of disagreement

# Routed-expert tensors in the two disk layouts of mixquant.model.families: qwen2_moe-style
# ``mlp.experts.E.{gate,up,down}_proj`` and Mixtral-style ``block_sparse_moe.experts.E.{w1,w3,w2}``.
_ROUTED_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.(\w+)$"
)
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_KV_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k)_proj\.k_scale|(v)_proj\.v_scale|(k)_scale|(v)_scale)$"
)
# a linear module's tensors as ModelOpt exports them (weight, its scales, the static input scale)
_MODULE_TENSORS = frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale"})
_CATEGORIES = (
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
    ("shared_experts", re.compile(r"\.shared_experts?\.")),
    ("attention", re.compile(r"\.(self_attn|attention|attn)\.")),
    ("router", re.compile(r"\.(mlp|block_sparse_moe)\.gate$")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)$")),
    ("embeddings", re.compile(r"embed")),
)
_EXPERTS_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointInspectionError(ValueError):
    """The checkpoint cannot be audited (no shards, a truncated shard, a corrupt header or JSON file);
    the message is one line naming the file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ------------------------------------------------------------------------------------------ reading


def _read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """``(tensors, header_bytes)`` of one shard; header_bytes = 8 + the JSON header's declared length."""
    # Imported here: mixquant.quantize.layer pulls in torch and ModelOpt, which only this needs.
    from mixquant.checkpoint.shards import CheckpointError as QuantizeInputError
    from mixquant.checkpoint.shards import read_safetensors_header

    try:
        header = read_safetensors_header(path)
    except QuantizeInputError as exc:
        raise CheckpointInspectionError(str(exc)) from exc
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
    return header, 8 + header_len


def _read_json(path: Path) -> Any:
    from mixquant.jsonio import read_json

    return read_json(path, "JSON", error=CheckpointInspectionError)


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CheckpointInspectionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _examples(items: list[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:MAX_LISTED])
    return shown + (f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else "")


# ---------------------------------------------------------------------------------- classification


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _architecture(config: Mapping[str, Any] | None, problems: list[str]):
    """The family architecture of the export's config.json (None without one or for an unknown type)."""
    if not config or not isinstance(config.get("model_type"), str):
        return None
    from mixquant.model.families import UnsupportedArchitecture, architecture

    try:
        return architecture(config)
    except UnsupportedArchitecture as exc:
        problems.append(f"config.json: {exc}")
    except (TypeError, ValueError, KeyError) as exc:
        problems.append(f"config.json: not a model config transformers can build ({exc})")
    return None


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


# --------------------------------------------------------------------------------------- the audit


def _find_shards(
    root: Path, index: Mapping[str, Any] | None, problems: list[str]
) -> tuple[list[str], list[str]]:
    """``(shards to read, unreferenced shard files)``, names relative to ``root``."""
    on_disk = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    if index is None:
        if not on_disk:
            raise CheckpointInspectionError(f"{root}: no *.safetensors files and no {INDEX_FILE}")
        if len(on_disk) > 1:
            problems.append(f"{len(on_disk)} safetensors files but no {INDEX_FILE}")
        return on_disk, []
    referenced = sorted(set(index["weight_map"].values()))
    return [s for s in referenced if (root / s).is_file()], [s for s in on_disk if s not in referenced]


def _check_index(
    index: Mapping[str, Any] | None, headers: Mapping[str, Mapping[str, Any]], root: Path, payload: int
) -> dict[str, Any]:
    if index is None:
        return {"present": False, "ok": None, "problems": [], "total_size": None, "total_parameters": None}
    problems: list[str] = []
    weight_map: Mapping[str, str] = index["weight_map"]
    metadata = index.get("metadata") or {}
    missing_files = sorted({s for s in weight_map.values() if not (root / s).is_file()})
    if missing_files:
        problems.append(f"weight_map names missing shards: {_examples(missing_files)}")
    located: dict[str, str] = {}
    duplicates: list[str] = []
    for shard, tensors in headers.items():
        for name in tensors:
            if name in located:
                duplicates.append(name)
            located[name] = shard
    if duplicates:
        problems.append(f"tensors in more than one shard: {_examples(sorted(duplicates))}")
    absent = sorted(n for n, s in weight_map.items() if s not in missing_files and n not in located)
    if absent:
        problems.append(f"weight_map tensors absent from the shards: {_examples(absent)}")
    unindexed = sorted(n for n in located if n not in weight_map)
    if unindexed:
        problems.append(f"shard tensors not in weight_map: {_examples(unindexed)}")
    misplaced = sorted(n for n, s in located.items() if n in weight_map and weight_map[n] != s)
    if misplaced:
        problems.append(
            f"weight_map points to the wrong shard for: "
            f"{_examples([f'{n} ({weight_map[n]}, is in {located[n]})' for n in misplaced])}"
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


def module_category(module: str) -> str:
    """Where a non-expert module sits: lm_head, shared_experts, attention, router, dense_mlp, embeddings,
    other (by the names transformers' MoE families give them)."""
    return next((name for name, pattern in _CATEGORIES if pattern.search(module)), "other")


def _experts_modules(layer: int) -> tuple[str, ...]:
    """The names a quant config gives layer ``layer``'s routed experts: ``mlp.experts`` (in memory, and
    on disk for the qwen2_moe-style families) or Mixtral's disk name ``block_sparse_moe.experts``."""
    return (f"model.layers.{layer}.mlp.experts", f"model.layers.{layer}.block_sparse_moe.experts")


def _expected_from_quant_config(
    quant: Mapping[str, Any], moe_layers: list[int], disagreements: list[str]
) -> dict[int, str] | None:
    """Routed format per MoE layer that hf_quant_config.json declares (None if it cannot say)."""
    algo = quant.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = quant.get("quantized_layers") or {}
        out = {}
        for layer in moe_layers:
            entry = next((layers[k] for k in _experts_modules(layer) if k in layers), None)
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
        modules = [m for module in _experts_modules(layer) for m in (module, f"{module}.0.gate_proj")]
        return any(fnmatch.fnmatchcase(m, p) for p in excludes for m in modules)

    return {layer: BF16 if excluded(layer) else fmt for layer in moe_layers}


def _check_quant_config(
    hf_quant_config: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    layer_formats: Mapping[int, str],
    kv_layers: Mapping[int, set[str]],
    num_layers: int,
    non_expert_quantized: Mapping[str, str],
) -> dict[str, Any]:
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
    expected = _expected_from_quant_config(quant, moe_layers, disagreements)
    if expected is not None:
        for layer in moe_layers:
            if expected[layer] != layer_formats[layer]:
                disagreements.append(
                    f"layer {layer}: {QUANT_CONFIG_FILE} says {expected[layer]}, "
                    f"tensors are {layer_formats[layer]}"
                )
    if quant.get("quant_algo") == "MIXED_PRECISION":
        for module, entry in sorted((quant.get("quantized_layers") or {}).items()):
            match = _EXPERTS_MODULE_RE.match(module)
            if match and int(match.group(1)) not in layer_formats:
                disagreements.append(f"quantized_layers names {module}, which has no routed-expert tensors")
            elif not match and module not in non_expert_quantized:
                disagreements.append(f"quantized_layers names {module}, whose tensors are not quantized")
            elif not match:
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
                f"quantized non-expert modules not in quantized_layers: {_examples(unlisted)}"
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
                f"kv_cache_quant_algo {kv_algo}, but layers lack a k_scale or v_scale: "
                f"{_examples(incomplete)}"
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


def _file_category(rel: str, shards: set[str], unreferenced: set[str]) -> str:
    if rel in shards:
        return "shard"
    if rel in unreferenced:
        return "unreferenced_shards"
    if rel == INDEX_FILE:
        return "index"
    if rel in CONFIG_FILES:
        return "configs"
    if rel in TOKENIZER_FILES:
        return "tokenizer"
    return "other"


def inspect_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Audit the ModelOpt-format checkpoint in ``directory`` (``model.safetensors`` or shards + index).

    Reads only safetensors headers and the JSON files. Returns a JSON-serialisable report:

    * ``tensors`` / ``bytes``: ``routed`` per format (always the three project formats; ``nvfp4`` /
      ``unknown`` only when present), ``non_expert``, ``kv_scales``, ``total``; ``payload_bytes``;
    * ``disk_bytes``: ``payload``, ``shard_headers``, ``shard_slack``, ``index``, ``configs``,
      ``tokenizer``, ``unreferenced_shards``, ``other`` and ``total`` (= the sum of all file sizes), and
      ``files`` (each file's size and category); ``shards`` (per-shard tensors, payload and header bytes);
    * ``layer_formats`` (``{"L": format}`` per MoE layer, ``mixed`` when its projections disagree),
      ``placement_counts``, ``experts_per_layer``, ``routed_effective_bits`` (numel-weighted nominal bits),
      ``routed_storage_bits`` (routed bytes * 8 / routed weight elements), ``routed_parameters``;
    * ``sha256`` of hf_quant_config.json and model.safetensors.index.json (None when absent),
      ``producer``; ``quant_config_check`` and ``index_check`` (``ok`` plus the disagreements);
      ``problems`` (anything else inconsistent) and ``ok`` (no problem anywhere).

    Raises :class:`CheckpointInspectionError` (one line naming the file) for a missing directory, no
    shards, a truncated shard, a corrupt safetensors header or a corrupt JSON file.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointInspectionError(f"{root}: not a directory")
    problems: list[str] = []
    index_path, quant_path, config_path = root / INDEX_FILE, root / QUANT_CONFIG_FILE, root / "config.json"
    index = _read_json_object(index_path)
    if index is not None and not isinstance(index.get("weight_map"), dict):
        raise CheckpointInspectionError(f"{index_path}: no 'weight_map' object")
    hf_quant_config = _read_json_object(quant_path)
    config = _read_json_object(config_path)
    shard_names, unreferenced = _find_shards(root, index, problems)
    if unreferenced:
        problems.append(f"safetensors files not referenced by {INDEX_FILE}: {_examples(unreferenced)}")

    headers: dict[str, dict[str, dict[str, Any]]] = {}
    shards: list[dict[str, Any]] = []
    for shard in shard_names:
        tensors, header_bytes = _read_header(root / shard)
        headers[shard] = tensors
        payload = sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0]) for t in tensors.values())
        file_bytes = (root / shard).stat().st_size
        shards.append(
            {
                "file": shard,
                "tensors": len(tensors),
                "payload_bytes": payload,
                "header_bytes": header_bytes,
                "slack_bytes": file_bytes - header_bytes - payload,
                "file_bytes": file_bytes,
            }
        )

    # ---- classify every tensor
    projections: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    kv_layers: dict[int, set[str]] = defaultdict(set)
    tensors_count: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    bytes_count: dict[str, Any] = {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    non_expert_modules: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    max_layer = -1
    for tensors in headers.values():
        for name, info in tensors.items():
            nbytes = int(info["data_offsets"][1]) - int(info["data_offsets"][0])
            if (m := _LAYER_RE.match(name)) is not None:
                max_layer = max(max_layer, int(m.group(1)))
            if (m := _ROUTED_RE.match(name)) is not None:
                proj = _MIXTRAL_PROJECTIONS.get(m.group(3), m.group(3))
                projections[(int(m.group(1)), int(m.group(2)), proj)][m.group(4)] = {
                    **info,
                    "nbytes": nbytes,
                }
                continue
            if (m := _KV_RE.match(name)) is not None:
                kv_layers[int(m.group(1))].add(next(g for g in m.groups()[1:] if g))
                tensors_count["kv_scales"] += 1
                bytes_count["kv_scales"] += nbytes
                continue
            tensors_count["non_expert"] += 1
            bytes_count["non_expert"] += nbytes
            module, _, suffix = name.rpartition(".")
            if suffix in _MODULE_TENSORS and module:
                non_expert_modules[module][suffix] = info

    layer_numel: dict[int, Counter] = defaultdict(Counter)
    experts: dict[int, set[int]] = defaultdict(set)
    projection_problems: list[str] = []
    for (layer, expert, proj), parts in sorted(projections.items()):
        fmt, numel, problem = classify_projection(parts)
        if problem:
            projection_problems.append(f"model.layers.{layer}.mlp.experts.{expert}.{proj}: {problem}")
        layer_numel[layer][fmt] += numel
        experts[layer].add(expert)
        tensors_count["routed"][fmt] = tensors_count["routed"].get(fmt, 0) + len(parts)
        bytes_count["routed"][fmt] = bytes_count["routed"].get(fmt, 0) + sum(
            p["nbytes"] for p in parts.values()
        )
    non_expert_quantized: dict[str, str] = {}
    for module, parts in sorted(non_expert_modules.items()):
        if set(parts) == {"weight"}:
            continue  # a plain (BF16 / F32) weight: not quantized
        fmt, _, problem = classify_projection(parts)
        non_expert_quantized[module] = fmt
        if problem:
            projection_problems.append(f"{module}: {problem}")
    if projection_problems:
        problems.append(f"quantized projections: {_examples(projection_problems)}")
    for table in (tensors_count, bytes_count):
        table["total"] = sum(table["routed"].values()) + table["non_expert"] + table["kv_scales"]

    layer_formats = {
        layer: next(iter(numel)) if len(numel) == 1 else "mixed"
        for layer, numel in sorted(layer_numel.items())
    }
    for layer, fmt in layer_formats.items():
        if fmt == "mixed":
            problems.append(
                f"layer {layer}: routed projections in several formats {dict(layer_numel[layer])}"
            )
    incomplete = [
        f"{layer}.{expert}"
        for layer in experts
        for expert in sorted(experts[layer])
        if any((layer, expert, p) not in projections for p in ("gate_proj", "up_proj", "down_proj"))
    ]
    if incomplete:
        problems.append(f"experts missing a projection (layer.expert): {_examples(incomplete)}")
    expert_counts = {layer: len(ids) for layer, ids in sorted(experts.items())}
    arch = _architecture(config, problems)
    if arch is not None:
        wrong = {layer: n for layer, n in expert_counts.items() if n != arch.num_experts}
        if wrong:
            problems.append(f"config.json: {arch.num_experts} experts per MoE layer, but layers have {wrong}")
        if list(arch.moe_layers) != sorted(layer_formats):
            problems.append(
                f"config.json MoE layers {list(arch.moe_layers)} != layers with routed experts "
                f"{sorted(layer_formats)}"
            )

    total_numel = sum(sum(c.values()) for c in layer_numel.values())
    known_numel = sum(n for c in layer_numel.values() for fmt, n in c.items() if fmt in FORMAT_BITS)
    effective_bits = None
    if known_numel:
        weighted = sum(
            Fraction(FORMAT_BITS[fmt]) * n
            for c in layer_numel.values()
            for fmt, n in c.items()
            if fmt in FORMAT_BITS
        )
        effective_bits = float(weighted / known_numel)
    placement_counts = dict.fromkeys(FORMATS, 0)
    for fmt in layer_formats.values():
        placement_counts[fmt] = placement_counts.get(fmt, 0) + 1

    num_layers = (
        int(config["num_hidden_layers"]) if config and config.get("num_hidden_layers") else max_layer + 1
    )
    payload = bytes_count["total"]
    index_check = _check_index(index, headers, root, payload)
    quant_check = _check_quant_config(
        hf_quant_config, config, layer_formats, kv_layers, num_layers, non_expert_quantized
    )
    quantized_modules: dict[str, dict[str, int]] = defaultdict(Counter)
    for fmt in layer_formats.values():
        if fmt != BF16:
            quantized_modules["routed_experts"][fmt] += 1  # one experts module per MoE layer
    for module, fmt in non_expert_quantized.items():
        quantized_modules[module_category(module)][fmt] += 1
    if kv_layers:
        quantized_modules["kv_cache"]["fp8"] = len(kv_layers)

    # ---- on-disk bytes
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part in SKIPPED_DIRS for part in rel.parts):
            continue
        files.append(
            {
                "path": rel.as_posix(),
                "bytes": path.stat().st_size,
                "category": _file_category(rel.as_posix(), set(shard_names), set(unreferenced)),
            }
        )
    disk: dict[str, int] = {
        "payload": payload,
        "shard_headers": sum(s["header_bytes"] for s in shards),
        "shard_slack": sum(s["slack_bytes"] for s in shards),
    }
    for category in ("index", "configs", "tokenizer", "unreferenced_shards", "other"):
        disk[category] = sum(f["bytes"] for f in files if f["category"] == category)
    disk["total"] = sum(f["bytes"] for f in files)
    routed_bytes = sum(bytes_count["routed"].values())

    report = {
        "directory": str(root),
        "layout": "sharded" if index is not None else "single",
        "shards": shards,
        "tensors": tensors_count,
        "bytes": bytes_count,
        "payload_bytes": payload,
        "disk_bytes": disk,
        "files": files,
        "layer_formats": {str(layer): fmt for layer, fmt in layer_formats.items()},
        "placement_counts": placement_counts,
        "experts_per_layer": {str(layer): n for layer, n in expert_counts.items()},
        "routed_parameters": total_numel,
        "routed_effective_bits": effective_bits,
        "routed_storage_bits": routed_bytes * 8 / total_numel if total_numel else None,
        "kv_scale_layers": sorted(kv_layers),
        "quantized_modules": {cat: dict(sorted(c.items())) for cat, c in sorted(quantized_modules.items())},
        "quantized_module_count": sum(sum(c.values()) for c in quantized_modules.values()),
        "non_expert_formats": non_expert_quantized,
        "sha256": {QUANT_CONFIG_FILE: _sha256(quant_path), INDEX_FILE: _sha256(index_path)},
        "producer": (hf_quant_config or {}).get("producer"),
        "quant_config_check": quant_check,
        "index_check": index_check,
        "problems": problems,
    }
    report["ok"] = not problems and quant_check["ok"] and index_check["ok"] is not False
    return report


# ---------------------------------------------------------------------------------------- report


def format_inspection(report: Mapping[str, Any]) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s report."""
    t, b, disk = report["tensors"], report["bytes"], report["disk_bytes"]
    producer = report.get("producer") or {}
    bits = report["routed_effective_bits"]
    lines = [
        f"checkpoint: {report['directory']} ({report['layout']}, {len(report['shards'])} shard(s))",
        f"producer: {producer.get('name', '?')} {producer.get('version', '?')}"
        if producer
        else "producer: unknown",
        "placement: " + ", ".join(f"{fmt}={n}" for fmt, n in report["placement_counts"].items()),
        f"routed effective bits: {bits:.4f}" if bits is not None else "routed effective bits: n/a",
        f"{'category':<22}{'tensors':>12}{'bytes':>20}",
    ]
    for fmt, n in t["routed"].items():
        lines.append(f"{'routed ' + fmt:<22}{n:>12,}{b['routed'][fmt]:>20,}")
    lines += [
        f"{'non-expert':<22}{t['non_expert']:>12,}{b['non_expert']:>20,}",
        f"{'KV-cache scales':<22}{t['kv_scales']:>12,}{b['kv_scales']:>20,}",
        f"{'total (payload)':<22}{t['total']:>12,}{b['total']:>20,}",
        "on disk:",
    ]
    for key in (
        "payload",
        "shard_headers",
        "shard_slack",
        "index",
        "configs",
        "tokenizer",
        "unreferenced_shards",
    ):
        lines.append(f"  {key:<20}{disk[key]:>20,}")
    lines.append(f"  {'other':<20}{disk['other']:>20,}")
    lines.append(f"  {'total':<20}{disk['total']:>20,}")
    for f in report["files"]:
        if f["category"] == "other":
            lines.append(f"    other file {f['path']}: {f['bytes']:,}")
    for name, digest in report["sha256"].items():
        lines.append(f"sha256 {name}: {digest or 'absent'}")
    if report["layer_formats"]:
        lines.append("layers: " + " ".join(f"{k}:{v}" for k, v in report["layer_formats"].items()))
    lines.append(f"quantized modules: {report['quantized_module_count']}")
    for category, formats in report["quantized_modules"].items():
        lines.append(f"  {category:<20}" + ", ".join(f"{fmt}={n}" for fmt, n in formats.items()))
    qc, ic = report["quant_config_check"], report["index_check"]
    lines.append(f"hf_quant_config vs tensors: {'ok' if qc['ok'] else 'DISAGREE'}")
    lines += [f"  - {d}" for d in qc["disagreements"]]
    if ic["present"]:
        lines.append(f"index vs shard headers: {'ok' if ic['ok'] else 'DISAGREE'}")
        lines += [f"  - {p}" for p in ic["problems"]]
    lines += [f"problem: {p}" for p in report["problems"]]
    lines.append(f"overall: {'ok' if report['ok'] else 'PROBLEMS'}")
    return "\n".join(lines)
