"""GPTQ rounding of one MoE layer's routed experts, each against the tokens its router sent it.

For expert ``e`` of layer ``L``: its calibration inputs ``X_e`` are the rows of the layer's recorded expert
inputs whose routing names ``e`` (:mod:`mixquant.quantize.expert_inputs`). The gate and up projections read
``X_e`` (one Hessian ``X_e^T X_e`` for the fused ``[2I, H]`` slice: rows are independent given it, so fusing
them changes nothing); the down projection reads ``D_e = act(X_e gate_e^T) * (X_e up_e^T)``, recomputed from
the BF16 weights exactly as the expert computes it. Both in float64. The block scales are the rebuild's
(chosen on the BF16 weight, fixed), and :func:`mixquant.formats.nvfp4_gptq.gptq_nvfp4` decides the codes.

An expert that received fewer than ``min_tokens`` tokens is rounded to nearest (``rtn_fallback`` in the
audit): a Hessian of a handful of rows fits those rows, not the expert's input distribution.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mixquant.formats.nvfp4_gptq import gptq_nvfp4, nvfp4_rtn, nvfp4_scales
from mixquant.quantize.expert_inputs import HIDDEN, ROUTING

__all__ = ["ExpertHessians", "LayerInputs", "load_layer_inputs", "gptq_expert_weights"]


class LayerInputs:
    """One MoE layer's recorded expert inputs ``[T, H]`` and routing ``[T, k]`` on the rebuild's device,
    and the expert activation function (the model config's ``hidden_act``)."""

    def __init__(self, hidden: torch.Tensor, routing: torch.Tensor, hidden_act: str):
        from transformers.activations import ACT2FN

        self.hidden = hidden
        self.routing = routing
        self.act = ACT2FN[hidden_act]

    def tokens_of(self, expert: int) -> torch.Tensor:
        """The rows the router sent to ``expert`` (ascending token order)."""
        return self.hidden[(self.routing == expert).any(dim=-1)]

    def routed_counts(self, num_experts: int) -> list[int]:
        counts = torch.bincount(self.routing.reshape(-1).long(), minlength=num_experts)
        return [int(c) for c in counts[:num_experts].cpu()]


def load_layer_inputs(path: str | Path, model_dir: str | Path, device: torch.device) -> LayerInputs:
    """A layer file of ``collect_expert_inputs`` on ``device``, with ``model_dir``'s activation."""
    from safetensors.torch import load_file

    tensors = load_file(str(path), device=str(device))
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return LayerInputs(tensors[HIDDEN], tensors[ROUTING], str(config.get("hidden_act", "silu")))


class ExpertHessians:
    """``X^T X`` of an expert's gate/up input and of its down input (float64), and the token count."""

    def __init__(self, inputs: LayerInputs, expert: int, gate: torch.Tensor, up: torch.Tensor):
        x = inputs.tokens_of(expert)
        self.tokens = int(x.shape[0])
        gate_out, up_out = F.linear(x, torch.cat([gate, up]).to(x.dtype)).chunk(2, dim=-1)
        down_in = inputs.act(gate_out) * up_out  # the expert's own down input, in the model dtype
        x64, d64 = x.to(torch.float64), down_in.to(torch.float64)
        self.gate_up = x64.T @ x64
        self.down = d64.T @ d64


def _output_error(diff: torch.Tensor, hessian: torch.Tensor) -> float:
    """``sum_t ||diff x_t||^2 = tr(diff H diff^T)`` over the calibration inputs of ``hessian``."""
    d = diff.to(torch.float64)
    return float(((d @ hessian) * d).sum())


def gptq_expert_weights(
    weights: Sequence[Mapping[str, torch.Tensor]],
    scales: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    hessians: Sequence[ExpertHessians],
    settings: Mapping[str, Any],
) -> list[tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]]:
    """For each of a chunk of experts: the compensated fp32 weights of its three projections (what the
    NVFP4 export rounds), and per projection the calibration output error of round-to-nearest and of
    GPTQ under the same scales. The experts are rounded as one batch (:func:`gptq_nvfp4`'s leading
    dimension): each with its own Hessians, one column step for all.

    ``scales[i][proj]``: ``(weight_scale, weight_scale_2)`` of the export (fixed); ``settings``:
    ``damping``, ``block_size``, ``order``.
    """
    options = {k: settings[k] for k in ("damping", "block_size", "order")}
    element = [{proj: nvfp4_scales(*s[proj]) for proj in s} for s in scales]
    rows = weights[0]["gate_proj"].shape[0]
    gate_up = torch.stack([torch.cat([w["gate_proj"], w["up_proj"]]) for w in weights])
    gate_up_scale = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in element])
    fused = gptq_nvfp4(gate_up, torch.stack([h.gate_up for h in hessians]), gate_up_scale, **options)
    down = gptq_nvfp4(
        torch.stack([w["down_proj"] for w in weights]),
        torch.stack([h.down for h in hessians]),
        torch.stack([e["down_proj"] for e in element]),
        **options,
    )
    out = []
    for i, (weight, hessian) in enumerate(zip(weights, hessians, strict=True)):
        compensated = {"gate_proj": fused[i, :rows], "up_proj": fused[i, rows:], "down_proj": down[i]}
        errors = {}
        for proj, source in weight.items():
            h = hessian.down if proj == "down_proj" else hessian.gate_up
            exact = source.to(torch.float64)
            rtn = nvfp4_rtn(source, element[i][proj]).to(torch.float64)
            gptq = nvfp4_rtn(compensated[proj], element[i][proj]).to(torch.float64)
            errors[proj] = {
                "rtn": _output_error(exact - rtn, h),
                "gptq": _output_error(exact - gptq, h),
                "reference": _output_error(exact, h),
            }
        out.append((compensated, errors))
    return out
