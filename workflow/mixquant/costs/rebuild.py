"""Cost functions of the rebuild: activation statistics, the quantize windows, the placement search
(score passes and the solve) and the export."""

from __future__ import annotations

from mixquant.costs.hardware import MIB
from mixquant.costs.job import CostJob
from mixquant.costs.sizes import (
    AUDIT_BYTES_PER_TENSOR,
    QUANTIZE_TEMP_BYTES,
    activation_stats_bytes,
    layer_result_bytes,
    pinned_layer_bytes,
    placement_counts,
    score_macro_batch,
    streamed_seconds,
)
from mixquant.export.predict import checkpoint_tensors, predict_structure
from mixquant.facts import scored_formats, scored_pairs
from mixquant.facts.jobs import (
    batch_activation_bytes,
    gptq_chunk_experts,
    gptq_expert_bytes,
    max_layer_bytes,
    non_layer_bytes,
    score_transient_bytes,
    state_bytes,
)


def collect_activation_stats(job: CostJob) -> None:
    """One layer-streamed pass, every sequence through each layer."""
    cfg, geometry, hw, calib = job.cfg, job.geometry, job.hw, job.cfg.calibration
    tokens = calib.num_samples * calib.seq_len
    job.read = job.model_bytes + tokens * 4
    flops = geometry.forward_flops(calib.seq_len, calib.num_samples, first_layer=0)
    compute_s = flops / job.device_flops
    states = state_bytes(geometry, calib.num_samples, calib.seq_len)
    transient = batch_activation_bytes(geometry, cfg.quantize.activation_batch_size, calib.seq_len)
    job.streamed_s = streamed_seconds(job.read, compute_s, geometry, hw, job.on_gpu)
    job.streamed_read = job.read
    held = 2 * max_layer_bytes(geometry) + non_layer_bytes(geometry) + states + transient
    if job.on_gpu:
        job.gpu_bytes = held
        job.host += 2 * pinned_layer_bytes(geometry)  # pinned read-ahead buffer and the layer being copied
    else:
        job.host += held
    job.written = activation_stats_bytes(geometry)


def expert_inputs_bytes(cfg, geometry) -> int:
    """One MoE layer's recorded expert inputs: every calibration token's bf16 state and its routing."""
    tokens = cfg.calibration.num_samples * cfg.calibration.seq_len
    return tokens * (geometry.hidden_size * geometry.dtype_bytes + 4 * geometry.num_experts_per_tok)


def collect_expert_inputs(job: CostJob) -> None:
    """The activation statistics' layer-streamed pass, each MoE layer's expert inputs written as it ends."""
    collect_activation_stats(job)
    layer_file = expert_inputs_bytes(job.cfg, job.geometry)
    job.written = len(job.geometry.moe_layers) * layer_file
    job.host += 2 * layer_file  # the layer's recorded batches, and their concatenation being written


