"""GPTQ rounding of NVFP4 weights under fixed block scales (mixquant.formats.nvfp4_gptq): on an identity
Hessian it is round-to-nearest bit for bit, it never leaves the NVFP4 grid of its block's scale, the export
rounds its compensated weights to exactly the codes it chose, and on the toy's trained expert weights it
lowers the output error on held-out inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mixquant.formats.cpu_fake_quant import static_nvfp4_scales
from mixquant.formats.dequant import dequantize_tensors
from mixquant.formats.nvfp4 import (
    BLOCK_SIZE,
    nvfp4_export_tensors,
    shared_global_amax,
    sweep_nvfp4_block_amax,
)
from mixquant.formats.nvfp4_gptq import gptq_nvfp4, nvfp4_grid, nvfp4_rtn, nvfp4_scales, output_error
from mixquant.model.layer_reader import LayerSource

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "data" / "toy-laguna"
LAYER = 1


@pytest.fixture(scope="module")
def toy_experts() -> dict[str, torch.Tensor]:
    """The trained toy's MoE layer 1 routed experts, ``{proj: [E, out, in]}`` bf16."""
    with LayerSource(TOY, LAYER) as source:
        experts = [weights for _, weights in source.experts()]
    return {proj: torch.stack([w[proj] for w in experts]) for proj in ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def toy_expert_inputs(tmp_path_factory) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Layer 1's expert inputs per expert (fp32 rows): from 32 x 128 calibration tokens of the corpus (fit)
    and from 24 evaluation windows of 128 tokens over data/eval's three domains (held out)."""
    from mixquant.calibration.disjoint import read_jsonl
    from mixquant.calibration.eval_suite import draw_domain
    from mixquant.calibration.sample import sample_calibration
    from mixquant.quantize.expert_inputs import collect_expert_inputs, expert_inputs_file
    from mixquant.quantize.gptq import load_layer_inputs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOY))
    corpus = [row["messages"] for row in read_jsonl(REPO / "data" / "corpus" / "python-stdlib-chat.jsonl")]
    fit = sample_calibration(corpus, tokenizer, num_samples=32, seq_len=128, seed=0)
    windows = []
    for index, (name, text, messages) in enumerate(
        (("docs", "text", None), ("code", "text", None), ("chat", None, "messages"))
    ):
        rows = read_jsonl(REPO / "data" / "eval" / f"{name}.jsonl")
        domain = {"name": name, "windows": 8, "text_field": text, "messages_field": messages}
        windows += draw_domain(tokenizer, rows, domain, index, window_tokens=128, seed=0)[0]
    out = []
    for name, ids in (("fit", fit), ("held_out", torch.tensor(windows))):
        directory = tmp_path_factory.mktemp(name)
        collect_expert_inputs(TOY, ids, directory, batch_size=8, progress=False)
        inputs = load_layer_inputs(expert_inputs_file(directory, LAYER), TOY, torch.device("cpu"))
        out.append({e: inputs.tokens_of(e).float() for e in range(16)})
    return out[0], out[1]


def _exported(weight: torch.Tensor, amax: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    packed, scale, scale_2 = nvfp4_export_tensors(weight, amax, g)
    return {"w.weight": packed, "w.weight_scale": scale, "w.weight_scale_2": scale_2}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _dequantized(exported: dict[str, torch.Tensor]) -> torch.Tensor:
    return dequantize_tensors(exported, torch.float32)["w.weight"]


def _problem(seed: int, rows: int = 48, cols: int = 96):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 0.05).to(torch.bfloat16)
    weight[torch.rand(rows, cols, generator=generator) < 0.01] *= 20  # a few large weights per block
    mix = torch.eye(cols) + 0.4 * torch.randn(cols, cols, generator=generator)
    inputs = (torch.randn(4 * cols, cols, generator=generator) @ mix).to(torch.bfloat16).float()
    g = shared_global_amax(weight)
    amax = sweep_nvfp4_block_amax(weight, g)
    scale, scale_2 = static_nvfp4_scales(weight, amax, g, BLOCK_SIZE)
    return weight, inputs, g, amax, nvfp4_scales(scale, scale_2)


@pytest.mark.parametrize("order", ["natural", "activation"])
def test_identity_hessian_is_round_to_nearest_bit_for_bit(toy_experts, order):
    weight = toy_experts["down_proj"][0]
    g = shared_global_amax(weight)
    amax = sweep_nvfp4_block_amax(weight, g)
    scale, scale_2 = static_nvfp4_scales(weight, amax, g, BLOCK_SIZE)
    compensated = gptq_nvfp4(weight, torch.eye(weight.shape[1]), nvfp4_scales(scale, scale_2), order=order)
    rtn, gptq = _exported(weight, amax, g), _exported(compensated, amax, g)
    for name in rtn:
        assert gptq[name].dtype == rtn[name].dtype
        assert torch.equal(_bytes(gptq[name]), _bytes(rtn[name])), name


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("order", ["natural", "activation"])
def test_never_leaves_the_grid_and_the_export_keeps_its_codes(seed, order):
    weight, inputs, g, amax, scale = _problem(seed)
    hessian = inputs.double().T @ inputs.double()
    compensated = gptq_nvfp4(weight, hessian, scale, order=order, block_size=32)
    chosen = nvfp4_rtn(compensated, scale)
    grid = nvfp4_grid(scale)
    assert bool((chosen.unsqueeze(-1) == grid).any(-1).all()), "a value outside its block's NVFP4 grid"
    exported = _exported(compensated, amax, g)
    assert torch.equal(_dequantized(exported), chosen)  # ModelOpt's export rounds to GPTQ's codes
    rtn = _exported(weight, amax, g)  # the scales are round-to-nearest's, byte for byte
    for name in ("w.weight_scale", "w.weight_scale_2"):
        assert torch.equal(_bytes(exported[name]), _bytes(rtn[name]))
    assert not torch.equal(exported["w.weight"], rtn["w.weight"])  # and the codes are not


