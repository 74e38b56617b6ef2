"""Engines for the KL gate: a checkpoint + a prompt -> full-vocabulary logits of every prompt position.

One interface (:class:`mixquant.kld.settings.Engine`, with the settings), two implementations, each built
fresh by :func:`open_engine`; what kind of checkpoint an engine is handed: :mod:`mixquant.kld.checkpoints`.

``hf`` (:class:`mixquant.kld.hf_engine.HfEngine`)
    the checkpoint's transformers model in bf16 (eager experts, sdpa attention), one forward of the whole
    prompt (``use_cache=False``, inference mode). A BF16 upstream checkpoint is loaded as is. A ModelOpt
    export is loaded with :func:`mixquant.model.dequant.load_dequantized_model` (NVFP4 / FP8 weights
    dequantized to bf16: NVFP4 W4A16 needs nothing more) and every layer whose routed experts are FP8 W8A8
    gets its expert inputs fake-quantized at the exported, layer-shared static ``input_scale``
    (:func:`mixquant.model.experts.fp8_expert_inputs`, ModelOpt's ``scaled_e4m3_impl``). Any other
    quantization (compressed-tensors, NVFP4 W4A4, quantized non-expert tensors, ...) is refused.

    ``kv_cache_dtype="fp8"`` is an *emulation* of vLLM's FP8 (E4M3) KV cache: K (after ``k_norm`` and RoPE)
    and V are fake-quantized per tensor where the attention function receives them -- the tensors a KV
    cache stores. ``hf_fp8_kv_scales="dynamic"`` (default): amax = max |x| of each call;
    ``"checkpoint"``: vLLM 0.33's own rule, the checkpoint's static ``k_scale`` / ``v_scale`` when it has
    them, else scale 1.0 (amax 448). vLLM additionally quantizes the query (static scale) for FP8 KV on
    FlashAttention 3 and runs its own fp8 attention kernels; neither is emulated.

``vllm`` (:class:`mixquant.kld.vllm_engine.VllmEngine`)
    ``vllm.LLM`` with every setting that changes numerics pinned (see
    :func:`mixquant.kld.vllm_engine.vllm_llm_kwargs`), imported
    lazily. Full-vocabulary logits, fast path (``method="hidden_states+lm_head"``): a forward hook on the
    model's final norm, installed in every worker with ``LLM.apply_model``, captures the pre-``lm_head``
    hidden states of a 1-token generate of the prompt; the BF16 ``lm_head`` read from the checkpoint is
    applied here (fp32 GEMM rounded to bf16, as a bf16 GEMM with fp32 accumulation). Fallback
    (``method="prompt_logprobs"``): ``SamplingParams(prompt_logprobs=-1)``, the full-vocabulary
    log-probabilities of every prompt position. These are ``log_softmax(logits)``, not logits: each row
    differs from the logits by a constant, to which softmax, and so the KL, is invariant.

Every engine returns float32 ``[T-1, V]`` on the CPU: the logits of positions ``0..T-2`` (the predictions
of tokens ``1..T-1``).
"""

from __future__ import annotations

from pathlib import Path

from mixquant.kld.hf_engine import HfEngine
from mixquant.kld.settings import Engine, EngineSettings
from mixquant.kld.vllm_engine import VllmEngine

__all__ = ["open_engine"]


def open_engine(model_dir: str | Path, settings: EngineSettings | None = None) -> Engine:
    """A fresh engine for the checkpoint in ``model_dir``."""
    settings = settings or EngineSettings()
    if settings.engine == "hf":
        return HfEngine(model_dir, settings)
    return VllmEngine(model_dir, settings)
