"""Benchmark: the searched placement vs ModelOpt's own AutoQuantize placement, on KL over held-out windows.

Usage: .venv/bin/python benchmarks/bench_autoquantize_families.py [--target 6.0]
       [--calibration 32x128] [--windows 8] [--window-tokens 128] [--models toy,qwen3_moe,...] [--threads 1]

Models: the toy (data/toy-laguna, trained, 8 MoE layers) and each supported family's trained instance
(data/instances/<model_type>: trained on the shipped corpus by the toy's recipe, 8 MoE layers each).
Per model, on the same calibration tokens (``--calibration`` N x T from data/corpus/python-stdlib-chat.jsonl
through the toy's tokenizer: ``sample_calibration``, seed 0, pack) and the same budget (``--target`` routed
effective bits, cost model numel):

* searched: mixquant's scorer and ILP with ``placement.search.calibration: rebuild`` numerics -- FP8 input
  amax from ``collect_activation_stats``, each (MoE layer, format) rebuilt by ``quantize_layer`` with the
  default config's settings (NVFP4 ``fp8_sweep``, FP8 ``mse``), ``sensitivity_scores`` on the whole model,
  ``solve_placement(method="ilp")``;
* autoquantize: ModelOpt's ``mtq.auto_quantize(method="kl_div")`` itself
  (:func:`mixquant.search.autoquantize.modelopt_autoquantize_placement`: its own max calibration, scores and
  threshold bisection, the cost denominator the routed experts alone);
* uniform NVFP4;
* the searched placement at the bits ModelOpt's pick spends (its threshold bisection can leave budget unused):
  the same scores, the ILP re-solved at that target -- the equal-bits comparison.

Every placement is applied the way it ships: the routed experts swapped for the rebuilt (quantize_layer)
weights of their format, FP8 inputs fake-quantized at the layer's amax (``quantized_experts``). KL(BF16 ||
candidate) per position (float32 log-softmax, full vocabulary, every position) on held-out windows: the
first ``--window-tokens`` tokens of ``--windows`` documents per domain of data/eval/{docs,code,chat}.jsonl
(``draw_domain``, seed 0), checked disjoint by content from the whole calibration corpus
(``check_disjoint``). The reduction of the searched placement's mean KL vs ModelOpt's, with the paired
window bootstrap stratified by domain (``window_bootstrap``, 10,000 resamples, 95 %); positive: the
searched placement's KL is lower.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]

TOY = REPO / "data" / "toy-laguna"
CORPUS = REPO / "data" / "corpus" / "python-stdlib-chat.jsonl"
EVAL = {
    "docs": (REPO / "data" / "eval" / "docs.jsonl", "text", None),
    "code": (REPO / "data" / "eval" / "code.jsonl", "text", None),
    "chat": (REPO / "data" / "eval" / "chat.jsonl", None, "messages"),
}
FORMATS = ["nvfp4_w4a16", "fp8", "bf16"]
REBUILD = {"nvfp4_w4a16": {"calibration": "fp8_sweep"}, "fp8": {"weight_calibration": "mse"}}
BATCH_SIZE = 8
SHORT = {"nvfp4_w4a16": "n", "fp8": "f", "bf16": "b"}


def calibration_and_windows(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor, list[str], dict]:
    """Calibration ids [N, T], evaluation windows [W, T'], each window's domain, the disjointness counts."""
    from mixquant.calibration.disjoint import check_disjoint, read_jsonl
    from mixquant.calibration.eval_suite import draw_domain
    from mixquant.calibration.sample import sample_calibration

    corpus = read_jsonl(CORPUS)
    rows = {name: read_jsonl(path) for name, (path, _, _) in EVAL.items()}
    checked = check_disjoint(
        {name: (rows[name], text, messages) for name, (_, text, messages) in EVAL.items()},
        (corpus, "messages"),
    )
    samples, seq_len = (int(v) for v in args.calibration.split("x"))
    ids = sample_calibration(
        [row["messages"] for row in corpus], tokenizer, num_samples=samples, seq_len=seq_len, seed=0
    )
    windows, domains = [], []
    for index, (name, (_, text, messages)) in enumerate(EVAL.items()):
        domain = {"name": name, "windows": args.windows, "text_field": text, "messages_field": messages}
        drawn, _ = draw_domain(tokenizer, rows[name], domain, index, window_tokens=args.window_tokens, seed=0)
        windows += drawn
        domains += [name] * len(drawn)
    return ids.long(), torch.tensor(windows, dtype=torch.long), domains, checked


def rebuilt_quants(model_dir: Path, ids: torch.Tensor, layers: list[int]) -> dict:
    """{(layer, format): LayerQuant} of the rebuilt weights, as quantize_layer ships them."""
    from mixquant.model.families import architecture
    from mixquant.quantize.activations import collect_activation_stats
    from mixquant.quantize.layer import quantize_layer
    from mixquant.search.score import layer_quant_from_tensors

    arch = architecture(model_dir)
    stats = collect_activation_stats(model_dir, ids, batch_size=BATCH_SIZE, progress=False)
    quants = {}
    for layer in layers:
        for fmt, params in REBUILD.items():
            amax = None
            if fmt == "fp8":
                amax = {
                    "gate_up": stats["gate_up_input_amax"][layer],
                    "down": stats["down_input_amax"][layer],
                }
            tensors, _ = quantize_layer(model_dir, layer, fmt, params, activation_amax=amax)
            quants[layer, fmt] = layer_quant_from_tensors(tensors, layer, fmt, arch=arch)
    return quants


def searched_placements(model, model_dir: Path, ids, layers, quants, targets: list[float]) -> list[dict]:
    """The ILP's placement at each of ``targets``, from one set of scores."""
    from mixquant.search.run import search_groups
    from mixquant.search.score import sensitivity_scores
    from mixquant.search.solve import solve_placement

    table: dict[int, dict[str, float]] = {layer: {} for layer in layers}
    for fmt in REBUILD:
        scores = sensitivity_scores(
            model, ids, {layer: quants[layer, fmt] for layer in layers}, fmt, batch_size=BATCH_SIZE
        )
        for layer, value in scores.items():
            table[layer][fmt] = value["kl_per_token"]
    settings = {"cost_model": "numel", "pins": {}, "moe_layers": layers, "formats": FORMATS}
    config = json.loads((model_dir / "config.json").read_text())
    groups = search_groups(settings, table, config)
    solutions = [solve_placement(groups, target, method="ilp") for target in targets]
    return [{int(name.split(".")[2]): fmt for name, fmt in s.choice.items()} for s in solutions]


def position_kl(model, windows: torch.Tensor, quants: dict, placement: dict[int, str]) -> np.ndarray:
    """KL(BF16 || placement) of every position of every window, float64 [W * T]."""
    from mixquant.search.score import quantized_experts

    out = []
    with torch.inference_mode():
        for start in range(0, windows.shape[0], BATCH_SIZE):
            batch = windows[start : start + BATCH_SIZE]
            log_p = torch.log_softmax(model(input_ids=batch, use_cache=False).logits, -1, dtype=torch.float32)
            with contextlib.ExitStack() as stack:
                for layer, fmt in placement.items():
                    if fmt != "bf16":
                        stack.enter_context(quantized_experts(model, quants[layer, fmt]))
                logits = model(input_ids=batch, use_cache=False).logits
            log_q = torch.log_softmax(logits, -1, dtype=torch.float32)
            kl = (log_p.exp().double() * (log_p.double() - log_q.double())).sum(-1)
            out.append(kl.reshape(-1).numpy())
    return np.concatenate(out)


def routed_bits(placement: dict[int, str]) -> float:
    from mixquant.formats.facts import ROUTED_FORMAT_BITS

    return sum(ROUTED_FORMAT_BITS[f] for f in placement.values()) / len(placement)


def counts(placement: dict[int, str]) -> str:
    return "/".join(str(sum(1 for f in placement.values() if f == fmt)) for fmt in FORMATS)


def layout(placement: dict[int, str]) -> str:
    return " ".join(f"{layer}:{SHORT[fmt]}" for layer, fmt in sorted(placement.items()))


def bench_model(name: str, model_dir: Path, ids, windows, domains, args) -> dict:
    from mixquant.kld.windows import window_bootstrap
    from mixquant.model.families import architecture
    from mixquant.search.autoquantize import modelopt_autoquantize_placement
    from mixquant.search.score import load_search_model

    started = time.perf_counter()
    layers = list(architecture(model_dir).moe_layers)
    model = load_search_model(model_dir)
    quants = rebuilt_quants(model_dir, ids, layers)
    modelopt = modelopt_autoquantize_placement(
        model,
        ids,
        layers=layers,
        formats=FORMATS,
        batch_size=BATCH_SIZE,
        target_effective_bits=args.target,
        cost_model="numel",
    )
    autoquantize = modelopt["selection"]
    # the budget, and the bits ModelOpt's pick actually spends (its bisection can leave budget unused)
    searched, equal_bits = searched_placements(
        model, model_dir, ids, layers, quants, [args.target, modelopt["routed_effective_bits"]]
    )
    uniform = dict.fromkeys(layers, "nvfp4_w4a16")
    placements = {
        "searched": searched,
        "autoquantize": autoquantize,
        "uniform": uniform,
        "equal_bits": equal_bits,
    }
    measured: dict[tuple, np.ndarray] = {}
    for placement in placements.values():
        key = tuple(sorted(placement.items()))
        if key not in measured:
            measured[key] = position_kl(model, windows, quants, placement)
    kl = {name: measured[tuple(sorted(p.items()))] for name, p in placements.items()}
    window_ids = np.repeat(np.arange(windows.shape[0]), windows.shape[1])
    strata = dict(enumerate(domains))
    boot = window_bootstrap(kl["searched"], kl["autoquantize"], window_ids.tolist(), strata, samples=10000)
    boot_equal = window_bootstrap(
        kl["equal_bits"], kl["autoquantize"], window_ids.tolist(), strata, samples=10000
    )
    return {
        "model": name,
        "layers": layers,
        "searched": searched,
        "autoquantize": autoquantize,
        "equal_bits": equal_bits,
        "bootstrap_equal_bits": boot_equal,
        "modelopt_satisfied": modelopt["audit"]["is_satisfied"],
        "mean_kl": {key: float(values.mean()) for key, values in kl.items()},
        "bootstrap": boot,
        "seconds": time.perf_counter() - started,
    }


def interval(boot: dict) -> str:
    return f"{100 * boot['reduction']:+.1f}% [{100 * boot['ci_low']:+.1f}, {100 * boot['ci_high']:+.1f}]"


HEADER = (
    "| model | MoE layers | searched n/f/b @ bits | autoquantize n/f/b @ bits | KLD searched "
    "| KLD autoquantize | KLD uniform NVFP4 | reduction searched vs autoquantize [95% CI] | identical "
    "| searched at autoquantize's bits: n/f/b, KLD, reduction [95% CI] |"
)


def row(result: dict) -> str:
    s, a, e = result["searched"], result["autoquantize"], result["equal_bits"]
    m = result["mean_kl"]
    return (
        f"| {result['model']} | {len(result['layers'])} | {counts(s)} @ {routed_bits(s):.3f} | "
        f"{counts(a)} @ {routed_bits(a):.3f}{'' if result['modelopt_satisfied'] else ' (over)'} | "
        f"{m['searched']:.5f} | {m['autoquantize']:.5f} | {m['uniform']:.5f} | "
        f"{interval(result['bootstrap'])} | "
        f"{'yes' if s == a else 'no'} | {counts(e)} @ {routed_bits(e):.3f}, {m['equal_bits']:.5f}, "
        f"{interval(result['bootstrap_equal_bits'])} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=6.0, help="routed effective bits")
    parser.add_argument("--calibration", default="32x128", help="calibration samples x tokens")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows per domain")
    parser.add_argument("--window-tokens", type=int, default=128)
    parser.add_argument("--models", default="toy,qwen3_moe,deepseek_v3,glm4_moe,mixtral,minimax_m2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOY))
    ids, windows, domains, checked = calibration_and_windows(args, tokenizer)
    print(
        f"calibration {tuple(ids.shape)} from {CORPUS.name}; eval windows {tuple(windows.shape)} over "
        f"{', '.join(EVAL)} ({args.windows} each); disjoint by content: {checked}"
    )
    print(
        f"budget {args.target} routed effective bits (numel); rebuild numerics NVFP4 fp8_sweep, FP8 mse; "
        f"family instances: data/instances (trained); {args.threads} thread(s)"
    )
    results = []
    for name in args.models.split(","):
        model_dir = TOY if name == "toy" else REPO / "data" / "instances" / name
        result = bench_model(name, model_dir, ids, windows, domains, args)
        results.append(result)
        per_domain = ", ".join(
            f"{domain} {100 * v['reduction']:+.1f}% [{100 * v['ci_low']:+.1f}, {100 * v['ci_high']:+.1f}]"
            for domain, v in result["bootstrap"]["domains"].items()
        )
        searched, autoquantize = layout(result["searched"]), layout(result["autoquantize"])
        print(
            f"{name}: searched {searched} | autoquantize {autoquantize} | per-domain reduction "
            f"{per_domain} ({result['seconds']:.0f} s)",
            flush=True,
        )
    print()
    print(HEADER)
    print("|---" * HEADER.count(" | ") + "|---|")
    for result in results:
        print(row(result))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
