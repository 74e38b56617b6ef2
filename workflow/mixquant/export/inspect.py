"""Audit a ModelOpt-format checkpoint directory from its safetensors headers and JSON files alone.

:func:`inspect_checkpoint` never reads tensor data: every shard's header is parsed and validated
(:func:`mixquant.checkpoint.headers.read_safetensors_header`: a truncated shard or corrupt header stops it
with one line naming the file), and the tensors are classified by their names, read as the model's family
writes them (:mod:`mixquant.model.families.naming`; the config.json beside the shards names the family),
and by the set of tensors present:

* a routed-expert projection by its tensors (:func:`~mixquant.export.inspect_checks.classify_projection`;
  :mod:`mixquant.export.predict` has the table): ``nvfp4_w4a16`` (U8 weight, F8_E4M3 weight_scale, F32
  weight_scale_2), ``nvfp4`` (the same plus an input_scale: ModelOpt's W4A4 NVFP4), ``fp8`` (F8_E4M3
  weight, F32 weight_scale and input_scale), ``bf16`` (a BF16 weight alone), else ``unknown``;
* KV-cache scales: ``model.layers.L.self_attn.{k_proj.k_scale, v_proj.v_scale}`` (ModelOpt's names; the
  bare ``self_attn.{k,v}_scale`` spelling is accepted too);
* everything else is non-expert (including the router's ``e_score_correction_bias``).

The index and hf_quant_config.json are checked against the tensors (:mod:`mixquant.export.inspect_checks`).
On-disk bytes are itemised so that they add up to the directory's total: tensor payload, shard headers
(8-byte length prefix + JSON header), slack inside shards (bytes neither header nor tensor), the index,
config files, tokenizer files and anything else (``.git`` and ``.cache`` folders are skipped).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from mixquant.checkpoint.headers import CheckpointError, layer_of, read_header
from mixquant.export.files import CONFIG_FILE, CONFIG_FILES, INDEX_FILE, QUANT_CONFIG_FILE, TOKENIZER_FILES
from mixquant.export.inspect_checks import (
    FORMAT_BITS,
    check_index,
    check_quant_config,
    classify_projection,
    examples,
)
from mixquant.formats.facts import BF16, FORMATS, FP8
from mixquant.jsonio import read_json
from mixquant.model.families import PROJECTIONS, Architecture, UnsupportedArchitecture, architecture
from mixquant.model.families.naming import expert_prefix, module_category, routed_expert_tensor

__all__ = ["CheckpointInspectionError", "inspect_checkpoint"]

SKIPPED_DIRS = frozenset({".git", ".cache"})
_KV_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k)_proj\.k_scale|(v)_proj\.v_scale|(k)_scale|(v)_scale)$"
)
# a linear module's tensors as ModelOpt exports them (weight, its scales, the static input scale)
_MODULE_TENSORS = frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale"})


class CheckpointInspectionError(ValueError):
    """The checkpoint cannot be audited (no shards, a truncated shard, a corrupt header or JSON file);
    the message is one line naming the file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ------------------------------------------------------------------------------------------ reading


def _read_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """``(tensors, header_bytes)`` of one shard; header_bytes = 8 + the JSON header's declared length."""
    try:
        return read_header(path)
    except CheckpointError as exc:
        raise CheckpointInspectionError(str(exc)) from exc


def _read_json(path: Path) -> Any:
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


def _architecture(config: Mapping[str, Any] | None, problems: list[str]):
    """The family architecture of the export's config.json (None without one or for an unknown type)."""
    if not config or not isinstance(config.get("model_type"), str):
        return None
    try:
        return architecture(config)
    except UnsupportedArchitecture as exc:
        problems.append(f"config.json: {exc}")
    except (TypeError, ValueError, KeyError) as exc:
        problems.append(f"config.json: not a model config transformers can build ({exc})")
    return None


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


