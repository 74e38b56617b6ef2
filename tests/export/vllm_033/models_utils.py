"""``WeightsMapper`` from vllm/model_executor/models/utils.py (its torch-only ``apply`` omitted).

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

# ruff: noqa: E731, UP037
from __future__ import annotations

import re  # vLLM: ``import regex as re`` (only ``Pattern.search`` / ``.sub`` are used here)
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers.conversion_mapping import WeightRenaming

from ._stubs import ShardIds, init_logger

logger = init_logger(__name__)


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/utils.py:48-146
@dataclass
class WeightsMapper:
    """Maps the name of each weight if they match the following patterns.

    If a key maps to a value of `None`, the corresponding weight is ignored."""

    orig_to_new_renaming: list["WeightRenaming"] = field(default_factory=list)
    orig_to_new_regex: Mapping[re.Pattern, str | None] = field(default_factory=dict)
    orig_to_new_substr: Mapping[str, str | None] = field(default_factory=dict)
    orig_to_new_stacked: Mapping[str, tuple[str, ShardIds]] = field(
        default_factory=dict
    )
    orig_to_new_prefix: Mapping[str, str | None] = field(default_factory=dict)
    orig_to_new_suffix: Mapping[str, str | None] = field(default_factory=dict)

    def __or__(self, other: "WeightsMapper") -> "WeightsMapper":
        """Combine two `WeightsMapper`s by merging their mappings."""
        return WeightsMapper(
            orig_to_new_renaming=[
                *self.orig_to_new_renaming,
                *other.orig_to_new_renaming,
            ],
            orig_to_new_regex={**self.orig_to_new_regex, **other.orig_to_new_regex},
            orig_to_new_substr={**self.orig_to_new_substr, **other.orig_to_new_substr},
            orig_to_new_stacked={
                **self.orig_to_new_stacked,
                **other.orig_to_new_stacked,
            },
            orig_to_new_prefix={**self.orig_to_new_prefix, **other.orig_to_new_prefix},
            orig_to_new_suffix={**self.orig_to_new_suffix, **other.orig_to_new_suffix},
        )

    def map_name(self, key: str) -> str | None:
        """Map a weight name; returns ``None`` if the weight should be ignored."""
        result = self._map_name_with_shard(key)
        return result[0] if result is not None else None

    def _map_name(self, key: str) -> str | None:
        """Backward-compatible alias for :meth:`map_name`."""
        return self.map_name(key)

    def _map_name_with_shard(self, key: str) -> tuple[str, ShardIds | None] | None:
        """Map a weight name and extract any shard_id metadata.

        Returns:
            (mapped_name, shard_id) if the name should be kept. A list of shard
            ids means the weight is loaded into each of those shards in turn.
            None if the name should be dropped.

        """
        # Deprecation warnings
        if key.endswith(".kv_scale"):
            logger.warning_once(
                "DEPRECATED. Found kv_scale in the checkpoint. "
                "This format is deprecated in favor of separate k_scale and "
                "v_scale tensors and will be removed in a future release. "
                "Functionally, we will remap kv_scale to k_scale and duplicate "
                "k_scale to v_scale"
            )

        for renaming in self.orig_to_new_renaming:
            key, _ = renaming.rename_source_key(key)

        for pattern, new_key in self.orig_to_new_regex.items():
            if pattern.search(key):
                if new_key is None:
                    return None

                key = pattern.sub(new_key, key)

        for substr, new_key in self.orig_to_new_substr.items():
            if substr in key:
                if new_key is None:
                    return None

                key = key.replace(substr, new_key, 1)

        shard_id: ShardIds | None = None
        for substr, (new_key, new_shard_id) in self.orig_to_new_stacked.items():
            if substr in key:
                key = key.replace(substr, new_key, 1)
                shard_id = new_shard_id

        for prefix, new_key in self.orig_to_new_prefix.items():
            if key.startswith(prefix):
                if new_key is None:
                    return None

                key = key.replace(prefix, new_key, 1)

        for suffix, new_key in self.orig_to_new_suffix.items():
            if key.endswith(suffix):
                if new_key is None:
                    return None

                key = new_key.join(key.rsplit(suffix, 1))

        return key, shard_id

# <<< vllm 0.33.0 vllm/model_executor/models/utils.py:48-146
# fmt: on


    # [omitted: WeightsMapper.apply, utils.py:147-165 (streams torch tensors; unused here)]


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/utils.py:166-199
    def apply_list(self, values: list[str]) -> list[str]:
        return [
            out_name
            for name in values
            if (out_name := self._map_name(name)) is not None
        ]

    def apply_dict(self, values: dict[str, Any]) -> dict[str, Any]:
        return {
            out_name: value
            for name, value in values.items()
            if (out_name := self._map_name(name)) is not None
        }

    def get_rename_mapper(self) -> "WeightsMapper":
        """Mapper variant keeping only the renames.

        This is what consumers that *name* modules rather than load them need:
        LoRA name parsing and the quantization config's layer lists.

        Stacked maps are dropped so that constituent names (e.g. `q_proj`) survive
        rather than being rewritten to the stacked vLLM name (`qkv_proj`). Mappings to
        `None` are dropped because "do not load this weight" is meaningless to such a
        consumer, and applying it would silently shrink a quantization config's ignore
        list or make LoRA name parsing fail."""
        remove_none = lambda d: {k: v for k, v in d.items() if v is not None}
        return replace(
            self,
            orig_to_new_regex=remove_none(self.orig_to_new_regex),
            orig_to_new_substr=remove_none(self.orig_to_new_substr),
            orig_to_new_stacked={},
            orig_to_new_prefix=remove_none(self.orig_to_new_prefix),
            orig_to_new_suffix=remove_none(self.orig_to_new_suffix),
        )
# <<< vllm 0.33.0 vllm/model_executor/models/utils.py:166-199
# fmt: on
