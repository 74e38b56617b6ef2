"""The sensitivity scorer: suffix forwards from cached layer inputs equal full forwards, and the KL sums
equal a straightforward full-model computation with only one group quantized."""

from __future__ import annotations

import pytest
import torch
from mixquant.quantize.activations import collect_activation_stats
from mixquant.quantize.layer import quantize_layer
from mixquant.search.score import (
    layer_quant_from_tensors,
    load_search_model,
    quantized_experts,
    sensitivity_scores,
)

torch.set_num_threads(1)
ORIGINAL_LINEAR = torch.nn.functional.linear
LAYERS = [1, 2, 3, 4]
PARAMS = {"nvfp4_w4a16": {"calibration": "max"}, "fp8": {"weight_calibration": "max"}}


@pytest.fixture(scope="module")
def stats(small_laguna, small_calibration_ids):
    return collect_activation_stats(small_laguna, small_calibration_ids, batch_size=4, progress=False)


@pytest.fixture(scope="module")
def layer_tensors(small_laguna, stats):
    out = {}
    for fmt, params in PARAMS.items():
        for layer in LAYERS:
            amax = (
                {"gate_up": stats["gate_up_input_amax"][layer], "down": stats["down_input_amax"][layer]}
                if fmt == "fp8"
                else None
            )
            out[fmt, layer] = quantize_layer(small_laguna, layer, fmt, params, activation_amax=amax)[0]
    return out


def straightforward_kl(model, ids, quant, batch_size):
    """Full forwards with and without the quantized group; log-softmax in float32 (the documented numerics:
    KL of tiny perturbations is dominated by its rounding), KL = sum p * (log p - log q) in float64."""
    total = 0.0
    with torch.inference_mode():
        for start in range(0, ids.shape[0], batch_size):
            batch = ids[start : start + batch_size]
            ref = model(input_ids=batch, use_cache=False).logits.float()
            with quantized_experts(model, quant):
                q = model(input_ids=batch, use_cache=False).logits.float()
            log_p, log_q = ref.log_softmax(-1).double(), q.log_softmax(-1).double()
            total += float((log_p.exp() * (log_p - log_q)).sum())
    return total


@pytest.mark.parametrize("fmt", list(PARAMS))
def test_scores_equal_full_forward_kl(small_laguna, small_calibration_ids, layer_tensors, fmt):
    model = load_search_model(small_laguna)
    tensors = {layer: layer_tensors[fmt, layer] for layer in LAYERS}
    scores = sensitivity_scores(model, small_calibration_ids, tensors, fmt, batch_size=4)
    assert sorted(scores) == LAYERS
    for layer in LAYERS:
        quant = layer_quant_from_tensors(tensors[layer], layer, fmt)
        expected = straightforward_kl(model, small_calibration_ids, quant, 4)
        got = scores[layer]
        assert got["tokens"] == small_calibration_ids.numel()
        assert got["kl_sum"] > 0
        assert got["kl_sum"] == pytest.approx(expected, rel=1e-4), (fmt, layer)
        assert got["kl_per_token"] == pytest.approx(got["kl_sum"] / got["tokens"], rel=1e-12)


def test_model_restored_after_scoring(small_laguna, small_calibration_ids, layer_tensors):
    model = load_search_model(small_laguna)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {layer: layer_tensors["fp8", layer] for layer in LAYERS}
    sensitivity_scores(model, small_calibration_ids, tensors, "fp8", batch_size=4)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.nn.functional.linear.__module__ == "torch.nn.functional" or callable(
        torch.nn.functional.linear
    )


def test_suffix_forward_is_bit_identical(small_laguna, small_calibration_ids, layer_tensors):
    """Scoring from the cached input of layer L equals the full quantized forward's logits bit for bit."""
    from mixquant.search.score import _LayerInputs, suffix_logits

    model = load_search_model(small_laguna)
    batch = small_calibration_ids[:4]
    quant = layer_quant_from_tensors(layer_tensors["nvfp4_w4a16", 3], 3, "nvfp4_w4a16")
    with torch.inference_mode():
        inputs = _LayerInputs(model, 1)
        model(input_ids=batch, use_cache=False)
        inputs.remove()
        assert set(inputs.hidden) == set(inputs.kwargs) == {1, 2, 3, 4}
        with quantized_experts(model, quant):
            full = model(input_ids=batch, use_cache=False).logits
            from_layer_input = suffix_logits(model, 3, inputs)
    assert torch.equal(full, from_layer_input)


def test_kl_sum_with_precomputed_p_is_modelopts_kl_div_bit_for_bit():
    from mixquant.search.score import kl_sum

    gen = torch.Generator().manual_seed(0)
    ref = (torch.randn(3, 7, 50, generator=gen) * 4).to(torch.bfloat16)
    quant = (ref.float() + 0.05 * torch.randn(3, 7, 50, generator=gen)).to(torch.bfloat16)
    log_p = torch.log_softmax(ref.float(), dim=-1)
    modelopt = torch.nn.functional.kl_div(
        torch.log_softmax(quant.float(), dim=-1), log_p, reduction="sum", log_target=True
    )
    assert torch.equal(kl_sum(log_p, quant), modelopt)
    assert torch.equal(kl_sum(log_p, quant, log_p.exp()), modelopt)


def test_fp8_amax_recovered_exactly(layer_tensors, stats):
    for layer in LAYERS:
        quant = layer_quant_from_tensors(layer_tensors["fp8", layer], layer, "fp8")
        assert torch.equal(quant.gate_up_input_amax, stats["gate_up_input_amax"][layer].float())
        assert torch.equal(quant.down_input_amax, stats["down_input_amax"][layer].float())


def test_format_mismatch_is_refused(small_laguna, small_calibration_ids, layer_tensors):
    model = load_search_model(small_laguna)
    quant = layer_quant_from_tensors(layer_tensors["fp8", 1], 1, "fp8")
    with pytest.raises(ValueError, match="layer 1: tensors are fp8"):
        sensitivity_scores(model, small_calibration_ids, {1: quant}, "nvfp4_w4a16", batch_size=4)


def test_modelopt_numerics_reproduce_auto_quantize_kl_div_scores(small_laguna, small_calibration_ids, stats):
    """placement.search.calibration: max -- mixquant's scores equal ModelOpt auto_quantize(kl_div)'s."""
    from mixquant.search.reference import modelopt_kl_div_scores
    from mixquant.search.score import modelopt_search_quant

    model = load_search_model(small_laguna)
    theirs = modelopt_kl_div_scores(
        model, small_calibration_ids, layers=LAYERS, formats=list(PARAMS), batch_size=4
    )
    for fmt in PARAMS:
        quants = {}
        for layer in LAYERS:
            amax = None
            if fmt == "fp8":
                amax = {
                    "gate_up": stats["gate_up_input_amax"][layer],
                    "down": stats["down_input_amax"][layer],
                }
            quants[layer] = modelopt_search_quant(model, layer, fmt, amax)
        ours = sensitivity_scores(model, small_calibration_ids, quants, fmt, batch_size=4)
        for layer in LAYERS:
            assert ours[layer]["kl_sum"] == pytest.approx(theirs["scores"][layer][fmt], rel=1e-4), (
                fmt,
                layer,
            )
