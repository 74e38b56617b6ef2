"""Activation statistics from one hooked BF16 forward, checked bit for bit against ModelOpt.

The FP8 ``input_scale`` that ModelOpt exports for every expert of an FP8 layer must equal
``fp32(amax) / 448`` of the per-layer amaxes collected here; the K / V amaxes must equal the amax of
ModelOpt's own KV-cache quantizers; per-expert values must equal an independent recomputation.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402
from mixquant.model import toy_layout  # noqa: E402
from mixquant.model.tokenizer import SPECIAL_TOKENS  # noqa: E402
from mixquant.model.toy import init_toy_model, to_bfloat16, toy_laguna_config  # noqa: E402
from mixquant.quantize.activations import (  # noqa: E402
    ATTENTION_STATS,
    EXPERT_STATS,
    JSON_NAME,
    SAFETENSORS_NAME,
    collect_activation_stats,
    load_activation_stats,
    modelopt_fp8_input_scale,
    save_activation_stats,
)
from mixquant.quantize.reference import FP8, NVFP4, modelopt_reference_export  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_LAYERS = 5
NUM_EXPERTS = 16
TOP_K = 2
MOE_LAYERS = (1, 2, 3, 4)
PLACEMENT = {1: FP8, 2: FP8, 3: NVFP4, 4: FP8}
UNROUTED = (2, 5)  # (layer, expert) no token is routed to (router bias -100)
BATCH_SIZE = 2  # the reference export's; bit-exactness needs the same batch size (see test below)
ARCH = {
    "num_hidden_layers": NUM_LAYERS,
    "hidden_size": 32,
    "head_dim": 16,
    "num_attention_heads_full": 2,
    "num_attention_heads_sliding": 4,
    "num_key_value_heads": 2,
    "sliding_window": 8,
    "intermediate_size": 64,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}


class StubTokenizer:
    """Just what toy_laguna_config reads: a length and the special-token ids."""

    def __len__(self) -> int:
        return 128

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL_TOKENS.index(token)


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Upstream-layout bf16 toy Laguna: dense layer 0, 4 MoE layers, full/sliding attention, 16 experts."""
    config = toy_laguna_config(ARCH, StubTokenizer())
    model = init_toy_model(config, seed=5, router_bias_init_std=0.05)
    with torch.no_grad():
        for layer in MOE_LAYERS:
            model.model.layers[layer].mlp.gate.weight.mul_(20.0)  # spread the routing over many experts
        model.model.layers[UNROUTED[0]].mlp.gate.e_score_correction_bias[UNROUTED[1]] = -100.0
    to_bfloat16(model)
    out = tmp_path_factory.mktemp("src")
    with quiet():
        toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    return out


@pytest.fixture(scope="module")
def calibration_ids():
    return torch.randint(4, 128, (5, 12), generator=torch.Generator().manual_seed(2), dtype=torch.int32)


@pytest.fixture(scope="module")
def stats(source, calibration_ids):
    with quiet():
        return collect_activation_stats(source, calibration_ids, batch_size=BATCH_SIZE, progress=False)


