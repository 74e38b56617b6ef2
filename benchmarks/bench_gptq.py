"""Benchmark: GPTQ rounding's cost on the CPU at the real Laguna-S-2.1 expert shape, and what batching the
experts buys -- the constants of the cost model (mixquant.costs.hardware: cpu_fp64_flops_per_core,
cpu_gptq_column_s).

Usage: .venv/bin/python benchmarks/bench_gptq.py [--experts 4] [--tokens 10240] [--threads 1]
       [--hidden 3072] [--inter 1024]

Per expert: gate/up ``[2I, H]`` and down ``[H, I]`` bf16 weights N(0, 0.02), Hessians ``X^T X`` of
``--tokens`` random inputs (a Laguna expert's share of 512 x 512 calibration tokens at top-10 of 256 is
~10K), the fixed NVFP4 scales of the rebuild's ``fp8_sweep``. Timed, side by side in one run:

* the float64 GEMM rate (``X^T X``), giving ``cpu_fp64_flops_per_core``;
* :func:`mixquant.formats.nvfp4_gptq.gptq_nvfp4` on the ``--experts`` experts as one batch and one expert at
  a time: the ratio is what batching buys on a CPU (the column steps' dispatch is not what costs there); the
  batch's time less its GEMM FLOPs at the measured rate, per in-block rank-1 update element, is
  ``cpu_gptq_update_s``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=10240)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from mixquant.formats.cpu_fake_quant import static_nvfp4_scales
    from mixquant.formats.nvfp4 import BLOCK_SIZE, shared_global_amax, sweep_nvfp4_block_amax
    from mixquant.formats.nvfp4_gptq import gptq_nvfp4, nvfp4_scales

    h, i, n = args.hidden, args.inter, args.experts
    generator = torch.Generator().manual_seed(0)
    weights, scales, hessians = [], [], []
    x = torch.randn(args.tokens, h, generator=generator, dtype=torch.float64)
    _, gemm_s = timed(lambda: x.T @ x)
    fp64_rate = 2 * args.tokens * h * h / gemm_s
    for _ in range(n):
        w = (torch.randn(2 * i, h, generator=generator) * 0.02).to(torch.bfloat16)
        g = shared_global_amax(w)
        amax = sweep_nvfp4_block_amax(w, g)
        s, s2 = static_nvfp4_scales(w, amax, g, BLOCK_SIZE)
        weights.append(w)
        scales.append(nvfp4_scales(s, s2))
        xe = torch.randn(args.tokens, h, generator=generator, dtype=torch.float64)
        hessians.append(xe.T @ xe)
    w, s, hs = torch.stack(weights), torch.stack(scales), torch.stack(hessians)
    _, batched_s = timed(lambda: gptq_nvfp4(w, hs, s))
    _, alone_s = timed(lambda: [gptq_nvfp4(weights[e], hessians[e], scales[e]) for e in range(n)])
    # the cost model's terms for the batch (gate/up only here): factorisations ~2 H^3 and the block GEMMs
    # 2 x 2I x H^2 at the GEMM rate, then the in-block rank-1 updates (2I x H x block / 2 elements)
    flops = n * (2 * h**3 + 2 * 2 * i * h * h)
    updates = n * 2 * i * h * 128 / 2
    update_s = max(0.0, batched_s - flops / fp64_rate) / updates
    print(
        f"shape: {n} experts of gate/up [{2 * i}, {h}], {args.tokens} tokens each; {args.threads} thread(s)"
    )
    print(f"fp64 GEMM: {fp64_rate:.3g} FLOP/s per {args.threads} thread(s) (cpu_fp64_flops_per_core)")
    print(f"GPTQ batched: {batched_s:.1f} s; one expert at a time: {alone_s:.1f} s")
    print(f"ratio one at a time / batched: {alone_s / batched_s:.2f}")
    print(f"per in-block update beyond the GEMM FLOPs: {update_s:.3g} s (cpu_gptq_update_s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
