"""Load an exported (ModelOpt-format) checkpoint back as a BF16 model: ModelOpt's own dequantization.

:func:`load_dequantized_state_dict` reads the shards of an export directory (``export_checkpoint``'s or
ModelOpt's own ``export_hf_checkpoint``'s) and returns the upstream-named state dict with every quantized
weight replaced by its dequantization -- :func:`mixquant.formats.dequant.dequantize_tensors`, i.e.
``NVFP4QTensor.dequantize`` (uint8 ``weight`` + ``weight_scale`` + ``weight_scale_2``) and
``FP8QTensor.dequantize`` (float8_e4m3fn ``weight`` * ``weight_scale``), computed in fp32 and rounded once
to bf16 -- and without the scale tensors (``weight_scale``, ``weight_scale_2``, ``input_scale`` of a
dequantized weight; KV-cache ``k_scale`` / ``v_scale``). Unquantized tensors are returned as stored (the
model's dtype), bit for bit.

:func:`load_dequantized_model` turns that into the checkpoint's transformers model through its normal
loading path: the state dict is written in upstream layout (``model.safetensors`` + config.json without
``quantization_config``) into a temporary directory and loaded with ``from_pretrained`` (which applies the
family's conversion mapping: per-expert weights fused into ``gate_up_proj`` / ``down_proj``, renames).
The whole model is held in memory (this is for evaluation, not for the export path).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from mixquant.checkpoint.shards import SINGLE_FILE, CheckpointError, ShardReader
from mixquant.checkpoint.writer import SAFETENSORS_METADATA, save_file_sorted
from mixquant.formats.dequant import dequantize_tensors
from mixquant.model.layout import CONFIG_FILE, GENERATION_CONFIG_FILE

__all__ = ["SCALE_SUFFIXES", "load_dequantized_model", "load_dequantized_state_dict"]

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def dequantized_group(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Upstream-named tensors of an export (all of it, or one layer's) with every quantized weight
    dequantized and its scales and the KV-cache scales dropped; everything else as stored.

    A ``*.weight`` is dequantized when it is uint8 with ``weight_scale`` and ``weight_scale_2`` (NVFP4) or
    float8_e4m3fn with ``weight_scale`` (FP8); a uint8 / float8 weight without its scales is an error.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(KV_SCALE_SUFFIXES):
            continue
        scale_of = next((name[: -len(s)] for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_of is not None and f"{scale_of}.weight" in tensors:
            continue  # consumed with its weight
        if name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.float8_e4m3fn):
            base = name.removesuffix(".weight")
            group = {
                name: tensor,
                **{f"{base}{s}": tensors[f"{base}{s}"] for s in SCALE_SUFFIXES if f"{base}{s}" in tensors},
            }
            nvfp4 = tensor.dtype == torch.uint8 and {f"{base}.weight_scale", f"{base}.weight_scale_2"} <= set(
                group
            )
            fp8 = tensor.dtype == torch.float8_e4m3fn and f"{base}.weight_scale" in group
            if not (nvfp4 or fp8):
                raise CheckpointError(f"{name} is {tensor.dtype} without its scale tensors")
            with torch.no_grad():
                out[name] = dequantize_tensors(group, dtype)[name]
        else:
            out[name] = tensor
    return out


def load_dequantized_state_dict(
    export_dir: Path, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """``{upstream name: tensor}`` of the export in ``export_dir``, quantized weights dequantized
    (``dtype``, :func:`dequantized_group`); every shard's header is validated first (a truncated or
    corrupt shard stops with one line naming it)."""
    export_dir = Path(export_dir)
    reader = ShardReader(export_dir)
    reader.check_all()
    try:
        return dequantized_group(reader.read(reader.names), dtype)
    except CheckpointError as error:
        raise CheckpointError(f"{export_dir}: {error}") from None


def load_dequantized_model(
    export_dir: Path, *, dtype: torch.dtype = torch.bfloat16, **from_pretrained_kwargs
):
    """The checkpoint's transformers model with the dequantized weights of ``export_dir`` (eval mode).

    config.json minus ``quantization_config``; weights from :func:`load_dequantized_state_dict`, loaded by
    ``AutoModelForCausalLM.from_pretrained(..., dtype=dtype, **from_pretrained_kwargs)`` from a temporary
    upstream-layout copy, so transformers' own conversion mapping builds the fused expert tensors.
    """
    from transformers import AutoModelForCausalLM

    export_dir = Path(export_dir)
    config = json.loads((export_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    state_dict = load_dequantized_state_dict(export_dir, dtype)
    with tempfile.TemporaryDirectory(prefix="mixquant-dequant-") as tmp:
        tmp_dir = Path(tmp)
        (tmp_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if (export_dir / GENERATION_CONFIG_FILE).exists():
            shutil.copyfile(export_dir / GENERATION_CONFIG_FILE, tmp_dir / GENERATION_CONFIG_FILE)
        payload = {name: t.contiguous() for name, t in state_dict.items()}
        save_file_sorted(payload, tmp_dir / SINGLE_FILE, SAFETENSORS_METADATA)
        del payload, state_dict
        model = AutoModelForCausalLM.from_pretrained(tmp_dir, dtype=dtype, **from_pretrained_kwargs)
        # parameters may still be views of the (memory-mapped) temporary file: materialize them
        for param in model.parameters():
            if not param.data.is_contiguous() or param.data.untyped_storage().filename is not None:
                param.data = param.data.clone()
    return model.eval()