@pytest.fixture(scope="module")
def reference(source, calibration_ids, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    with quiet():
        modelopt_reference_export(
            source,
            calibration_ids,
            dict(PLACEMENT),
            out,
            nvfp4_algorithm="max",  # weight algorithms cannot influence activation amaxes
            fp8_weight_algorithm="max",
            batch_size=BATCH_SIZE,
        )
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


def assert_same_stats(a: dict, b: dict) -> None:
    for stat in EXPERT_STATS + ATTENTION_STATS:
        assert a[stat].keys() == b[stat].keys(), stat
        for layer in a[stat]:
            assert a[stat][layer].dtype == b[stat][layer].dtype, (stat, layer)
            assert torch.equal(a[stat][layer], b[stat][layer]), (stat, layer)


# ----------------------------------------------------------------------------------------- ModelOpt


def test_fp8_input_scales_bit_exact(stats, reference):
    """fp32(amax) / 448 == ModelOpt's exported input_scale, every FP8 layer, every expert (routed or not)."""
    fp8_layers = [layer for layer, fmt in PLACEMENT.items() if fmt == FP8]
    assert UNROUTED[0] in fp8_layers
    for layer in fp8_layers:
        gate_up = stats["gate_up_input_amax"][layer].float() / 448
        down = stats["down_input_amax"][layer].float() / 448
        assert torch.equal(modelopt_fp8_input_scale(stats["gate_up_input_amax"][layer]), gate_up)
        for e in range(NUM_EXPERTS):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            assert torch.equal(reference[f"{p}.gate_proj.input_scale"], gate_up), (layer, e)
            assert torch.equal(reference[f"{p}.up_proj.input_scale"], gate_up), (layer, e)
            assert torch.equal(reference[f"{p}.down_proj.input_scale"], down), (layer, e)
    # an NVFP4 W4A16 layer has no input scale, but its stats are collected all the same
    assert "model.layers.3.mlp.experts.0.gate_proj.input_scale" not in reference
    assert stats["gate_up_input_amax"][3] > 0 and stats["down_input_amax"][3] > 0


def test_kv_amax_equals_modelopt_kv_cache_quantizers(source, calibration_ids, stats):
    """K / V amax == the amax ModelOpt's k_bmm / v_bmm (FP8 KV cache) quantizers calibrate, all layers."""
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16, experts_implementation="eager")
    model.eval()
    quant_cfg = {
        "quant_cfg": [{"quantizer_name": "*", "enable": False}, *mtq.FP8_KV_CFG["quant_cfg"]],
        "algorithm": "max",
    }
    ids = calibration_ids.to(torch.long)

    def forward_loop(m):
        for start in range(0, ids.shape[0], BATCH_SIZE):
            m(input_ids=ids[start : start + BATCH_SIZE], use_cache=False)

    with quiet(), torch.no_grad():
        mtq.quantize(model, quant_cfg, forward_loop=forward_loop)
    assert sorted(stats["k_amax"]) == sorted(stats["v_amax"]) == list(range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        attn = model.model.layers[layer].self_attn
        assert torch.equal(attn.k_bmm_quantizer.amax.float(), stats["k_amax"][layer]), layer
        assert torch.equal(attn.v_bmm_quantizer.amax.float(), stats["v_amax"][layer]), layer
        assert stats["k_amax"][layer].dtype == torch.float32 and stats["k_amax"][layer].shape == ()


# ----------------------------------------------------------------------------------------- per expert


def recomputed_per_expert(source, calibration_ids, layer: int):
    """Independent recomputation (a pre-hook replaying the eager expert loop): per-expert amaxes, counts."""
    model = LagunaForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, experts_implementation="eager", attn_implementation="sdpa"
    )
    gate_up = torch.zeros(NUM_EXPERTS)
    down = torch.zeros(NUM_EXPERTS)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.long)

    def hook(module, args):
        hidden, top_k_index, _ = args
        for e in range(module.num_experts):
            token_idx = torch.where(top_k_index == e)[0]
            counts[e] += token_idx.numel()
            if token_idx.numel():
                x = hidden[token_idx]
                g, u = F.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
                gate_up[e] = max(gate_up[e], x.abs().amax().float())
                down[e] = max(down[e], (module.act_fn(g) * u).abs().amax().float())

    model.model.layers[layer].mlp.experts.register_forward_pre_hook(hook)
    ids = calibration_ids.to(torch.long)
    with quiet(), torch.no_grad():
        for start in range(0, ids.shape[0], BATCH_SIZE):
            model(input_ids=ids[start : start + BATCH_SIZE], use_cache=False)
    return gate_up, down, counts


@pytest.mark.parametrize("layer", [UNROUTED[0], 3])
def test_per_expert_stats_match_recomputation(source, calibration_ids, stats, layer):
    gate_up, down, counts = recomputed_per_expert(source, calibration_ids, layer)
    assert torch.equal(stats["routed_tokens"][layer], counts)
    assert torch.equal(stats["gate_up_input_amax_per_expert"][layer], gate_up)
    assert torch.equal(stats["down_input_amax_per_expert"][layer], down)


def test_routing_counts_and_unrouted_expert(stats, calibration_ids):
    num_tokens = calibration_ids.numel()
    assert sorted(stats["routed_tokens"]) == list(MOE_LAYERS)
    for layer in MOE_LAYERS:
        routed = stats["routed_tokens"][layer]
        assert routed.dtype == torch.int64 and routed.shape == (NUM_EXPERTS,)
        assert int(routed.sum()) == num_tokens * TOP_K
        assert int((routed > 0).sum()) >= NUM_EXPERTS // 2  # routing spread, so the checks discriminate
        for stat in ("gate_up_input_amax", "down_input_amax"):
            per_expert = stats[f"{stat}_per_expert"][layer]
            assert per_expert.dtype == torch.float32 and per_expert.shape == (NUM_EXPERTS,)
            assert torch.equal(stats[stat][layer], per_expert.max())  # layer amax = max over experts
            assert torch.equal(per_expert > 0, routed > 0)  # zero exactly where no token was routed
            assert len(set(per_expert[routed > 0].tolist())) > 1  # experts differ
    layer, expert = UNROUTED
    assert stats["routed_tokens"][layer][expert] == 0
    assert stats["gate_up_input_amax_per_expert"][layer][expert] == 0
    assert stats["down_input_amax_per_expert"][layer][expert] == 0
    # the layer amax comes from the routed experts only (and equals ModelOpt's, test above)
    others = [e for e in range(NUM_EXPERTS) if e != expert]
    assert stats["gate_up_input_amax"][layer] == stats["gate_up_input_amax_per_expert"][layer][others].max()
    assert stats["down_input_amax"][layer] == stats["down_input_amax_per_expert"][layer][others].max()


