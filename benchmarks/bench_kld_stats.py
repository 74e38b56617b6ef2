"""Benchmark: mixquant.kld.stats.kld_statistics vs merely reading the two logit tensors from disk.

Usage: .venv/bin/python benchmarks/bench_kld_stats.py [--positions 2047] [--vocab 100352]
       [--chunk-rows 64] [--threads 2] [--repeats 3] [--seed 0]

Writes a synthetic float32 pair (ref = randn * 3, cand = ref + 0.05 * randn, seeded; 822 MB per tensor at
the real 2,047 x 100,352) as two safetensors files in a temporary directory (removed at the end), then:

(a) reads both tensors: ``safetensors.torch.load_file(..., backend="pread")`` -- the default ``mmap``
    backend returns lazily mapped tensors and reads nothing until first touched, so it would time nothing;
    one warm read first (page cache), then the best of ``--repeats``;
(b) reads both tensors and runs ``kld_statistics`` on them, best of ``--repeats``; the statistics' own
    wall time is printed as a ratio of (a) (goal <= 2);
(c) in a fresh child process (so that no earlier run's freed heap can hide an allocation): reads both
    tensors, then runs ``kld_statistics`` once while a background thread samples the resident set size
    (``/proc/self/statm``, every 0.5 ms); prints the peak RSS minus the RSS just before the call
    (goal <= 512 MB).

The machine needs ~3 GB of free memory and ~1.7 GB of free disk in the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from mixquant.kld.stats import kld_statistics
from safetensors.torch import load_file, save_file

KEY = "logits"
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``, second field, in pages)."""
    with open("/proc/self/statm", "rb") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakRss:
    """Samples the RSS in a background thread while active; ``peak`` is the largest sample."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def read_pair(workdir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = load_file(workdir / "ref.safetensors", backend="pread")[KEY]
    cand = load_file(workdir / "cand.safetensors", backend="pread")[KEY]
    tokens = load_file(workdir / "tokens.safetensors", backend="pread")[KEY]
    return ref, cand, tokens


def write_pair(workdir: Path, n: int, v: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, v, generator=gen).mul_(3.0)
    save_file({KEY: ref}, workdir / "ref.safetensors")
    top1 = ref.argmax(dim=1)
    cand = torch.randn(n, v, generator=gen).mul_(0.05).add_(ref)
    del ref
    save_file({KEY: cand}, workdir / "cand.safetensors")
    del cand
    # next tokens: the reference's top-1 at 3 positions in 4, a random token otherwise
    tokens = torch.where(torch.rand(n, generator=gen) < 0.75, top1, torch.randint(0, v, (n,), generator=gen))
    save_file({KEY: tokens}, workdir / "tokens.safetensors")


def memory_probe(workdir: Path, chunk_rows: int, threads: int) -> None:
    """Child process: print ``peak_rss_delta_bytes <n>`` for one ``kld_statistics`` call."""
    torch.set_num_threads(threads)
    ref, cand, tokens = read_pair(workdir)
    kld_statistics(ref[:2], cand[:2], tokens[:2], chunk_rows=chunk_rows)  # import-time / lazy init
    before = rss_bytes()
    with PeakRss() as sampler:
        kld_statistics(ref, cand, tokens, chunk_rows=chunk_rows)
    print(f"peak_rss_delta_bytes {sampler.peak - before}")


def best_of(repeats: int, fn) -> tuple[float, list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), times, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=2047)
    parser.add_argument("--vocab", type=int, default=100352)
    parser.add_argument("--chunk-rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-probe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe is not None:
        memory_probe(args.memory_probe, args.chunk_rows, args.threads)
        return 0

    torch.set_num_threads(args.threads)
    n, v = args.positions, args.vocab
    mb = n * v * 4 / 1e6
    print(f"logits      {n} x {v} float32 ({mb:.0f} MB per tensor), {args.threads} threads, ", end="")
    print(f"chunk_rows {args.chunk_rows}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_kld_") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        write_pair(workdir, n, v, args.seed)
        print(f"wrote       2 x {mb:.0f} MB safetensors in {time.perf_counter() - t0:.1f} s ({workdir})")

        read_pair(workdir)  # warm read: page cache
        t_read, read_times, _ = best_of(args.repeats, lambda: read_pair(workdir))

        stats_times: list[float] = []

        def read_and_stats():
            ref, cand, tokens = read_pair(workdir)
            t1 = time.perf_counter()
            out = kld_statistics(ref, cand, tokens, chunk_rows=args.chunk_rows)
            stats_times.append(time.perf_counter() - t1)
            return out

        t_both, both_times, out = best_of(args.repeats, read_and_stats)
        t_stats = min(stats_times)

        child = subprocess.run(
            [sys.executable, __file__, "--memory-probe", str(workdir)]
            + ["--chunk-rows", str(args.chunk_rows), "--threads", str(args.threads)],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.exit(f"memory probe failed:\n{child.stderr[-2000:]}")
        delta = int(child.stdout.split("peak_rss_delta_bytes")[1].split()[0])

    fmt = ", ".join
    print(f"(a) read both tensors          best {t_read:6.3f} s  ({fmt(f'{t:.3f}' for t in read_times)})")
    print(f"(b) read + kld_statistics      best {t_both:6.3f} s  ({fmt(f'{t:.3f}' for t in both_times)})")
    print(f"    kld_statistics alone       best {t_stats:6.3f} s  ({fmt(f'{t:.3f}' for t in stats_times)})")
    print(f"kld_statistics / reading: {t_stats / t_read:.2f} (goal <= 2)")
    print(f"kld_statistics extra memory (peak RSS delta): {delta / 2**20:.0f} MiB (goal <= 512 MB)")
    s = out["summary"]
    print(f"summary     mean KLD {s['mean_kld']:.6f} ± {s['mean_kld_se']:.6f}, ", end="")
    print(f"same top {s['same_top_pct']:.2f} %, RMS Δp {100 * s['rms_dp']:.3f} %, ", end="")
    print(f"PPL ratio {s['ppl_ratio']:.6f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
