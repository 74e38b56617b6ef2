"""Cost functions of the KLD stages: reference logits, the candidate's runs, the gates, the report and the
verdict."""

from __future__ import annotations

from mixquant.costs.hardware import GIB, MIB
from mixquant.costs.job import CostJob
from mixquant.costs.sizes import candidate_bytes, pinned_layer_bytes, streamed_seconds
from mixquant.facts.jobs import batch_activation_bytes, max_layer_bytes, non_layer_bytes


def _engine_stage(job: CostJob, runs: int, reference: bool) -> None:
    """reference_logits (``reference``) or run_kld: one job does every run, each with a fresh engine (vllm:
    a fresh process per run), so the per-run load, forward and statistics repeat; the peak is one run's."""
    cfg, geometry, hw, stage = job.cfg, job.geometry, job.hw, job.stage
    engine = cfg.kld.engine
    prompt_len, logits_bytes = job.prompt_len, job.logits_bytes
    if reference:
        checkpoint, what = job.model_bytes, "the BF16 model"
    else:
        checkpoint, what = candidate_bytes(cfg, geometry, job.candidate)
        job.notes.append(what)
    read = checkpoint + prompt_len * 4 + (logits_bytes if not reference else 0)
    written = logits_bytes if reference else (prompt_len - 1) * 41 + 10_000
    hashed = logits_bytes * (2 if not reference else 1)  # logits_sha256 (candidate; reference)
    flops = geometry.forward_flops(prompt_len)
    # lm_head applied off-engine in fp32 (vllm), and the KL statistics over [T-1, V] (run_kld)
    off_engine = 2 * (prompt_len - 1) * geometry.lm_head_params if engine == "vllm" else 0
    off_engine += 20 * (prompt_len - 1) * geometry.vocab_size if not reference else 0
    compute_s = off_engine / hw.cpu_forward_flops_per_core
    # output logits: fp32 result, its bf16 rounding and fp32 copy, numpy copy for the SHA-256
    job.host += 3 * logits_bytes
    if not reference:
        job.host += logits_bytes  # the reference logits
    streamed_s, streamed_read = 0.0, 0
    if engine == "vllm":
        job.startup += hw.vllm_startup_s
        tp = cfg.kld.tensor_parallel_size
        if job.gpus < tp:
            raise ValueError(
                f"{stage}: vllm with tensor_parallel_size {tp} needs {tp} GPUs, job has {job.gpus}"
            )
        compute_s += flops / (tp * hw.gpu_bf16_flops * hw.gpu_mfu)
        job.gpu_bytes = int(hw.vllm_gpu_memory_utilization * hw.gpu_memory_bytes)
        job.host += tp * hw.vllm_worker_host_bytes + geometry.lm_head_params * 6  # bf16 + fp32 lm_head
        if checkpoint / tp > job.gpu_bytes:
            job.notes.append(f"weights {checkpoint / tp / GIB:.0f} GiB per GPU exceed vLLM's reservation")
    else:  # hf: layer-streamed on numerics.device, a quantized layer dequantized as it is read
        act = batch_activation_bytes(geometry, 1, prompt_len) + (prompt_len * geometry.vocab_size * 2)
        held = 2 * max_layer_bytes(geometry) + non_layer_bytes(geometry) + act
        streamed_s = streamed_seconds(checkpoint, flops / job.device_flops, geometry, hw, job.on_gpu)
        streamed_read = checkpoint
        if job.on_gpu:
            job.gpu_bytes = held
            job.host += 2 * pinned_layer_bytes(geometry)
        else:
            job.host += held
        job.host += prompt_len * geometry.vocab_size * 2  # logits [1, T, V] bf16
    if runs > 1:
        per_process = job.startup if engine == "vllm" else 0.0  # a vllm run's own process and engine
        job.startup += (runs - 1) * per_process
        # the prompt (and, for hf, the reference logits) is read once per job
        once = prompt_len * 4 + (logits_bytes if engine == "hf" else 0)
        read = once + runs * (read - once)
        written, hashed, compute_s = runs * written, runs * hashed, runs * compute_s
        streamed_s, streamed_read = runs * streamed_s, runs * streamed_read
    job.read, job.written, job.hashed, job.compute_s = read, written, hashed, compute_s
    job.streamed_s, job.streamed_read = streamed_s, streamed_read


def reference_logits(job: CostJob) -> None:
    _engine_stage(job, 1, reference=True)


def run_kld(job: CostJob) -> None:
    _engine_stage(job, job.cfg.kld.runs, reference=False)


def gate_kld(job: CostJob) -> None:
    cfg, hw = job.cfg, job.hw
    positions = job.prompt_len - 1
    runs = cfg.kld.runs * (2 if cfg.kld.baseline else 1)
    job.read = runs * (positions * 41 + 10_000)
    samples = cfg.kld.gates.bootstrap_samples
    job.compute_s = samples * positions * 10 / hw.cpu_forward_flops_per_core
    job.host += 3 * samples * positions * 8  # resampled indices and the paired means
    job.written = positions * 8 + 20_000


def kld_report(job: CostJob) -> None:
    cfg, hw = job.cfg, job.hw
    pairs = len(cfg.kld.candidates) * len(cfg.kld.kv_cache_dtypes)
    job.read = pairs * ((job.prompt_len - 1) * 8 + 20_000)
    job.compute_s = 2 * len(cfg.kld.kv_cache_dtypes) * hw.plot_s
    job.written = pairs * 2000 + 2 * len(cfg.kld.kv_cache_dtypes) * 150_000
    job.host += 512 * MIB


def check_kld_gates(job: CostJob) -> None:
    job.read, job.written = 50_000, 20_000
