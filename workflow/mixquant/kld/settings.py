"""What every KLD engine shares: its settings, its interface, its error and the prompt it takes.

Torch-free at import (the release card reads the vLLM KV-cache dtypes without loading an engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENGINES",
    "KV_CACHE_DTYPES",
    "METHOD_HF",
    "METHOD_HIDDEN_STATES",
    "METHOD_PROMPT_LOGPROBS",
    "VLLM_KV_CACHE_DTYPES",
    "Engine",
    "EngineError",
    "EngineSettings",
    "prompt_ids",
]

ENGINES = ("hf", "vllm")
KV_CACHE_DTYPES = ("bfloat16", "fp8")
# Our KV dtype -> vLLM's kv_cache_dtype, pinned (never "auto", which would follow the checkpoint's
# kv_cache_quant_algo). vLLM 0.33 vllm/config/cache.py CacheDType accepts both; an explicit "bfloat16" must
# equal the model dtype (VllmConfig._reject_mismatched_float_kv_cache), which we pin to bfloat16.
VLLM_KV_CACHE_DTYPES = {"bfloat16": "bfloat16", "fp8": "fp8"}
HF_FP8_KV_SCALES = ("dynamic", "checkpoint")
VLLM_LOGITS = ("auto", "hidden_states", "prompt_logprobs")
METHOD_HF = "forward_logits"
METHOD_HIDDEN_STATES = "hidden_states+lm_head"
METHOD_PROMPT_LOGPROBS = "prompt_logprobs"


class EngineError(RuntimeError):
    """An engine cannot be built or run; the message is one line naming the culprit."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class EngineSettings:
    """How to run an engine. ``hf_fp8_kv_scales`` and ``vllm_logits`` only concern one engine each."""

    engine: str = "hf"  # "hf" | "vllm"
    kv_cache_dtype: str = "bfloat16"  # "bfloat16" | "fp8"
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    enforce_eager: bool = True
    seed: int = 0
    enable_prefix_caching: bool = False
    device: str | None = None  # hf: cpu, cuda or cuda:N (None: cpu); the configured numerics.device
    threads: int | None = None  # hf on CPU: torch threads for the run
    max_model_len: int | None = None  # vllm: None -> vLLM's default (the config's max_position_embeddings)
    hf_fp8_kv_scales: str = "dynamic"  # hf, fp8 KV: "dynamic" (per-call amax) | "checkpoint" (vLLM's rule)
    vllm_logits: str = "auto"  # vllm: "auto" | "hidden_states" | "prompt_logprobs"

    def __post_init__(self) -> None:
        choices = {
            "engine": ENGINES,
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "dtype": ("bfloat16",),
            "hf_fp8_kv_scales": HF_FP8_KV_SCALES,
            "vllm_logits": VLLM_LOGITS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise EngineError(
                    f"engine settings: {name}={getattr(self, name)!r}, expected one of {allowed}"
                )
        if int(self.tensor_parallel_size) < 1:
            raise EngineError(f"engine settings: tensor_parallel_size={self.tensor_parallel_size} < 1")
        for name in ("threads", "max_model_len"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise EngineError(f"engine settings: {name}={getattr(self, name)} < 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine(Protocol):
    """A fresh model instance that scores prompts."""

    def prompt_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` or ``[1, T]`` token ids -> float32 ``[T-1, V]``: logits of positions 0..T-2."""
        ...

    def info(self) -> dict[str, Any]:
        """JSON-able description: engine, versions, KV dtype in effect, device, checkpoint, method, ..."""
        ...

    def close(self) -> None: ...


def prompt_ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[T]`` or ``[1, T]`` integer token ids (T >= 2) as a CPU int64 ``[T]`` tensor."""
    import torch  # third-party, at call time: this module stays torch-free

    ids = torch.as_tensor(token_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.shape[0] < 2:
        raise ValueError(f"token_ids must be [T] or [1, T] with T >= 2, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"token_ids must be integers, got {ids.dtype}")
    return ids.to(torch.long).cpu()
