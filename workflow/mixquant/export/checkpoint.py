"""Assemble the quantized HF checkpoint: source shards + per-layer results, streamed, ModelOpt-identical.

:func:`export_checkpoint` writes what ModelOpt 0.47's ``export_hf_checkpoint`` writes for the same
placement (see :mod:`mixquant.quantize.reference`), without ever holding the model in memory:

Tensors (upstream names, as ModelOpt's quant-aware reverse conversion writes them)
    * every tensor of the source checkpoint that is not a routed-expert weight is copied byte for byte
      (ModelOpt exports them as bf16 copies, bit-identical to the source);
    * the routed experts of every MoE layer come from that layer's ``layer.safetensors``
      (:func:`mixquant.quantize.layer.save_layer_result`; byte-identical to ModelOpt's export per
      layer): ``weight`` (+ ``weight_scale`` + ``weight_scale_2`` for NVFP4, + ``weight_scale`` +
      ``input_scale`` for FP8), or the bf16 source weights;
    * with ``kv_cache="fp8"``: ``model.layers.L.self_attn.k_proj.k_scale`` and ``...v_proj.v_scale`` for
      every layer, fp32 0-dim ``= fp32(amax) / 448`` -- ModelOpt's ``postprocess_state_dict`` turns the
      ``k_bmm_quantizer._amax`` / ``v_bmm_quantizer._amax`` buffers (bf16, the max |K| / |V| its
      calibration saw) into exactly these (``value.float() / 448``, no zero rule). ``kv_amax`` is
      :func:`mixquant.quantize.activations.load_activation_stats`' ``k_amax`` / ``v_amax``.

    Tensor bytes are never decoded: untouched tensors and layer results are raw byte ranges of their
    files, located through the validated header (:func:`mixquant.checkpoint.shards.read_safetensors_header`)
    and copied with ``os.copy_file_range`` (in-kernel; plain ``pread``/``write`` through one 8 MiB buffer
    where the kernel or file system refuses), so memory stays flat whatever the model size.

Shards
    Whole layers stay together, in natural name order: the embedding group, layer 0, ..., the rest
    (final norm, lm_head) -- the groups of :func:`mixquant.model.layout.assign_shards`. ``num_shards``
    uses that function's byte-balanced split; ``max_shard_bytes`` closes a shard before the group that
    would push it past the limit (a single group larger than the limit gets a shard of its own). Files
    ``model-0000k-of-0000N.safetensors`` with ``{"format": "pt"}`` metadata, plus
    ``model.safetensors.index.json`` (``metadata.total_size`` = sum of tensor bytes, ``weight_map``).

    Each shard is written by :func:`write_safetensors`: the header is built here and the tensor bytes
    are streamed after it. The byte layout is safetensors' own (``safetensors.torch.save_file`` gives the
    same bytes for the same tensors; tests/export/test_checkpoint.py checks it):

    * 8 bytes: little-endian u64 ``N``, the length of the header;
    * ``N`` bytes: compact JSON (no spaces) ``{"__metadata__":{"format":"pt"},"<name>":{"dtype":"BF16",
      "shape":[...],"data_offsets":[begin,end]},...}`` with the tensors in *data order* -- sorted by
      dtype, widest alignment first (safetensors' ``Dtype`` enum order, descending: U64, I64, F64, C64,
      F32, U32, I32, BF16, F16, U16, I16, F8_E8M0, F8_E4M3, F8_E5M2, I8, U8, ..., BOOL), then by name --
      padded with spaces to a multiple of 8 bytes;
    * the tensors' raw little-endian bytes back to back in that order (``data_offsets`` are relative to
      the end of the header).

Configs (ModelOpt's own code computes them, see :func:`modelopt_hf_quant_config`)
    ``hf_quant_config.json`` (``json.dump(indent=4)``, no trailing newline) and ``config.json`` with
    ``quantization_config`` appended (``convert_hf_quant_config_format``), both only when something is
    quantized (experts or KV cache): ``MIXED_PRECISION`` with ``quantized_layers`` when the quantized
    MoE layers use more than one format, the single-algorithm form (``quant_algo``, ``group_size``,
    ``exclude_modules`` summarised with prefix wildcards) otherwise; BF16 layers are absent;
    ``kv_cache_quant_algo`` / ``kv_cache_scheme`` as configured. The ``producer`` is the caller's
    (:func:`default_producer`: mixquant, plus the ModelOpt version whose numerics it reproduces), in
    both files -- the one intended difference from a ModelOpt export.

    Known differences from ModelOpt's files, apart from ``producer``:

    * MiniMax-M2 only: ``quantized_layers`` keys are ``model.layers.L.mlp.experts``, where ModelOpt writes
      the disk name ``block_sparse_moe``: vLLM 0.33 resolves only the former for that model (with
      ModelOpt's keys its experts would load as BF16); :mod:`mixquant.model.families.mixtral`.

    * ``config.json`` keeps every key of the source ``config.json``. ModelOpt re-serialises the config
      through transformers (``save_pretrained``, diff against defaults), which drops default-valued keys
      and the legacy ``torch_dtype`` spelling (for the toy: ``_name_or_path``,
      ``chunk_size_feed_forward``, ``id2label``, ``is_encoder_decoder``, ``label2id``,
      ``output_attentions``, ``output_hidden_states``, ``problem_type``, ``return_dict``,
      ``torch_dtype``) and writes transformers' own ``transformers_version``. Every key ModelOpt writes
      is here with the same value (for a source written by the installed transformers). Key order:
      the source's, then ``quantization_config`` (ModelOpt: transformers' sorted keys, then
      ``quantization_config``); ``json.dump(indent=4)``, no trailing newline, as ModelOpt.
    * ``generation_config.json`` is the source's file byte for byte (ModelOpt re-serialises it through
      ``GenerationConfig``, which adds ``transformers_version``).
    * Tokenizer files are copied from ``tokenizer_dir`` (ModelOpt's export writes none).
    * Sharding is this module's (ModelOpt: transformers' ``max_shard_size="10GB"`` split).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.shards import read_safetensors_header
from mixquant.model.layout import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_METADATA,
    assign_shards,
    layer_of,
    natural_key,
    shard_file_name,
    shard_groups,
    write_json,
)
from mixquant.producer import default_producer
from mixquant.quantize.layer import AUDIT_FILE, LAYER_FILE, QuantizeInputError
from mixquant.quantize.reference import BF16, FORMATS, NVFP4

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "HF_QUANT_CONFIG_FILE",
    "KV_CACHE_FORMATS",
    "TOKENIZER_FILES",
    "ExportInputError",
    "TensorRecord",
    "default_producer",
    "export_checkpoint",
    "kv_scale_name",
    "modelopt_hf_quant_config",
    "modelopt_quantization_config",
    "safetensors_header",
    "tensor_record",
    "write_safetensors",
]

HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
KV_CACHE_FORMATS = ("fp8",)
KV_MAX_BOUND = 448.0  # ModelOpt: "kv cache scale as amax / 448" (FP8 E4M3 max)
# Files copied from tokenizer_dir when present (tokenizer.json or tokenizer.model must be among them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
_TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer.model")

# safetensors' Dtype enum, in its (ascending alignment) order; data is laid out in descending order.
_ST_DTYPE_ORDER = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_ST_RANK = {name: i for i, name in enumerate(_ST_DTYPE_ORDER)}
_TORCH_TO_ST = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
if hasattr(torch, "float8_e8m0fnu"):
    _TORCH_TO_ST[torch.float8_e8m0fnu] = "F8_E8M0"

_COPY_BUFFER_BYTES = 8 << 20
_COPY_CHUNK_BYTES = 1 << 30  # per copy_file_range call
# copy_file_range errors that mean "not supported here": fall back to pread/write.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP, errno.EPERM}


class ExportInputError(QuantizeInputError):
    """Bad export input (source checkpoint, layer results, placement, options); one line naming it."""


# ----------------------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class TensorRecord:
    """One tensor to write: safetensors dtype string, shape, byte size and where its raw bytes are.

    Either ``path`` + ``offset`` (absolute file offset of the first byte) or ``data`` (bytes in memory).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: Path | None = None
    offset: int = 0
    data: bytes | None = None