def test_the_lazy_block_size_changes_nothing_but_rounding_noise():
    weight, inputs, _, _, scale = _problem(7)
    hessian = inputs.double().T @ inputs.double()
    one = nvfp4_rtn(gptq_nvfp4(weight, hessian, scale, block_size=1), scale)
    many = nvfp4_rtn(gptq_nvfp4(weight, hessian, scale, block_size=128), scale)
    assert (one != many).float().mean() < 1e-3


def test_lowers_output_error_on_held_out_inputs_of_trained_experts(toy_experts, toy_expert_inputs):
    """The toy's trained layer-1 experts, each with the tokens the router sent it: a Hessian from the
    calibration draw, the error measured on the evaluation windows' tokens (held out)."""
    from transformers.activations import ACT2FN

    act = ACT2FN["silu"]
    fit, held_out = toy_expert_inputs
    totals = {"rtn": 0.0, "gptq": 0.0}
    for e in range(toy_experts["gate_proj"].shape[0]):
        x_fit, x_out = fit[e], held_out[e]
        if x_fit.shape[0] < 64 or x_out.shape[0] == 0:
            continue
        gate, up = toy_experts["gate_proj"][e], toy_experts["up_proj"][e]
        gate_up = torch.cat([gate, up])
        g = shared_global_amax(gate, up)
        amax = torch.cat([sweep_nvfp4_block_amax(w, g) for w in (gate, up)])
        s, s2 = static_nvfp4_scales(gate_up, amax, g, BLOCK_SIZE)
        scale = nvfp4_scales(s, s2)
        compensated = gptq_nvfp4(gate_up, x_fit.double().T @ x_fit.double(), scale)
        source = gate_up.float()
        for kind, quantized in (("rtn", nvfp4_rtn(gate_up, scale)), ("gptq", nvfp4_rtn(compensated, scale))):
            # the expert's intermediate activation, as the model computes it, against BF16's
            ref = act(x_out @ source[: gate.shape[0]].T) * (x_out @ source[gate.shape[0] :].T)
            got = act(x_out @ quantized[: gate.shape[0]].T) * (x_out @ quantized[gate.shape[0] :].T)
            totals[kind] += float((ref - got).double().square().sum())
        assert output_error(source, source, x_out) == 0
    assert totals["gptq"] < 0.8 * totals["rtn"], totals


def test_bad_shapes_and_orders_are_refused():
    weight, _, _, _, scale = _problem(1)
    with pytest.raises(ValueError, match="Hessian"):
        gptq_nvfp4(weight, torch.eye(8), scale)
    with pytest.raises(ValueError, match="order"):
        gptq_nvfp4(weight, torch.eye(weight.shape[1]), scale, order="random")


def test_an_input_no_token_reached_is_rounded_to_nearest_and_feeds_nothing():
    weight, inputs, _, _, scale = _problem(3)
    inputs[:, 5] = 0  # column 5 never sees a nonzero input
    hessian = inputs.double().T @ inputs.double()
    compensated = gptq_nvfp4(weight, hessian, scale)
    assert torch.isfinite(compensated).all()
    assert torch.equal(compensated[:, 5], weight[:, 5].float())  # no error fed into it: its own RTN
    assert not torch.equal(compensated[:, 6], weight[:, 6].float())  # the live column after it moves


@pytest.mark.parametrize("order", ["natural", "activation"])
def test_a_batch_of_experts_rounds_as_each_alone(order):
    """Experts batched along a leading dimension (one column step for all of them) choose the codes each
    chooses alone."""
    problems = [_problem(seed) for seed in (11, 12, 13)]
    weights = torch.stack([p[0] for p in problems])
    hessians = torch.stack([p[1].double().T @ p[1].double() for p in problems])
    scales = torch.stack([p[4] for p in problems])
    batched = gptq_nvfp4(weights, hessians, scales, order=order, block_size=32)
    for b, (weight, _, _, _, scale) in enumerate(problems):
        alone = gptq_nvfp4(weight, hessians[b], scale, order=order, block_size=32)
        assert torch.equal(nvfp4_rtn(batched[b], scale), nvfp4_rtn(alone, scale))
