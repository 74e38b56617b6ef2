"""The cluster cost model: estimates that scale as the code does, from a geometry alone."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from mixquant.costs import B200, placement_counts, rule_resources, stage_cost

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
LAGUNA_CONFIG = ROOT / "data/models/laguna-s-2.1/config.json"
# the reference release's tensor payload
LAGUNA_PAYLOAD = 92_433_871_744
NVFP4_PROJECTION_BYTES = 1_769_476
FP8_PROJECTION_BYTES = 3_145_736


def suite_config(cfg, suite=None, **update):
    """``cfg`` with ``kld.eval`` replaced by ``suite`` (None: the pinned prompt alone) and ``update``d."""
    if suite is not None and update:
        suite = suite.model_copy(update=update)
    return cfg.model_copy(update={"kld": cfg.kld.model_copy(update={"eval": suite})})


def test_a_search_without_expected_counts_plans_the_heaviest_placement_the_budget_allows(laguna_cfg, laguna):
    unexpected = laguna_cfg.model_copy(
        update={"expected": laguna_cfg.expected.model_copy(update={"placement_counts": None})}
    )
    # 47 layers at <= 6.0 bits: 6 BF16 (+69 bits over NVFP4), the 1.5 left upgrade nothing
    counts = placement_counts(unexpected, laguna)
    assert counts == {"nvfp4_w4a16": 41, "fp8": 0, "bf16": 6}
    # at 5.8 bits: 5 BF16 (+57.5 of 61.1 bits), the 3.6 left upgrade one layer to FP8
    tighter = unexpected.model_copy(
        update={"placement": unexpected.placement.model_copy(update={"target_effective_bits": 5.8})}
    )
    assert placement_counts(tighter, laguna) == {"nvfp4_w4a16": 41, "fp8": 1, "bf16": 5}
    no_bf16 = unexpected.model_copy(
        update={"placement": unexpected.placement.model_copy(update={"formats": ["nvfp4_w4a16", "fp8"]})}
    )
    assert placement_counts(no_bf16, laguna) == {"nvfp4_w4a16": 27, "fp8": 20, "bf16": 0}
    for case in (unexpected, tighter, no_bf16):
        n = placement_counts(case, laguna)
        bits = (4.5 * n["nvfp4_w4a16"] + 8 * n["fp8"] + 16 * n["bf16"]) / 47
        assert bits <= case.placement.target_effective_bits


def test_export_bytes_match_the_release_payload(laguna_cfg, laguna):
    assert placement_counts(laguna_cfg, laguna) == {"nvfp4_w4a16": 39, "fp8": 3, "bf16": 5}
    cost = stage_cost(laguna_cfg, laguna, "export_checkpoint")
    headers = cost.bytes_written - LAGUNA_PAYLOAD
    assert 0 < headers < 0.01 * LAGUNA_PAYLOAD
    # non-expert tensors from the source, routed tensors from the layer results (+ the activation
    # statistics for the KV scales), then the manifest re-read of everything written
    assert cost.bytes_read - cost.bytes_written == pytest.approx(LAGUNA_PAYLOAD, rel=1e-4)
    assert cost.peak_host_bytes < 4 * 2**30  # tensors are copied file to file


def on_cpu(cfg):
    """The config with every stage on the CPU (numerics.device: cpu)."""
    return cfg.model_copy(update={"numerics": cfg.numerics.model_copy(update={"device": "cpu"})})


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
    # numerics.device cuda: one GPU, one expert's fp32 temporaries on it
    assert nvfp4.gpus == 1 and 0 < nvfp4.peak_gpu_bytes < GIB
    # on the CPU the FP8 MSE sweep is slower per element than NVFP4's fp8_sweep (measured rates)
    cpu = [
        stage_cost(on_cpu(laguna_cfg), laguna, "quantize_layer", fmt=f)
        for f in ("fp8", "nvfp4_w4a16", "bf16")
    ]
    assert cpu[0].runtime_s > cpu[1].runtime_s > cpu[2].runtime_s
    assert cpu[1].gpus == 0 and cpu[1].peak_gpu_bytes == 0
    assert cpu[1].runtime_s > nvfp4.runtime_s


def test_a_score_pass_streams_the_model_once_with_every_branch(laguna_cfg, laguna):
    from mixquant.facts import score_macro_batch

    size = score_macro_batch(laguna_cfg)
    assert size == 256  # two passes of the 512 calibration sequences fit a B200
    one = stage_cost(laguna_cfg, laguna, "score_sensitivity", sequences=size)
    half = stage_cost(laguna_cfg, laguna, "score_sensitivity", sequences=size // 2)
    results = 47 * (768 * NVFP4_PROJECTION_BYTES + 768 * FP8_PROJECTION_BYTES)
    # the states saved every quarter of the requested wall time (twice the estimate): 2 saves of 95 streams
    search = laguna_cfg.placement.search.model_copy(update={"checkpoint_interval_s": 1e9})
    never = laguna_cfg.model_copy(
        update={"placement": laguna_cfg.placement.model_copy(update={"search": search})}
    )
    unsaved = stage_cost(never, laguna, "score_sensitivity", sequences=size)
    assert one.bytes_written - unsaved.bytes_written == 2 * 95 * size * 512 * 3072 * 2
    # the BF16 model once, every scored layer x format result once, the calibration tokens
    assert unsaved.bytes_read - unsaved.bytes_written == laguna.bf16_bytes + results + size * 512 * 4
    # the reference and 94 branches of 256 x 512 tokens x 3072 hidden (bf16) on the GPU, with two layers
    states = 95 * size * 512 * 3072 * 2
    assert states < one.peak_gpu_bytes <= 0.85 * B200.gpu_memory_bytes
    assert one.peak_gpu_bytes - half.peak_gpu_bytes == states // 2
    assert one.peak_host_bytes <= 64e9 < laguna.bf16_bytes  # never the whole model
    assert one.gpus == 1 and one.runtime_s > half.runtime_s
    # ~220 PF for all 512 sequences; 2-4 passes over the weights; within 1 GPU-hour
    assert 2 * one.gpu_hours <= 1.0


def test_macro_batch_follows_the_device_memory(laguna_cfg, laguna):
    from mixquant.costs import Hardware, score_macro_batch

    small = Hardware(gpu_memory_bytes=80 * GIB)
    assert score_macro_batch(laguna_cfg, laguna, small) < score_macro_batch(laguna_cfg, laguna, B200)
    size = score_macro_batch(laguna_cfg, laguna, small)
    passes = -(-512 // size)
    assert size % 8 == 0 and passes > 2  # whole micro-batches; more passes than on a B200
    assert passes * size - 512 < 8 * passes  # evened out: no pass much shorter than the others
    search = laguna_cfg.placement.search.model_copy(update={"stack_branches": False})
    placement = laguna_cfg.placement.model_copy(update={"search": search})
    alone = laguna_cfg.model_copy(update={"placement": placement})
    assert score_macro_batch(alone, laguna, B200) >= score_macro_batch(laguna_cfg, laguna, B200)


def test_activation_statistics_stream_the_model_once(laguna_cfg, laguna):
    cost = stage_cost(laguna_cfg, laguna, "collect_activation_stats")
    assert laguna.bf16_bytes < cost.bytes_read < laguna.bf16_bytes * 1.001
    assert cost.peak_host_bytes < 32e9 < laguna.bf16_bytes
    states = 512 * 512 * 3072 * 2  # every calibration sequence's hidden states, on the GPU
    assert states < cost.peak_gpu_bytes < states + 3 * 5.2e9 + 1.3e9
    # load bound on a GPU: about the time to read 235 GB and lay it out in host memory
    load_s = laguna.bf16_bytes * (1 / B200.storage_read_bytes_per_s + 1 / B200.host_layer_load_bytes_per_s)
    assert load_s < cost.runtime_s < 1.2 * load_s + 60
    cpu = stage_cost(on_cpu(laguna_cfg), laguna, "collect_activation_stats")
    assert cpu.runtime_s > 10 * cost.runtime_s and cpu.gpus == 0 and cpu.peak_gpu_bytes == 0


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
    """The pinned prompt alone (no evaluation suite): a run reads the candidate instead of the BF16 model."""
    laguna_cfg = suite_config(laguna_cfg, None)
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
        ("score_sensitivity", {"sequences": 256}),
    ):
        cost = stage_cost(laguna_cfg, laguna, stage, **kwargs)
        resources = rule_resources(laguna_cfg, laguna, stage, **kwargs)
        assert all(type(v) is int for v in resources.values())
        assert resources["mem_mb"] == max(2000, math.ceil(cost.peak_host_bytes * 1.25 / 2**30) * 1024)
        assert resources["runtime"] == max(10, math.ceil(cost.runtime_s * 2 / 600) * 10)
        assert resources.get("gpu", 0) == cost.gpus
        assert resources["disk_mb"] == max(1000, math.ceil(cost.bytes_written * 1.1 / 1e6))
    assert rule_resources(laguna_cfg, laguna, "check_kld_gates") == {
        "mem_mb": 3072,
        "runtime": 10,
        "disk_mb": 1000,
    }
    assert rule_resources(on_cpu(laguna_cfg), laguna, "quantize_layer", fmt="fp8") == {
        "mem_mb": 9216,
        "runtime": 40,
        "disk_mb": 2659,  # a window of one layer: 2.4 GB of FP8 experts
    }
    # a stage that writes the model asks for its size, not Snakemake's 50 GB default (the 235 GB
    # Qwen3 fetch): the Laguna fetch writes 235 GB
    fetch = stage_cost(laguna_cfg, laguna, "fetch_model")
    assert fetch.bytes_written > 200e9
    assert rule_resources(laguna_cfg, laguna, "fetch_model")["disk_mb"] == math.ceil(
        fetch.bytes_written * 1.1 / 1e6
    )


def test_unknown_stage_is_refused(laguna_cfg, laguna):
    with pytest.raises(ValueError, match="unknown stage 'publish_release'"):
        stage_cost(laguna_cfg, laguna, "publish_release")


def test_pinned_host_buffers_are_counted_as_torch_rounds_them(laguna_cfg, laguna):
    """On a GPU the streamed stages read layers pinned, the routed experts straight into their fused
    parameters; torch's caching host allocator rounds each pinned block up to a power of two: Laguna's
    gate_up buffer (256 x 2048 x 3072 bf16, 3 GiB) takes 4 GiB and its down buffer (1.5 GiB) 2 GiB, and the
    host request holds two such layers (the one copied and the read-ahead)."""
    from mixquant.costs.sizes import pinned_layer_bytes
    from mixquant.facts.jobs import max_layer_bytes

    gib = 1 << 30
    assert 256 * 2 * laguna.moe_intermediate_size * laguna.hidden_size * 2 == 3 * gib
    pinned = pinned_layer_bytes(laguna)
    assert pinned == 6 * gib + 2 * (max_layer_bytes(laguna) - 4.5 * gib)  # the rest doubled, at most
    assert pinned > max_layer_bytes(laguna)
    host = stage_cost(laguna_cfg, laguna, "collect_activation_stats", gpus=1).peak_host_bytes
    assert host >= 2 * pinned


def test_the_cost_model_stands_without_the_artifact_graph():
    """Costs read the planning facts, never the keyed graph (so they are tested from a geometry alone)."""
    code = "import sys, mixquant.costs; print([m for m in sys.modules if m.startswith('mixquant.graph')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------- the evaluation suite
# config/laguna-s-2.1.yaml: 3 domains x 41 windows of 2,048 tokens, the reference in the top-k form (1,024)
LAGUNA_SUITE_POSITIONS = 3 * 41 * 2047  # 251,781


def test_the_topk_reference_is_sized_as_the_kld_package_stores_it(laguna_cfg, laguna):
    """The cost model's torch-free storage arithmetic is mixquant.kld.topk's; at Laguna scale the suite's
    reference is 2.07 GB in the top-k form (1/49 of the 101 GB of full float32 logits)."""
    from mixquant.costs.kld import full_reference_bytes, topk_reference_bytes
    from mixquant.kld import topk

    for positions, k in ((1, 1), (2047, 16), (LAGUNA_SUITE_POSITIONS, 1024), (10_000, 100_352)):
        assert topk_reference_bytes(positions, k) == topk.reference_bytes(positions, k)
        assert full_reference_bytes(positions, 100_352) == topk.full_reference_bytes(positions, 100_352)
    suite = laguna_cfg.kld.eval
    assert (suite.reference, suite.top_k, suite.reference_captures) == ("topk", 1024, 2)
    assert sum(d.windows for d in suite.domains) * suite.window_tokens == 251_904 >= 250_000
    stored = topk.reference_bytes(LAGUNA_SUITE_POSITIONS, 1024)
    assert stored == 2_070_646_944
    cost = stage_cost(laguna_cfg, laguna, "reference_logits", gpus=4, suite=True)
    # and the second capture's statistics against the first (57 B a position), scratch removed once read
    assert cost.bytes_written == stored + LAGUNA_SUITE_POSITIONS * 57 + 10_000
    assert cost.warnings == ()
    full = stage_cost(
        suite_config(laguna_cfg, suite, reference="full"), laguna, "reference_logits", gpus=4, suite=True
    )
    full_bytes = topk.full_reference_bytes(LAGUNA_SUITE_POSITIONS, laguna.vocab_size)
    assert full.bytes_written == full_bytes + LAGUNA_SUITE_POSITIONS * 41 + 10_000
    (warning,) = full.warnings
    assert warning.startswith("kld.eval.reference: full stores the suite's reference as 101 GB")
    assert warning.endswith("reference: topk (top_k 1024) stores 2.1 GB")


def test_a_full_suite_reference_warns_in_the_plan_only_at_scale(laguna_cfg, laguna):
    """The toy's exact full reference (24 windows x 255 positions x 2,048 x 4 B = 50 MB) is no warning,
    although it is larger than the toy model."""
    from mixquant.config import load_config_file
    from mixquant.facts import planning_geometry

    toy = load_config_file(ROOT / "config/config.yaml")
    assert toy.kld.eval is not None and toy.kld.eval.reference == "full"
    assert stage_cost(toy, planning_geometry(toy), "reference_logits", suite=True).warnings == ()


def test_the_suite_adds_its_jobs_and_run_kld_scales_with_its_windows(laguna_cfg, laguna):
    """Per run, one engine scores the prompt and every window: doubling the windows doubles run_kld's
    suite part (the per-run engine start stays one), and so the suite reference's; without kld.eval the
    jobs cost what the prompt costs."""
    from mixquant.costs import Hardware

    suite = laguna_cfg.kld.eval
    doubled = suite.model_copy(
        update={"domains": [d.model_copy(update={"windows": 82}) for d in suite.domains]}
    )
    prompt_only = suite_config(laguna_cfg, None)
    with pytest.raises(ValueError, match="needs kld.eval"):
        stage_cost(prompt_only, laguna, "reference_logits", gpus=4, suite=True)
    with pytest.raises(ValueError, match="needs kld.eval"):
        stage_cost(prompt_only, laguna, "sample_eval")

    def cost(cfg, stage, **kwargs):
        return stage_cost(
            cfg, laguna, stage, gpus=4 if stage in ("reference_logits", "run_kld") else 0, **kwargs
        )

    base, once, twice = (
        cost(c, "run_kld") for c in (prompt_only, laguna_cfg, suite_config(laguna_cfg, doubled))
    )
    assert base.runtime_s < once.runtime_s < twice.runtime_s
    assert (twice.runtime_s - base.runtime_s) / (once.runtime_s - base.runtime_s) == pytest.approx(
        2, rel=0.02
    )
    assert (twice.bytes_read - base.bytes_read) / (once.bytes_read - base.bytes_read) == pytest.approx(
        2, rel=0.01
    )
    runs = laguna_cfg.kld.runs
    # the suite's per-position statistics, 57 B a position scored against the top-k form, per run
    assert once.bytes_written - base.bytes_written == runs * (LAGUNA_SUITE_POSITIONS * 57 + 10_000)
    # one engine start per run, whether it scores one window or 124
    slow_start = Hardware(vllm_startup_s=B200.vllm_startup_s + 1000)
    for cfg in (prompt_only, laguna_cfg, suite_config(laguna_cfg, doubled)):
        later = stage_cost(cfg, laguna, "run_kld", gpus=4, hardware=slow_start).runtime_s
        assert later - cost(cfg, "run_kld").runtime_s == pytest.approx(runs * 1000)
    reference, reference_twice = (
        cost(c, "reference_logits", suite=True) for c in (laguna_cfg, suite_config(laguna_cfg, doubled))
    )
    assert reference_twice.bytes_written - 10_000 == 2 * (reference.bytes_written - 10_000)
    assert reference.gpus == 4 and reference.gpu_hours > 0
    sample, sample_twice = (cost(c, "sample_eval") for c in (laguna_cfg, suite_config(laguna_cfg, doubled)))
    assert sample.gpus == 0 and sample.bytes_written > 251_904 * 4
    assert sample_twice.bytes_written - sample.bytes_written > 251_904 * 4
    assert sample.peak_host_bytes <= 64e9
    # the gate reads the runs' suite statistics (its own and the baseline's) and bootstraps over windows
    for stage in ("gate_kld", "kld_report"):
        without, with_suite = cost(prompt_only, stage), cost(laguna_cfg, stage)
        assert with_suite.bytes_read > without.bytes_read and with_suite.runtime_s > without.runtime_s
    gate = cost(laguna_cfg, "gate_kld").bytes_read - cost(prompt_only, "gate_kld").bytes_read
    assert gate >= 2 * runs * LAGUNA_SUITE_POSITIONS * 57