def gptq_layer_cost(cfg, geometry, hw, on_gpu: bool, cpus: int) -> tuple[float, int]:
    """(seconds, device bytes) of GPTQ rounding one MoE layer's routed experts (beyond round-to-nearest).

    Per expert, float64: the two Hessians (``X^T X`` of its tokens, ``H x H``; of its down inputs, ``I x I``,
    after recomputing them), three factorisations of each (Cholesky, inverse, upper Cholesky: ~H^3), and
    the error feedback's block GEMMs; the rank-1 updates inside each lazy block (elementwise: ``rows x cols
    x block / 2`` per projection); on a GPU the launches of the column steps, which run a chunk of experts
    at once (:func:`mixquant.facts.jobs.gptq_chunk_experts`) -- otherwise the loop is launch-bound.
    """
    hidden, inter, experts = geometry.hidden_size, geometry.moe_intermediate_size, geometry.num_experts
    routed_tokens = cfg.calibration.num_samples * cfg.calibration.seq_len * geometry.num_experts_per_tok
    flops = 2 * routed_tokens * (hidden * hidden + inter * inter + 2 * inter * hidden)  # Hessians, down input
    flops += experts * (2 * (hidden**3 + inter**3))  # factorisations
    flops += experts * 2 * (2 * inter * hidden * hidden + hidden * inter * inter)  # error feedback
    chunk = min(experts, gptq_chunk_experts(hidden, inter, "cuda" if on_gpu else "cpu"))
    steps = -(-experts // chunk) * (hidden + inter)
    device = chunk * gptq_expert_bytes(hidden, inter)
    # the rank-1 updates inside each lazy block (half a block per column on average): elementwise work
    block = cfg.quantize.nvfp4_w4a16.gptq.block_size
    updates = experts * (2 * inter * hidden + hidden * inter) * min(block, hidden) / 2
    if on_gpu:
        seconds = (
            flops / hw.gpu_fp64_flops + steps * hw.gpu_gptq_column_s + updates / hw.gpu_gptq_updates_per_s
        )
        return seconds, device
    seconds = flops / (hw.cpu_fp64_flops_per_core * cpus) + updates * hw.cpu_gptq_update_s / cpus
    return seconds, device


def quantize_layer(job: CostJob) -> None:
    """One window of ``layers`` MoE layers, one after the other (GPTQ rounding: + the layer's expert
    inputs read and the rounding's float64 work, :func:`gptq_layer_cost`)."""
    cfg, geometry, hw, layers = job.cfg, job.geometry, job.hw, job.layers
    fmt = job.fmt or "nvfp4_w4a16"
    params = {
        "nvfp4_w4a16": f"nvfp4_w4a16:{cfg.quantize.nvfp4_w4a16.calibration}",
        "fp8": f"fp8:{cfg.quantize.fp8.weight_calibration}",
        "bf16": "bf16",
    }[fmt]
    result = layer_result_bytes(geometry, fmt)
    job.read = layers * geometry.routed_bytes_per_layer
    job.written = layers * (result + 3 * geometry.num_experts * AUDIT_BYTES_PER_TENSOR)
    elements = layers * geometry.routed_params_per_layer
    if job.on_gpu:
        job.compute_s = elements / hw.gpu_quantize_elements_per_s + job.read / hw.host_to_device_bytes_per_s
        job.gpu_bytes = 4 * geometry.routed_params_per_expert * 4 + QUANTIZE_TEMP_BYTES  # one expert, fp32
    else:
        job.compute_s = elements / (hw.cpu_quantize_elements_per_s_per_core[params] * job.cpus)
    # one layer at a time: the growing result, safetensors' save_file copy of it, per-expert temporaries
    job.host += 2 * result + QUANTIZE_TEMP_BYTES
    if fmt == "nvfp4_w4a16" and cfg.quantize.nvfp4_w4a16.rounding == "gptq":
        inputs = expert_inputs_bytes(cfg, geometry)
        seconds, device = gptq_layer_cost(cfg, geometry, hw, job.on_gpu, job.cpus)
        job.read += layers * inputs
        job.compute_s += layers * (seconds + (inputs / hw.host_to_device_bytes_per_s if job.on_gpu else 0))
        if job.on_gpu:
            job.gpu_bytes += inputs + device  # the layer's inputs stay on the device while its experts round
            job.host += inputs
        else:
            job.host += inputs + device
        job.notes.append(
            f"GPTQ rounding: {layers} x {seconds / 60:.1f} min, expert inputs {inputs / 1e9:.2f} GB per layer"
        )


def score_sensitivity(job: CostJob) -> None:
    """One macro-batch: a streamed, branch-parallel pass."""
    cfg, geometry, hw, calib = job.cfg, job.geometry, job.hw, job.cfg.calibration
    search = cfg.placement.search
    size = job.sequences or score_macro_batch(cfg, geometry, hw)
    tokens = size * calib.seq_len
    pairs = scored_pairs(cfg)
    read = job.model_bytes + tokens * 4
    if search.calibration == "rebuild":  # each scored layer x format result, once
        read += sum(
            layer_result_bytes(geometry, f) for formats in scored_formats(cfg).values() for f in formats
        )
    flops = geometry.forward_flops(calib.seq_len, size)  # the reference
    for layer, formats in sorted(scored_formats(cfg).items()):
        routed = 2 * geometry.num_experts_per_tok * geometry.routed_params_per_expert * tokens
        suffix = geometry.forward_flops(calib.seq_len, size, first_layer=layer + 1)
        flops += len(formats) * (routed + suffix)
    flops += (1 + pairs) * 20 * tokens * geometry.vocab_size  # log-softmax, exp and the KL sums
    states = (1 + pairs) * state_bytes(geometry, size, calib.seq_len)
    # the states saved every checkpoint_interval_s (one stream at a time through the host)
    compute_s = flops / job.device_flops
    streamed_s = streamed_seconds(read, compute_s, geometry, hw, job.on_gpu)
    job.read, job.streamed_read = read, read
    # null: a quarter of the requested wall time, which is twice the estimate (rule_resources)
    interval = search.checkpoint_interval_s
    interval = streamed_s / 2 if interval is None else interval
    if interval > 0:
        saves = int(streamed_s // interval)
        # a save sits beside the last until progress.json names it, then the last goes: the footprint,
        # not the sum of the saves (their time is counted below)
        job.scratch = 2 * states if saves else 0
        streamed_s += saves * states / hw.storage_write_bytes_per_s
    job.streamed_s = streamed_s
    held = (
        2 * max_layer_bytes(geometry)
        + non_layer_bytes(geometry)
        + geometry.routed_bytes_per_layer  # one format's dequantized copy of a scored layer
        + states
        + score_transient_bytes(cfg, geometry)
    )
    # host: the read-ahead layer, a quantized layer's file and its dequantized copy, one stream's states
    staging = (
        2 * pinned_layer_bytes(geometry)  # read pinned (on a GPU, where staging is what the host holds)
        + geometry.routed_bytes_per_layer
        + layer_result_bytes(geometry, "fp8")
        + state_bytes(geometry, size, calib.seq_len)
    )
    if job.on_gpu:
        job.gpu_bytes = held
        job.host += staging
    else:
        job.host += held + layer_result_bytes(geometry, "fp8")
    job.written = 400 * pairs * (size // search.batch_size + 1) + 2000
    job.notes.append(f"{size} sequences, {pairs} branches")


def solve_placement(job: CostJob) -> None:
    cfg, geometry, hw = job.cfg, job.geometry, job.hw
    search = cfg.placement.search
    job.read = 500 * len(geometry.moe_layers) * len(cfg.placement.formats)
    job.compute_s = (1 + search.frontier_points) * hw.ilp_solve_s + 2 * hw.plot_s
    job.written = 2000 * len(geometry.moe_layers) + 200 * search.frontier_points + 400_000  # JSON, CSV, 2 PNG
    job.host += 512 * MIB


def refine_placement(job: CostJob) -> None:
    """One layer-streamed pass over the held-out sequences carrying the reference and K candidates (each
    with its placed layers' rebuilt experts swapped in), then the K-best solves."""
    cfg, geometry, hw, calib = job.cfg, job.geometry, job.hw, job.cfg.calibration
    refine = cfg.placement.search.refine
    k = refine.candidates if refine is not None else 2
    size = refine.holdout_samples if refine is not None else 1
    tokens = size * calib.seq_len
    # each candidate's quantized layers: at most every scored layer x format result, read once
    read = job.model_bytes + tokens * 4
    read += sum(layer_result_bytes(geometry, f) for formats in scored_formats(cfg).values() for f in formats)
    flops = (1 + k) * geometry.forward_flops(calib.seq_len, size)
    flops += (1 + k) * 20 * tokens * geometry.vocab_size  # log-softmax, exp and the KL sums
    compute_s = flops / job.device_flops + k * hw.ilp_solve_s
    job.read, job.streamed_read = read, read
    job.streamed_s = streamed_seconds(read, compute_s, geometry, hw, job.on_gpu)
    states = (1 + k) * state_bytes(geometry, size, calib.seq_len)
    held = (
        2 * max_layer_bytes(geometry)
        + non_layer_bytes(geometry)
        + geometry.routed_bytes_per_layer  # one format's dequantized copy of a layer
        + states
        + batch_activation_bytes(geometry, cfg.placement.search.batch_size, calib.seq_len)
    )
    if job.on_gpu:
        job.gpu_bytes = held
        job.host += 2 * pinned_layer_bytes(geometry) + layer_result_bytes(geometry, "fp8")
    else:
        job.host += held + layer_result_bytes(geometry, "fp8")
    job.written = 3000 * k + 2000 * len(geometry.moe_layers) + 200_000  # audits, placement, one PNG
    job.notes.append(f"{k} candidates on {size} held-out sequences")


def autoquantize_placement(job: CostJob) -> None:
    """ModelOpt's ``auto_quantize(method="kl_div")`` on the whole model held on one device: per calibration
    batch, one max-calibration forward per searched format (no-quant is not calibrated), then one no-quant
    reference forward and one full forward per (MoE layer, format), each fake-quantizing that layer's routed
    experts anew (ModelOpt's dynamic NVFP4; no suffix reuse, unlike score_sensitivity)."""
    cfg, geometry, hw, calib = job.cfg, job.geometry, job.hw, job.cfg.calibration
    batch_size = cfg.placement.search.batch_size
    formats = [fmt for fmt in cfg.placement.formats if fmt != "bf16"]
    layers = len(geometry.moe_layers)
    tokens = calib.num_samples * calib.seq_len
    forwards = len(formats) + 1 + layers * len(formats)  # per batch: calibration, reference, scores
    flops = forwards * geometry.forward_flops(calib.seq_len, calib.num_samples)
    flops += (1 + layers * len(formats)) * 20 * tokens * geometry.vocab_size  # log-softmax and the KL sums
    job.compute_s = flops / job.device_flops
    batches = -(-calib.num_samples // batch_size)
    fake_quant = layers * len(formats) * batches * geometry.routed_params_per_layer
    if job.on_gpu:
        job.compute_s += fake_quant / hw.gpu_quantize_elements_per_s
    else:
        job.compute_s += fake_quant / (hw.cpu_quantize_elements_per_s_per_core["nvfp4_w4a16:max"] * job.cpus)
    job.read = job.model_bytes + tokens * 4
    held = (
        job.model_bytes
        + 4 * geometry.routed_bytes_per_layer  # one layer's fake-quantized experts and fp32 temporaries
        + batch_activation_bytes(geometry, batch_size, calib.seq_len)
        + batch_size * calib.seq_len * geometry.vocab_size * (2 * 2 + 4 * 3)  # logits; log_p, log_q, KL
    )
    if job.on_gpu:
        job.gpu_bytes = held
        job.host += job.model_bytes  # from_pretrained loads on the host before the move
    else:
        job.host += held
    # placement.json, and the audit: scores, costs, the constraint's excluded module names
    job.written = 2000 * layers + 200 * geometry.num_hidden_layers * 12 + 4000
    job.notes.append(f"whole model on one device, {forwards} forwards per batch of {batch_size}")


def export_checkpoint(job: CostJob) -> None:
    cfg, geometry = job.cfg, job.geometry
    counts = placement_counts(cfg, geometry)
    kv = "FP8" if cfg.export.kv_cache_quant else None
    structure = predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv)
    written = structure["payload_bytes"]
    routed = sum(structure["bytes"]["routed"].values())
    # non-expert tensors from the source, routed ones from the layer results
    job.read = structure["bytes"]["non_expert"] + routed
    if kv:
        job.read += activation_stats_bytes(geometry)  # k/v amax for the KV-cache scales
    entries = checkpoint_tensors(geometry.to_hf_config(), {}, kv_cache_quant=kv)
    job.written = written + 200 * len(entries)  # shard headers + index (~200 B of JSON per tensor)
    job.host += 256 * MIB  # headers and records only: tensor bytes are copied file to file
    job.notes.append("placement " + ", ".join(f"{f}={n}" for f, n in counts.items()))
