"""KL sensitivity of each MoE layer's routed experts to one quantization format.

Score of a group (the routed experts of MoE layer ``L``) and a format ``f``: KL(BF16 || model with only that
group quantized to ``f``), summed over every calibration token and the full vocabulary, exactly as ModelOpt
0.47's ``auto_quantize(method="kl_div")`` accumulates it per batch --
``F.kl_div(log_softmax(q.float()), log_softmax(p.float()), reduction="sum", log_target=True)`` -- and
reported both as that sum (``kl_sum``) and normalised per token (``kl_per_token = kl_sum / tokens``, tokens =
every position of every calibration sequence, the last one included). The ILP works on ``kl_per_token``.

Two numerics (``placement.search.calibration``), both with FP8 W8A8 expert inputs fake-quantized by
ModelOpt's own ``scaled_e4m3_impl`` at the layer-shared static amax, as ModelOpt's ``_QuantFusedExperts``:

* ``rebuild`` (default): the quantized weights are the dequantized tensors a ``quantize_layer`` job wrote
  (ModelOpt's export numerics with the rebuild's calibration), so the search scores bit for bit the
  weights that ship;
* ``max``: ModelOpt's own search numerics (:func:`modelopt_search_quant`): its shipped presets, max
  calibration, its fake-quant arithmetic -- what ``auto_quantize`` scores. ModelOpt searches with max and
  rebuilds with MSE; this reproduces its scores.

Work is reused: per batch, one BF16 forward records every decoder layer's input (hidden states and the
layer's keyword arguments: masks, rotary embeddings, positions) and the reference log-probabilities; the
score of layer ``L`` then runs only layers ``L..N-1``, the final norm and ``lm_head`` -- bit-identical to a
full forward with only ``L`` quantized, since nothing before ``L``'s experts changes. Quantized weights are
dequantized (or fake-quantized) once per group instead of on every forward, and ``exp(log p_ref)`` once
per batch. This whole-model scorer is the reference of the layer-streamed one (:mod:`.branches`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mixquant.calibration.tokens import calibration_batches
from mixquant.formats.dequant import dequantize_tensors
from mixquant.model.experts import amax_from_input_scale, fp8_expert_inputs, swapped_experts
from mixquant.model.families import default_expert_weight, experts_of

__all__ = [
    "LayerQuant",
    "kl_sum",
    "layer_quant_from_tensors",
    "load_search_model",
    "modelopt_search_quant",
    "quantized_experts",
    "sensitivity_scores",
]


def load_search_model(model_dir: str | Path, *, device: str | torch.device = "cpu"):
    """The whole BF16 source model as ModelOpt's search runs it (eager experts, sdpa): the reference the
    streamed scorer (:mod:`mixquant.search.branches`) is tested against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        Path(model_dir), dtype=torch.bfloat16, experts_implementation="eager", attn_implementation="sdpa"
    )
    if model.config._experts_implementation != "eager":
        raise RuntimeError(
            f"experts implementation is {model.config._experts_implementation!r}, need 'eager'"
        )
    return model.to(device).eval()


@dataclass(frozen=True)
class LayerQuant:
    """One MoE layer's routed experts in one format, ready to swap in: dequantized fused weights and, for
    FP8 W8A8, the layer-shared input amax of the gate/up and down projections."""

    layer: int
    fmt: str
    gate_up: torch.Tensor  # [E, 2I, H], model dtype
    down: torch.Tensor  # [E, H, I]
    gate_up_input_amax: torch.Tensor | None = None  # fp32 scalar
    down_input_amax: torch.Tensor | None = None


