"""Reading a checkpoint's tensor and module names by family: which routed expert a tensor belongs to, what
a quantization config calls a layer's routed experts, where a non-expert module sits.

Each takes the checkpoint's :class:`~mixquant.model.families.Architecture` (its config.json), or None for a
checkpoint whose family is unknown: then the qwen2_moe-style names (:data:`DEFAULT_EXPERT_TEMPLATES`,
Laguna's) are read. Torch-free: the checkpoint audit reads headers only.
"""

from __future__ import annotations

import re

from mixquant.model.families import (
    DEFAULT_EXPERT_TEMPLATES,
    EXPERTS_MODULE,
    Architecture,
    _routed_patterns,
)

__all__ = [
    "expert_prefix",
    "experts_module_layer",
    "experts_module_names",
    "module_category",
    "routed_expert_tensor",
]

# Where a non-expert module sits, by the names transformers' MoE families give them (first match wins).
_CATEGORIES = (
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
    ("shared_experts", re.compile(r"\.shared_experts?\.")),
    ("attention", re.compile(r"\.(self_attn|attention|attn)\.")),
    ("router", re.compile(r"\.(mlp|block_sparse_moe)\.gate$")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)$")),
    ("embeddings", re.compile(r"embed")),
)


def _templates(arch: Architecture | None) -> dict[str, str]:
    return dict(arch.expert_templates) if arch is not None else dict(DEFAULT_EXPERT_TEMPLATES)


def routed_expert_tensor(name: str, arch: Architecture | None) -> tuple[int, int, str, str] | None:
    """``(layer, expert, proj, suffix)`` of a routed-expert tensor (its weight or one of its scales:
    ``suffix``), ``proj`` in mixquant's names (gate_proj / up_proj / down_proj); None for any other."""
    for proj, pattern in _routed_patterns(tuple(sorted(_templates(arch).items()))):
        match = pattern.match(name)
        if match:
            return int(match.group("layer")), int(match.group("expert")), proj, name.rpartition(".")[2]
    return None


def expert_prefix(layer: int, expert: int, proj: str, arch: Architecture | None) -> str:
    """The checkpoint's module name of routed expert ``expert``'s ``proj`` in layer ``layer``."""
    return _templates(arch)[proj].format(layer=int(layer), expert=int(expert)).removesuffix(".weight")


def _experts_module_templates(arch: Architecture | None) -> tuple[str, ...]:
    """The in-memory experts module (ModelOpt's quantized layer, the key vLLM resolves) and the
    checkpoint's own (ModelOpt's export writes the disk name: ``block_sparse_moe.experts`` for Mixtral)."""
    in_memory = arch.experts_module_template if arch is not None else EXPERTS_MODULE
    on_disk = _templates(arch)["gate_proj"].split(".{expert}", 1)[0]
    return (in_memory,) if on_disk == in_memory else (in_memory, on_disk)


def experts_module_names(layer: int, arch: Architecture | None) -> tuple[str, ...]:
    """The names a quantization config may give MoE layer ``layer``'s routed experts, the in-memory one
    first."""
    return tuple(template.format(layer=int(layer)) for template in _experts_module_templates(arch))


def experts_module_layer(module: str, arch: Architecture | None) -> int | None:
    """The layer whose routed experts ``module`` names (:func:`experts_module_names`), else None."""
    for template in _experts_module_templates(arch):
        pattern = re.escape(template).replace(re.escape("{layer}"), r"(\d+)")
        match = re.fullmatch(pattern, module)
        if match:
            return int(match.group(1))
    return None


def module_category(module: str) -> str:
    """Where a non-expert module sits: lm_head, shared_experts, attention, router, dense_mlp, embeddings,
    other (by the names transformers' MoE families give them)."""
    return next((name for name, pattern in _CATEGORIES if pattern.search(module)), "other")
