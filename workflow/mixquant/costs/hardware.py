"""What the cost model assumes of a job's node: rates measured on the development VM and a B200 node's
figures (docs/cost-model.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mixquant.facts.jobs import (
    CPU_JOB_MEMORY_BYTES,
    GPU_MEMORY_BYTES,
    GPU_MEMORY_HEADROOM,
    PROCESS_BASE_BYTES,
    score_memory_budget,
)

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Hardware:
    """What a job's node offers. Defaults: one HGX B200 node on a shared filesystem.

    Measured on this 2-core development VM (Intel, bf16 AMX), torch 1 thread, with the real code
    (docs/cost-model.md): quantize_layer on a synthetic checkpoint layer of two
    Laguna-shaped experts (gate/up [1024, 3072], down [3072, 1024], N(0, 0.02) bf16), elements/s including
    the read, the per-expert audit and the dequantization; the forward rate of transformers'
    LagunaForCausalLM.model (eager experts, sdpa) on a 2-layer Laguna-S-2.1-geometry model, B=8 x T=512,
    counted as 2 x active decoder params x tokens; hashlib SHA-256 over 256 MiB. Two threads ran slower
    than one on this VM (shared cores), so the per-core rates are the 1-thread ones, scaled linearly.
    """

    gpu_name: str = "HGX B200"  # what a plan says its estimates assume (mixquant plan)
    gpu_memory_bytes: int = GPU_MEMORY_BYTES  # B200 (HGX): 179 GiB HBM3e
    gpu_bf16_flops: float = 2.25e15  # B200 (HGX, 1000 W) dense BF16 tensor-core peak per GPU
    gpu_mfu: float = 0.2  # assumption: eager (no CUDA graphs) prefill of one prompt
    gpu_fp32_flops: float = 7.5e13  # assumption: B200 FP32 (non-tensor-core) rate; the off-engine lm_head
    gpu_memory_bytes_per_s: float = 8e12  # B200 HBM3e bandwidth: the KL statistics are memory-bound there
    vllm_gpu_memory_utilization: float = 0.9  # vLLM's default; vllm_llm_kwargs does not set it
    vllm_worker_host_bytes: int = 8 * GIB  # assumption: host RSS of one vLLM worker (torch, CUDA, NCCL)
    storage_read_bytes_per_s: float = 2e9  # assumption: shared filesystem, per job
    # measured (benchmarks/bench_layer_load.py, docs/cost-model.md): the host side of
    # StreamedModel.load_layer at the real Laguna layer size -- the copy out of the page cache, the fused
    # layout, transformers' attach -- from the page cache (warm): 1.51 s per 4.98 GB MoE layer (3.3 GB/s;
    # 1.42 s in a second run). It follows the storage read in the same prefetch thread, so a streamed layer
    # loads in bytes / storage + bytes / it (cold there: 5.13 s measured, 4.11 + 1.51 = 5.62 s modelled).
    host_layer_load_bytes_per_s: float = 3.3e9
    storage_write_bytes_per_s: float = 2e9  # assumption
    hub_download_bytes_per_s: float = 5e8  # assumption: Hugging Face hub (Xet/CDN), per job
    process_startup_s: float = 10.0  # python + torch + transformers import: measured 6.4 s here (warm)
    vllm_startup_s: float = 180.0  # assumption: engine spawn, CUDA/NCCL init, profiling run (not loading)
    process_base_bytes: int = PROCESS_BASE_BYTES  # assumption: python + torch + transformers, no data
    cpu_forward_flops_per_core: float = 2.4e11  # measured: 2.41e11 FLOP/s (Laguna layer forward, bf16)
    cpu_quantize_elements_per_s_per_core: dict[str, float] = field(
        default_factory=lambda: {
            "nvfp4_w4a16:fp8_sweep": 3.79e6,  # measured
            "nvfp4_w4a16:mse": 5.16e5,  # measured
            "nvfp4_w4a16:max": 1.32e7,  # measured
            "fp8:mse": 2.06e6,  # measured
            "fp8:max": 4.32e7,  # measured
            "bf16": 5.81e7,  # measured (read + audit only)
        }
    )
    # measured: checkpoint.fp8_source.dequantize_block_fp8 of a 2048 x 7168 block-FP8 weight, torch 1 thread
    cpu_dequant_fp8_elements_per_s_per_core: float = 1.68e8
    sha256_bytes_per_s: float = 1.19e9  # measured: hashlib, one core
    hub_dataset_split_bytes: int = 2 * 10**9  # assumption: one hub dataset split (or local JSONL) as loaded
    python_object_factor: float = 3.0  # assumption: a dataset column as Python lists / dicts vs its bytes
    # assumption: datasets' JSON/Parquet -> Arrow conversion of a hub split works in record batches
    arrow_conversion_bytes: int = 2 * GIB
    tokenize_tokens_per_s: float = 2e5  # assumption: apply_chat_template + fast tokenizer, one core
    # measured (benchmarks/bench_suite_costs.py: the real code at the real 100,352 vocabulary, the portable
    # profile, one thread, CPU time): the KLD statistics per logit, and the vLLM engine's off-engine fp32
    # lm_head (F.linear under MKL_CBWR=COMPATIBLE, about a sixth of the bf16 forward's rate above)
    cpu_kl_logits_per_s_per_core: float = 7.8e7  # kld_statistics against a full reference
    cpu_topk_reduce_logits_per_s_per_core: float = 2.45e7  # reduce_reference: recording the top-k form
    cpu_topk_kl_logits_per_s_per_core: float = 3.07e7  # kld_statistics_topk against the top-k form
    cpu_fp32_gemm_flops_per_core: float = 3.7e10
    # assumption: dataset rows decoded to Python objects and their text whitespace-normalised, one core
    # (sample_eval's disjointness check visits every row of the calibration dataset and of each domain)
    python_text_bytes_per_s: float = 5e7
    # measured: the toy's training step on the 2-core dev VM (320 steps in 198 s, 2 threads, idle machine):
    # a tiny model's step is dispatch-bound, so the FLOP estimate alone is ~8x short of it
    toy_step_s: float = 0.62
    ilp_solve_s: float = 1.0  # assumption: one pulp CBC solve of ~50 groups (process spawn dominates)
    plot_s: float = 2.0  # assumption: one matplotlib figure
    # Layer-streamed forward stages on a GPU (docs/cost-model.md, GPU constants). Not measured
    # here (no GPU); tools/gpu-check.sh measures each on a lent GPU.
    # assumption: transformers' eager LagunaExperts runs one GEMM pair per routed expert, so a layer call
    # is many mid-sized GEMMs; 25% of peak is the middle of the 20-30% eager prefill reaches
    gpu_streamed_mfu: float = 0.25
    # assumption: pinned host->device copies over PCIe Gen5 x16 (~64 GB/s raw, ~50 GB/s in
    # practice); half of it, since a layer's tensors arrive as many separate copies
    host_to_device_bytes_per_s: float = 25e9
    # assumption: the NVFP4 / FP8 scale sweeps are unfused torch elementwise passes, memory-bound: ~126
    # E4M3 candidates x ~16 B of traffic per element at ~4 TB/s of HBM is ~2e9 elements/s; half of it
    gpu_quantize_elements_per_s: float = 1e9
    # GPTQ rounding (quantize.nvfp4_w4a16.rounding: gptq). Measured (benchmarks/bench_gptq.py, the real
    # code at the Laguna-S-2.1 expert shape, 4 experts of [2048, 3072] batched, 10,240 tokens each, one
    # thread): the float64 GEMM rate, and the seconds per element of the rank-1 updates inside the lazy
    # blocks (the time beyond the GEMM FLOPs, per update)
    cpu_fp64_flops_per_core: float = 5.2e10
    cpu_gptq_update_s: float = 5.4e-9
    # assumption: B200 FP64 tensor-core peak is 40 TFLOP/s; half of it for mid-sized GEMMs and Cholesky
    gpu_fp64_flops: float = 2e13
    # assumption: ~8 kernel launches per column step of the error feedback, ~10 us each (launch-bound)
    gpu_gptq_column_s: float = 8e-5
    # assumption: the in-block rank-1 updates are memory-bound elementwise work, ~16 B each at ~3 TB/s
    gpu_gptq_updates_per_s: float = 2e11
    # the share of GPU memory a streamed stage plans to use (allocator fragmentation, CUDA context)
    gpu_memory_headroom: float = GPU_MEMORY_HEADROOM
    # assumption: host memory a CPU forward job may plan its macro-batch for (a node share, not a whole node)
    cpu_job_memory_bytes: int = CPU_JOB_MEMORY_BYTES

    def assumed_gpu(self) -> str:
        """The GPU a plan's estimates assume, in words (``one HGX B200 GPU (179 GiB) per GPU job``)."""
        return f"one {self.gpu_name} GPU ({self.gpu_memory_bytes / GIB:.0f} GiB) per GPU job"

    def score_memory_budget(self, device: str) -> float:
        """Bytes a score pass may fill on ``device`` here (mixquant.facts.jobs.score_memory_budget)."""
        return score_memory_budget(
            device,
            self.gpu_memory_bytes,
            self.gpu_memory_headroom,
            self.cpu_job_memory_bytes,
            self.process_base_bytes,
        )


B200 = Hardware()
