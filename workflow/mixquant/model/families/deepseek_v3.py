"""The DeepSeek-V3 layout: DeepSeek-V3/R1 (``deepseek_v3``) and GLM-4.5/4.6 (``glm4_moe``).

``first_k_dense_replace`` dense layers, then MoE layers with ``n_shared_experts`` shared experts
(``mlp.shared_experts``) and a sigmoid router with ``e_score_correction_bias`` (in ``mlp.gate``),
group-limited top-k (``n_group``, ``topk_group``) and ``routed_scaling_factor``; DeepSeek has MLA
attention. Experts on disk: ``mlp.experts.E.{gate,up,down}_proj``. DeepSeek publishes block-scaled FP8
(``weight_scale_inv`` per 128 x 128 block), GLM BF16 (and FP8 variants). Kimi-K2.x (``kimi_k2`` needs
remote code; ``kimi_k25`` is a vision-language wrapper in transformers 5.24) is not covered.
"""

NAME = "deepseek_v3"
MODEL_TYPES = ("deepseek_v3", "glm4_moe")
SOURCE_FORMATS = ("bf16", "fp8_block")