def tensor_record(name: str, tensor: torch.Tensor) -> TensorRecord:
    """An in-memory :class:`TensorRecord` of a CPU tensor (its contiguous little-endian bytes)."""
    t = tensor.detach().to("cpu").contiguous()
    dtype = _TORCH_TO_ST.get(t.dtype)
    if dtype is None:
        raise ValueError(f"{name}: dtype {t.dtype} has no safetensors equivalent here")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return TensorRecord(name, dtype, tuple(t.shape), len(data), data=data)


def _data_order(records: Iterable[TensorRecord]) -> list[TensorRecord]:
    records = list(records)
    unknown = sorted({r.dtype for r in records} - set(_ST_RANK))
    if unknown:
        raise ValueError(f"unknown safetensors dtype(s) {unknown}")
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    # safetensors: descending dtype (alignment) order, then name (Rust str order == code point order)
    return sorted(records, key=lambda r: (-_ST_RANK[r.dtype], r.name))


def safetensors_header(
    records: Iterable[TensorRecord], metadata: Mapping[str, str] | None = SAFETENSORS_METADATA
) -> tuple[bytes, list[TensorRecord]]:
    """``(8-byte length + padded JSON header, records in data order)`` exactly as safetensors writes them."""
    ordered = _data_order(records)
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for r in ordered:
        header[r.name] = {
            "dtype": r.dtype,
            "shape": list(r.shape),
            "data_offsets": [offset, offset + r.nbytes],
        }
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


