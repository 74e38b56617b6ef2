"""Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B, Coder-480B): no shared expert, a softmax router (top-k, optional
renormalisation), MoE on every layer but ``mlp_only_layers`` (every ``decoder_sparse_step``-th). Experts
on disk: ``mlp.experts.E.{gate,up,down}_proj`` (qwen2_moe's conversion). Published in BF16.
"""

NAME = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
SOURCE_FORMATS = ("bf16",)
