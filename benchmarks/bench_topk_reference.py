"""Benchmark: KL from a top-k + tail reference (mixquant.kld.topk) against the exact full-vocabulary KL.

Usage: .venv/bin/python benchmarks/bench_topk_reference.py [--model data/toy-laguna]
       [--corpus data/corpus/python-stdlib-chat.jsonl] [--tokens 512] [--top-k 16 64 256] [--threads 2]

The reference is the BF16 toy model on the first ``--tokens`` tokens of the corpus (its chat messages joined
as plain text); the candidate is the same model with every routed expert weight NVFP4 fake-quantized (block
16, dynamic scales: ``mixquant.formats.cpu_fake_quant.nvfp4_dynamic_qdq``). For each k it prints the mean
exact KL (``kld_statistics`` on the full logits), the mean point estimate and the mean bound
``[kl_low, kl_high]`` of ``kld_statistics_topk``, the largest per-position bound width, the mean
per-position error of the point estimate, the mean tail mass and the reference's storage per
position, and checks that every position's exact KL lies in its bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from mixquant.formats.cpu_fake_quant import nvfp4_dynamic_qdq
from mixquant.kld.stats import kld_statistics
from mixquant.kld.topk import full_reference_bytes, kld_statistics_topk, reduce_reference, reference_bytes

EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
BLOCK = 16


def corpus_text(path: Path) -> str:
    """The corpus's message contents in file order, joined by blank lines."""
    parts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            parts.extend(message["content"] for message in json.loads(line)["messages"])
    return "\n\n".join(parts)


@torch.no_grad()
def fake_quantize_experts(model: torch.nn.Module) -> int:
    """NVFP4 round trip of every routed expert matrix, in place; returns how many tensors it changed."""
    changed = 0
    for name, param in model.named_parameters():
        if name.endswith(EXPERT_SUFFIXES):
            for expert in param.data:  # one global scale per expert matrix, as the export gives
                expert.copy_(nvfp4_dynamic_qdq(expert.float(), BLOCK, expert.float().abs().amax()))
            changed += 1
    return changed


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids[None]).logits[0, :-1].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/toy-laguna")
    parser.add_argument("--corpus", default="data/corpus/python-stdlib-chat.jsonl")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tokenizer(corpus_text(Path(args.corpus)))["input_ids"][: args.tokens])
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    ref = logits_of(model, ids)
    changed = fake_quantize_experts(model)
    cand = logits_of(model, ids)
    next_tokens = ids[1:]
    n, vocab = ref.shape
    print(f"{args.model}: {n} positions, vocabulary {vocab}, candidate = {changed} expert tensors NVFP4")

    exact = kld_statistics(ref, cand, next_tokens)
    exact_kl = exact["per_position"]["kl"]
    print(
        f"full reference: {full_reference_bytes(1, vocab):,} B/position; exact mean KL "
        f"{exact['summary']['mean_kld']:.6f}, max {exact['summary']['max_kld']:.4f}"
    )
    header = (
        f"{'k':>6} {'B/pos':>7} {'mean exact':>11} {'mean point':>11} {'mean low':>10} {'mean high':>10} "
        f"{'max width':>10} {'mean |err|':>10} {'mean tail':>10} {'in bound':>9}"
    )
    print(header)
    for k in [*args.top_k, vocab]:
        reduced = reduce_reference(ref, next_tokens, k)
        out = kld_statistics_topk(reduced, cand, next_tokens)
        pp, s = out["per_position"], out["summary"]
        slack = 1e-10 + 1e-9 * exact_kl
        inside = int(((pp["kl_low"] <= exact_kl + slack) & (exact_kl <= pp["kl_high"] + slack)).sum())
        print(
            f"{k:>6} {reference_bytes(1, k):>7} {exact['summary']['mean_kld']:>11.6f} {s['mean_kld']:>11.6f} "
            f"{s['mean_kld_low']:>10.6f} {s['mean_kld_high']:>10.6f} {s['max_kl_bound_width']:>10.4f} "
            f"{float((pp['kl'] - exact_kl).abs().mean()):>10.2e} "
            f"{float(reduced['tail_mass'].mean()):>10.3e} {inside:>5}/{n:<3}"
        )
    print(f"k = {vocab}: kl bit-identical to kld_statistics: {torch.equal(pp['kl'], exact_kl)}")


if __name__ == "__main__":
    main()