class _Copier:
    """Raw byte-range copies into an fd: ``os.copy_file_range``, else ``pread`` + ``write`` (one buffer)."""

    def __init__(self) -> None:
        self.method = "copy_file_range" if hasattr(os, "copy_file_range") else "pread/write"
        self._buffer: bytearray | None = None
        self._sources: dict[Path, int] = {}

    def close(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()

    def _source_fd(self, path: Path) -> int:
        fd = self._sources.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            self._sources[path] = fd
        return fd

    def copy(self, path: Path, offset: int, count: int, dst: int) -> None:
        src = self._source_fd(path)
        done = 0
        while done < count and self.method == "copy_file_range":
            try:
                n = os.copy_file_range(src, dst, min(count - done, _COPY_CHUNK_BYTES), offset + done)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE or done:
                    raise
                self.method = "pread/write"
                break
            if n == 0:
                raise ExportInputError(f"{path}: unexpected end of file at byte {offset + done}")
            done += n
        if done < count:
            if self._buffer is None:
                self._buffer = bytearray(_COPY_BUFFER_BYTES)
            view = memoryview(self._buffer)
            while done < count:
                want = min(count - done, len(view))
                n = os.preadv(src, [view[:want]], offset + done)
                if n == 0:
                    raise ExportInputError(f"{path}: unexpected end of file at byte {offset + done}")
                _write_all(dst, view[:n])
                done += n


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_safetensors(
    path: Path,
    records: Iterable[TensorRecord],
    *,
    metadata: Mapping[str, str] | None = SAFETENSORS_METADATA,
    fsync: bool = True,
    _copier: _Copier | None = None,
) -> int:
    """Stream ``records`` into a new safetensors file at ``path``; returns the file size.

    The bytes equal ``safetensors.torch.save_file`` of the same tensors with the same metadata (layout
    in the module docstring). Only the header is built in memory; tensor bytes are copied from their
    files (or written from ``record.data``). ``fsync``: ``fdatasync`` the file before returning.
    """
    header, ordered = safetensors_header(records, metadata)
    copier = _copier or _Copier()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides, as for open()
    try:
        _write_all(fd, header)
        for r in ordered:
            if r.data is not None:
                if len(r.data) != r.nbytes:
                    raise ValueError(f"{r.name}: {len(r.data)} bytes of data for {r.nbytes} declared")
                _write_all(fd, r.data)
            elif r.nbytes:
                copier.copy(Path(r.path), r.offset, r.nbytes, fd)
        if fsync:
            os.fdatasync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
        if _copier is None:
            copier.close()
    expected = len(header) + sum(r.nbytes for r in ordered)
    if size != expected:
        raise OSError(f"{path}: wrote {size} bytes, expected {expected}")
    return size


def save_file_sorted(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str]
) -> int:
    """``safetensors.torch.save_file`` with the metadata in sorted key order, so the bytes are a function of
    the content: safetensors' own writer keeps metadata in a Rust HashMap, whose order changes from process
    to process once there are two or more keys (an identical result then hashes differently)."""
    records = [tensor_record(name, tensor) for name, tensor in tensors.items()]
    ordered_metadata = {str(k): str(v) for k, v in sorted(metadata.items())}
    return write_safetensors(Path(path), records, metadata=ordered_metadata, fsync=False)


