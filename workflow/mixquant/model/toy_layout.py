"""The upstream (original-checkpoint) tensor layout of a Laguna, the embedded toy's: names, renames, saving.

transformers keeps routed experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] = gate rows then
up rows, `mlp.experts.down_proj` [E, H, I]) and renames two things on load (conversion_mapping "laguna"):

    upstream (on disk)                              transformers (in memory)
    mlp.experts.{e}.{gate,up}_proj.weight       ->  mlp.experts.gate_up_proj[e]   (gate first, then up)
    mlp.experts.{e}.down_proj.weight            ->  mlp.experts.down_proj[e]
    mlp.experts.e_score_correction_bias         ->  mlp.gate.e_score_correction_bias
    mlp.shared_expert.*                         ->  mlp.shared_experts.*

This module does both directions explicitly (no reliance on transformers' reverse mapping at save time),
lists the names a config implies, and saves a model in that layout with the deterministic sharded writer
of :mod:`mixquant.model.layout`. Other families' layouts are derived from transformers
(:mod:`mixquant.model.families`); this one is written out because the toy is saved by it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixquant.model.families import mlp_layer_types
from mixquant.model.layout import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    natural_key,
    write_json,
    write_sharded_safetensors,
)

_HF_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_UP_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")
ATTENTION_NORMS = ("q_norm", "k_norm")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def upstream_tensor_names(config: Any) -> list[str]:
    """Every tensor name an upstream Laguna checkpoint with this config holds, in natural order.

    `config` is a LagunaConfig or its dict (config.json). Rotary inv_freq buffers are not persisted.
    """
    num_experts = int(_cfg(config, "num_experts"))
    names = ["model.embed_tokens.weight"]
    for layer, mlp_type in enumerate(mlp_layer_types(config)):
        prefix = f"model.layers.{layer}"
        names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
        names += [f"{prefix}.self_attn.{p}.weight" for p in ATTENTION_PROJECTIONS + ATTENTION_NORMS]
        if _cfg(config, "attention_bias", False):
            names += [f"{prefix}.self_attn.{p}.bias" for p in ATTENTION_PROJECTIONS if p != "g_proj"]
        if mlp_type == "dense":
            names += [f"{prefix}.mlp.{p}.weight" for p in MLP_PROJECTIONS]
        elif mlp_type == "sparse":
            names += [f"{prefix}.mlp.gate.weight", f"{prefix}.mlp.experts.e_score_correction_bias"]
            names += [
                f"{prefix}.mlp.experts.{e}.{p}.weight" for e in range(num_experts) for p in MLP_PROJECTIONS
            ]
            names += [f"{prefix}.mlp.shared_expert.{p}.weight" for p in MLP_PROJECTIONS]
        else:
            raise ValueError(f"layer {layer}: unknown mlp type {mlp_type!r}")
    names.append("model.norm.weight")
    if not _cfg(config, "tie_word_embeddings", False):
        names.append("lm_head.weight")
    return sorted(names, key=natural_key)


def hf_to_upstream_name(name: str) -> str:
    """Rename one non-fused transformers name to its upstream name (fused experts: see unfuse_experts)."""
    if _HF_FUSED_RE.match(name):
        raise ValueError(f"{name} is a fused expert tensor; use hf_to_upstream_state_dict")
    name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def upstream_to_hf_name(name: str) -> str:
    """Inverse of hf_to_upstream_name (per-expert names have no single transformers name)."""
    if _UP_EXPERT_RE.match(name):
        raise ValueError(f"{name} is a per-expert tensor; use upstream_to_hf_state_dict")
    name = name.replace(".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def hf_to_upstream_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers state dict -> upstream tensors: renames and per-expert unfusing (views, not copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _HF_FUSED_RE.match(name)
        if match is None:
            out[hf_to_upstream_name(name)] = tensor
            continue
        base, kind = match.groups()
        if kind == "gate_up_proj":
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(f"{name}: expected [E, 2I, H], got {tuple(tensor.shape)}")
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{base}.{e}.up_proj.weight"] = tensor[e, inter:]
        else:
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = tensor[e]
    return out


def upstream_to_hf_state_dict(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Upstream tensors -> transformers state dict (fuses experts, renames): the load-side mapping."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _UP_EXPERT_RE.match(name)
        if match is None:
            out[upstream_to_hf_name(name)] = tensor
            continue
        base, e, proj = match.groups()
        experts.setdefault(base, {}).setdefault(int(e), {})[proj] = tensor
    for base, per_expert in experts.items():
        ids = sorted(per_expert)
        if ids != list(range(len(ids))):
            raise ValueError(f"{base}: expert ids are not 0..{len(ids) - 1}")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]], dim=0) for e in ids]
        )
        out[f"{base}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in ids])
    return out


def checkpoint_config_dict(config: Any, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json contents: the config's dict with architectures and both dtype spellings pinned."""
    data = config.to_dict()
    data["architectures"] = ["LagunaForCausalLM"]
    data["dtype"] = dtype
    data["torch_dtype"] = dtype  # pre-v5 readers (vLLM, older transformers) look for this spelling
    return data


def save_upstream_checkpoint(
    model: torch.nn.Module, out_dir: str | Path, *, num_shards: int
) -> dict[str, Any]:
    """Save a transformers Laguna model in the upstream checkpoint layout, weights in bfloat16.

    Writes the shards, model.safetensors.index.json, config.json and generation_config.json (bos/eos/pad
    from the model config) into the existing `out_dir`. Checks that the tensor set equals
    upstream_tensor_names(config). Returns {"files": [...], "num_shards", "num_tensors", "total_size",
    "total_parameters"}.
    """
    out_dir = Path(out_dir)
    config = model.config
    tensors = hf_to_upstream_state_dict(model.state_dict())
    expected = upstream_tensor_names(config)
    if sorted(tensors, key=natural_key) != expected:
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise ValueError(f"state dict does not match the upstream layout: missing {missing}, extra {extra}")
    index = write_sharded_safetensors(tensors, out_dir, num_shards=num_shards, dtype=torch.bfloat16)
    write_json(out_dir / CONFIG_FILE, checkpoint_config_dict(config))
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    write_json(out_dir / GENERATION_CONFIG_FILE, {k: v for k, v in generation.items() if v is not None})
    shard_files = sorted(set(index["weight_map"].values()))
    return {
        "files": [*shard_files, INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE],
        "num_shards": len(shard_files),
        "num_tensors": len(index["weight_map"]),
        "total_size": index["metadata"]["total_size"],
        "total_parameters": index["metadata"]["total_parameters"],
    }
