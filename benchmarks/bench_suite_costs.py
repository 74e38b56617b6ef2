"""Benchmark: the per-logit CPU work of the KLD stages at real vocabulary size, for the cost model.

Usage: .venv/bin/python benchmarks/bench_suite_costs.py [--positions 256] [--vocab 100352] [--hidden 3072]
       [--top-k 1024] [--repeats 3] [--seed 0]

Under the portable numerics profile with one thread (what the KLD jobs compute under), on synthetic float32
logits (ref = randn * 3, cand = ref + 0.1 * randn, seeded), the least CPU time of ``--repeats`` (one
thread: the process's CPU time is the work's, whatever else shares the machine):

* ``kld_statistics`` (full-vocabulary reference), logits/s;
* ``reduce_reference`` (recording the top-k form), logits/s;
* ``kld_statistics_topk`` (scoring against the top-k form), logits/s;
* the vLLM engine's off-engine lm_head (``F.linear`` of fp32 hidden states [positions, hidden] with the fp32
  lm_head [vocab, hidden], rounded to bf16), FLOP/s (2 x positions x hidden x vocab).

These are the ``cpu_*_per_core`` rates of :class:`mixquant.costs.Hardware` (docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from mixquant.numerics import apply_environment

apply_environment("portable", 1)  # before torch: the KLD jobs' profile, one thread

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mixquant.kld.stats import kld_statistics  # noqa: E402
from mixquant.kld.topk import kld_statistics_topk, reduce_reference  # noqa: E402


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """The least CPU time of ``repeats`` calls: one thread, so a shared machine's waits do not count."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=100352)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--top-k", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(args.seed)
    n, v = args.positions, args.vocab
    ref = torch.randn(n, v, generator=generator) * 3
    cand = ref + 0.1 * torch.randn(n, v, generator=generator)
    tokens = torch.randint(0, v, (n,), generator=generator)
    reduced = reduce_reference(ref, tokens, args.top_k)
    hidden = torch.randn(n, args.hidden, generator=generator)
    lm_head = (torch.randn(v, args.hidden, generator=generator) * 0.02).to(torch.bfloat16).float()
    logits = n * v
    rates = {
        "kld_statistics (logits/s)": logits
        / best_seconds(lambda: kld_statistics(ref, cand, tokens), args.repeats),
        "reduce_reference (logits/s)": logits
        / best_seconds(lambda: reduce_reference(ref, tokens, args.top_k), args.repeats),
        "kld_statistics_topk (logits/s)": logits
        / best_seconds(lambda: kld_statistics_topk(reduced, cand, tokens), args.repeats),
        "fp32 lm_head (FLOP/s)": 2
        * n
        * args.hidden
        * v
        / best_seconds(lambda: F.linear(hidden, lm_head).to(torch.bfloat16).float(), args.repeats),
    }
    print(
        f"{n} positions x {v} vocabulary, top_k {args.top_k}, hidden {args.hidden}, torch 1 thread (portable)"
    )
    for name, rate in rates.items():
        print(f"  {name:32} {rate:.3g}")


if __name__ == "__main__":
    main()
