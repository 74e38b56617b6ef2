"""ModelOpt's auto_quantize(kl_div) reference scores on a small random bf16 Laguna (CPU, NVFP4 patch)."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.model import toy_layout  # noqa: E402
from mixquant.model.families import experts_module_name  # noqa: E402
from mixquant.search.reference import BF16, MODELOPT_FORMATS, modelopt_kl_div_scores  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_EXPERTS = 16
HIDDEN = 32
MOE_INTER = 16
MOE_LAYERS = [1, 2, 3, 4]
FORMATS = ["nvfp4_w4a16", "fp8"]
BATCH_SIZE = 4
UNROUTED = (2, 5)  # (layer, expert) no token is routed to (router bias -100)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, small_laguna_config):
    """Upstream-layout bf16 checkpoint of a random 5-layer Laguna (dense layer 0 + 4 MoE layers)."""
    config = small_laguna_config(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, moe_intermediate_size=MOE_INTER)
    torch.manual_seed(0)
    model = LagunaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in MOE_LAYERS:
            mlp = model.model.layers[layer].mlp
            for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                p[torch.rand(p.shape, generator=gen) < 3e-3] *= 25.0
            mlp.experts.gate_up_proj[:, MOE_INTER:] *= 2.0
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
        model.model.layers[UNROUTED[0]].mlp.gate.e_score_correction_bias[UNROUTED[1]] = -100.0
        # sharper logits, so the scores stand well above bf16 rounding noise
        model.lm_head.weight.mul_(8.0)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    out = tmp_path_factory.mktemp("laguna")
    toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    return out


def load(model_dir) -> LagunaForCausalLM:
    model = LagunaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, experts_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir)


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(4, 128, (6, 32), generator=torch.Generator().manual_seed(2))


def scores(model, ids, layers=MOE_LAYERS, **kwargs) -> dict:
    return modelopt_kl_div_scores(model, ids, layers=layers, formats=FORMATS, batch_size=BATCH_SIZE, **kwargs)


@pytest.fixture(scope="module")
def result(model, calibration_ids):
    before = {name: t.clone() for name, t in model.state_dict().items()}
    return scores(model, calibration_ids), before


def test_scores_shape_and_values(result, calibration_ids):
    res, _ = result
    assert res["tokens"] == calibration_ids.numel() == 192 and res["batches"] == 2
    assert res["modelopt_version"].startswith("0.47.")
    for key in ("scores", "clamped_scores", "costs"):
        assert sorted(res[key]) == MOE_LAYERS
        for layer in MOE_LAYERS:
            assert list(res[key][layer]) == [*FORMATS, BF16]
    numel = NUM_EXPERTS * (2 * MOE_INTER * HIDDEN + HIDDEN * MOE_INTER)
    for layer in MOE_LAYERS:
        raw = res["scores"][layer]
        assert all(math.isfinite(raw[f]) and raw[f] > 0 for f in FORMATS), raw
        assert raw[BF16] == 0.0 and res["clamped_scores"][layer][BF16] == 0.0
        assert res["costs"][layer] == {"nvfp4_w4a16": numel * 4.5 / 16, "fp8": numel * 8 / 16, BF16: numel}
    # ModelOpt's cost denominator counts every auto-quantize module (attention, lm_head, ...), not only ours
    assert res["cost_denominator"] > len(MOE_LAYERS) * numel
    # at 16 effective bits the minimax search ends on no-quant everywhere
    assert res["selection"] == dict.fromkeys(MOE_LAYERS, BF16) and res["selection_satisfied"]


def test_nvfp4_more_sensitive_than_fp8(result):
    """On this model NVFP4 W4A16 hurts more than FP8 W8A8 in every layer, so the clamp is a no-op."""
    res, _ = result
    for layer in MOE_LAYERS:
        raw, clamped = res["scores"][layer], res["clamped_scores"][layer]
        assert raw["nvfp4_w4a16"] > 1.2 * raw["fp8"], (layer, raw)
        assert clamped["nvfp4_w4a16"] == raw["nvfp4_w4a16"]
        assert clamped["fp8"] == min(raw["fp8"], raw["nvfp4_w4a16"])


def test_only_requested_layers_scored(result, model, calibration_ids):
    """A subset searches exactly those groups; groups are independent, so their scores are the same."""
    res, _ = result
    sub = scores(model, calibration_ids, layers=[3, 1])
    assert sorted(sub["scores"]) == [1, 3]
    for layer in (1, 3):
        assert sub["scores"][layer] == res["scores"][layer]
        assert sub["costs"][layer] == res["costs"][layer]


def test_rerun_identical(result, model, calibration_ids):
    res, _ = result
    assert scores(model, calibration_ids) == res


def test_callers_model_unchanged(result, model):
    _, before = result
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not [n for n, m in model.named_modules() if isinstance(m, mtq.nn.TensorQuantizer)]
    assert type(model.model.layers[1].mlp.experts).__name__ == "LagunaExperts"
    assert model.config._experts_implementation == "eager"


def restricted_cfg(preset: dict, layer: int) -> dict:
    """``preset``'s weight / input quantizer cfgs for layer ``layer``'s routed experts only."""
    entries = [{"quantizer_name": "*", "enable": False}]
    for entry in preset["quant_cfg"]:
        if entry["quantizer_name"] in ("*weight_quantizer", "*input_quantizer") and "cfg" in entry:
            name = f"{experts_module_name(layer)}.{entry['quantizer_name']}"
            entries.append({"quantizer_name": name, "cfg": copy.deepcopy(entry["cfg"])})
    return {"quant_cfg": entries, "algorithm": copy.deepcopy(preset["algorithm"])}


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_score_independently(result, model_dir, calibration_ids, fmt):
    """Layer 2 (with an unrouted expert) alone quantized by mtq.quantize with the same preset and max
    calibration over the same batches; KL(ref || quant) = sum p (log p - log q), fp32 log-softmax."""
    res, _ = result
    layer = UNROUTED[0]
    ref, quant = load(model_dir), load(model_dir)
    batches = [calibration_ids[i : i + BATCH_SIZE] for i in range(0, len(calibration_ids), BATCH_SIZE)]
    with warnings.catch_warnings(), cpu_nvfp4_fake_quant(), torch.inference_mode():
        warnings.simplefilter("ignore")
        mtq.quantize(
            quant,
            restricted_cfg(MODELOPT_FORMATS[fmt], layer),
            forward_loop=lambda m: [m(input_ids=b, use_cache=False) for b in batches],
        )
        quantizers = {n: m for n, m in quant.named_modules() if isinstance(m, mtq.nn.TensorQuantizer)}
        enabled = {n for n, m in quantizers.items() if m.is_enabled}
        assert enabled and all(n.startswith(f"{experts_module_name(layer)}.") for n in enabled)
        assert len([n for n in enabled if "weight_quantizers" in n]) == 2 * NUM_EXPERTS
        assert len([n for n in enabled if "input_quantizer" in n]) == (2 if fmt == "fp8" else 0)
        total = 0.0
        for batch in batches:
            log_p = torch.log_softmax(ref(input_ids=batch, use_cache=False).logits.float(), dim=-1)
            log_q = torch.log_softmax(quant(input_ids=batch, use_cache=False).logits.float(), dim=-1)
            total += float((log_p.exp() * (log_p - log_q)).sum(dtype=torch.float64))
    assert total > 0
    assert abs(res["scores"][layer][fmt] - total) <= 1e-4 * total, (res["scores"][layer][fmt], total)


def test_selection_is_modelopt_minimax(model, calibration_ids):
    """At a budget between all-NVFP4 and all-BF16, the pick minimises the largest clamped score among
    the placements that fit (brute force over the 3^4 placements)."""
    probe = scores(model, calibration_ids)
    denominator = probe["cost_denominator"]
    fixed = denominator - sum(probe["costs"][layer][BF16] for layer in MOE_LAYERS)
    all_nvfp4 = fixed + sum(probe["costs"][layer]["nvfp4_w4a16"] for layer in MOE_LAYERS)
    effective_bits = 16 * (all_nvfp4 + denominator) / 2 / denominator
    res = scores(model, calibration_ids, effective_bits=effective_bits)
    budget = denominator * effective_bits / 16
    choices = [*FORMATS, BF16]

    def cost(placement):
        return fixed + sum(res["costs"][layer][fmt] for layer, fmt in placement.items())

    def worst(placement):
        return max(res["clamped_scores"][layer][fmt] for layer, fmt in placement.items())

    feasible = [
        dict(zip(MOE_LAYERS, combo, strict=True))
        for combo in itertools.product(choices, repeat=len(MOE_LAYERS))
        if cost(dict(zip(MOE_LAYERS, combo, strict=True))) <= budget
    ]
    assert res["selection_satisfied"] and cost(res["selection"]) <= budget
    assert worst(res["selection"]) == min(worst(p) for p in feasible)
    assert set(res["selection"].values()) != {BF16}


def test_bad_arguments(model, calibration_ids):
    with pytest.raises(ValueError, match="MoE layers"):
        scores(model, calibration_ids, layers=[0, 1])
    with pytest.raises(ValueError, match="formats"):
        modelopt_kl_div_scores(model, calibration_ids, layers=[1], formats=["int4"], batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        modelopt_kl_div_scores(model, calibration_ids, layers=[1], formats=FORMATS, batch_size=0)


def test_unrestricted_search_is_caught(model, calibration_ids, monkeypatch):
    """If the restriction does not reach ModelOpt (here: disabled_layers dropped), the check raises."""
    from modelopt.torch.quantization.algorithms import _AutoQuantizeBaseSearcher

    original = _AutoQuantizeBaseSearcher.insert_hparams_after_merge_rules

    def unrestricted(self, model, quant_recipes, disabled_layers=None, *args, **kwargs):
        return original(self, model, quant_recipes, None, *args, **kwargs)

    monkeypatch.setattr(_AutoQuantizeBaseSearcher, "insert_hparams_after_merge_rules", unrestricted)
    with pytest.raises(RuntimeError, match="searched groups"):
        scores(model, calibration_ids, layers=[1])
