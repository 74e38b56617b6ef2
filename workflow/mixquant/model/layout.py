"""A checkpoint's files and their deterministic layout: file names, natural name order, shards.

The sharded writer writes sharded safetensors deterministically: names in natural order, whole layers per
shard, `{"format": "pt"}` metadata, an index whose total_size is the sum of tensor bytes. It takes any
{name: tensor}, whatever the family (the toy's upstream layout, :mod:`mixquant.model.toy_layout`, saves
through it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# The checkpoint's file names (mixquant.checkpoint.headers), here for the callers that build checkpoints.
from mixquant.checkpoint.headers import CONFIG_FILE as CONFIG_FILE
from mixquant.checkpoint.headers import GENERATION_CONFIG_FILE as GENERATION_CONFIG_FILE
from mixquant.checkpoint.headers import INDEX_FILE, layer_of
from mixquant.checkpoint.writer import SAFETENSORS_METADATA, tensor_record, write_safetensors

# ----------------------------------------------------------------------------------------- naming


def natural_key(name: str) -> tuple:
    """Sort key treating digit runs as numbers: layers.2 < layers.10, experts.2 < experts.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


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
        records = [tensor_record(name, tensor) for name, tensor in payload.items()]
        write_safetensors(out_dir / file_name, records, metadata=SAFETENSORS_METADATA, fsync=False)
        del records
        del payload
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_params},
        "weight_map": {name: weight_map[name] for name in sorted(weight_map, key=natural_key)},
    }
    write_json(out_dir / INDEX_FILE, index)
    return index


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
