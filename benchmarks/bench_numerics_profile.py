"""Benchmark: what the portable CPU numerics profile costs, measured side by side in one run.

Usage: .venv/bin/python benchmarks/bench_numerics_profile.py [--rounds 3] [--tokens 2048] [--threads 1]

Each round starts two fresh processes, one under ``numerics.cpu: portable`` (ATen AVX2, MKL_CBWR
COMPATIBLE, mkldnn off) and one under ``native`` (the host's defaults), alternating which goes first. Each
loads the shipped toy (data/toy-laguna) and times its bf16 forward over ``--tokens`` random token ids (the
reference_logits forward), best of 3 after one warm-up. Prints each round and the median ratio
portable / native, plus whether the two profiles gave the same logits bytes on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import hashlib, json, sys, time
from mixquant.numerics import enter
fingerprint = enter()
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
    experts_implementation="eager", attn_implementation="sdpa").eval()
generator = torch.Generator().manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, (1, int(sys.argv[2])), generator=generator)
times = []
with torch.inference_mode():
    for _ in range(4):
        start = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        times.append(time.perf_counter() - start)
digest = hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()
print(json.dumps({"seconds": min(times[1:]), "sha256": digest, "numerics": fingerprint["decisive"]}))
"""


def run(profile: str, threads: int, tokens: int) -> dict:
    env = {**os.environ, "MIXQUANT_NUMERICS": f"{profile}:{threads}"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "data" / "toy-laguna"), str(tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ratios, digests = [], {}
    for round_ in range(args.rounds):
        order = ("portable", "native") if round_ % 2 == 0 else ("native", "portable")
        got = {profile: run(profile, args.threads, args.tokens) for profile in order}
        ratio = got["portable"]["seconds"] / got["native"]["seconds"]
        ratios.append(ratio)
        for profile, result in got.items():
            digests.setdefault(profile, set()).add(result["sha256"])
        described = {
            profile: f"{result['seconds']:.3f} s ({result['numerics']['cpu_capability']}, "
            f"MKL {result['numerics']['mkl_cbwr']})"
            for profile, result in got.items()
        }
        print(
            f"round {round_}: portable {described['portable']}, native {described['native']}, "
            f"ratio {ratio:.2f}"
        )
    same = digests["portable"] == digests["native"]
    print(f"median portable / native: {statistics.median(ratios):.2f} over {args.rounds} rounds")
    print(f"same logits bytes under both profiles on this host: {same}")


if __name__ == "__main__":
    main()