def _file_records(path: Path, what: str) -> dict[str, TensorRecord]:
    """Records of every tensor in an existing safetensors file (validated header, absolute offsets)."""
    try:
        header = read_safetensors_header(path)
    except QuantizeInputError as exc:
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


# ----------------------------------------------------------------------------------------- ModelOpt config


@contextlib.contextmanager
def _quiet() -> Any:
    with (
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


def _placement_quant_cfg(placement: Mapping[int, str], kv_cache: str | None) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    from mixquant.quantize.reference import modelopt_placement_quant_cfg

    # The calibration algorithm changes no quantizer's format, hence nothing in the config.
    quant_cfg, _ = modelopt_placement_quant_cfg(
        dict(placement), nvfp4_algorithm="max", fp8_weight_algorithm="max"
    )
    if kv_cache == "fp8":
        quant_cfg["quant_cfg"].extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return quant_cfg


def modelopt_hf_quant_config(
    config: Mapping[str, Any],
    placement: Mapping[int, str],
    *,
    kv_cache: str | None = None,
    producer: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``hf_quant_config.json`` content ModelOpt 0.47 exports for ``placement``; None if unquantized.

    Computed by ModelOpt itself, without weights: the model's class is built on the meta device from
    ``config`` (the source config.json dict), ModelOpt's quantize mode is applied with the placement's
    ``quant_cfg`` (:func:`mixquant.quantize.reference.modelopt_placement_quant_cfg`, plus
    ``mtq.FP8_KV_CFG`` for ``kv_cache="fp8"``) -- the same module conversion ``mtq.quantize`` does,
    without calibration, which decides no format -- then ``get_quant_config`` and the quant-aware
    reverse renaming of module names (``build_reverse_name_mapper`` + ``revert_quant_config_names``),
    as ``export_hf_checkpoint`` does. ``None`` when ModelOpt would write no hf_quant_config.json (no
    quantized layer and no KV-cache quantization). ``producer`` replaces ModelOpt's if given.
    """
    import modelopt.torch.opt as mto
    from modelopt.torch.export.quant_aware_conversion import (
        build_reverse_name_mapper,
        revert_quant_config_names,
    )
    from modelopt.torch.export.quant_utils import get_quant_config
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    with _quiet():
        hf_config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        model = mto.apply_mode(model, mode=[("quantize", _placement_quant_cfg(placement, kv_cache))])
        quant_config = get_quant_config(model)
        mapper = build_reverse_name_mapper(model)
        if mapper is not None:
            revert_quant_config_names(quant_config.get("quantization", {}), mapper)
    quantization = quant_config.get("quantization", {})
    if quantization.get("quant_algo") is None and quantization.get("kv_cache_quant_algo") is None:
        return None
    if producer is not None:
        quant_config["producer"] = copy.deepcopy(dict(producer))
    return quant_config


def modelopt_quantization_config(hf_quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``quantization_config``: ModelOpt's ``convert_hf_quant_config_format``."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    return convert_hf_quant_config_format(copy.deepcopy(dict(hf_quant_config)))


def _sanitized_config(config: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's ``sanitize_hf_config_for_deployment`` (no in-memory model: config keys only)."""
    from modelopt.torch.export.plugins import sanitize_hf_config_for_deployment

    config = copy.deepcopy(config)
    with _quiet():
        sanitize_hf_config_for_deployment(config, None)
    return config


def _dump_modelopt_json(path: Path, data: Any) -> None:
    """``json.dump(data, f, indent=4)``: ModelOpt's formatting (no trailing newline)."""
    path.write_text(json.dumps(data, indent=4), encoding="utf-8")


# ----------------------------------------------------------------------------------------- inputs


def kv_scale_name(layer: int, kind: str) -> str:
    """``model.layers.L.self_attn.k_proj.k_scale`` / ``...v_proj.v_scale`` (ModelOpt's export names)."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return f"model.layers.{int(layer)}.self_attn.{kind}_proj.{kind}_scale"


def _load_json(path: Path, what: str) -> Any:
    from mixquant.jsonio import read_json

    return read_json(path, what, error=ExportInputError)


def _source_records(model_dir: Path) -> dict[str, TensorRecord]:
    """Every tensor of the source checkpoint (index or single file), headers validated."""
    index = model_dir / INDEX_FILE
    if index.exists():
        data = _load_json(index, "safetensors index")
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


def _layer_result_records(
    layer: int, fmt: str, directory: Path, source: Mapping[str, TensorRecord], weights: Sequence[str]
) -> dict[str, TensorRecord]:
    """Validated records of one layer result: exact tensor set, dtypes and shapes for ``fmt``."""
    directory = Path(directory)
    path = directory / LAYER_FILE
    if not path.exists():
        raise ExportInputError(f"layer {layer}: layer result {path} not found")
    audit_path = directory / AUDIT_FILE
    if audit_path.exists():
        audit = _load_json(audit_path, "layer audit")
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


def _kv_scale_records(kv_amax: Mapping[str, Any] | None, num_layers: int) -> dict[str, TensorRecord]:
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
            scale = amax.reshape(()) / KV_MAX_BOUND  # ModelOpt: value.float() / maxbound
            out[kv_scale_name(layer, kind)] = tensor_record(kv_scale_name(layer, kind), scale)
        extra = sorted(set(per_layer) - set(range(num_layers)))
        if extra:
            raise ExportInputError(
                f"layer {extra[0]}: kv_amax['{kind}_amax'] names a layer the model does not have "
                f"({num_layers} layers)"
            )
    return out


def _normalize_layer_dirs(
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


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    if not tokenizer_dir.is_dir():
        raise ExportInputError(f"{tokenizer_dir}: tokenizer directory does not exist")
    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not any(p.name in _TOKENIZER_REQUIRED for p in files):
        raise ExportInputError(f"{tokenizer_dir}: no tokenizer ({' or '.join(_TOKENIZER_REQUIRED)}) found")
    return files


# ----------------------------------------------------------------------------------------- sharding


class _Sized:
    """Stand-in for a tensor in :func:`assign_shards`: only its byte size matters."""

    def __init__(self, nbytes: int):
        self._nbytes = nbytes

    def numel(self) -> int:
        return self._nbytes

    def element_size(self) -> int:
        return 1


def _groups(names: Iterable[str]) -> list[list[str]]:
    """assign_shards' groups (layout.shard_groups): embedding, each layer, the rest."""
    return shard_groups(names)


def _plan_shards(
    sizes: Mapping[str, int], num_shards: int | None, max_shard_bytes: int | None
) -> list[list[str]]:
    if num_shards is not None and max_shard_bytes is not None:
        raise ExportInputError("give num_shards or max_shard_bytes, not both")
    if num_shards is not None:
        try:
            shards = assign_shards({n: _Sized(s) for n, s in sizes.items()}, int(num_shards))
        except ValueError as exc:
            raise ExportInputError(f"num_shards={num_shards}: {exc}") from exc
        return [sorted(s, key=natural_key) for s in shards]
    limit = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else int(max_shard_bytes)
    if limit < 1:
        raise ExportInputError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[str]] = []
    running = 0
    for group in _groups(sizes):
        size = sum(sizes[n] for n in group)
        if not shards or (shards[-1] and running + size > limit):
            shards.append([])
            running = 0
        shards[-1].extend(group)
        running += size
    return shards


# ----------------------------------------------------------------------------------------- export


def export_checkpoint(
    model_dir: Path,
    layer_dirs: dict[int, tuple[str, Path]],
    out_dir: Path,
    *,
    tokenizer_dir: Path,
    num_shards: int | None = None,
    max_shard_bytes: int | None = None,
    kv_cache: str | None = None,
    kv_amax: dict | None = None,
    producer: dict,
    fsync: bool = True,
) -> dict:
    """Write the quantized checkpoint of ``model_dir`` (upstream BF16 layout) into the empty ``out_dir``.

    Args:
        layer_dirs: every MoE layer -> ``(format, directory)`` with ``format`` in
            ``("nvfp4_w4a16", "fp8", "bf16")`` and ``directory`` holding that layer's ``layer.safetensors``
            (and optionally ``audit.json``, cross-checked for format and layer).
        tokenizer_dir: tokenizer files to copy (:data:`TOKENIZER_FILES` that exist; tokenizer.json or
            tokenizer.model required).
        num_shards / max_shard_bytes: shard count, or size limit (default
            :data:`DEFAULT_MAX_SHARD_BYTES`); not both.
        kv_cache: ``None`` or ``"fp8"`` (k_scale / v_scale per layer from ``kv_amax``).
        kv_amax: ``{"k_amax": {layer: amax}, "v_amax": {layer: amax}}`` for every layer
            (:func:`~mixquant.quantize.activations.load_activation_stats` output works as is).
        producer: recorded in hf_quant_config.json and config.json (see :func:`default_producer`).
        fsync: ``fdatasync`` every shard after writing it.

    Everything is validated before the first byte is written: config.json, every source shard's header
    and size, the layer set (one result per MoE layer, no other layer), each layer result's exact tensor
    set, dtypes and shapes against the source experts, the KV amaxes. Raises :class:`ExportInputError`
    (one line naming the file / layer) on bad input. Returns a JSON-serialisable summary.
    """
    start = time.perf_counter()
    model_dir, out_dir, tokenizer_dir = Path(model_dir), Path(out_dir), Path(tokenizer_dir)
    if not isinstance(producer, Mapping) or not producer.get("name"):
        raise ExportInputError(f"producer must be a dict with a 'name', got {producer!r}")
    if kv_cache is not None:
        kv_cache = str(kv_cache).lower()
        if kv_cache not in KV_CACHE_FORMATS:
            raise ExportInputError(f"kv_cache must be None or one of {KV_CACHE_FORMATS}, got {kv_cache!r}")
    elif kv_amax is not None:
        raise ExportInputError("kv_amax given without kv_cache")
    if not model_dir.is_dir():
        raise ExportInputError(f"{model_dir}: checkpoint directory does not exist")

    # -- config and layers
    config_path = model_dir / CONFIG_FILE
    config = _load_json(config_path, "model config")
    if not isinstance(config, dict):
        raise ExportInputError(f"{config_path}: corrupt model config (not a JSON object)")
    if "quantization_config" in config:
        raise ExportInputError(f"{config_path}: source already has a quantization_config (expected BF16)")
    from mixquant.model.families import UnsupportedArchitecture, architecture

    try:
        arch = architecture(config)
    except (UnsupportedArchitecture, KeyError, TypeError, ValueError) as exc:
        raise ExportInputError(f"{config_path}: not a supported MoE config ({exc})") from exc
    num_layers, num_experts, moe_layers = arch.num_hidden_layers, arch.num_experts, list(arch.moe_layers)
    layers = _normalize_layer_dirs(layer_dirs, moe_layers, num_layers, config_path)
    placement = {layer: fmt for layer, (fmt, _) in layers.items()}

    # -- tensors
    source = _source_records(model_dir)
    experts: dict[int, list[str]] = {layer: [] for layer in moe_layers}
    for name in source:
        routed = arch.routed_expert_of(name)
        if routed is not None and name.endswith(".weight"):
            if routed[0] not in experts:
                raise ExportInputError(f"{model_dir}: routed-expert tensor {name} in a non-MoE layer")
            experts[routed[0]].append(name)
    routed_weights = {name for names in experts.values() for name in names}
    records: dict[str, TensorRecord] = {n: r for n, r in source.items() if n not in routed_weights}
    from_layers = 0
    for layer, (fmt, directory) in layers.items():
        weights = sorted(experts[layer], key=natural_key)
        want = [
            arch.expert_weight(layer, e, proj)
            for e in range(num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        ]
        if weights != sorted(want, key=natural_key):
            missing = [n for n in want if n not in source]
            culprit = f"lacks {missing[0]}" if missing else f"has {sorted(set(weights) - set(want))[0]}"
            raise ExportInputError(
                f"layer {layer}: source checkpoint {culprit} ({num_experts} experts per {config_path})"
            )
        for name in weights:
            if source[name].dtype != "BF16" or len(source[name].shape) != 2:
                raise ExportInputError(
                    f"layer {layer}: source tensor {name} is {source[name].dtype} "
                    f"{list(source[name].shape)}, expected 2-D BF16"
                )
        result = _layer_result_records(layer, fmt, directory, source, weights)
        records.update(result)
        from_layers += sum(r.nbytes for r in result.values())
    if kv_cache == "fp8":
        kv = _kv_scale_records(kv_amax, num_layers)
        clash = sorted(set(kv) & set(records))
        if clash:
            raise ExportInputError(f"{model_dir}: source already has KV-cache scale {clash[0]}")
        records.update(kv)

    # -- configs (ModelOpt's own code), before writing anything
    hf_quant_config = modelopt_hf_quant_config(config, placement, kv_cache=kv_cache, producer=producer)
    if hf_quant_config is not None and "quantized_layers" in hf_quant_config.get("quantization", {}):
        # the keys vLLM resolves where a family's differ from ModelOpt's (mixquant.model.families)
        quantization = hf_quant_config["quantization"]
        quantization["quantized_layers"] = arch.vllm_quantized_layers(quantization["quantized_layers"])
    out_config = _sanitized_config(config)
    if hf_quant_config is not None:
        out_config["quantization_config"] = modelopt_quantization_config(hf_quant_config)
    generation_config = model_dir / GENERATION_CONFIG_FILE
    tokenizer_files = _tokenizer_files(tokenizer_dir)

    shards = _plan_shards({n: r.nbytes for n, r in records.items()}, num_shards, max_shard_bytes)

    # -- output directory
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ExportInputError(f"{out_dir}: output directory is not empty")

    weight_map: dict[str, str] = {}
    shard_summary = []
    copier = _Copier()
    written = 0
    try:
        for k, names in enumerate(shards):
            file_name = shard_file_name(k, len(shards))
            size = write_safetensors(
                out_dir / file_name, [records[n] for n in names], fsync=fsync, _copier=copier
            )
            written += size
            weight_map.update(dict.fromkeys(names, file_name))
            layer_ids = sorted({layer_of(n) for n in names if layer_of(n) is not None})
            shard_summary.append(
                {
                    "file": file_name,
                    "tensors": len(names),
                    "bytes": size,
                    "layers": [layer_ids[0], layer_ids[-1]] if layer_ids else [],
                }
            )
    finally:
        copier.close()
    total_size = sum(r.nbytes for r in records.values())
    index = {
        "metadata": {"total_size": total_size},
        "weight_map": {n: weight_map[n] for n in sorted(weight_map, key=natural_key)},
    }
    write_json(out_dir / INDEX_FILE, index)
    _dump_modelopt_json(out_dir / CONFIG_FILE, out_config)
    if hf_quant_config is not None:
        _dump_modelopt_json(out_dir / HF_QUANT_CONFIG_FILE, hf_quant_config)
    if generation_config.exists():
        shutil.copyfile(generation_config, out_dir / GENERATION_CONFIG_FILE)
    for path in tokenizer_files:
        shutil.copyfile(path, out_dir / path.name)

    seconds = time.perf_counter() - start
    quantization = (hf_quant_config or {}).get("quantization", {})
    return {
        "files": sorted(p.name for p in out_dir.iterdir()),
        "num_shards": len(shards),
        "shards": shard_summary,
        "num_tensors": len(records),
        "total_size": total_size,
        "bytes_written": written,
        "bytes_from_source": sum(r.nbytes for n, r in records.items() if source.get(n) is r),
        "bytes_from_layer_results": from_layers,
        "placement": {str(layer): fmt for layer, fmt in placement.items()},
        "formats": {fmt: sum(1 for f in placement.values() if f == fmt) for fmt in FORMATS},
        "quant_algo": quantization.get("quant_algo"),
        "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo"),
        "hf_quant_config": hf_quant_config,
        "producer": dict(producer),
        "copy_method": copier.method,
        "seconds": seconds,
        "write_rate_bytes_per_s": written / seconds if seconds > 0 else None,
    }
