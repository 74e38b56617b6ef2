"""Benchmark: ModelOpt's ``auto_quantize(method="kl_div")`` scores vs mixquant's scorer, same inputs.

Usage: .venv/bin/python benchmarks/bench_search_scores.py [--model-dir DIR] [--calibration-dir DIR]
       [--batch-size 8] [--samples N] [--threads 2]

Model and calibration tokens default to the workflow's own artifacts (the trained toy Laguna and its
calibration sample), located with ``mixquant paths --json`` run in the current directory (the workflow's
working directory, e.g. the repo after ``make run``); both must be built. Both sides get the SAME
bf16 model (eager experts, sdpa attention), calibration rows, formats (``nvfp4_w4a16`` W4A16 and ``fp8``
W8A8, max calibration: ModelOpt's presets) and layers (every MoE layer), and the same batches:

* ModelOpt: :func:`mixquant.search.reference.modelopt_kl_div_scores` -- a deep copy of the loaded model,
  ``mtq.auto_quantize`` (calibration per preset + one KL forward per batch, group and format);
* mixquant, as a ``score_sensitivity`` job with ``placement.search.calibration: max`` computes it:
  ``collect_activation_stats`` (loads the model itself; FP8 input amax) + ``modelopt_search_quant`` for
  every (layer, format) (ModelOpt's own fake quant of the weights, once) + ``sensitivity_scores`` per
  format on the loaded model (one reference forward per batch, then only layers L..N-1 per layer).

Loading the model for both sides and one untimed warm-up forward happen before either clock starts.
Prints the per-score relative differences (goal: max <= 1e-3) and mixquant's wall time as a ratio of
ModelOpt's (goal <= 0.5).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]
FORMATS = ["nvfp4_w4a16", "fp8"]
CALIBRATION_FILE = "calibration.safetensors"


def workflow_dirs() -> tuple[Path, Path]:
    """(model dir, calibration dir) of the workflow's artifacts, from ``mixquant paths --json``."""
    from mixquant.model.fetch import resolve_model_dir

    exe = Path(sys.executable).with_name("mixquant")
    cmd = [str(exe), "paths", "--json"] if exe.exists() else [sys.executable, "-m", "mixquant.cli", "paths"]
    proc = subprocess.run(cmd, cwd=Path.cwd(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"`mixquant paths --json` failed:\n{proc.stderr.strip()[-2000:]}")
    table = json.loads(proc.stdout)
    dirs = []
    for name in ("model", "calibration"):
        row = table[name]
        if not row["done"]:
            sys.exit(f"the {name} artifact is not built ({row['path']}); build it or pass --{name}-dir")
        dirs.append(Path.cwd() / row["path"])
    return resolve_model_dir(dirs[0]), dirs[1]


def load_model(model_dir: Path):
    from transformers import LagunaForCausalLM

    model = LagunaForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, experts_implementation="eager", attn_implementation="sdpa"
    )
    if model.config._experts_implementation != "eager":
        raise RuntimeError(f"experts implementation is {model.config._experts_implementation!r}")
    return model.eval()


def run_modelopt(model, ids: torch.Tensor, layers: list[int], batch_size: int) -> tuple[dict, float]:
    from mixquant.search.reference import modelopt_kl_div_scores

    start = time.perf_counter()
    result = modelopt_kl_div_scores(model, ids, layers=layers, formats=FORMATS, batch_size=batch_size)
    return result["scores"], time.perf_counter() - start


def run_mixquant(
    model, model_dir: Path, ids: torch.Tensor, layers: list[int], batch_size: int, threads: int
) -> tuple[dict, dict[str, float]]:
    from mixquant.quantize.activations import collect_activation_stats
    from mixquant.search.score import modelopt_search_quant, sensitivity_scores

    times: dict[str, float] = {}
    start = time.perf_counter()
    stats = collect_activation_stats(model_dir, ids, batch_size=batch_size, threads=threads, progress=False)
    times["activation stats"] = time.perf_counter() - start

    start = time.perf_counter()
    quants: dict[str, dict] = {fmt: {} for fmt in FORMATS}
    for fmt in FORMATS:
        for layer in layers:
            amax = None
            if fmt == "fp8":
                amax = {kind: stats[f"{kind}_input_amax"][layer] for kind in ("gate_up", "down")}
            quants[fmt][layer] = modelopt_search_quant(model, layer, fmt, amax)
    times["fake-quant weights"] = time.perf_counter() - start

    start = time.perf_counter()
    scores: dict[int, dict[str, float]] = {layer: {} for layer in layers}
    for fmt in FORMATS:
        for layer, value in sensitivity_scores(model, ids, quants[fmt], fmt, batch_size=batch_size).items():
            scores[int(layer)][fmt] = float(value["kl_sum"])
    times["scores"] = time.perf_counter() - start
    return scores, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="checkpoint dir (config.json + shards)")
    parser.add_argument("--calibration-dir", type=Path, help=f"dir holding {CALIBRATION_FILE}")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None, help="use the first N rows (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from mixquant.calibration.tokens import load_token_ids
    from mixquant.model.fetch import resolve_model_dir

    torch.set_num_threads(args.threads)
    if args.model_dir is None or args.calibration_dir is None:
        default_model, default_calibration = workflow_dirs()
    model_dir = resolve_model_dir(args.model_dir) if args.model_dir else default_model
    calibration_dir = args.calibration_dir or default_calibration
    ids = load_token_ids(calibration_dir / CALIBRATION_FILE).to(torch.long)
    if args.samples is not None:
        ids = ids[: args.samples]

    model = load_model(model_dir)
    layers = [i for i, kind in enumerate(model.config.mlp_layer_types) if kind == "sparse"]
    with torch.inference_mode():  # warm-up: first-call allocations and kernel selection
        model(input_ids=ids[:1], use_cache=False)
    print(f"model       {model_dir}")
    rows, cols = ids.shape
    print(f"tokens      {rows} x {cols} (batch size {args.batch_size}, {args.threads} threads)")
    print(f"layers      {layers}  formats {FORMATS}")

    modelopt, t_modelopt = run_modelopt(model, ids, layers, args.batch_size)
    mixquant, times = run_mixquant(model, model_dir, ids, layers, args.batch_size, args.threads)
    t_mixquant = sum(times.values())

    print(f"\n{'layer':>5}  {'format':12} {'ModelOpt KL sum':>16} {'mixquant KL sum':>16} {'rel diff':>9}")
    worst = 0.0
    for layer in layers:
        for fmt in FORMATS:
            ref, ours = modelopt[layer][fmt], mixquant[layer][fmt]
            rel = abs(ours - ref) / abs(ref) if ref else (0.0 if ours == ref else float("inf"))
            worst = max(worst, rel)
            print(f"{layer:>5}  {fmt:12} {ref:>16.8g} {ours:>16.8g} {rel:>9.2e}")
    print(f"\nmax relative score difference: {worst:.2e} (goal <= 1e-3)")
    print(f"ModelOpt wall time: {t_modelopt:.2f} s")
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in times.items())
    print(f"mixquant wall time: {t_mixquant:.2f} s ({parts})")
    print(f"mixquant/ModelOpt wall time: {t_mixquant / t_modelopt:.2f} (goal <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
