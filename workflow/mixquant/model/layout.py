"""Upstream (original-checkpoint) tensor layout of Laguna-style MoE models, and a deterministic writer.

transformers keeps routed experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] = gate rows then
up rows, `mlp.experts.down_proj` [E, H, I]) and renames two things on load (conversion_mapping "laguna"):

    upstream (on disk)                              transformers (in memory)
    mlp.experts.{e}.{gate,up}_proj.weight       ->  mlp.experts.gate_up_proj[e]   (gate first, then up)
    mlp.experts.{e}.down_proj.weight            ->  mlp.experts.down_proj[e]
    mlp.experts.e_score_correction_bias         ->  mlp.gate.e_score_correction_bias
    mlp.shared_expert.*                         ->  mlp.shared_experts.*

This module does both directions explicitly (no reliance on transformers' reverse mapping at save time),
lists the names a config implies, and writes sharded safetensors deterministically: names in natural order,
whole layers per shard, `{"format": "pt"}` metadata, an index whose total_size is the sum of tensor bytes.
The writer takes any {name: tensor} so a quantized exporter can reuse it with extra tensors (scales, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_METADATA = {"format": "pt"}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_HF_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_UP_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")
ATTENTION_NORMS = ("q_norm", "k_norm")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------- naming


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def mlp_layer_types(config: Any) -> list[str]:
    """Per-layer "dense"/"sparse", with Laguna's default (first layer dense, rest sparse)."""
    layers = int(_cfg(config, "num_hidden_layers"))
    types = _cfg(config, "mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers:
        raise ValueError(f"mlp_layer_types has {len(types)} entries for {layers} layers")
    return list(types)


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


def natural_key(name: str) -> tuple:
    """Sort key treating digit runs as numbers: layers.2 < layers.10, experts.2 < experts.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def layer_of(name: str) -> int | None:
    """Decoder layer index of a tensor name (either layout), None for embed/norm/lm_head."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


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


# ----------------------------------------------------------------------------------------- writing


def shard_file_name(index: int, num_shards: int) -> str:
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shard_groups(names) -> list[list[str]]:
    """Names grouped so a shard never splits them: embedding (+ other non-layer names before it),
    each decoder layer, then the rest; natural order inside each group."""
    names = sorted(names, key=natural_key)
    head = [n for n in names if layer_of(n) is None and "embed_tokens" in n]
    tail = [n for n in names if layer_of(n) is None and "embed_tokens" not in n]
    layers: dict[int, list[str]] = {}
    for n in names:
        if (layer := layer_of(n)) is not None:
            layers.setdefault(layer, []).append(n)
    return [g for g in [head, *(layers[k] for k in sorted(layers)), tail] if g]


def assign_shards(tensors: Mapping[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Split names into `num_shards` contiguous groups of whole layers, balanced by bytes.

    Groups in order: embedding (and anything else before layer 0), layer 0, ..., layer L-1, the rest
    (final norm, lm_head). Shard k closes once the running size reaches k/num_shards of the total, but
    every shard gets at least one group. Deterministic: depends only on names and sizes.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    groups = shard_groups(tensors)
    if num_shards > len(groups):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(groups)} shardable groups")
    sizes = [sum(tensor_nbytes(tensors[n]) for n in g) for g in groups]
    total = sum(sizes)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    shard, running = 0, 0
    for i, (group, size) in enumerate(zip(groups, sizes, strict=True)):
        remaining_groups = len(groups) - i
        remaining_shards = num_shards - shard
        # advance when this shard has reached its share, or when every later shard needs a group
        if shards[shard] and shard < num_shards - 1:
            if running * num_shards >= total * (shard + 1) or remaining_groups <= remaining_shards - 1:
                shard += 1
        shards[shard].extend(group)
        running += size
    return shards


def write_sharded_safetensors(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    num_shards: int,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Write `tensors` as `model-0000k-of-0000N.safetensors` + model.safetensors.index.json.

    Every tensor is copied into its own contiguous storage (safetensors refuses shared storage) and cast
    to `dtype` if given. Returns the index dict ({"metadata": {"total_size", "total_parameters"},
    "weight_map"}).
    """
    out_dir = Path(out_dir)
    shards = assign_shards(tensors, num_shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    total_params = 0
    for k, names in enumerate(shards):
        file_name = shard_file_name(k, num_shards)
        payload: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = tensors[name].detach().to("cpu")
            if dtype is not None:
                tensor = tensor.to(dtype)
            payload[name] = tensor.clone(memory_format=torch.contiguous_format)
            weight_map[name] = file_name
            total_size += tensor_nbytes(payload[name])
            total_params += payload[name].numel()
        save_file(payload, str(out_dir / file_name), metadata=dict(SAFETENSORS_METADATA))
        del payload
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_params},
        "weight_map": {name: weight_map[name] for name in sorted(weight_map, key=natural_key)},
    }
    write_json(out_dir / INDEX_FILE, index)
    return index


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
