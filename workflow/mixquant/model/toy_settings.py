"""Typed settings of the embedded toy Laguna: geometry, tokenizer, training.

Brackets give Laguna-S-2.1's value where one exists (its config.json). Every matrix input dimension
is a multiple of 16 so that NVFP4's 16-element blocks tile it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToyArchitecture(_Strict):
    num_hidden_layers: int = Field(default=9, ge=2, description="Decoder layers: dense ones, then MoE [48].")
    num_dense_layers: int = Field(default=1, ge=1, description="Leading layers with a dense MLP [1].")
    hidden_size: int = Field(default=128, ge=16, multiple_of=16, description="Residual width [3072].")
    head_dim: int = Field(default=16, ge=16, multiple_of=16, description="Per-head width [128].")
    num_attention_heads_full: int = Field(
        default=4, ge=1, description="Query heads on full-attention layers [48]."
    )
    num_attention_heads_sliding: int = Field(
        default=6, ge=1, description="Query heads on sliding-window layers [72]."
    )
    num_key_value_heads: int = Field(default=2, ge=1, description="KV heads; divides both head counts [8].")
    full_attention_period: int = Field(
        default=4, ge=1, description="Layer l uses full attention iff l % period == 0 [4]."
    )
    sliding_window: int = Field(
        default=64, ge=1, description="Tokens a sliding-window layer attends to [512]."
    )
    intermediate_size: int = Field(default=256, ge=16, multiple_of=16, description="Dense MLP width [12288].")
    num_experts: int = Field(default=16, ge=2, description="Routed experts per MoE layer [256].")
    num_experts_per_tok: int = Field(default=2, ge=1, description="Top-k routed experts per token [10].")
    moe_intermediate_size: int = Field(
        default=32, ge=16, multiple_of=16, description="Routed-expert MLP width [1024]."
    )
    shared_expert_intermediate_size: int = Field(
        default=64, ge=16, multiple_of=16, description="Shared-expert MLP width [1024]."
    )
    moe_routed_scaling_factor: float = Field(
        default=2.5, description="Routed output scale before adding the shared expert [2.5]."
    )
    full_rope_theta: float = Field(
        default=500000.0, description="RoPE base on full-attention layers [500000]."
    )
    full_partial_rotary_factor: float = Field(
        default=0.5, gt=0, le=1, description="Fraction of head_dim rotated on full-attention layers [0.5]."
    )
    sliding_rope_theta: float = Field(
        default=10000.0, description="RoPE base on sliding-window layers [10000]."
    )
    max_position_embeddings: int = Field(default=4096, ge=1, description="Advertised context length.")
    rms_norm_eps: float = Field(default=1e-6, gt=0, description="RMSNorm epsilon [1e-6].")
    initializer_range: float = Field(default=0.02, gt=0, description="Std of the normal weight init.")
    router_bias_init_std: float = Field(
        default=0.02, ge=0, description="Std of the seeded nonzero init of e_score_correction_bias."
    )


class ToyTokenizer(_Strict):
    vocab_size: int = Field(
        default=2048,
        ge=300,
        multiple_of=16,
        description="Byte-level BPE vocabulary incl. 256 bytes and specials.",
    )
    min_frequency: int = Field(default=2, ge=1, description="A pair must occur this often to be merged.")


class ToyTraining(_Strict):
    steps: int = Field(default=320, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=24, ge=1, description="Sequences per step.")
    seq_len: int = Field(
        default=128, ge=2, description="Tokens per training sequence (packed conversations)."
    )
    lr: float = Field(default=6e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final lr as a fraction of the peak (cosine)."
    )
    warmup_steps: int = Field(default=20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay (matrices only).")
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")
    router_bias_update_rate: float = Field(
        default=0.001, ge=0, description="Aux-loss-free balancing: bias += rate * sign(mean load - load)."
    )
    heldout_every: int = Field(
        default=20, ge=2, description="Every n-th conversation is held out from training (for held-out loss)."
    )
    eval_sequences: int = Field(
        default=256, ge=1, description="Sequences scored for train/held-out loss (at most)."
    )


class ToyOutlierLayer(_Strict):
    """Massive activations in one MoE layer's routed experts ("super weights", Yu et al. 2024)."""

    layer: int = Field(ge=1, description="MoE layer index whose routed experts get outlier channels.")
    channels: int = Field(
        ge=1, description="Intermediate channels per expert scaled up (chosen by a seeded permutation)."
    )
    log2_scale: int = Field(
        ge=1,
        le=20,
        description="The up_proj rows of those channels are multiplied by 2**log2_scale and the matching "
        "down_proj columns divided by it: the BF16 function is unchanged bit for bit (powers of two), but "
        "the intermediate activation gets outliers and down_proj tiny columns, which NVFP4 blocks zero out.",
    )


def _default_outliers() -> list[ToyOutlierLayer]:
    # Three layers of graded sensitivity; see config/README.md ("the toy's outlier layers").
    return [
        ToyOutlierLayer(layer=2, channels=4, log2_scale=8),
        ToyOutlierLayer(layer=5, channels=2, log2_scale=8),
        ToyOutlierLayer(layer=7, channels=1, log2_scale=8),
    ]


class ToyOutliers(_Strict):
    seed: int = Field(default=0, description="Seed of the permutation choosing the outlier channels.")
    layers: list[ToyOutlierLayer] = Field(
        default_factory=_default_outliers,
        description="Per-layer outlier channels applied after training (empty: none).",
    )
