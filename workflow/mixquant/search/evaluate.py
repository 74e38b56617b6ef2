"""Measured KL of a whole placement on a prompt (every placed layer quantized at once).

The search predicts a placement's KL as the sum of per-layer scores; this measures it: the BF16 model with
every placed layer's routed experts swapped for their quantized weights (FP8 W8A8 inputs fake-quantized,
see :mod:`mixquant.search.score`), one forward over the prompt, and KL(BF16 || placed) at each of the
prompt's first T-1 positions (the positions that predict a next token), log-softmax in float32 and sums in
float64.
"""

from __future__ import annotations

import contextlib
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