# ----------------------------------------------------------------------------------------- runs, storage


def test_deterministic_and_progress(source, calibration_ids, stats, capfd):
    again = collect_activation_stats(source, calibration_ids, batch_size=BATCH_SIZE, threads=1, progress=True)
    err = capfd.readouterr().err
    assert "activation stats" in err and "5/5" in err  # tqdm over the 5 streamed layers, on stderr
    assert_same_stats(stats, again)
    meta = again["metadata"]
    assert meta["batch_size"] == "2" and meta["num_sequences"] == "5" and meta["num_tokens"] == "60"
    assert meta["num_batches"] == "3" and json.loads(meta["moe_layers"]) == list(MOE_LAYERS)
    assert meta["experts_implementation"] == "eager" and meta["attn_implementation"] == "sdpa"
    assert meta["threads"] == "1" and torch.get_num_threads() == 1


def test_streamed_statistics_equal_the_whole_model_forward(source, calibration_ids, stats):
    """Layer-major streaming (each layer read once, every batch through it) gives the bits of the
    whole-model forward batch after batch, and reads each layer exactly once."""
    from mixquant.checkpoint.shards import ShardReader

    with quiet():
        whole = collect_activation_stats(
            source, calibration_ids, batch_size=BATCH_SIZE, progress=False, streamed=False
        )
        reader = ShardReader(source)
        streamed = collect_activation_stats(
            source, calibration_ids, batch_size=BATCH_SIZE, progress=False, reader=reader
        )
    assert_same_stats(whole, streamed)
    assert_same_stats(stats, streamed)
    assert dict(reader.reads) == dict.fromkeys(range(NUM_LAYERS), 1)


def test_save_load_roundtrip(stats, tmp_path):
    save_activation_stats(stats, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([SAFETENSORS_NAME, JSON_NAME])
    with safe_open(tmp_path / SAFETENSORS_NAME, "pt") as handle:
        names = set(handle.keys())
        assert handle.metadata() == stats["metadata"]
        assert handle.get_tensor("layers.2.gate_up_input_amax").dtype == torch.float32
        assert handle.get_tensor("layers.2.routed_tokens").dtype == torch.int64
    want = {f"layers.{layer}.{stat}" for layer in MOE_LAYERS for stat in EXPERT_STATS}
    want |= {f"layers.{layer}.{stat}" for layer in range(NUM_LAYERS) for stat in ATTENTION_STATS}
    assert names == want
    for path in (tmp_path, tmp_path / SAFETENSORS_NAME):
        loaded = load_activation_stats(path)
        assert_same_stats(stats, loaded)
        assert loaded["metadata"] == stats["metadata"]
    summary = json.loads((tmp_path / JSON_NAME).read_text())
    assert summary["metadata"]["batch_size"] == "2" and "k_amax" in summary["where"]
    assert summary["layers"]["2"]["routed_tokens"] == stats["routed_tokens"][2].tolist()
    assert summary["layers"]["0"]["k_amax"] == stats["k_amax"][0].item()


def test_modelopt_fp8_input_scale_edge_cases():
    """ModelOpt's export replaces a zero / NaN amax by 448 (scale 1.0)."""
    amax = torch.tensor([0.0, float("nan"), 448.0, 3.5])
    assert torch.equal(modelopt_fp8_input_scale(amax), torch.tensor([1.0, 1.0, 1.0, 3.5 / 448]))


def test_rejects_bad_input(source):
    with pytest.raises(ValueError, match="num_sequences"):
        collect_activation_stats(source, torch.zeros(12, dtype=torch.int32), progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        collect_activation_stats(source, torch.zeros(2, 4, dtype=torch.int32), batch_size=0, progress=False)
