"""The cluster cost model: geometry against published counts, and estimates that scale as the code does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mixquant.config import load_config_file
from mixquant.costs import (
    B200,
    Geometry,
    geometry_from_hf_config,
    model_geometry,
    placement_counts,
    rule_resources,
    stage_cost,
    toy_geometry,
)

ROOT = Path(__file__).resolve().parents[1]
LAGUNA_CONFIG = ROOT / "data/models/laguna-s-2.1/config.json"
# REFERENCE.md: Laguna-S-2.1 parameters and the release's tensor payload
LAGUNA_TOTAL = 117_561_977_600
LAGUNA_ROUTED = 113_548_197_888
LAGUNA_PAYLOAD = 92_433_871_744
NVFP4_PROJECTION_BYTES = 1_769_476
FP8_PROJECTION_BYTES = 3_145_736


@pytest.fixture(scope="module")
def laguna_cfg():
    return load_config_file(ROOT / "config/laguna-s-2.1.yaml")


@pytest.fixture(scope="module")
def laguna(laguna_cfg) -> Geometry:
    config = json.loads(LAGUNA_CONFIG.read_text("utf-8"))
    return geometry_from_hf_config(config, laguna_cfg.model.moe_layers)


def test_laguna_geometry_matches_published_counts(laguna):
    assert laguna.moe_layers == tuple(range(1, 48))
    assert laguna.total_params == LAGUNA_TOTAL
    assert laguna.routed_params == LAGUNA_ROUTED
    assert laguna.bf16_bytes == 2 * LAGUNA_TOTAL
    assert laguna.routed_bytes_per_layer == 256 * 3 * 3072 * 1024 * 2
    # "active ~8.45B": everything but the routed experts, plus top-10 of 256 per MoE layer
    assert laguna.active_params_per_token == LAGUNA_TOTAL - LAGUNA_ROUTED + 47 * 10 * 3 * 3072 * 1024
    assert round(laguna.active_params_per_token / 1e9, 2) == 8.45


def test_toy_geometry_equals_the_built_toy_model():
    import torch
    from mixquant.model.toy import parameter_counts, toy_laguna_config
    from transformers import LagunaForCausalLM

    cfg = load_config_file(ROOT / "config/config.yaml")

    class Tokenizer:  # the trained BPE tokenizer reaches its configured size
        def __len__(self) -> int:
            return cfg.model.toy.tokenizer.vocab_size

        def convert_tokens_to_ids(self, token: str) -> int:
            return 3

    config = toy_laguna_config(cfg.model.toy.arch.model_dump(), Tokenizer())
    with torch.device("meta"):
        counts = parameter_counts(LagunaForCausalLM(config))
    geometry = toy_geometry(cfg)
    assert geometry.total_params == counts["total"]
    assert geometry.routed_params == counts["routed_experts"]
    assert geometry.active_params_per_token == counts["active_per_token"]
    assert model_geometry(cfg) == geometry


def test_model_geometry_of_a_hub_model_needs_its_config(laguna_cfg, laguna):
    assert model_geometry(laguna_cfg, ROOT) == laguna  # the committed config.json model.geometry names
    unset = laguna_cfg.model_copy(update={"model": laguna_cfg.model.model_copy(update={"geometry": None})})
    with pytest.raises(ValueError, match=r"^model\.geometry: planning a hub/local model needs its config"):
        model_geometry(unset, ROOT)
    elsewhere = laguna_cfg.model.model_copy(update={"geometry": "no.json"})
    missing = laguna_cfg.model_copy(update={"model": elsewhere})
    with pytest.raises(ValueError, match=r"^model\.geometry: cannot read .*no\.json"):
        model_geometry(missing, ROOT)


def test_export_bytes_match_the_release_payload(laguna_cfg, laguna):
    assert placement_counts(laguna_cfg, laguna) == {"nvfp4_w4a16": 39, "fp8": 3, "bf16": 5}
    cost = stage_cost(laguna_cfg, laguna, "export_checkpoint")
    headers = cost.bytes_written - LAGUNA_PAYLOAD
    assert 0 < headers < 0.01 * LAGUNA_PAYLOAD
    # non-expert tensors from the source, routed tensors from the layer results (+ the activation
    # statistics for the KV scales), then the manifest re-read of everything written
    assert cost.bytes_read - cost.bytes_written == pytest.approx(LAGUNA_PAYLOAD, rel=1e-4)
    assert cost.peak_host_bytes < 4 * 2**30  # tensors are copied file to file


def test_layer_results_hold_exported_tensors_only(laguna_cfg, laguna):
    nvfp4 = stage_cost(laguna_cfg, laguna, "quantize_layer", fmt="nvfp4_w4a16")
    fp8 = stage_cost(laguna_cfg, laguna, "quantize_layer", fmt="fp8")
    bf16 = stage_cost(laguna_cfg, laguna, "quantize_layer", fmt="bf16")
    audit = 768 * 1200
    assert nvfp4.bytes_written == 768 * NVFP4_PROJECTION_BYTES + audit
    assert fp8.bytes_written == 768 * FP8_PROJECTION_BYTES + audit
    assert nvfp4.bytes_written < fp8.bytes_written < bf16.bytes_written
    # every job reads the layer's BF16 routed experts (4.83 GB) plus its own output for the manifest
    assert nvfp4.bytes_read == laguna.routed_bytes_per_layer + nvfp4.bytes_written
    # the FP8 MSE sweep is slower per element than NVFP4's fp8_sweep (measured rates)
    assert fp8.runtime_s > nvfp4.runtime_s > bf16.runtime_s
    assert nvfp4.gpus == 0 and nvfp4.peak_gpu_bytes == 0


def test_score_job_with_more_layers_costs_more(laguna_cfg, laguna):
    four = stage_cost(laguna_cfg, laguna, "score_sensitivity", gpus=4, fmt="nvfp4_w4a16", layers=4)
    eight = stage_cost(laguna_cfg, laguna, "score_sensitivity", gpus=4, fmt="nvfp4_w4a16", layers=8)
    result = 768 * NVFP4_PROJECTION_BYTES
    assert (eight.bytes_read - eight.bytes_written) - (four.bytes_read - four.bytes_written) == 4 * result
    assert eight.runtime_s > four.runtime_s
    # the whole BF16 model is held in host memory, plus per layer its file and its dequantized experts
    assert eight.peak_host_bytes - four.peak_host_bytes >= 4 * (result + laguna.routed_bytes_per_layer)
    assert four.peak_host_bytes > laguna.bf16_bytes
    # the search code computes on the CPU whatever the job requests
    assert four.peak_gpu_bytes == 0
    assert any("computes on CPU" in note for note in four.notes)


def test_activation_stats_hold_the_whole_model(laguna_cfg, laguna):
    cost = stage_cost(laguna_cfg, laguna, "collect_activation_stats", gpus=4)
    assert cost.bytes_read > laguna.bf16_bytes
    assert cost.peak_host_bytes > laguna.bf16_bytes
    tokens = 512 * 512
    cpu_seconds = 2 * laguna.active_params_per_token * tokens / (B200.cpu_forward_flops_per_core * 2)
    assert cost.runtime_s > cpu_seconds


def test_more_gpus_shorten_the_vllm_forward(laguna_cfg, laguna):
    tp2 = laguna_cfg.model_copy(update={"kld": laguna_cfg.kld.model_copy(update={"tensor_parallel_size": 2})})
    on4 = stage_cost(laguna_cfg, laguna, "reference_logits", gpus=4)
    on2 = stage_cost(tp2, laguna, "reference_logits", gpus=2)
    assert on2.runtime_s > on4.runtime_s
    assert on2.bytes_read == on4.bytes_read
    assert on4.peak_gpu_bytes == int(0.9 * 179 * 2**30)  # vLLM reserves 90% of each GPU
    assert on2.peak_host_bytes < on4.peak_host_bytes  # one worker process per GPU
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        stage_cost(laguna_cfg, laguna, "reference_logits", gpus=2)


def test_run_kld_is_cheaper_than_the_reference(laguna_cfg, laguna):
    reference = stage_cost(laguna_cfg, laguna, "reference_logits", gpus=4)
    run = stage_cost(laguna_cfg, laguna, "run_kld", gpus=4)
    logits = 2047 * 100352 * 4
    assert reference.bytes_written == logits
    # one job holds the protocol's runs, each a fresh engine reading the candidate checkpoint (the 39/3/5
    # export) and the reference logits instead of the BF16 model
    runs = laguna_cfg.kld.runs
    assert run.bytes_read == pytest.approx(runs * LAGUNA_PAYLOAD, rel=0.01)
    assert run.bytes_read / runs < reference.bytes_read
    assert run.runtime_s / runs < reference.runtime_s
    assert run.gpu_hours == pytest.approx(4 * run.runtime_s / 3600)


def test_rule_resources_round_as_documented(laguna_cfg, laguna):
    for stage, kwargs in (
        ("quantize_layer", {"fmt": "fp8"}),
        ("run_kld", {"gpus": 4}),
        ("check_kld_gates", {}),
        ("score_sensitivity", {"gpus": 4, "fmt": "fp8", "layers": 4}),
    ):
        cost = stage_cost(laguna_cfg, laguna, stage, **kwargs)
        resources = rule_resources(laguna_cfg, laguna, stage, **kwargs)
        assert all(type(v) is int for v in resources.values())
        assert resources["mem_mb"] == max(2000, math.ceil(cost.peak_host_bytes * 1.25 / 2**30) * 1024)
        assert resources["runtime"] == max(10, math.ceil(cost.runtime_s * 2 / 600) * 10)
        assert resources.get("gpu", 0) == kwargs.get("gpus", 0)
    assert rule_resources(laguna_cfg, laguna, "check_kld_gates") == {"mem_mb": 3072, "runtime": 10}
    assert rule_resources(laguna_cfg, laguna, "quantize_layer", fmt="fp8") == {"mem_mb": 9216, "runtime": 40}


def test_unknown_stage_is_refused(laguna_cfg, laguna):
    with pytest.raises(ValueError, match="unknown stage 'publish_release'"):
        stage_cost(laguna_cfg, laguna, "publish_release")
