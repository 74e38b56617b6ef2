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
    files, copied by :func:`mixquant.checkpoint.writer.write_safetensors` (whose byte layout is
    safetensors' own), so memory stays flat whatever the model size. What is read is checked first
    (:mod:`mixquant.export.inputs`).

Shards
    Whole layers stay together (:mod:`mixquant.export.shard_plan`). Files
    ``model-0000k-of-0000N.safetensors`` with ``{"format": "pt"}`` metadata, plus
    ``model.safetensors.index.json`` (``metadata.total_size`` = sum of tensor bytes, ``weight_map``).

Configs (ModelOpt's own code computes them: :mod:`mixquant.export.modelopt_config`)
    ``hf_quant_config.json`` and ``config.json`` with ``quantization_config`` appended, both only when
    something is quantized. The ``producer`` is the caller's (:func:`mixquant.producer.default_producer`:
    mixquant, plus the ModelOpt version whose numerics it reproduces), in both files -- the one intended
    difference from a ModelOpt export.

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

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixquant.checkpoint.headers import layer_of
from mixquant.checkpoint.writer import RangeCopier, TensorRecord, write_safetensors
from mixquant.export.files import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, QUANT_CONFIG_FILE
from mixquant.export.inputs import (
    ExportInputError,
    kv_scale_records,
    layer_result_records,
    load_json,
    normalize_layer_dirs,
    source_records,
    tokenizer_files,
)
from mixquant.export.modelopt_config import (
    dump_modelopt_json,
    modelopt_hf_quant_config,
    modelopt_quantization_config,
    sanitized_config,
)
from mixquant.export.shard_plan import plan_shards
from mixquant.formats.facts import FORMATS, FP8, KV_CACHE_FORMATS
from mixquant.model.families import PROJECTIONS, Architecture, UnsupportedArchitecture, architecture
from mixquant.model.layout import natural_key, shard_file_name, write_json

__all__ = ["export_checkpoint"]


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
        tokenizer_dir: tokenizer files to copy (:data:`~mixquant.export.inputs.TOKENIZER_FILES` that
            exist; tokenizer.json or tokenizer.model required).
        num_shards / max_shard_bytes: shard count, or size limit (default
            :data:`~mixquant.export.shard_plan.DEFAULT_MAX_SHARD_BYTES`); not both.
        kv_cache: ``None`` or ``"fp8"`` (k_scale / v_scale per layer from ``kv_amax``).
        kv_amax: ``{"k_amax": {layer: amax}, "v_amax": {layer: amax}}`` for every layer
            (:func:`~mixquant.quantize.activations.load_activation_stats` output works as is).
        producer: recorded in hf_quant_config.json and config.json (see
            :func:`mixquant.producer.default_producer`).
        fsync: ``fdatasync`` every shard after writing it.

    Everything is validated before the first byte is written: config.json, every source shard's header
    and size, the layer set (one result per MoE layer, no other layer), each layer result's exact tensor
    set, dtypes and shapes against the source experts, the KV amaxes. Raises :class:`ExportInputError`
    (one line naming the file / layer) on bad input. Returns a JSON-serialisable summary.
    """
    start = time.perf_counter()
    model_dir, out_dir, tokenizer_dir = Path(model_dir), Path(out_dir), Path(tokenizer_dir)
    kv_cache = _check_options(model_dir, kv_cache, kv_amax, producer)
    config, config_path, arch = _source_config(model_dir)
    layers = normalize_layer_dirs(layer_dirs, list(arch.moe_layers), arch.num_hidden_layers, config_path)
    placement = {layer: fmt for layer, (fmt, _) in layers.items()}

    # -- tensors
    source = source_records(model_dir)
    records, from_layers = _tensor_records(model_dir, config_path, arch, source, layers)
    if kv_cache == FP8:
        kv = kv_scale_records(kv_amax, arch.num_hidden_layers)
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
    out_config = sanitized_config(config)
    if hf_quant_config is not None:
        out_config["quantization_config"] = modelopt_quantization_config(hf_quant_config)
    generation_config = model_dir / GENERATION_CONFIG_FILE
    tokenizer_paths = tokenizer_files(tokenizer_dir)

    shards = plan_shards({n: r.nbytes for n, r in records.items()}, num_shards, max_shard_bytes)

    # -- output directory
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ExportInputError(f"{out_dir}: output directory is not empty")
    weight_map, shard_summary, written, copy_method = _write_shards(out_dir, shards, records, fsync)
    total_size = sum(r.nbytes for r in records.values())
    index = {
        "metadata": {"total_size": total_size},
        "weight_map": {n: weight_map[n] for n in sorted(weight_map, key=natural_key)},
    }
    write_json(out_dir / INDEX_FILE, index)
    dump_modelopt_json(out_dir / CONFIG_FILE, out_config)
    if hf_quant_config is not None:
        dump_modelopt_json(out_dir / QUANT_CONFIG_FILE, hf_quant_config)
    if generation_config.exists():
        shutil.copyfile(generation_config, out_dir / GENERATION_CONFIG_FILE)
    for path in tokenizer_paths:
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
        "copy_method": copy_method,
        "seconds": seconds,
        "write_rate_bytes_per_s": written / seconds if seconds > 0 else None,
    }


def _check_options(model_dir: Path, kv_cache: str | None, kv_amax: dict | None, producer: dict) -> str | None:
    """The export's options checked (one line each); ``kv_cache`` normalised."""
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
    return kv_cache


def _source_config(model_dir: Path) -> tuple[dict[str, Any], Path, Architecture]:
    """``(config.json, its path, the model's architecture)`` of a BF16 source checkpoint."""
    config_path = model_dir / CONFIG_FILE
    config = load_json(config_path, "model config")
    if not isinstance(config, dict):
        raise ExportInputError(f"{config_path}: corrupt model config (not a JSON object)")
    if "quantization_config" in config:
        raise ExportInputError(f"{config_path}: source already has a quantization_config (expected BF16)")
    try:
        arch = architecture(config)
    except (UnsupportedArchitecture, KeyError, TypeError, ValueError) as exc:
        raise ExportInputError(f"{config_path}: not a supported MoE config ({exc})") from exc
    return config, config_path, arch


def _tensor_records(
    model_dir: Path,
    config_path: Path,
    arch: Architecture,
    source: dict[str, TensorRecord],
    layers: Mapping[int, tuple[str, Path]],
) -> tuple[dict[str, TensorRecord], int]:
    """``(every tensor of the export but the KV-cache scales, bytes taken from layer results)``: the source's
    tensors with each MoE layer's routed-expert weights replaced by that layer's result."""
    num_experts, moe_layers = arch.num_experts, list(arch.moe_layers)
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
        want = [arch.expert_weight(layer, e, proj) for e in range(num_experts) for proj in PROJECTIONS]
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
        result = layer_result_records(layer, fmt, directory, source, weights)
        records.update(result)
        from_layers += sum(r.nbytes for r in result.values())
    return records, from_layers


def _write_shards(
    out_dir: Path, shards: list[list[str]], records: Mapping[str, TensorRecord], fsync: bool
) -> tuple[dict[str, str], list[dict[str, Any]], int, str]:
    """Write the shard files: ``(weight_map, per-shard summary, bytes written, how bytes were copied)``."""
    weight_map: dict[str, str] = {}
    shard_summary = []
    copier = RangeCopier()
    written = 0
    try:
        for k, names in enumerate(shards):
            file_name = shard_file_name(k, len(shards))
            size = write_safetensors(
                out_dir / file_name, [records[n] for n in names], fsync=fsync, copier=copier
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
    return weight_map, shard_summary, written, copier.method
