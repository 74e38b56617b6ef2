"""Benchmark: layer-streamed, branch-parallel scoring vs the whole-model suffix scorer, on CPU, side by side.

Usage: .venv/bin/python benchmarks/bench_streamed_scoring.py [--rounds 2] [--layers 8] [--experts 64]
       [--sequences 16] [--seq-len 64] [--dir DIR]

Builds, in a temporary directory under ``--dir``: a random Laguna-shaped BF16 checkpoint (dense layer 0,
``--layers - 1`` MoE layers of ``--experts`` experts, hidden 256, one shard per layer) and every MoE
layer's NVFP4 W4A16 result (quantize_layer, max calibration). Then each round runs, in two fresh
processes (order alternating), the KL sensitivity of every MoE layer in NVFP4 on the same calibration
ids and micro-batches:

* whole: the model loaded whole (``load_search_model``) and every layer's quantized copy held, scored
  by :func:`mixquant.search.score.sensitivity_scores` (suffix reuse, one forward per scored layer);
* streamed: :class:`mixquant.model.streaming.StreamedModel` + :func:`branch_parallel_scores` (one pass,
  each layer read once, a quantized layer read when it is scored).

Each child reports its wall time (model load included, process start not) and its peak resident memory
above what it held before loading anything (VmHWM after a clear_refs reset); the parent prints both,
their ratios and whether the scores are the same floats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from pathlib import Path
from mixquant.numerics import enter
enter("portable", 1)
import torch
import modelopt.torch.quantization.qtensor  # noqa: F401 - the dequantization's; imported before the base
import transformers.models.laguna.modeling_laguna  # noqa: F401 - likewise
from safetensors.torch import load_file
from mixquant.model.streaming import StreamedModel
from mixquant.search.branches import branch_parallel_scores
from mixquant.search.score import layer_quant_from_tensors, load_search_model, sensitivity_scores

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

mode, model_dir, quant_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sequences, seq_len = int(sys.argv[4]), int(sys.argv[5])
config = json.loads((Path(model_dir) / "config.json").read_text())
moe = [i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "sparse"]
ids = torch.randint(0, config["vocab_size"], (sequences, seq_len), generator=torch.Generator().manual_seed(0))

def quant(layer):
    tensors = load_file(str(quant_dir / f"layer_{layer}.safetensors"))
    return layer_quant_from_tensors(tensors, layer, "nvfp4_w4a16")

base = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
start = time.perf_counter()
if mode == "whole":
    model = load_search_model(model_dir)
    quants = {layer: quant(layer) for layer in moe}
    scores = sensitivity_scores(model, ids, quants, "nvfp4_w4a16", batch_size=4)
    sums = {str(layer): value["kl_sum"] for layer, value in scores.items()}
else:
    with StreamedModel(model_dir) as stream:
        per_batch = branch_parallel_scores(
            stream, ids, {layer: ["nvfp4_w4a16"] for layer in moe}, lambda layer, fmt, loaded: quant(layer),
            batch_size=4,
        )
    sums = {}
    for layer, values in per_batch["nvfp4_w4a16"].items():
        total = 0.0
        for value in values:
            total += value
        sums[str(layer)] = total
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_above_base": status("VmHWM") - base, "sums": sums}))
"""


def _build(root: Path, layers: int, experts: int) -> tuple[Path, Path, int]:
    sys.path.insert(0, str(REPO / "tests" / "model"))
    from mixquant.numerics import enter

    enter("portable", 1)
    from mixquant.quantize.layer import quantize_layer
    from safetensors.torch import save_file
    from streaming_helpers import laguna_config, write_random_checkpoint

    config = laguna_config(
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=experts,
        vocab_size=512,
    )
    model_dir = write_random_checkpoint(config, root / "model")
    quant_dir = root / "quantized"
    quant_dir.mkdir()
    for layer in range(1, layers):
        tensors, _ = quantize_layer(model_dir, layer, "nvfp4_w4a16", {"calibration": "max"})
        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, str(quant_dir / f"layer_{layer}.safetensors")
        )
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return model_dir, quant_dir, size


def _run(mode: str, model_dir: Path, quant_dir: Path, sequences: int, seq_len: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(model_dir), str(quant_dir), str(sequences), str(seq_len)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mixquant-bench-", dir=args.dir) as tmp:
        started = time.perf_counter()
        model_dir, quant_dir, size = _build(Path(tmp), args.layers, args.experts)
        built = time.perf_counter() - started
        print(f"checkpoint {size / 1e6:.0f} MB in {args.layers} layers, built in {built:.0f} s")
        times, peaks = [], []
        for round_ in range(args.rounds):
            order = ("whole", "streamed") if round_ % 2 == 0 else ("streamed", "whole")
            got = {mode: _run(mode, model_dir, quant_dir, args.sequences, args.seq_len) for mode in order}
            same = got["whole"]["sums"] == got["streamed"]["sums"]
            times.append(got["streamed"]["seconds"] / got["whole"]["seconds"])
            peaks.append(got["streamed"]["peak_above_base"] / got["whole"]["peak_above_base"])
            whole, streamed = (
                f"{got[mode]['seconds']:.2f} s, {got[mode]['peak_above_base'] / 1e6:.0f} MB"
                for mode in ("whole", "streamed")
            )
            print(f"round {round_}: whole {whole} | streamed {streamed} | same scores: {same}")
        time_ratio, memory_ratio = statistics.median(times), statistics.median(peaks)
        print(
            f"streamed / whole: time {time_ratio:.2f}, peak memory {memory_ratio:.2f} "
            f"(median of {args.rounds} rounds)"
        )


if __name__ == "__main__":
    main()
