"""What the export reads, checked before the first byte is written: the source checkpoint's tensors
(every shard's header validated), each MoE layer's result (its exact tensor set, dtypes and shapes for
its format, against the source experts), the KV-cache amaxes and the tokenizer files. Every failure is an
:class:`ExportInputError` with one line naming the file or layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.headers import INDEX_FILE, SINGLE_FILE, CheckpointError, read_safetensors_header
from mixquant.checkpoint.writer import TensorRecord, tensor_record
from mixquant.export.files import TOKENIZER_FILES
from mixquant.formats.facts import BF16, FORMATS, FP8_E4M3_MAX, NVFP4
from mixquant.jsonio import read_json
from mixquant.model.layout import natural_key
from mixquant.quantize.layer import AUDIT_FILE, LAYER_FILE

__all__ = [
    "ExportInputError",
    "kv_scale_name",
    "load_json",
    "kv_scale_records",
    "layer_result_records",
    "normalize_layer_dirs",
    "source_records",
    "tokenizer_files",
]

_TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer.model")


class ExportInputError(CheckpointError):
    """Bad export input (source checkpoint, layer results, placement, options); one line naming it."""


def _file_records(path: Path, what: str) -> dict[str, TensorRecord]:
    """Records of every tensor in an existing safetensors file (validated header, absolute offsets)."""
    try:
        header = read_safetensors_header(path)
    except CheckpointError as exc:
        raise ExportInputError(f"{what}: {exc}") from exc
    with open(path, "rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
    out = {}
    for name, info in header.items():
        begin, end = (int(v) for v in info["data_offsets"])
        out[name] = TensorRecord(
            name,
            str(info["dtype"]),
            tuple(int(d) for d in info["shape"]),
            end - begin,
            path=path,
            offset=data_start + begin,
        )
    return out


def kv_scale_name(layer: int, kind: str) -> str:
    """``model.layers.L.self_attn.k_proj.k_scale`` / ``...v_proj.v_scale`` (ModelOpt's export names)."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return f"model.layers.{int(layer)}.self_attn.{kind}_proj.{kind}_scale"


def load_json(path: Path, what: str) -> Any:
    """The JSON file at ``path``; a missing or corrupt file is an :class:`ExportInputError` naming it."""
    return read_json(path, what, error=ExportInputError)


def source_records(model_dir: Path) -> dict[str, TensorRecord]:
    """Every tensor of the source checkpoint (index or single file), headers validated."""
    index = model_dir / INDEX_FILE
    if index.exists():
        data = load_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportInputError(f"{index}: corrupt safetensors index (no weight_map)")
        shards: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(str(file), []).append(str(name))
    elif (model_dir / SINGLE_FILE).exists():
        index, shards = model_dir / SINGLE_FILE, {SINGLE_FILE: []}
    else:
        raise ExportInputError(f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    records: dict[str, TensorRecord] = {}
    for file in sorted(shards):
        path = model_dir / file
        if not path.exists():
            raise ExportInputError(f"{path}: source shard listed in {index} is missing")
        in_file = _file_records(path, "source checkpoint")
        names = shards[file] or list(in_file)
        for name in names:
            if name not in in_file:
                raise ExportInputError(f"{path}: tensor {name} listed in {index} is not in the shard")
            records[name] = in_file[name]
    return records


def _expected_layer_tensors(
    fmt: str, source: Mapping[str, TensorRecord], weights: Sequence[str]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a layer result in ``fmt`` for the source expert ``weights``."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in weights:
        base = name.removesuffix(".weight")
        shape = source[name].shape
        if fmt == BF16:
            out[name] = (source[name].dtype, shape)
        elif fmt == NVFP4:
            n, k = shape
            out[name] = ("U8", (n, k // 2))
            out[f"{base}.weight_scale"] = ("F8_E4M3", (n, k // 16))
            out[f"{base}.weight_scale_2"] = ("F32", ())
        else:
            out[name] = ("F8_E4M3", shape)
            out[f"{base}.weight_scale"] = ("F32", ())
            out[f"{base}.input_scale"] = ("F32", ())
    return out


def layer_result_records(
    layer: int, fmt: str, directory: Path, source: Mapping[str, TensorRecord], weights: Sequence[str]
) -> dict[str, TensorRecord]:
    """Validated records of one layer result: exact tensor set, dtypes and shapes for ``fmt``."""
    directory = Path(directory)
    path = directory / LAYER_FILE
    if not path.exists():
        raise ExportInputError(f"layer {layer}: layer result {path} not found")
    audit_path = directory / AUDIT_FILE
    if audit_path.exists():
        audit = load_json(audit_path, "layer audit")
        if isinstance(audit, dict):
            if audit.get("format") not in (None, fmt):
                raise ExportInputError(
                    f"layer {layer}: {directory} holds a {audit.get('format')} result, placement says {fmt}"
                )
            if audit.get("layer") not in (None, layer):
                raise ExportInputError(
                    f"layer {layer}: {directory} holds the result of layer {audit['layer']}"
                )
    records = _file_records(path, f"layer {layer} result")
    expected = _expected_layer_tensors(fmt, source, weights)
    missing = [n for n in sorted(expected, key=natural_key) if n not in records]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ExportInputError(f"layer {layer}: {path} lacks {missing[0]} for {fmt}{more}")
    extra = [n for n in sorted(records, key=natural_key) if n not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ExportInputError(f"layer {layer}: {path} has unexpected tensor {extra[0]} for {fmt}{more}")
    for name, (dtype, shape) in expected.items():
        r = records[name]
        if (r.dtype, r.shape) != (dtype, shape):
            raise ExportInputError(
                f"layer {layer}: {path}: {name} is {r.dtype} {list(r.shape)}, expected {dtype} {list(shape)} "
                f"for {fmt}"
            )
    return records


def kv_scale_records(kv_amax: Mapping[str, Any] | None, num_layers: int) -> dict[str, TensorRecord]:
    if not isinstance(kv_amax, Mapping):
        raise ExportInputError("kv_cache='fp8' needs kv_amax ({'k_amax': {layer: amax}, 'v_amax': {...}})")
    out: dict[str, TensorRecord] = {}
    for kind in ("k", "v"):
        per_layer = kv_amax.get(f"{kind}_amax")
        if not isinstance(per_layer, Mapping):
            raise ExportInputError(f"kv_amax has no '{kind}_amax' mapping (layer -> amax)")
        try:
            per_layer = {int(k): v for k, v in per_layer.items()}
        except (TypeError, ValueError) as exc:
            raise ExportInputError(f"kv_amax['{kind}_amax'] has a non-integer layer key") from exc
        for layer in range(num_layers):
            if layer not in per_layer:
                raise ExportInputError(f"layer {layer}: kv_amax['{kind}_amax'] has no value for this layer")
            try:
                amax = torch.as_tensor(per_layer[layer]).detach().to("cpu", torch.float32)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ExportInputError(f"layer {layer}: kv_amax['{kind}_amax'] is not a number") from exc
            if amax.numel() != 1 or not bool(torch.isfinite(amax).all()) or float(amax.reshape(())) <= 0:
                raise ExportInputError(
                    f"layer {layer}: kv_amax['{kind}_amax'] must be one finite value > 0, got "
                    f"{amax.reshape(-1).tolist()}"
                )
            scale = amax.reshape(()) / FP8_E4M3_MAX  # ModelOpt: value.float() / maxbound
            out[kv_scale_name(layer, kind)] = tensor_record(kv_scale_name(layer, kind), scale)
        extra = sorted(set(per_layer) - set(range(num_layers)))
        if extra:
            raise ExportInputError(
                f"layer {extra[0]}: kv_amax['{kind}_amax'] names a layer the model does not have "
                f"({num_layers} layers)"
            )
    return out


def normalize_layer_dirs(
    layer_dirs: Mapping[Any, Any], moe_layers: Sequence[int], num_layers: int, config_path: Path
) -> dict[int, tuple[str, Path]]:
    out: dict[int, tuple[str, Path]] = {}
    for key, value in layer_dirs.items():
        try:
            layer = int(key)
        except (TypeError, ValueError) as exc:
            raise ExportInputError(f"layer {key!r}: not a layer index") from exc
        if not 0 <= layer < num_layers:
            raise ExportInputError(f"layer {layer}: does not exist, {config_path} has {num_layers} layers")
        if layer not in moe_layers:
            raise ExportInputError(
                f"layer {layer}: is not an MoE layer (no routed experts) per {config_path}; "
                f"MoE layers: {list(moe_layers)}"
            )
        try:
            fmt, directory = value
        except (TypeError, ValueError) as exc:
            raise ExportInputError(f"layer {layer}: expected (format, directory), got {value!r}") from exc
        if fmt not in FORMATS:
            raise ExportInputError(f"layer {layer}: format must be one of {FORMATS}, got {fmt!r}")
        out[layer] = (str(fmt), Path(directory))
    missing = [layer for layer in moe_layers if layer not in out]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ExportInputError(f"layer {missing[0]}: no layer result given; every MoE layer needs one{more}")
    return dict(sorted(out.items()))


def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    if not tokenizer_dir.is_dir():
        raise ExportInputError(f"{tokenizer_dir}: tokenizer directory does not exist")
    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not any(p.name in _TOKENIZER_REQUIRED for p in files):
        raise ExportInputError(f"{tokenizer_dir}: no tokenizer ({' or '.join(_TOKENIZER_REQUIRED)}) found")
    return files