def layer_quant_from_tensors(
    tensors: Mapping[str, torch.Tensor],
    layer: int,
    fmt: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    arch: Any = None,
) -> LayerQuant:
    """A :class:`LayerQuant` from the tensors a ``quantize_layer`` job wrote (exported, i.e. disk, names:
    ``arch``'s, :class:`mixquant.model.families.Architecture`; default the qwen2_moe-style names).

    Dequantized one expert at a time straight into the fused ``[E, 2I, H]`` / ``[E, H, I]`` tensors, so
    the routed experts are held once in the model dtype (plus one expert's temporaries).
    """

    def weight_name(e: int, proj: str) -> str:
        if arch is not None:
            return arch.expert_weight(layer, e, proj)
        return default_expert_weight(layer, e, proj)

    experts = []
    while weight_name(len(experts), "gate_proj") in tensors:
        experts.append(len(experts))
    if not experts:
        raise ValueError(f"layer {layer}: no routed-expert weights among the quantized tensors")

    def expert(e: int) -> dict[str, torch.Tensor]:
        prefixes = {
            proj: weight_name(e, proj).removesuffix(".weight")
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        own = {n: t for n, t in tensors.items() if any(n.startswith(f"{p}.") for p in prefixes.values())}
        deq = dequantize_tensors(own, dtype)
        out = {}
        for proj, prefix in prefixes.items():
            name = f"{prefix}.weight"
            if name not in deq:
                raise ValueError(f"layer {layer}: missing {name}")
            out[proj] = deq[name]
        return out

    gate_up = down = None
    for e in experts:
        weights = expert(e)
        gate, up = weights["gate_proj"], weights["up_proj"]
        if gate_up is None:
            gate_up = torch.empty(len(experts), gate.shape[0] + up.shape[0], gate.shape[1], dtype=dtype)
            down = torch.empty(len(experts), *weights["down_proj"].shape, dtype=dtype)
        gate_up[e, : gate.shape[0]] = gate
        gate_up[e, gate.shape[0] :] = up
        down[e] = weights["down_proj"]
    amax: dict[str, torch.Tensor | None] = {"gate_up": None, "down": None}
    if fmt == "fp8":
        for kind, proj in (("gate_up", "gate_proj"), ("down", "down_proj")):
            names = [weight_name(e, proj).removesuffix(".weight") + ".input_scale" for e in experts]
            scales = {tensors[name].float().item() for name in names}
            if len(scales) != 1:
                raise ValueError(
                    f"layer {layer}: {proj} input_scale differs across experts ({sorted(scales)})"
                )
            amax[kind] = amax_from_input_scale(tensors[names[0]])
    return LayerQuant(layer, fmt, gate_up, down, amax["gate_up"], amax["down"])


MODELOPT_PRESETS = {"nvfp4_w4a16": "W4A16_NVFP4_CFG", "fp8": "FP8_DEFAULT_CFG"}


def modelopt_search_quant(
    model: torch.nn.Module, layer: int, fmt: str, activation_amax: Mapping[str, Any] | None = None
) -> LayerQuant:
    """Layer ``layer``'s routed experts exactly as ModelOpt's ``auto_quantize`` fake-quantizes them.

    ModelOpt's shipped preset (``W4A16_NVFP4_CFG``: dynamic NVFP4 blocks; ``FP8_DEFAULT_CFG``: per-tensor
    FP8 weights and inputs), max calibration: each expert's fused gate_up and its down weight get a
    ``TensorQuantizer`` from the preset's weight-quantizer attributes with ``amax = max |w|`` and are passed
    through it once (ModelOpt's fake-quant arithmetic, which rounds differently from the export's in a few
    blocks); FP8 inputs use the layer-shared activation amax (``{"gate_up", "down"}``).
    """
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # lazy: imports modelopt

    preset = getattr(mtq, MODELOPT_PRESETS[fmt])
    cfg = next(
        copy.deepcopy(entry["cfg"])
        for entry in preset["quant_cfg"]
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry
    )
    experts = experts_of(model, layer)
    fused = []
    with cpu_nvfp4_fake_quant(), torch.no_grad():
        for param in (experts.gate_up_proj, experts.down_proj):
            out = torch.empty_like(param)
            for e in range(param.shape[0]):
                quantizer = TensorQuantizer(QuantizerAttributeConfig(**cfg)).to(param.device)
                quantizer.amax = param[e].abs().amax()
                out[e] = quantizer(param[e])
            fused.append(out)
    amax: dict[str, torch.Tensor | None] = {"gate_up": None, "down": None}
    if fmt == "fp8":
        if activation_amax is None:
            raise ValueError(f"layer {layer}: fp8 needs the layer's activation amax")
        for kind in amax:
            amax[kind] = torch.as_tensor(activation_amax[kind]).float()
    return LayerQuant(layer, fmt, fused[0], fused[1], amax["gate_up"], amax["down"])


@contextlib.contextmanager
def quantized_experts(model: torch.nn.Module, quant: LayerQuant) -> Iterator[None]:
    """Swap ``quant``'s weights into its layer's experts (and fake-quantize FP8 inputs) for the duration."""
    experts = experts_of(model, quant.layer)
    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped_experts(experts, quant.gate_up, quant.down, layer=quant.layer))
        if quant.fmt == "fp8":
            stack.enter_context(fp8_expert_inputs(experts, quant.gate_up_input_amax, quant.down_input_amax))
        yield


def kl_sum(
    log_p_ref: torch.Tensor, logits_quant: torch.Tensor, p_ref: torch.Tensor | None = None
) -> torch.Tensor:
    """ModelOpt's kl_div score of one batch: sum over tokens and vocabulary of KL(ref || quant), float32.

    ``F.kl_div(log_q, log_p, reduction="sum", log_target=True)`` is ``exp(log_p) * (log_p - log_q)`` summed;
    passing ``p_ref = exp(log_p_ref)`` (computed once per batch) gives the same float32 elements and sum
    without one exp per call.
    """
    log_q = torch.log_softmax(logits_quant.float(), dim=-1)
    if p_ref is None:
        return F.kl_div(log_q, log_p_ref, reduction="sum", log_target=True)
    return torch.sub(log_p_ref, log_q, out=log_q).mul_(p_ref).sum()  # in place: log_q is ours


