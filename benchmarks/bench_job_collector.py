"""Benchmark: a job process's garbage collector (mixquant.heap) against Python's defaults, side by side.

Usage: .venv/bin/python benchmarks/bench_job_collector.py [--rounds 3] [--passes 5]

Each round starts two fresh child processes of the same work, in alternating order: what a KLD job of
the hf engine does besides computing. They import torch, transformers' modeling and ModelOpt's
quantization package (the imports of a ``run_kld`` job), then, ``--passes`` times, build a small module
graph with reference cycles, release it and collect (``HfEngine.close``). ``default``: Python's
thresholds and ``gc.collect()``; ``job``: :func:`mixquant.heap.tune_for_job` before the imports,
:func:`~mixquant.heap.freeze_imports` after them and :func:`~mixquant.heap.collect`. Each child reports
its CPU seconds and the seconds spent in the collector (``gc.callbacks``); the parent prints the medians
over rounds and the job's share of the default's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "workflow"

CHILD = """
import gc, json, sys, time, warnings
warnings.simplefilter("ignore")
spent = [0.0, 0.0]
def timer(phase, info):
    if phase == "start":
        spent[1] = time.process_time()
    else:
        spent[0] += time.process_time() - spent[1]
gc.callbacks.append(timer)
job = sys.argv[1] == "job"
from mixquant.heap import collect, freeze_imports, tune_for_job
if job:
    tune_for_job()
import torch, transformers.modeling_utils, modelopt.torch.quantization
if job:
    freeze_imports()
for _ in range(int(sys.argv[2])):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(200)])
    for layer in model:
        layer.owner = model  # a cycle, as a streamed model's hooks make
    del model, layer
    collect() if job else gc.collect()
print(json.dumps({"cpu_s": time.process_time(), "gc_s": spent[0]}))
"""


def child(variant: str, passes: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant, str(passes)], cwd=LIBRARY, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"{variant} child failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"default": [], "job": []}
    for round_ in range(args.rounds):
        order = ("default", "job") if round_ % 2 == 0 else ("job", "default")
        for variant in order:
            results[variant].append(child(variant, args.passes))
    medians = {
        variant: {key: statistics.median(row[key] for row in rows) for key in ("cpu_s", "gc_s")}
        for variant, rows in results.items()
    }
    print(f"{'variant':8} {'CPU s':>7} {'collector s':>12}   ({args.rounds} rounds, {args.passes} passes)")
    for variant, row in medians.items():
        print(f"{variant:8} {row['cpu_s']:7.2f} {row['gc_s']:12.2f}")
    default, job = medians["default"], medians["job"]
    print(
        f"job / default: CPU {job['cpu_s'] / default['cpu_s']:.2f}x, "
        f"collector {job['gc_s'] / max(default['gc_s'], 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
