"""Mixtral-style naming: Mixtral (``mixtral``) and MiniMax-M2 (``minimax_m2``).

Every layer is MoE; no shared expert. On disk the block is ``block_sparse_moe`` and an expert's weights
are ``w1`` (gate), ``w3`` (up), ``w2`` (down) -- transformers renames them to ``mlp.experts`` with fused
``gate_up_proj`` on load, and ModelOpt's export writes the disk names back. Mixtral routes with a softmax;
MiniMax-M2 with a sigmoid and a correction bias held on the block (``block_sparse_moe.e_score_correction_
bias``). MiniMax publishes block-scaled FP8.
"""

NAME = "mixtral"
# hf_quant_config.json's quantized_layers keys as vLLM 0.33 resolves them, where they differ from the
# ones ModelOpt 0.47 writes (the disk name, ``block_sparse_moe``): vLLM's minimax_m2.py builds its
# routed experts under the prefix ``model.layers.L.mlp.experts`` (minimax_m2.py:285-289), so ModelOpt's
# keys would match nothing and the experts would load as BF16 (tests/export/test_vllm_resolution.py).
VLLM_QUANTIZED_LAYER_KEYS = {
    "minimax_m2": ("model.layers.{layer}.block_sparse_moe.experts", "model.layers.{layer}.mlp.experts")
}
MODEL_TYPES = ("mixtral", "minimax_m2")
SOURCE_FORMATS = ("bf16", "fp8_block")
