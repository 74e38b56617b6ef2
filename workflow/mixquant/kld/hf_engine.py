"""The hf engine: the checkpoint's transformers model, layer-streamed, with the candidate's quantization
reproduced (see :mod:`mixquant.kld.engines` for what it reproduces and what it refuses)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mixquant.formats.facts import FP8_E4M3_MAX
from mixquant.heap import collect
from mixquant.kld.checkpoints import describe_checkpoint, read_tensors, tensor_files
from mixquant.kld.settings import METHOD_HF, EngineError, EngineSettings, prompt_ids
from mixquant.model.attention import attention_kv_hook
from mixquant.model.experts import amax_from_input_scale, fp8_expert_inputs
from mixquant.model.families import architecture, experts_of
from mixquant.model.streaming import StreamedModel, resolve_device
from mixquant.numerics import fingerprint, torch_threads

__all__ = ["HfEngine", "fp8_kv_fake_quant"]

HF_FORMATS = ("nvfp4_w4a16", "fp8", "bf16")  # routed-expert formats the hf engine reproduces
MODELOPT_QUANT_ALGOS = ("MIXED_PRECISION", "W4A16_NVFP4", "FP8", None)
MODELOPT_KV_ALGOS = ("FP8", None)
_KV_SCALE_NAMES = {
    "k": ("model.layers.{layer}.self_attn.k_proj.k_scale", "model.layers.{layer}.self_attn.k_scale"),
    "v": ("model.layers.{layer}.self_attn.v_proj.v_scale", "model.layers.{layer}.self_attn.v_scale"),
}


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


def _fp8_input_amax(model_dir: Path, layer: int, who: str) -> dict[str, torch.Tensor]:
    """The layer-shared static input amax of an FP8 layer's gate/up and down projections (exported
    ``input_scale``; checked identical across experts, and between gate and up)."""
    arch = architecture(model_dir)
    names = {
        proj: [f"{arch.expert_prefix(layer, e, proj)}.input_scale" for e in range(arch.num_experts)]
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    tensors = read_tensors(model_dir, [n for group in names.values() for n in group], who)
    amax: dict[str, torch.Tensor] = {}
    for kind, projs in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        values = {float(tensors[n].float().item()) for proj in projs for n in names[proj]}
        if len(values) != 1:
            raise EngineError(
                f"{who}: layer {layer} {'/'.join(projs)} input_scale is not layer-shared "
                f"({sorted(values)[:4]})"
            )
        amax[kind] = amax_from_input_scale(tensors[names[projs[0]][0]])
    return amax


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
            with torch_threads(settings.threads):
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
        if not (self.fp8_activations and layer in self._fp8_amax):
            return contextlib.nullcontext()
        amax = self._fp8_amax[layer]
        return fp8_expert_inputs(experts_of(self.model, layer), amax["gate_up"], amax["down"])

    def _kv_static_amax(self) -> dict[int, dict[str, torch.Tensor]]:
        """vLLM's static KV scales: the checkpoint's k_scale / v_scale per layer, else 1.0 (amax 448)."""
        weight_map = tensor_files(self.model_dir, self.who)
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer in range(int(self.model.config.num_hidden_layers)):
            out[layer] = {}
            for kind, patterns in _KV_SCALE_NAMES.items():
                name = next(
                    (p.format(layer=layer) for p in patterns if p.format(layer=layer) in weight_map), None
                )
                scale = (
                    read_tensors(self.model_dir, [name], self.who)[name].float().reshape(())
                    if name is not None
                    else torch.tensor(1.0)
                )
                out[layer][kind] = scale * FP8_E4M3_MAX
        return out

    def prompt_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        return next(iter(self.windows_logits(prompt_ids(token_ids)[None])))

    def windows_logits(self, windows: torch.Tensor) -> Iterator[torch.Tensor]:
        """Each window's float32 ``[T-1, V]`` logits, in order, from ``[W, T]`` token ids: every window
        carried through one layer-streamed pass (each layer read and dequantized once, then called once per
        window, as a single window's forward calls it: a window's logits do not depend on the others; FP8 KV
        amax is per call, so per window). Holds every window's hidden states, not their logits."""
        if self.model is None:
            raise EngineError(f"{self.who}: engine is closed")
        ids = torch.as_tensor(windows).to(torch.long).cpu()
        if ids.dim() != 2 or ids.shape[1] < 2:
            raise ValueError(f"windows must be [W, T] with T >= 2, got shape {tuple(ids.shape)}")
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch_threads(self.settings.threads))
            stack.enter_context(torch.no_grad())
            if self._kv_fp8:
                stack.enter_context(fp8_kv_fake_quant(self.model, self._kv_static, self.kv_calls))
            inputs = [self.stream.layer_inputs(window[None]) for window in ids]
            hidden = [window.hidden for window in inputs]
            for i, layer in self.stream.stream():
                with self._fp8_inputs(i):
                    for w, window in enumerate(inputs):
                        hidden[w] = layer(hidden[w], **window.kwargs[i])
            for w in range(len(hidden)):
                logits = self.stream.head(hidden[w])
                hidden[w] = None
                yield logits[0, :-1].float().cpu()

    def info(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        import transformers

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
        collect()  # the model's reference cycles (mixquant.heap)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> HfEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
