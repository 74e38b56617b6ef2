"""Measured KL of a whole placement on a prompt (every placed layer quantized at once).

The search predicts a placement's KL as the sum of per-layer scores; this measures it: the BF16 model with
every placed layer's routed experts swapped for their quantized weights (FP8 W8A8 inputs fake-quantized,
see :mod:`mixquant.search.score`), one forward over the prompt, and KL(BF16 || placed) at each of the
prompt's first T-1 positions (the positions that predict a next token), log-softmax in float32 and sums in
float64.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from mixquant.search.score import LayerQuant, quantized_experts


def placement_kld(
    model: torch.nn.Module, prompt_ids: torch.Tensor, quants: Mapping[int, LayerQuant]
) -> dict[str, Any]:
    """``{"mean_kl", "max_kl", "positions", "per_position"}`` of KL(BF16 || model with ``quants`` applied)."""
    ids = prompt_ids.detach().to(torch.long).reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError(f"prompt needs at least 2 tokens, got {ids.shape[1]}")
    ids = ids.to(next(model.parameters()).device)
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        with contextlib.ExitStack() as stack:
            for layer in sorted(quants):
                stack.enter_context(quantized_experts(model, quants[layer]))
            cand = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
    per_position = (log_p.exp() * (log_p - log_q)).double().sum(-1)
    return {
        "mean_kl": float(per_position.mean()),
        "max_kl": float(per_position.max()),
        "positions": int(per_position.numel()),
        "per_position": per_position.cpu(),
    }


def random_placements(placement: Mapping[int, str], count: int, *, seed: int = 0) -> list[dict[int, str]]:
    """``count`` distinct placements that permute ``placement``'s formats over its layers, none equal to it.

    Every MoE layer has the same number of routed weights, so a permutation has exactly the same effective
    bits. Drawn with a seeded ``random.Random``; fewer are returned when fewer distinct ones exist.
    """
    layers = sorted(placement)
    formats = [placement[layer] for layer in layers]
    distinct = math.factorial(len(formats))
    for fmt in set(formats):
        distinct //= math.factorial(formats.count(fmt))
    wanted = min(count, distinct - 1)
    rng = random.Random(seed)
    seen = {tuple(formats)}
    drawn: list[dict[int, str]] = []
    while len(drawn) < wanted:
        shuffled = formats[:]
        rng.shuffle(shuffled)
        if tuple(shuffled) not in seen:
            seen.add(tuple(shuffled))
            drawn.append(dict(zip(layers, shuffled, strict=True)))
    return drawn


def compare_with_random(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    quants: Mapping[tuple[int, str], LayerQuant],
    placement: Mapping[int, str],
    *,
    count: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Measured prompt KL of ``placement`` and of ``count`` random placements with the same effective bits.

    ``quants`` holds a :class:`LayerQuant` for every (layer, format) the placements use (BF16 layers need
    none). Returns ``{"placement": {...}, "random": [{"placement", "mean_kl"}, ...], "beats_all": bool,
    "margin": min(random) / placement - 1}``.
    """

    def measured(candidate: Mapping[int, str]) -> float:
        chosen = {layer: quants[(layer, fmt)] for layer, fmt in candidate.items() if fmt != "bf16"}
        return placement_kld(model, prompt_ids, chosen)["mean_kl"]

    own = measured(placement)
    others = [
        {"placement": {str(k): v for k, v in other.items()}, "mean_kl": measured(other)}
        for other in random_placements(placement, count, seed=seed)
    ]
    best_random = min((o["mean_kl"] for o in others), default=float("inf"))
    return {
        "placement": {"placement": {str(k): v for k, v in placement.items()}, "mean_kl": own},
        "random": others,
        "beats_all": bool(others) and own < best_random,
        "margin": best_random / own - 1 if own > 0 else float("inf"),
    }