class _LayerInputs:
    """Hooks recording, per decoder layer from ``first`` on, its input and keyword arguments."""

    def __init__(self, model: torch.nn.Module, first: int):
        self.hidden: dict[int, torch.Tensor] = {}
        self.kwargs: dict[int, dict[str, Any]] = {}
        self.handles = [
            layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, layer in enumerate(model.model.layers)
            if i >= first
        ]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self.hidden[i] = args[0] if args else kwargs["hidden_states"]
            self.kwargs[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def suffix_logits(model: torch.nn.Module, start: int, inputs: _LayerInputs) -> torch.Tensor:
    """Logits of layers ``start..N-1`` + final norm + lm_head, from the recorded input of layer ``start``:
    with layer ``start``'s experts swapped, bit-identical to a full forward with only them quantized
    (nothing before them changes; any family, since the layers run as the model's own modules)."""
    layers = model.model.layers
    hidden = inputs.hidden[start]
    for i in range(start, len(layers)):
        hidden = layers[i](hidden, **inputs.kwargs[i])
    return model.lm_head(model.model.norm(hidden))


def sensitivity_scores(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    layer_tensors: Mapping[int, Mapping[str, torch.Tensor]] | Mapping[int, LayerQuant],
    fmt: str,
    *,
    batch_size: int,
    progress: bool = False,
) -> dict[int, dict[str, Any]]:
    """KL(BF16 || only layer L's routed experts in ``fmt``) for every layer of ``layer_tensors``.

    ``model`` is the BF16 model (:func:`load_search_model`); ``layer_tensors`` maps layer -> the tensors its
    ``quantize_layer`` job wrote for ``fmt`` (or a ready :class:`LayerQuant`). Batches of ``batch_size``
    sequences, no attention mask, as ModelOpt's search loop. Returns ``{layer: {"kl_sum", "tokens",
    "kl_per_token"}}`` (sums accumulated across batches in float64).
    """
    from tqdm import tqdm

    quants = {
        int(layer): value
        if isinstance(value, LayerQuant)
        else layer_quant_from_tensors(value, int(layer), fmt)
        for layer, value in layer_tensors.items()
    }
    if not quants:
        return {}
    for layer, quant in quants.items():
        if quant.fmt != fmt:
            raise ValueError(f"layer {layer}: tensors are {quant.fmt}, asked to score {fmt}")
    batches = calibration_batches(calibration_ids, batch_size)
    device = next(model.parameters()).device
    order = sorted(quants)
    sums = dict.fromkeys(order, 0.0)
    bar = tqdm(
        total=len(batches) * len(order),
        desc=f"scores {fmt}",
        unit="fwd",
        file=sys.stderr,
        disable=not progress,
    )
    with torch.inference_mode(), bar:
        for batch in batches:
            batch = batch.to(device)
            inputs = _LayerInputs(model, order[0])
            try:
                logits = model(input_ids=batch, use_cache=False).logits
            finally:
                inputs.remove()
            log_p = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            p = log_p.exp()
            for layer in order:
                with quantized_experts(model, quants[layer]):
                    sums[layer] += float(kl_sum(log_p, suffix_logits(model, layer, inputs), p))
                bar.update()
            del inputs, log_p, p, logits
    tokens = sum(int(batch.numel()) for batch in batches)
    return {
        layer: {"kl_sum": sums[layer], "tokens": tokens, "kl_per_token": sums[layer] / tokens}
        for layer in order
    }


def scores_table(results: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """{layer: {format: kl_per_token}} from score-job results, each holding one macro-batch's KL sum per
    micro-batch (``{"sequences": [first, stop], "sequence_length", "kl_sums": {fmt: {layer: [...]}}}``).

    The per-micro-batch sums are added in calibration order, left to right from 0.0 -- exactly the
    accumulation of a single pass over every batch -- and divided by the tokens of every sequence.
    """
    ordered = sorted(results, key=lambda result: int(result["sequences"][0]))
    covered = 0
    for result in ordered:
        first, stop = (int(v) for v in result["sequences"])
        if first != covered:
            raise ValueError(f"score jobs do not tile the calibration: sequences {covered}.. missing")
        covered = stop
    tokens = covered * int(ordered[0]["sequence_length"]) if ordered else 0
    totals: dict[tuple[int, str], float] = {}
    for result in ordered:
        for fmt, per_layer in result["kl_sums"].items():
            for layer, values in per_layer.items():
                total = totals.get((int(layer), fmt), 0.0)
                for value in values:
                    total += float(value)
                totals[(int(layer), fmt)] = total
    table: dict[int, dict[str, float]] = {}
    for (layer, fmt), total in sorted(totals.items()):
        table.setdefault(layer, {})[fmt] = total / tokens
    return table
