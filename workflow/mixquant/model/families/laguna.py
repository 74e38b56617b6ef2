"""Laguna (poolside): the embedded toy's architecture and the reference release's.

Dense first layer(s), then MoE layers (``mlp_layer_types``); sigmoid router with a correction bias that
the checkpoint stores as ``mlp.experts.e_score_correction_bias`` (in memory ``mlp.gate.``), a shared
expert (``mlp.shared_expert`` on disk, ``mlp.shared_experts`` in memory), routed scaling; hybrid
sliding/full attention with per-head gating. Experts on disk: ``mlp.experts.E.{gate,up,down}_proj``.
"""

NAME = "laguna"
MODEL_TYPES = ("laguna",)
SOURCE_FORMATS = ("bf16",)
# FP8 KV-cache scales: checked against the reference release and vLLM (the other families: not yet)
KV_CACHE_SCALES = True
