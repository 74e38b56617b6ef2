"""Benchmark: mixquant against ModelOpt's AutoQuantize at equal (or fewer) routed bits, on trained weights.

Usage: .venv/bin/python benchmarks/bench_equal_bits.py [--models toy,qwen3_moe,...] [--target 6.0]
       [--calibration 64x128] [--holdout 16] [--candidates 8] [--windows 8] [--window-tokens 256]
       [--json out.json]

Models: the toy (data/toy-laguna) and every family's trained instance (data/instances/<model_type>, trained
on the shipped corpus by the toy's recipe, with its outlier channels). Per model, on the same calibration
tokens (``--calibration`` N x T of data/corpus/python-stdlib-chat.jsonl, ``sample_calibration`` seed 0):

* ModelOpt: ``mtq.auto_quantize(method="kl_div")`` itself at ``--target`` bits (its own max calibration,
  scores and threshold bisection; :func:`mixquant.search.autoquantize.modelopt_autoquantize_placement`),
  rebuilt round-to-nearest -- the anchor. Its bisection can leave budget unused: B = the bits it spends;
* searched RTN / GPTQ: mixquant's scores (``sensitivity_scores`` of the rebuilt layers: NVFP4 ``fp8_sweep``
  scales rounded to nearest, or GPTQ-rounded with the experts' own calibration tokens; FP8 ``mse``) and
  the exact ILP at B, so every searched placement spends at most ModelOpt's bits;
* searched GPTQ refined: the ILP's ``--candidates`` best placements at B (GPTQ scores), each measured end to
  end (:func:`mixquant.search.refine.measured_kl`) on ``--holdout`` calibration sequences continuing the
  calibration draw, the lowest kept;
* uniform NVFP4, RTN and GPTQ (4.5 bits).

Every placement is applied the way it ships (the rebuilt tensors of its format swapped in, FP8 inputs
fake-quantized) and measured as KL(BF16 || candidate) per position on held-out windows: the first
``--window-tokens`` tokens of ``--windows`` documents per domain of data/eval/{docs,code,chat}.jsonl,
content-checked disjoint from the whole calibration corpus. Reduction = 1 - KL(method) / KL(ModelOpt),
paired window bootstrap stratified by domain (10,000 resamples, 95 %); positive: lower than ModelOpt's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_autoquantize_families import (  # noqa: E402
    BATCH_SIZE,
    CORPUS,
    FORMATS,
    TOY,
    calibration_and_windows,
    layout,
    position_kl,
    routed_bits,
)

INSTANCES = REPO / "data" / "instances"
GPTQ = {"damping": 0.01, "block_size": 128, "order": "natural", "min_tokens": 64}
METHODS = (
    ("uniform_rtn", "uniform NVFP4 RTN"),
    ("uniform_gptq", "uniform NVFP4 GPTQ"),
    ("modelopt", "ModelOpt auto_quantize (RTN)"),
    ("searched_rtn", "searched RTN"),
    ("searched_gptq", "searched GPTQ"),
    ("refined_gptq", "searched GPTQ refined"),
)


def rebuilt(model_dir: Path, ids: torch.Tensor, layers: list[int], scratch: Path) -> dict:
    """{(layer, "nvfp4_w4a16" | "nvfp4_gptq" | "fp8"): LayerQuant} as quantize_layer ships them, and the
    GPTQ layers' calibration output-error ratios."""
    from mixquant.model.families import architecture
    from mixquant.quantize.activations import collect_activation_stats
    from mixquant.quantize.expert_inputs import collect_expert_inputs, expert_inputs_file
    from mixquant.quantize.layer import quantize_layer
    from mixquant.search.score import layer_quant_from_tensors

    arch = architecture(model_dir)
    stats = collect_activation_stats(model_dir, ids, batch_size=BATCH_SIZE, progress=False)
    collect_expert_inputs(model_dir, ids, scratch, batch_size=BATCH_SIZE, progress=False)
    quants, fallback, ratios = {}, 0, {}
    jobs = {
        "nvfp4_w4a16": ("nvfp4_w4a16", {"calibration": "fp8_sweep"}),
        "nvfp4_gptq": ("nvfp4_w4a16", {"calibration": "fp8_sweep", "rounding": "gptq", "gptq": GPTQ}),
        "fp8": ("fp8", {"weight_calibration": "mse"}),
    }
    for layer in layers:
        for name, (fmt, params) in jobs.items():
            amax = None
            if fmt == "fp8":
                amax = {
                    "gate_up": stats["gate_up_input_amax"][layer],
                    "down": stats["down_input_amax"][layer],
                }
            inputs = expert_inputs_file(scratch, layer) if name == "nvfp4_gptq" else None
            tensors, audit = quantize_layer(
                model_dir, layer, fmt, params, activation_amax=amax, expert_inputs=inputs
            )
            quants[layer, name] = layer_quant_from_tensors(tensors, layer, fmt, arch=arch)
            if name == "nvfp4_gptq":
                fallback += audit["gptq"]["rtn_fallback"]
                ratios[layer] = audit["gptq"]["calibration_output_error"]["ratio"]
    return {"quants": quants, "gptq_fallback_experts": fallback, "gptq_calibration_error_ratio": ratios}