def _read_shards(
    root: Path, shard_names: list[str]
) -> tuple[dict[str, dict[str, dict[str, Any]]], list[dict[str, Any]]]:
    """``(each shard's header, each shard's tensors and bytes)``, headers validated."""
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
    return headers, shards


@dataclass
class _Tensors:
    """Every tensor of the checkpoint, by kind: routed projections (``(layer, expert, proj)`` -> their
    tensors), KV-cache scales per layer, non-expert modules' tensors; counts and bytes per kind."""

    projections: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    kv_layers: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    non_expert_modules: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    count: dict[str, Any] = field(
        default_factory=lambda: {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    )
    bytes: dict[str, Any] = field(
        default_factory=lambda: {"routed": dict.fromkeys(FORMATS, 0), "non_expert": 0, "kv_scales": 0}
    )
    max_layer: int = -1


def _classify_tensors(
    headers: Mapping[str, Mapping[str, dict[str, Any]]], arch: Architecture | None
) -> _Tensors:
    """Sort every tensor by name (the family's, :mod:`mixquant.model.families.naming`) into its kind."""
    out = _Tensors()
    for tensors in headers.values():
        for name, info in tensors.items():
            nbytes = int(info["data_offsets"][1]) - int(info["data_offsets"][0])
            if (layer := layer_of(name)) is not None:
                out.max_layer = max(out.max_layer, layer)
            if (routed := routed_expert_tensor(name, arch)) is not None:
                layer, expert, proj, suffix = routed
                out.projections[(layer, expert, proj)][suffix] = {**info, "nbytes": nbytes}
                continue
            if (m := _KV_RE.match(name)) is not None:
                out.kv_layers[int(m.group(1))].add(next(g for g in m.groups()[1:] if g))
                out.count["kv_scales"] += 1
                out.bytes["kv_scales"] += nbytes
                continue
            out.count["non_expert"] += 1
            out.bytes["non_expert"] += nbytes
            module, _, suffix = name.rpartition(".")
            if suffix in _MODULE_TENSORS and module:
                out.non_expert_modules[module][suffix] = info
    return out


def _effective_bits(layer_numel: Mapping[int, Counter]) -> float | None:
    """Numel-weighted nominal bits of the routed weights in a known format (None without any)."""
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
    return effective_bits


def _disk_bytes(
    root: Path, shard_names: list[str], unreferenced: list[str], shards: list[dict[str, Any]], payload: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``(every file with its size and category, bytes per category)``: they add up to the directory's."""
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
    return files, disk


def _projection_formats(tensors, arch):
    """The format and weight elements of every quantized projection (routed: per layer, counted into
    ``tensors.count`` / ``tensors.bytes``; non-expert: per module), with the problems found on the way."""
    projections = tensors.projections
    tensors_count, bytes_count = tensors.count, tensors.bytes
    layer_numel: dict[int, Counter] = defaultdict(Counter)
    experts: dict[int, set[int]] = defaultdict(set)
    projection_problems: list[str] = []
    for (layer, expert, proj), parts in sorted(projections.items()):
        fmt, numel, problem = classify_projection(parts)
        if problem:
            projection_problems.append(f"{expert_prefix(layer, expert, proj, arch)}: {problem}")
        layer_numel[layer][fmt] += numel
        experts[layer].add(expert)
        tensors_count["routed"][fmt] = tensors_count["routed"].get(fmt, 0) + len(parts)
        bytes_count["routed"][fmt] = bytes_count["routed"].get(fmt, 0) + sum(
            p["nbytes"] for p in parts.values()
        )
    non_expert_quantized: dict[str, str] = {}
    for module, parts in sorted(tensors.non_expert_modules.items()):
        if set(parts) == {"weight"}:
            continue  # a plain (BF16 / F32) weight: not quantized
        fmt, _, problem = classify_projection(parts)
        non_expert_quantized[module] = fmt
        if problem:
            projection_problems.append(f"{module}: {problem}")
    return layer_numel, experts, non_expert_quantized, projection_problems


def _layer_checks(layer_numel, experts, projections, arch, arch_problems: list[str], problems: list[str]):
    """Each MoE layer's format (``mixed`` when its projections disagree) and expert count, appending to
    ``problems`` what disagrees: mixed layers, incomplete experts, then the architecture's own problems and
    where the layers contradict config.json."""
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
        if any((layer, expert, p) not in projections for p in PROJECTIONS)
    ]
    if incomplete:
        problems.append(f"experts missing a projection (layer.expert): {examples(incomplete)}")
    expert_counts = {layer: len(ids) for layer, ids in sorted(experts.items())}
    problems.extend(arch_problems)
    if arch is not None:
        wrong = {layer: n for layer, n in expert_counts.items() if n != arch.num_experts}
        if wrong:
            problems.append(f"config.json: {arch.num_experts} experts per MoE layer, but layers have {wrong}")
        if list(arch.moe_layers) != sorted(layer_formats):
            problems.append(
                f"config.json MoE layers {list(arch.moe_layers)} != layers with routed experts "
                f"{sorted(layer_formats)}"
            )
    return layer_formats, expert_counts


def _quantized_modules(layer_formats, non_expert_quantized, kv_layers) -> dict[str, dict[str, int]]:
    """Quantized modules per category and format (one routed-experts module per MoE layer)."""
    quantized_modules: dict[str, dict[str, int]] = defaultdict(Counter)
    for fmt in layer_formats.values():
        if fmt != BF16:
            quantized_modules["routed_experts"][fmt] += 1  # one experts module per MoE layer
    for module, fmt in non_expert_quantized.items():
        quantized_modules[module_category(module)][fmt] += 1
    if kv_layers:
        quantized_modules["kv_cache"][FP8] = len(kv_layers)
    return quantized_modules


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
    index_path, quant_path, config_path = root / INDEX_FILE, root / QUANT_CONFIG_FILE, root / CONFIG_FILE
    index = _read_json_object(index_path)
    if index is not None and not isinstance(index.get("weight_map"), dict):
        raise CheckpointInspectionError(f"{index_path}: no 'weight_map' object")
    hf_quant_config = _read_json_object(quant_path)
    config = _read_json_object(config_path)
    arch_problems: list[str] = []
    arch = _architecture(config, arch_problems)
    shard_names, unreferenced = _find_shards(root, index, problems)
    if unreferenced:
        problems.append(f"safetensors files not referenced by {INDEX_FILE}: {examples(unreferenced)}")

    headers, shards = _read_shards(root, shard_names)
    tensors = _classify_tensors(headers, arch)
    projections, kv_layers = tensors.projections, tensors.kv_layers
    tensors_count, bytes_count = tensors.count, tensors.bytes

    layer_numel, experts, non_expert_quantized, projection_problems = _projection_formats(tensors, arch)
    if projection_problems:
        problems.append(f"quantized projections: {examples(projection_problems)}")
    for table in (tensors_count, bytes_count):
        table["total"] = sum(table["routed"].values()) + table["non_expert"] + table["kv_scales"]

    layer_formats, expert_counts = _layer_checks(
        layer_numel, experts, projections, arch, arch_problems, problems
    )

    total_numel = sum(sum(c.values()) for c in layer_numel.values())
    effective_bits = _effective_bits(layer_numel)
    placement_counts = dict.fromkeys(FORMATS, 0)
    for fmt in layer_formats.values():
        placement_counts[fmt] = placement_counts.get(fmt, 0) + 1

    num_layers = (
        int(config["num_hidden_layers"])
        if config and config.get("num_hidden_layers")
        else tensors.max_layer + 1
    )
    payload = bytes_count["total"]
    index_check = check_index(index, headers, root, payload)
    quant_check = check_quant_config(
        hf_quant_config, config, layer_formats, kv_layers, num_layers, non_expert_quantized, arch
    )
    quantized_modules = _quantized_modules(layer_formats, non_expert_quantized, kv_layers)

    files, disk = _disk_bytes(root, shard_names, unreferenced, shards, payload)
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
