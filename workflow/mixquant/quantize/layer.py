"""Streaming, per-layer quantization of MoE routed experts: bit-identical to ModelOpt's HF export.

One MoE layer at a time, one expert at a time, straight from the upstream shards (never the whole model,
:class:`mixquant.model.layer_reader.LayerSource`): :func:`quantize_layer` produces exactly the tensors
``modelopt_reference_export`` (:mod:`mixquant.quantize.reference`: ``mtq.quantize`` +
``export_hf_checkpoint``) writes for that layer's routed experts, under the same names, dtypes and shapes,
byte for byte. What ModelOpt 0.47 does, and what is reproduced here (see :mod:`mixquant.quantize.reference`
for the module/quantizer structure):

* One weight quantizer per expert covers the *fused* ``[2I, H]`` gate+up slice (gate rows first), another
  the ``[H, I]`` down slice. Export splits the fused one into ``gate_proj`` / ``up_proj`` with copies of
  the same quantizer, so gate and up share every per-tensor quantity.
* ``nvfp4_w4a16`` (static E2M1 weights, E4M3 scale per 16 elements of the input dim, fp32
  ``weight_scale_2 = global_amax / (6 * 448)``): ``global_amax`` is max |w| over gate+up (shared) and
  over down. Per-block amax by the calibration (``fp8_sweep``, ``max`` or ``mse``:
  :func:`mixquant.formats.nvfp4_amax.nvfp4_block_amax`), then
  :func:`mixquant.formats.nvfp4.nvfp4_export_tensors` (``NVFP4QTensor``): ``weight`` uint8 ``[N, K/2]``,
  ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 0-dim. No ``input_scale`` (W4A16).
* ``fp8`` (per-tensor E4M3 weights and static per-tensor E4M3 inputs): weight amax by ``max`` or ``mse``
  (:func:`fp8_mse_weight_amax`, rounded to bf16 like ModelOpt's ``_amax`` buffer) over
  ``torch.cat([gate, up])`` (shared by gate and up) and over down; :func:`fp8_export_tensors`.
  ``input_scale = fp32(amax) / 448`` from the layer's *shared* input quantizers -- ``gate_up`` for gate
  and up, ``down`` for down -- so every expert of the layer gets the same two values, including experts
  that never received a calibration token. They are arguments here (``activation_amax``).
* ``bf16``: the source tensors, unchanged.

Source dtype must be bfloat16 (the reference loads the model in bf16; the FP8 export divides in bf16).
Bit-exactness caveat (FP8 ``mse`` only): the loss is a ``torch.sum`` over the whole fused weight whose
summation order depends on device and, above 32768 elements on CPU, on torch's thread count; run with the
same settings as the reference for a guaranteed byte match (see :mod:`mixquant.formats.fp8`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mixquant.checkpoint.shards import CheckpointError
from mixquant.checkpoint.writer import SAFETENSORS_METADATA, save_file_sorted
from mixquant.facts.jobs import gptq_chunk_experts
from mixquant.formats.dequant import dequantize_tensors
from mixquant.formats.facts import BF16, FORMATS, FP8, NVFP4
from mixquant.formats.facts import NVFP4_GROUP_SIZE as BLOCK_SIZE
from mixquant.formats.fp8 import FP8_E4M3_MAX, fp8_export_tensors, fp8_max_amax, fp8_mse_weight_amax
from mixquant.formats.nvfp4_amax import NVFP4_CALIBRATIONS, nvfp4_block_amax
from mixquant.model.families import PROJECTIONS
from mixquant.model.layer_reader import LayerSource
from mixquant.model.layout import natural_key

__all__ = [
    "AUDIT_FILE",
    "FP8_WEIGHT_CALIBRATIONS",
    "INPUT_SCALE_SOURCE",
    "LAYER_FILE",
    "QuantizeInputError",
    "quantize_layer",
    "save_layer_result",
]

FP8_WEIGHT_CALIBRATIONS = ("mse", "max")
LAYER_FILE = "layer.safetensors"
AUDIT_FILE = "audit.json"
INPUT_SCALE_SOURCE = "layer-shared (ModelOpt per-layer input quantizer)"

_PARAM_KEYS = {NVFP4: {"calibration", "rounding", "gptq"}, FP8: {"weight_calibration"}, BF16: set()}
NVFP4_ROUNDINGS = ("rtn", "gptq")
GPTQ_KEYS = ("damping", "block_size", "order", "min_tokens")
# Accepted spellings of the two layer-shared activation amaxes (the first is canonical).
_AMAX_KEYS = {"gate_up": ("gate_up", "gate_up_input_amax"), "down": ("down", "down_input_amax")}


# Bad quantization input (checkpoint, layer, parameters): one line naming the culprit. The checkpoint
# reader's error, so a broken shard is the same error wherever it is found.
QuantizeInputError = CheckpointError


def _validate_params(layer: int, fmt: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise QuantizeInputError(f"layer {layer}: format must be one of {FORMATS}, got {fmt!r}")
    params = dict(params or {})
    unknown = sorted(set(params) - _PARAM_KEYS[fmt])
    if unknown:
        known = sorted(_PARAM_KEYS[fmt])
        raise QuantizeInputError(f"layer {layer}: unknown {fmt} params {unknown}; known {known}")
    if fmt == NVFP4 and params.get("calibration") not in NVFP4_CALIBRATIONS:
        raise QuantizeInputError(
            f"layer {layer}: nvfp4_w4a16 params need calibration in {NVFP4_CALIBRATIONS}, "
            f"got {params.get('calibration')!r}"
        )
    if fmt == NVFP4 and params.get("rounding", "rtn") not in NVFP4_ROUNDINGS:
        raise QuantizeInputError(
            f"layer {layer}: nvfp4_w4a16 rounding must be one of {NVFP4_ROUNDINGS}, "
            f"got {params['rounding']!r}"
        )
    if fmt == NVFP4 and params.get("rounding") == "gptq":
        gptq = params.get("gptq")
        if not isinstance(gptq, Mapping) or sorted(gptq) != sorted(GPTQ_KEYS):
            raise QuantizeInputError(f"layer {layer}: gptq rounding needs gptq settings {list(GPTQ_KEYS)}")
    if fmt == FP8 and params.get("weight_calibration") not in FP8_WEIGHT_CALIBRATIONS:
        raise QuantizeInputError(
            f"layer {layer}: fp8 params need weight_calibration in {FP8_WEIGHT_CALIBRATIONS}, "
            f"got {params.get('weight_calibration')!r}"
        )
    return params


def _scalar_amax(layer: int, activation_amax: Mapping[str, Any], key: str) -> torch.Tensor:
    given = [k for k in _AMAX_KEYS[key] if activation_amax.get(k) is not None]
    if not given:
        raise QuantizeInputError(
            f"layer {layer}: fp8 needs activation_amax[{key!r}] (the layer's input amax)"
        )
    value = activation_amax[given[0]]
    try:
        amax = torch.as_tensor(value).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise QuantizeInputError(f"layer {layer}: activation_amax[{key!r}] is not a number") from exc
    if amax.numel() != 1:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax[{key!r}] must be a scalar (one value per layer), "
            f"got shape {list(amax.shape)}"
        )
    amax = amax.reshape(())
    if not bool(torch.isfinite(amax)) or float(amax) <= 0:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax[{key!r}] = {float(amax)} is not finite and > 0"
        )
    return amax


def _unrouted(layer: int, activation_amax: Mapping[str, Any], num_experts: int) -> list[int] | None:
    counts = activation_amax.get("routed_tokens")
    if counts is None:
        return None
    counts = torch.as_tensor(counts).detach().reshape(-1)
    if counts.numel() != num_experts:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax['routed_tokens'] has {counts.numel()} entries for "
            f"{num_experts} experts"
        )
    return [int(e) for e in (counts == 0).nonzero().flatten()]


def _stats(values: torch.Tensor) -> dict[str, float]:
    v = values.detach().to(torch.float64).reshape(-1)
    return {"min": float(v.min()), "max": float(v.max()), "mean": float(v.mean())}


class _ErrorTotals:
    """Running sums for the per-layer and per-projection error totals (float64)."""

    def __init__(self) -> None:
        self.sq_err = 0.0
        self.sq_ref = 0.0
        self.numel = 0
        self.max_rel = 0.0
        self.tensors = 0

    def add(self, sq_err: float, sq_ref: float, numel: int, rel: float) -> None:
        self.sq_err += sq_err
        self.sq_ref += sq_ref
        self.numel += numel
        self.max_rel = max(self.max_rel, rel)
        self.tensors += 1

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "mse": self.sq_err / self.numel if self.numel else 0.0,
            "relative_error": _relative(self.sq_err, self.sq_ref),
            "max_relative_error": self.max_rel,
        }


def _relative(sq_err: float, sq_ref: float) -> float:
    if sq_ref > 0:
        return math.sqrt(sq_err / sq_ref)
    return 0.0 if sq_err == 0 else math.inf


def nvfp4_prepared(weights: Mapping[str, torch.Tensor], calibration: str) -> dict[str, Any]:
    """One expert's NVFP4 quantizer state: ``global_amax`` (shared by gate and up, one quantizer over the
    fused ``[2I, H]`` slice), the per-block amax the calibration chooses on the BF16 weight (fixed for any
    rounding), and ``rounded``: the weights the export rounds (the source; GPTQ replaces them)."""
    from mixquant.formats.nvfp4 import shared_global_amax  # lazy: imports modelopt

    g_gate_up = shared_global_amax(weights["gate_proj"], weights["up_proj"])
    global_amax = {
        "gate_proj": g_gate_up,
        "up_proj": g_gate_up,
        "down_proj": shared_global_amax(weights["down_proj"]),
    }
    block_amax = {p: nvfp4_block_amax(weights[p], global_amax[p], calibration) for p in PROJECTIONS}
    return {"global_amax": global_amax, "block_amax": block_amax, "rounded": dict(weights)}


def _quantize_expert(
    prefixes: Mapping[str, str],
    weights: Mapping[str, torch.Tensor],
    fmt: str,
    params: Mapping[str, Any],
    input_scales: Mapping[str, torch.Tensor],
    prepared: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Exported tensors of one expert (natural name order); ``prefixes[proj]``: its disk names without
    ``.weight`` (ModelOpt's export writes the checkpoint's own names back). NVFP4: ``prepared``
    (:func:`nvfp4_prepared`, made here when None) holds the block scales and the weights to round -- the
    source, or GPTQ's compensated weights (:class:`_GptqLayer`), whose codes the export is checked to keep;
    the second value is then each projection's calibration output error, RTN and GPTQ."""
    out: dict[str, torch.Tensor] = {}
    errors = None
    gate, up, down = (weights[p] for p in PROJECTIONS)
    if fmt == BF16:
        for proj in PROJECTIONS:
            out[f"{prefixes[proj]}.weight"] = weights[proj]
    elif fmt == NVFP4:
        from mixquant.formats.nvfp4 import nvfp4_export_tensors  # lazy: imports modelopt

        prepared = prepared or nvfp4_prepared(weights, params["calibration"])
        rounded, errors = prepared["rounded"], prepared.get("errors")
        for proj in PROJECTIONS:
            packed, scale, scale_2 = nvfp4_export_tensors(
                rounded[proj], prepared["block_amax"][proj], prepared["global_amax"][proj]
            )
            p = prefixes[proj]
            out[f"{p}.weight"], out[f"{p}.weight_scale"], out[f"{p}.weight_scale_2"] = packed, scale, scale_2
            if errors is not None:
                _check_gptq_codes(p, out, rounded[proj])
    else:
        amax_fn = fp8_mse_weight_amax if params["weight_calibration"] == "mse" else fp8_max_amax
        gate_up = torch.cat([gate, up])  # gate rows first, as gate_up_proj[e]
        amax_gate_up = amax_fn(gate_up)
        del gate_up
        for proj, amax, key in (
            ("gate_proj", amax_gate_up, "gate_up"),
            ("up_proj", amax_gate_up, "gate_up"),
            ("down_proj", amax_fn(down), "down"),
        ):
            weight, scale = fp8_export_tensors(weights[proj], amax)
            p = prefixes[proj]
            out[f"{p}.weight"], out[f"{p}.weight_scale"] = weight, scale
            out[f"{p}.input_scale"] = input_scales[key].clone()  # own storage per tensor (safetensors)
    return out, errors