def score_table(model, ids, layers, quants, nvfp4: str) -> dict[int, dict[str, float]]:
    from mixquant.search.score import sensitivity_scores

    table: dict[int, dict[str, float]] = {layer: {} for layer in layers}
    for name, fmt in ((nvfp4, "nvfp4_w4a16"), ("fp8", "fp8")):
        scores = sensitivity_scores(
            model, ids, {layer: quants[layer, name] for layer in layers}, fmt, batch_size=BATCH_SIZE
        )
        for layer, value in scores.items():
            table[layer][fmt] = value["kl_per_token"]
    return table


def groups_of(model_dir: Path, layers: list[int], table: dict) -> list:
    from mixquant.search.run import search_groups

    settings = {"cost_model": "numel", "pins": {}, "moe_layers": layers, "formats": FORMATS}
    return search_groups(settings, table, json.loads((model_dir / "config.json").read_text()))


def ilp_placement(groups, target: float) -> dict[int, str]:
    from mixquant.search.solve import solve_placement

    solution = solve_placement(groups, target, method="ilp")
    return {int(name.split(".")[2]): fmt for name, fmt in solution.choice.items()}


def refined_placement(model_dir, groups, target, holdout, quants, k: int) -> tuple[dict[int, str], dict]:
    """The K best ILP placements at ``target``, each measured on ``holdout``; the lowest measured."""
    from mixquant.model.streaming import StreamedModel
    from mixquant.search.refine import candidate_placements, measured_kl

    first = ilp_placement(groups, target)
    candidates = candidate_placements(groups, target, k, first)
    named = {"nvfp4_w4a16": "nvfp4_gptq", "fp8": "fp8"}
    with StreamedModel(model_dir) as stream:
        sums = measured_kl(
            stream,
            holdout,
            [c["placement"] for c in candidates],
            lambda layer, fmt: quants[layer, named[fmt]],
            batch_size=BATCH_SIZE,
        )
    measured = [sum(s) / holdout.numel() for s in sums]
    best = int(np.argmin(measured))
    return candidates[best]["placement"], {
        "candidates": len(candidates),
        "kept_predicted_rank": best + 1,
        "predicted": [c["predicted"] for c in candidates],
        "measured": measured,
    }


def bench_model(name: str, model_dir: Path, ids, holdout, windows, domains, args, scratch: Path) -> dict:
    from mixquant.kld.windows import window_bootstrap
    from mixquant.model.families import architecture
    from mixquant.search.autoquantize import modelopt_autoquantize_placement
    from mixquant.search.score import load_search_model

    started = time.perf_counter()
    layers = list(architecture(model_dir).moe_layers)
    model = load_search_model(model_dir)
    built = rebuilt(model_dir, ids, layers, scratch)
    quants = built["quants"]
    modelopt = modelopt_autoquantize_placement(
        model,
        ids,
        layers=layers,
        formats=FORMATS,
        batch_size=BATCH_SIZE,
        target_effective_bits=args.target,
        cost_model="numel",
    )
    bits = modelopt["routed_effective_bits"]
    rtn_groups = groups_of(model_dir, layers, score_table(model, ids, layers, quants, "nvfp4_w4a16"))
    gptq_groups = groups_of(model_dir, layers, score_table(model, ids, layers, quants, "nvfp4_gptq"))
    refined, refine = refined_placement(model_dir, gptq_groups, bits, holdout, quants, args.candidates)
    uniform = dict.fromkeys(layers, "nvfp4_w4a16")
    placements = {
        "uniform_rtn": (uniform, "nvfp4_w4a16"),
        "uniform_gptq": (uniform, "nvfp4_gptq"),
        "modelopt": (modelopt["selection"], "nvfp4_w4a16"),
        "searched_rtn": (ilp_placement(rtn_groups, bits), "nvfp4_w4a16"),
        "searched_gptq": (ilp_placement(gptq_groups, bits), "nvfp4_gptq"),
        "refined_gptq": (refined, "nvfp4_gptq"),
    }
    measured: dict[tuple, np.ndarray] = {}
    kl = {}
    for method, (placement, nvfp4) in placements.items():
        key = (tuple(sorted(placement.items())), nvfp4)
        if key not in measured:
            swap = {
                (layer, fmt): quants[layer, nvfp4 if fmt == "nvfp4_w4a16" else fmt]
                for layer, fmt in placement.items()
                if fmt != "bf16"
            }
            measured[key] = position_kl(model, windows, swap, placement)
        kl[method] = measured[key]
    window_ids = np.repeat(np.arange(windows.shape[0]), windows.shape[1]).tolist()
    strata = dict(enumerate(domains))
    boot = {
        method: window_bootstrap(kl[method], kl["modelopt"], window_ids, strata, samples=10000)
        for method in kl
        if method != "modelopt"
    }
    per_domain = {
        method: {
            d: float(values[np.repeat(np.array(domains), windows.shape[1]) == d].mean())
            for d in sorted(set(domains))
        }
        for method, values in kl.items()
    }
    return {
        "model": name,
        "layers": layers,
        "modelopt_bits": bits,
        "placements": {m: {str(k): v for k, v in p.items()} for m, (p, _) in placements.items()},
        "bits": {m: routed_bits(p) for m, (p, _) in placements.items()},
        "mean_kl": {m: float(v.mean()) for m, v in kl.items()},
        "per_domain": per_domain,
        "bootstrap": boot,
        "refine": refine,
        "gptq_fallback_experts": built["gptq_fallback_experts"],
        "gptq_calibration_error_ratio": built["gptq_calibration_error_ratio"],
        "seconds": time.perf_counter() - started,
    }


