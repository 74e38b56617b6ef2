"""``is_layer_skipped`` from vllm/model_executor/layers/quantization/utils/quant_utils.py.

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/layers/quantization/utils/quant_utils.py:619-693
def is_layer_skipped(
    prefix: str,
    ignored_layers: list[str],
    fused_mapping: Mapping[str, list[str]] = MappingProxyType({}),
    *,
    match_mode: Literal["exact", "substring", "suffix"] = "exact",
) -> bool:
    def prefix_full_match(prefix: str, ignored_layers: list[str]) -> bool:
        return prefix in ignored_layers

    # For case like: ignored_layers = ["self_attn"]
    def substr_match(prefix: str, ignored_layers: list[str]) -> bool:
        return any(layer in prefix for layer in ignored_layers)

    # Match abbreviated module paths at a component boundary. For example,
    # ``b_proj`` matches ``model.layers.0.self_attn.b_proj`` but not
    # ``model.layers.0.self_attn.q_b_proj``.
    def suffix_match(prefix: str, ignored_layers: list[str]) -> bool:
        return any(
            prefix == layer or prefix.endswith(f".{layer}") for layer in ignored_layers
        )

    if match_mode == "exact":
        match_func = prefix_full_match
    elif match_mode == "substring":
        match_func = substr_match
    elif match_mode == "suffix":
        match_func = suffix_match
    else:
        raise ValueError(f"Unsupported layer skip match mode: {match_mode}")

    # prefix: model.layers.0.self_attn.q_proj
    # proj_name: q_proj
    proj_name = prefix.split(".")[-1]

    # Fused layers like gate_up_proj or qkv_proj will not be fused
    # in the safetensors checkpoint. So, we convert the name
    # from the fused version to unfused + check to make sure that
    # each shard of the fused layer has the same scheme.
    #
    # Some checkpoints (e.g. block-FP8 Step-3.5-Flash) already list the
    # fused name (e.g. ``self_attn.qkv_proj``) directly in
    # ``modules_to_not_convert``. Honor that fused-name match first so
    # those layers are still correctly skipped even when a
    # ``packed_modules_mapping`` is registered on the model.
    if proj_name in fused_mapping and match_func(prefix, ignored_layers):
        is_skipped = True
    elif proj_name in fused_mapping:
        shard_prefixes = [
            prefix.replace(proj_name, shard_proj_name)
            for shard_proj_name in fused_mapping[proj_name]
        ]

        is_skipped = None
        for shard_prefix in shard_prefixes:
            is_shard_skipped = match_func(shard_prefix, ignored_layers)

            if is_skipped is None:
                is_skipped = is_shard_skipped
            elif is_shard_skipped != is_skipped:
                raise ValueError(
                    f"Detected some but not all shards of {prefix} "
                    "are quantized. All shards of fused layers "
                    "to have the same precision."
                )
    elif "experts" in prefix and match_mode == "exact":
        expert_ignore_layers = filter(
            lambda layer_name: "experts" in layer_name, ignored_layers
        )
        return any(prefix in layer_name for layer_name in expert_ignore_layers)
    else:
        is_skipped = match_func(prefix, ignored_layers)

    assert is_skipped is not None
    return is_skipped
# <<< vllm 0.33.0 vllm/model_executor/layers/quantization/utils/quant_utils.py:619-693
# fmt: on
