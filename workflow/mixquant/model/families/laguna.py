"""Laguna (poolside): the embedded toy's architecture and the reference release's.

Dense first layer(s), then MoE layers (``mlp_layer_types``); sigmoid router with a correction bias that
the checkpoint stores as ``mlp.experts.e_score_correction_bias`` (in memory ``mlp.gate.``), a shared
expert (``mlp.shared_expert`` on disk, ``mlp.shared_experts`` in memory), routed scaling; hybrid
sliding/full attention with per-head gating. Experts on disk: ``mlp.experts.E.{gate,up,down}_proj``.
"""

from __future__ import annotations

from typing import Any

NAME = "laguna"
MODEL_TYPES = ("laguna",)
SOURCE_FORMATS = ("bf16",)
# FP8 KV-cache scales: checked against the reference release and vLLM (the other families: not yet)
KV_CACHE_SCALES = True


def planning_config(geometry: Any) -> dict[str, Any]:
    """A Laguna config.json of a planning geometry (``mixquant.facts.Geometry``, the embedded toy's): what
    the cost model and the planning checks read before the toy is built."""
    layers = geometry.num_hidden_layers
    return {
        "model_type": "laguna",
        "vocab_size": geometry.vocab_size,
        "hidden_size": geometry.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": geometry.num_attention_heads,
        "num_attention_heads_per_layer": [geometry.heads(layer) for layer in range(layers)],
        "num_key_value_heads": geometry.num_key_value_heads,
        "head_dim": geometry.head_dim,
        "intermediate_size": geometry.intermediate_size,
        "num_experts": geometry.num_experts,
        "num_experts_per_tok": geometry.num_experts_per_tok,
        "moe_intermediate_size": geometry.moe_intermediate_size,
        "shared_expert_intermediate_size": geometry.shared_expert_intermediate_size,
        "mlp_layer_types": ["sparse" if layer in geometry.moe_layers else "dense" for layer in range(layers)],
        "tie_word_embeddings": geometry.tie_word_embeddings,
        "dtype": {2: "bfloat16", 4: "float32"}[geometry.dtype_bytes],
        "gating": True,
        "attention_bias": False,
    }