def interval(boot: dict) -> str:
    return f"{100 * boot['reduction']:+.1f} % [{100 * boot['ci_low']:+.1f}, {100 * boot['ci_high']:+.1f}]"


def table(results: list[dict]) -> str:
    header = "| model | ModelOpt bits | " + " | ".join(label for _, label in METHODS) + " |"
    lines = [header, "|---" * (len(METHODS) + 2) + "|"]
    for r in results:
        cells = []
        for method, _ in METHODS:
            mean = f"{r['mean_kl'][method]:.3g}"
            extra = "" if method == "modelopt" else f"<br>{interval(r['bootstrap'][method])}"
            cells.append(f"{mean} @ {r['bits'][method]:.2f}{extra}")
        lines.append(f"| {r['model']} | {r['modelopt_bits']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def domain_table(results: list[dict]) -> str:
    domains = sorted(next(iter(results))["per_domain"]["modelopt"])
    lines = ["| model | method | " + " | ".join(domains) + " |", "|---" * (len(domains) + 2) + "|"]
    for r in results:
        for method, label in METHODS:
            cells = []
            for d in domains:
                text = f"{r['per_domain'][method][d]:.3g}"
                if method != "modelopt":
                    b = r["bootstrap"][method]["domains"][d]
                    text += f" ({interval(b)})"
                cells.append(text)
            lines.append(f"| {r['model']} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="toy,qwen3_moe,deepseek_v3,glm4_moe,mixtral,minimax_m2")
    parser.add_argument("--target", type=float, default=6.0, help="routed effective bits given to ModelOpt")
    parser.add_argument("--calibration", default="64x128", help="calibration samples x tokens")
    parser.add_argument("--holdout", type=int, default=16, help="held-out calibration sequences (refinement)")
    parser.add_argument("--candidates", type=int, default=8, help="placements the refinement measures")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows per domain")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from mixquant.calibration.disjoint import read_jsonl
    from mixquant.calibration.sample import sample_calibration
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOY))
    ids, windows, domains, checked = calibration_and_windows(args, tokenizer)
    samples, seq_len = (int(v) for v in args.calibration.split("x"))
    corpus = [row["messages"] for row in read_jsonl(CORPUS)]
    both = sample_calibration(corpus, tokenizer, num_samples=samples + args.holdout, seq_len=seq_len, seed=0)
    assert torch.equal(both[:samples].long(), ids)
    holdout = both[samples:].long()
    print(
        f"calibration {tuple(ids.shape)}, held-out {tuple(holdout.shape)} (the draw continued); eval windows "
        f"{tuple(windows.shape)} (disjoint by content: {checked}); ModelOpt at {args.target} bits; "
        f"GPTQ {GPTQ}; refinement over {args.candidates} candidates; {args.threads} thread(s)",
        flush=True,
    )
    results = []
    for name in args.models.split(","):
        model_dir = TOY if name == "toy" else INSTANCES / name
        with tempfile.TemporaryDirectory() as scratch:
            result = bench_model(name, model_dir, ids, holdout, windows, domains, args, Path(scratch))
        results.append(result)
        placements = ", ".join(
            f"{m} {layout({int(k): v for k, v in p.items()})}"
            for m, p in result["placements"].items()
            if m != "uniform_rtn" and m != "uniform_gptq"
        )
        print(
            f"{name}: {placements}; refine kept predicted rank {result['refine']['kept_predicted_rank']}; "
            f"GPTQ RTN fallbacks {result['gptq_fallback_experts']} ({result['seconds']:.0f} s)",
            flush=True,
        )
    print()
    print("Mean KLD on the held-out windows @ routed bits, and the reduction vs ModelOpt's [95 % window CI]:")
    print(table(results))
    print()
    print("Per domain: mean KLD (reduction vs ModelOpt [95 % CI]):")
    print(domain_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