def _check_gptq_codes(base: str, exported: Mapping[str, torch.Tensor], compensated: torch.Tensor) -> None:
    """The export rounded GPTQ's compensated weights to the codes GPTQ chose for them (same scales, same
    rounding): a mismatch is a bug, never a checkpoint."""
    from mixquant.formats.nvfp4_gptq import nvfp4_rtn, nvfp4_scales  # lazy: imports modelopt

    own = {n: t for n, t in exported.items() if n.startswith(base + ".")}
    shipped = dequantize_tensors(own, torch.float32)[f"{base}.weight"]
    chosen = nvfp4_rtn(compensated, nvfp4_scales(own[f"{base}.weight_scale"], own[f"{base}.weight_scale_2"]))
    if not torch.equal(shipped, chosen):
        raise RuntimeError(f"{base}: the exported NVFP4 codes are not the ones GPTQ chose")


def _tensor_audit(
    fmt: str, source: torch.Tensor, exported: Mapping[str, torch.Tensor], base: str, dequantized: torch.Tensor
) -> tuple[dict[str, Any], tuple[float, float, int, float]]:
    ref = source.to(torch.float64)
    diff = ref - dequantized.to(torch.float64)
    sq_err, sq_ref = float(diff.square().sum()), float(ref.square().sum())
    rel = _relative(sq_err, sq_ref)
    entry: dict[str, Any] = {
        "format": fmt,
        "shape": list(source.shape),
        "dtype": str(exported[f"{base}.weight"].dtype).removeprefix("torch."),
        "exported": {
            name.removeprefix(base + "."): {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
            for name, t in exported.items()
            if name.startswith(base + ".")
        },
        "scales": {},
        "mse": sq_err / source.numel() if source.numel() else 0.0,
        "relative_error": rel,
    }
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        scale = exported.get(f"{base}.{suffix}")
        if scale is not None:
            entry["scales"][suffix] = _stats(scale.to(torch.float32))
    return entry, (sq_err, sq_ref, source.numel(), rel)


class _GptqLayer:
    """A layer's GPTQ rounding (NVFP4 with ``rounding: gptq``): its recorded expert inputs, each expert's
    Hessians (or None: round to nearest), and the audit -- who fell back to RTN and the calibration output
    error of both roundings."""

    def __init__(self, layer, params, expert_inputs, model_dir, device, num_experts: int) -> None:
        self.enabled = params.get("rounding") == "gptq"
        self.settings = dict(params.get("gptq") or {})
        self.fallback: list[int] = []
        self.errors = {p: {"rtn": 0.0, "gptq": 0.0, "reference": 0.0} for p in PROJECTIONS}
        self.inputs = None
        self.tokens: list[int] = []
        if not self.enabled:
            return
        if expert_inputs is None or not Path(expert_inputs).is_file():
            raise QuantizeInputError(
                f"layer {layer}: gptq rounding needs the layer's expert inputs (collect_expert_inputs), "
                f"got {expert_inputs!r}"
            )
        from mixquant.quantize.gptq import load_layer_inputs  # lazy: imports transformers

        self.inputs = load_layer_inputs(expert_inputs, model_dir, device)
        self.tokens = self.inputs.routed_counts(num_experts)

    def chunk_size(self, shapes: Mapping[str, Any], device: torch.device) -> int:
        """Experts rounded as one batch (:func:`mixquant.facts.jobs.gptq_chunk_experts`)."""
        inter, hidden = shapes["gate_proj"][-2], shapes["gate_proj"][-1]
        return gptq_chunk_experts(hidden, inter, str(device)) if self.enabled else 1

    def prepare(self, chunk: list[tuple[int, dict[str, torch.Tensor]]], params: Mapping[str, Any]) -> dict:
        """``{expert: nvfp4_prepared(...)}`` for a chunk; with GPTQ, the rounded weights are the
        compensated ones (one batch for the experts with enough tokens) and the errors are filled in."""
        from mixquant.formats.cpu_fake_quant import static_nvfp4_scales  # lazy: imports modelopt
        from mixquant.quantize.gptq import ExpertHessians, gptq_expert_weights  # lazy: imports transformers

        prepared = {e: nvfp4_prepared(weights, params["calibration"]) for e, weights in chunk}
        if not self.enabled:
            return prepared
        rounded = []
        for e, _ in chunk:
            if self.tokens[e] < int(self.settings["min_tokens"]):
                self.fallback.append(e)
            else:
                rounded.append(e)
        if rounded:
            weights = dict(chunk)
            scales = [
                {
                    p: static_nvfp4_scales(
                        weights[e][p], prepared[e]["block_amax"][p], prepared[e]["global_amax"][p], BLOCK_SIZE
                    )
                    for p in PROJECTIONS
                }
                for e in rounded
            ]
            hessians = [
                ExpertHessians(self.inputs, e, weights[e]["gate_proj"], weights[e]["up_proj"])
                for e in rounded
            ]
            results = gptq_expert_weights([weights[e] for e in rounded], scales, hessians, self.settings)
            for e, (compensated, errors) in zip(rounded, results, strict=True):
                prepared[e]["rounded"], prepared[e]["errors"] = compensated, errors
                for proj, values in errors.items():
                    for kind, value in values.items():
                        self.errors[proj][kind] += value
        return prepared

    def audit(self) -> dict[str, Any]:
        projections = {
            proj: {**e, "ratio": e["gptq"] / e["rtn"] if e["rtn"] > 0 else None}
            for proj, e in self.errors.items()
        }
        rtn, gptq = (sum(e[k] for e in self.errors.values()) for k in ("rtn", "gptq"))
        return {
            "settings": self.settings,
            "experts_gptq": len(self.tokens) - len(self.fallback),
            "rtn_fallback": len(self.fallback),
            "rtn_fallback_experts": self.fallback,
            "tokens_per_expert": self.tokens,
            "calibration_output_error": {
                "projections": projections,
                "rtn": rtn,
                "gptq": gptq,
                "ratio": gptq / rtn if rtn > 0 else None,
                "over": "the GPTQ experts' calibration tokens: sum over tokens of ||(W - Q) x||^2",
            },
        }


def _experts_in_chunks(source: LayerSource, device: torch.device, fmt: str, params, gptq: _GptqLayer):
    """``(expert, weights on device, NVFP4 prepared state or None)`` in expert order: one expert at a time,
    or with GPTQ a chunk at a time (the chunk's experts are rounded as one batch)."""
    chunk: list[tuple[int, dict[str, torch.Tensor]]] = []
    size = gptq.chunk_size(source.shapes, device)
    experts = source.experts()
    while True:
        for e, weights in experts:
            chunk.append((e, {proj: weight.to(device) for proj, weight in weights.items()}))
            if len(chunk) == size:
                break
        if not chunk:
            return
        prepared = gptq.prepare(chunk, params) if fmt == NVFP4 else {}
        for e, weights in chunk:
            yield e, weights, prepared.get(e)
        chunk = []


@torch.no_grad()
def quantize_layer(
    model_dir: Path,
    layer: int,
    fmt: str,
    params: dict,
    *,
    activation_amax: dict | None = None,
    expert_inputs: str | Path | None = None,
    progress: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize the routed experts of one MoE ``layer`` of the upstream checkpoint at ``model_dir``.

    Args:
        fmt: ``"nvfp4_w4a16"`` (params ``{"calibration": "fp8_sweep" | "max" | "mse"}``), ``"fp8"``
            (params ``{"weight_calibration": "mse" | "max"}``) or ``"bf16"`` (params ``{}``).
        activation_amax: fp8 only (required there): ``{"gate_up": amax, "down": amax}`` -- the layer's
            input amax into gate/up and into down (fp32 scalars; ``gate_up_input_amax`` /
            ``down_input_amax`` are accepted spellings), applied to *every* expert as ModelOpt's one input
            quantizer per layer does; optional ``"routed_tokens"`` ([E] token counts) to report experts
            that were never routed (they get the same layer-shared input_scale).
        expert_inputs: NVFP4 with ``rounding: gptq`` only (required there): this layer's file of
            ``collect_expert_inputs`` (:func:`mixquant.quantize.expert_inputs.expert_inputs_file`), the
            tokens the router sent each expert in calibration.
        progress: show a per-expert progress bar (stderr).
        device: where the scale search and the export arithmetic run (each expert's weights are moved
            there; the exported tensors come back to the CPU). ModelOpt's export numerics on every
            device: the pure-torch formulas, never the CUDA fake-quant kernels.

    Returns:
        ``(tensors, audit)``: ``tensors`` under the exported names (``model.layers.L.mlp.experts.E.
        {gate,up,down}_proj.{weight, weight_scale, weight_scale_2 | input_scale}``), byte-identical to
        ModelOpt's HF export; ``audit`` a JSON-serialisable dict (per-tensor scale stats and errors of
        the dequantized weight vs the bf16 source, per-projection and per-layer totals).

    Experts are processed one at a time: only one expert's source weights and temporaries are alive
    besides the growing output. Raises :class:`QuantizeInputError` on bad input (see
    :func:`mixquant.model.layer_reader.read_layer_experts`; NVFP4 additionally needs every input dim to be a
    multiple of 16).
    """
    layer = int(layer)
    params = _validate_params(layer, fmt, params)
    activation_amax = dict(activation_amax or {})
    input_scales: dict[str, torch.Tensor] = {}
    input_amax: dict[str, torch.Tensor] = {}
    if fmt == FP8:
        input_amax = {key: _scalar_amax(layer, activation_amax, key) for key in _AMAX_KEYS}
        input_scales = {key: amax / FP8_E4M3_MAX for key, amax in input_amax.items()}  # fp32(amax) / 448
    with LayerSource(model_dir, layer) as source:
        if fmt == NVFP4:
            for proj in PROJECTIONS:
                k = source.shapes[proj][-1]
                if k % BLOCK_SIZE:
                    name = source.name(0, proj)
                    raise QuantizeInputError(
                        f"layer {layer}: tensor {name} (and every expert's {proj}) has input dim {k}, "
                        f"not a multiple of the NVFP4 block size {BLOCK_SIZE}"
                    )
        unrouted = _unrouted(layer, activation_amax, source.num_experts) if fmt == FP8 else None
        tensors: dict[str, torch.Tensor] = {}
        per_tensor: dict[str, Any] = {}
        totals = _ErrorTotals()
        per_proj = {p: _ErrorTotals() for p in PROJECTIONS}
        source_bytes = 0
        bar = tqdm(total=source.num_experts, desc=f"layer {layer} {fmt}", disable=not progress, leave=False)
        device = torch.device(device)
        input_scales = {key: scale.to(device) for key, scale in input_scales.items()}
        gptq = _GptqLayer(layer, params, expert_inputs, model_dir, device, source.num_experts)
        for e, weights, prepared in _experts_in_chunks(source, device, fmt, params, gptq):
            prefixes = {proj: source.prefix(e, proj) for proj in PROJECTIONS}
            exported, _ = _quantize_expert(prefixes, weights, fmt, params, input_scales, prepared)
            dequantized = dequantize_tensors(exported)
            for proj in PROJECTIONS:
                base = prefixes[proj]
                entry, (sq_err, sq_ref, numel, rel) = _tensor_audit(
                    fmt, weights[proj], exported, base, dequantized[f"{base}.weight"]
                )
                per_tensor[f"{base}.weight"] = entry
                totals.add(sq_err, sq_ref, numel, rel)
                per_proj[proj].add(sq_err, sq_ref, numel, rel)
                source_bytes += weights[proj].numel() * weights[proj].element_size()
            del dequantized
            tensors.update({name: tensor.cpu() for name, tensor in exported.items()})
            bar.update(1)
        bar.close()

    exported_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    audit: dict[str, Any] = {
        "layer": layer,
        "format": fmt,
        "params": params,
        "num_experts": source.num_experts,
        "expert_shapes": {p: list(s) for p, s in source.shapes.items()},
        "totals": {
            **totals.summary(),
            "exported_tensors": len(tensors),
            "source_bytes": source_bytes,
            "exported_bytes": exported_bytes,
            "scales": _scale_totals(per_tensor),
            "projections": {p: t.summary() for p, t in per_proj.items()},
        },
        "tensors": per_tensor,
    }
    if fmt == NVFP4:
        audit["rounding"] = params.get("rounding", "rtn")
        if gptq.enabled:
            audit["gptq"] = gptq.audit()
    if fmt == FP8:
        audit["input_scale_source"] = INPUT_SCALE_SOURCE
        audit["input_amax"] = {k: float(v) for k, v in input_amax.items()}
        audit["input_scale"] = {k: float(v) for k, v in input_scales.items()}
        audit["unrouted_experts"] = None if unrouted is None else len(unrouted)
        audit["unrouted_expert_ids"] = unrouted
    return tensors, audit


def _scale_totals(per_tensor: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Layer-wide min / max / mean-of-means of each scale kind over all tensors."""
    out: dict[str, dict[str, float]] = {}
    for entry in per_tensor.values():
        for kind, s in entry["scales"].items():
            agg = out.setdefault(kind, {"min": math.inf, "max": -math.inf, "mean": 0.0, "_n": 0})
            agg["min"], agg["max"] = min(agg["min"], s["min"]), max(agg["max"], s["max"])
            agg["mean"] += s["mean"]
            agg["_n"] += 1
    for agg in out.values():
        agg["mean"] /= agg.pop("_n")
    return out


def save_layer_result(tensors: Mapping[str, torch.Tensor], audit: Mapping[str, Any], out_dir: Path) -> None:
    """Write ``out_dir/layer.safetensors`` (natural name order, ``{"format": "pt"}``) and ``audit.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors, key=natural_key):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors sharing storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        payload[name] = tensor
    save_file_sorted(payload, out_dir / LAYER_FILE, SAFETENSORS_METADATA)
    (out_dir / AUDIT_FILE).write_text(json.dumps(audit, indent=2, sort_keys=True) + "\n", encoding="utf-8")
