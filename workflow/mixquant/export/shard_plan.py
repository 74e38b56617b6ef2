"""How the export's tensors are split into shards: whole layers stay together, in natural name order.

The groups are :func:`mixquant.model.layout.assign_shards`' (the embedding group, layer 0, ..., the rest:
final norm, lm_head). ``num_shards`` uses that function's byte-balanced split; ``max_shard_bytes`` closes a
shard before the group that would push it past the limit (a single group larger than the limit gets a
shard of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mixquant.export.inputs import ExportInputError
from mixquant.model.layout import assign_shards, natural_key, shard_groups

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "plan_shards"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


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


def plan_shards(
    sizes: Mapping[str, int], num_shards: int | None, max_shard_bytes: int | None
) -> list[list[str]]:
    """The shards' tensor names (in file order) for tensors of ``sizes`` bytes: ``num_shards`` shards, or
    shards of at most ``max_shard_bytes`` (default :data:`DEFAULT_MAX_SHARD_BYTES`); not both."""
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
