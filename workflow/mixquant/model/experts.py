"""The expert swap: one MoE layer's routed experts run with other weights, or with their linear calls seen.

transformers' eager experts (``@use_experts_implementation``, the backend mixquant runs) compute each expert
with two ``torch.nn.functional.linear`` calls: ``F.linear(x, gate_up_proj[e])`` and ``F.linear(act(gate) *
up, down_proj[e])``. ModelOpt's ``_QuantFusedExperts`` quantizes the inputs of those calls, and the
activation statistics read them there. :func:`intercept_expert_linears` is the one place that patches
``F.linear``: while an experts module runs (between its forward pre-hook and its forward hook), every call
passes its input through that module's :class:`ExpertIntercept` first. :func:`swapped_experts` puts other
fused weights in for a while. The experts modules come from the families
(:func:`mixquant.model.families.moe_experts`, :func:`mixquant.model.families.experts_of`).

Used by the activation statistics (recording), the sensitivity scores (quantized weights, FP8 inputs) and
the hf KLD engine (FP8 inputs at the exported static scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from mixquant.formats.facts import FP8_E4M3_MAX

__all__ = [
    "ExpertIntercept",
    "Fp8ExpertInputs",
    "amax_from_input_scale",
    "fp8_expert_inputs",
    "intercept_expert_linears",
    "swapped_experts",
]


def amax_from_input_scale(scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt exports input_scale = fp32(amax) / 448 of a bf16 amax; invert exactly (round to bf16)."""
    return (scale.float() * FP8_E4M3_MAX).to(torch.bfloat16).float()


class ExpertIntercept:
    """What happens at one experts module's linear calls; this base changes nothing."""

    def enter(self, args: tuple) -> None:
        """Called with the experts module's positional arguments, before it runs."""

    def linear_input(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The input ``F.linear(input, weight)`` computes with (called for every linear of the module)."""
        return input


class Fp8ExpertInputs(ExpertIntercept):
    """FP8 W8A8 expert inputs: fake-quantized at the layer-shared static amax of the gate/up and the down
    projection (ModelOpt's ``scaled_e4m3_impl``, as its ``_QuantFusedExperts``)."""

    def __init__(self, experts: torch.nn.Module, gate_up_amax: torch.Tensor, down_amax: torch.Tensor):
        from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

        self.experts = experts
        self.quantize = scaled_e4m3_impl
        self.amax = {
            "gate_up": gate_up_amax.to(experts.gate_up_proj.device),
            "down": down_amax.to(experts.gate_up_proj.device),
        }

    def linear_input(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        same = weight.untyped_storage().data_ptr()
        if same == self.experts.gate_up_proj.untyped_storage().data_ptr():
            input = self.quantize(input, self.amax["gate_up"])
        elif same == self.experts.down_proj.untyped_storage().data_ptr():
            input = self.quantize(input, self.amax["down"])
        return input


@contextlib.contextmanager
def intercept_expert_linears(intercepts: Mapping[torch.nn.Module, ExpertIntercept]) -> Iterator[None]:
    """While one of ``intercepts``' experts modules runs, each ``F.linear`` call takes its input through
    that module's :meth:`ExpertIntercept.linear_input`; ``F.linear`` is restored on exit."""
    orig_linear = F.linear
    active: list[ExpertIntercept] = []

    def linear(input, weight, bias=None):
        if active:
            input = active[-1].linear_input(input, weight)
        return orig_linear(input, weight, bias)

    handles = []
    for experts, intercept in intercepts.items():

        def enter(module, args, intercept=intercept) -> None:
            intercept.enter(args)
            active.append(intercept)

        def leave(module, args, output) -> None:  # must return None: a value would replace the output
            active.pop()

        handles.append(experts.register_forward_pre_hook(enter))
        handles.append(experts.register_forward_hook(leave))
    F.linear = linear
    try:
        yield
    finally:
        F.linear = orig_linear
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def fp8_expert_inputs(
    experts: torch.nn.Module, gate_up_amax: torch.Tensor, down_amax: torch.Tensor
) -> Iterator[None]:
    """``experts``' inputs fake-quantized to FP8 at static amaxes for a while (:class:`Fp8ExpertInputs`)."""
    with intercept_expert_linears({experts: Fp8ExpertInputs(experts, gate_up_amax, down_amax)}):
        yield


@contextlib.contextmanager
def swapped_experts(
    experts: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor, *, layer: int
) -> Iterator[None]:
    """``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` in place of ``experts``' fused weights for the
    duration (cast to the parameters' device and dtype; the parameters' own data put back after)."""
    params = (experts.gate_up_proj, experts.down_proj)
    new = (gate_up, down)
    for param, value in zip(params, new, strict=True):
        if param.shape != value.shape:
            raise ValueError(f"layer {layer}: quantized {tuple(value.shape)} vs model {tuple(param.shape)}")
    saved = [param.data for param in params]
    for param, value in zip(params, new, strict=True):
        param.data = value.to(device=param.device, dtype=param.dtype)
    try:
        yield
    finally:
        for param, value in zip(params, saved, strict=True):
            param.data = value
