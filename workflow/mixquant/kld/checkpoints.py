"""What a KLD engine is handed: the kind of checkpoint (BF16, ModelOpt export, other), read from its JSON
files and safetensors headers, and its tensors read by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mixquant.checkpoint.shards import checkpoint_weight_map
from mixquant.export.inspect import CheckpointInspectionError, inspect_checkpoint
from mixquant.jsonio import read_json
from mixquant.kld.settings import EngineError
from mixquant.model.families import UnsupportedArchitecture, architecture
from mixquant.model.fetch import workdir_path

__all__ = ["QUANT_SUFFIXES", "describe_checkpoint", "read_checkpoint_json", "read_tensors", "tensor_files"]

QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


def read_checkpoint_json(path: Path, who: str) -> Any:
    """A JSON file of the checkpoint; a missing or damaged one is an :class:`EngineError` naming ``who``."""
    return read_json(path, "JSON", error=EngineError, who=who)


def tensor_files(model_dir: Path, who: str) -> dict[str, str]:
    """``{tensor name: shard file}`` of the checkpoint in ``model_dir``."""
    try:
        return checkpoint_weight_map(model_dir)[0]
    except (FileNotFoundError, ValueError) as exc:
        raise EngineError(f"{who}: {exc}") from exc


def describe_checkpoint(model_dir: str | Path, who: str = "engine") -> dict[str, Any]:
    """What kind of checkpoint ``model_dir`` is, from its JSON files and safetensors headers.

    ``kind``: ``"bf16"`` (no ``quantization_config`` / ``hf_quant_config.json``), ``"modelopt"`` or
    ``"other"`` (another ``quant_method``); ``quant_method``, ``quant_algo``, ``kv_cache_quant_algo``,
    ``producer``; ``layer_formats`` (``{"L": routed format}`` per MoE layer, from the tensors, as
    :func:`mixquant.export.inspect.inspect_checkpoint` classifies them), ``kv_scale_layers``,
    ``quantized_non_expert`` (non-routed tensors with quantization scales, at most 5) and the inspection's
    ``problems``.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EngineError(f"{who}: {model_dir} is not a directory")
    config = read_checkpoint_json(model_dir / "config.json", who)
    quant_path = model_dir / "hf_quant_config.json"
    hf_quant = read_checkpoint_json(quant_path, who) if quant_path.is_file() else None
    qc = config.get("quantization_config")
    quantization = (hf_quant or {}).get("quantization") or {}
    quant_method = (qc or {}).get("quant_method") if qc is not None else None
    if qc is None and hf_quant is None:
        kind = "bf16"
    elif (qc is None or quant_method == "modelopt") and (hf_quant is None or _is_modelopt(hf_quant)):
        kind = "modelopt"
    else:
        kind = "other"
    try:
        report = inspect_checkpoint(model_dir)
    except CheckpointInspectionError as exc:
        raise EngineError(f"{who}: {exc}") from exc
    names = tensor_files(model_dir, who)
    try:
        arch = architecture(config)
    except (UnsupportedArchitecture, TypeError, ValueError, KeyError):
        arch = None  # the inspection's problems name it
    non_expert = sorted(
        name
        for name in names
        if name.endswith(QUANT_SUFFIXES) and arch is not None and arch.routed_expert_of(name) is None
    )
    return {
        "directory": workdir_path(model_dir),  # the same record from every clone
        "kind": kind,
        "quant_method": quant_method or ("modelopt" if kind == "modelopt" else None),
        "quant_algo": quantization.get("quant_algo", (qc or {}).get("quant_algo")),
        "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo", (qc or {}).get("kv_cache_quant_algo")),
        "producer": (hf_quant or {}).get("producer", (qc or {}).get("producer")),
        "layer_formats": dict(report["layer_formats"]),
        "kv_scale_layers": list(report["kv_scale_layers"]),
        "quantized_non_expert": non_expert[:5],
        "problems": list(report["problems"]) + list(report["quant_config_check"].get("disagreements") or []),
    }


def _is_modelopt(hf_quant: Mapping[str, Any]) -> bool:
    """ModelOpt's own export, or mixquant's (producer mixquant, numerics ModelOpt: the same schema)."""
    producer = hf_quant.get("producer") or {}
    if not isinstance(producer, Mapping):
        return False
    numerics = producer.get("numerics") or {}
    return producer.get("name") == "modelopt" or (
        producer.get("name") == "mixquant"
        and isinstance(numerics, Mapping)
        and numerics.get("name") == "modelopt"
    )


def read_tensors(model_dir: Path, names: Sequence[str], who: str) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint in ``model_dir``, each shard opened once."""
    weight_map = tensor_files(model_dir, who)
    missing = [name for name in names if name not in weight_map]
    if missing:
        raise EngineError(f"{who}: {model_dir} has no tensor {missing[0]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map[name], []).append(name)
    for file, file_names in sorted(by_file.items()):
        with safe_open(str(model_dir / file), framework="pt") as handle:
            for name in file_names:
                out[name] = handle.get_tensor(name)
    return out
