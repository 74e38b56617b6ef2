"""The on-disk bytes of a checkpoint that are not tensor payload (shard headers, the index), estimated for
a list of tensors saved the way ModelOpt's ``export_hf_checkpoint`` saves them."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from mixquant.checkpoint.headers import DTYPE_BYTES
from mixquant.export.predict import TensorEntry

__all__ = ["estimate_metadata_bytes"]


def _greedy_shards(entries: list[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """transformers' ``split_torch_state_dict_into_shards``: fill in order, start a new shard when the
    next tensor would exceed ``max_shard_bytes``."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _safetensors_header_bytes(entries: list[TensorEntry], metadata: Mapping[str, str] | None) -> int:
    """Exact size (8-byte length prefix + JSON, padded to 8) of the header safetensors writes: compact
    JSON, tensors laid out by descending element size, then name (safetensors' ``prepare``)."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for e in sorted(entries, key=lambda e: (-DTYPE_BYTES[e.dtype], e.name)):
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return 8 + len(text) + (-len(text)) % 8


def estimate_metadata_bytes(
    entries: list[TensorEntry],
    *,
    max_shard_bytes: int = 10 * 10**9,
    metadata: Mapping[str, str] | None = None,
    total_parameters: int | None = None,
) -> dict[str, Any]:
    """On-disk bytes that are not tensor payload, for ``entries`` saved the way ``export_hf_checkpoint``
    saves them (``save_pretrained(max_shard_size="10GB")``: greedy shards in state-dict order, safetensors
    headers with ``{"format": "pt"}`` metadata, an index ``json.dumps(indent=2, sort_keys=True)``).

    The tensor order inside the state dict is approximated by ``entries``' order, so shard boundaries and
    offset digit counts are an estimate; the header text per tensor is exact. Returns ``shards`` (number),
    ``shard_header_bytes`` (total and per shard), ``index_bytes`` and their sum.
    """
    metadata = {"format": "pt"} if metadata is None else metadata
    shards = _greedy_shards(list(entries), max_shard_bytes)
    n = len(shards)
    per_shard = [_safetensors_header_bytes(s, metadata) for s in shards]
    index_bytes = 0
    if n > 1:
        names = {
            e.name: f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            for i, shard in enumerate(shards)
            for e in shard
        }
        params = (
            total_parameters if total_parameters is not None else sum(math.prod(e.shape) for e in entries)
        )
        index = {
            "metadata": {"total_parameters": params, "total_size": sum(e.nbytes for e in entries)},
            "weight_map": names,
        }
        index_bytes = len((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return {
        "shards": n,
        "shard_header_bytes": sum(per_shard),
        "shard_header_bytes_per_shard": per_shard,
        "index_bytes": index_bytes,
        "total": sum(per_shard) + index_bytes,
    }
