"""The expert swap: the one F.linear intercept, the weight swap and the FP8 input arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mixquant.model.experts import (
    ExpertIntercept,
    amax_from_input_scale,
    fp8_expert_inputs,
    intercept_expert_linears,
    swapped_experts,
)

EXPERTS, HIDDEN, INTER = 3, 8, 4


class Experts(torch.nn.Module):
    """An eager fused-experts module: two F.linear calls per expert, as transformers' eager backend."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator))
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER, generator=generator))

    def forward(self, hidden: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = F.linear(hidden, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class Recorder(ExpertIntercept):
    def __init__(self):
        self.entered, self.inputs = [], []

    def enter(self, args: tuple) -> None:
        self.entered.append(args[1])

    def linear_input(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.inputs.append((input.shape[-1], weight.shape))
        return input


def test_intercept_sees_only_its_modules_linears_and_restores_f_linear():
    experts, other = Experts(), torch.nn.Linear(HIDDEN, HIDDEN)
    recorder, original = Recorder(), F.linear
    hidden = torch.randn(5, HIDDEN)
    expected = experts(hidden, 1)
    with torch.no_grad(), intercept_expert_linears({experts: recorder}):
        assert F.linear is not original
        other(hidden)  # outside the experts module: not seen
        out = experts(hidden, 1)
    assert F.linear is original
    assert torch.equal(out, expected)  # an intercept that returns its input changes nothing
    assert recorder.entered == [1]
    assert recorder.inputs == [(HIDDEN, (2 * INTER, HIDDEN)), (INTER, (HIDDEN, INTER))]
    assert not experts._forward_pre_hooks and not experts._forward_hooks


def test_swap_puts_the_weights_in_and_back():
    experts, donor = Experts(0), Experts(1)
    hidden = torch.randn(4, HIDDEN)
    own, theirs = experts(hidden, 2), donor(hidden, 2)
    saved = experts.gate_up_proj.data_ptr()
    with torch.no_grad(), swapped_experts(experts, donor.gate_up_proj.data, donor.down_proj.data, layer=7):
        assert torch.equal(experts(hidden, 2), theirs)
    assert experts.gate_up_proj.data_ptr() == saved and torch.equal(experts(hidden, 2), own)
    with pytest.raises(ValueError, match="layer 7: quantized"):
        with swapped_experts(experts, donor.gate_up_proj.data[:, :1], donor.down_proj.data, layer=7):
            pass


def test_fp8_inputs_are_modelopts_static_fake_quant():
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

    experts = Experts().to(torch.bfloat16)
    hidden = torch.randn(6, HIDDEN).to(torch.bfloat16)
    amax_gate_up, amax_down = torch.tensor(2.5), torch.tensor(1.25)
    with torch.no_grad():
        gate, up = F.linear(scaled_e4m3_impl(hidden, amax_gate_up), experts.gate_up_proj[0]).chunk(2, dim=-1)
        expected = F.linear(scaled_e4m3_impl(F.silu(gate) * up, amax_down), experts.down_proj[0])
        with fp8_expert_inputs(experts, amax_gate_up, amax_down):
            got = experts(hidden, 0)
    assert torch.equal(got, expected)


def test_amax_from_input_scale_inverts_the_export():
    amax = torch.tensor(3.140625, dtype=torch.bfloat16)  # a bf16 amax, exported as fp32(amax) / 448
    assert torch.equal(amax_from_input_scale(amax.float() / 448.0), amax.float())
