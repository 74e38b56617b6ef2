"""Deterministic calibration sampling from chat conversations.

Each conversation is rendered through the tokenizer's chat template
(``apply_chat_template(messages, tokenize=True, add_generation_prompt=False)``), so calibration sees exactly
the token stream the served model sees.

Sampling policy (``sample_calibration``):

1. Visit order: ``numpy.random.Generator(numpy.random.PCG64(seed)).permutation(len(conversations))``.
2. A conversation with **>= seq_len** tokens yields one sample on its own: its first `seq_len` tokens.
3. A shorter conversation, with ``short_policy="pack"``: it is appended to a packing buffer (in visit
   order); when the buffer reaches `seq_len` tokens it yields one sample -- the buffer's first `seq_len`
   tokens, i.e. the last conversation is truncated and its remainder dropped -- and the buffer is emptied.
   Long conversations (rule 2) do not touch the buffer. With ``short_policy="skip"`` short conversations are
   ignored.
4. Samples are kept in the order they are completed; sampling stops as soon as `num_samples` are made, so
   only as many conversations are rendered as needed. If the conversations run out first (a partly filled
   buffer is discarded) a one-line ``ValueError`` says how many samples could be made.

The result is an int32 tensor ``[num_samples, seq_len]``; the same inputs and seed give identical tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

SHORT_POLICIES = ("pack", "skip")


def render_chat(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token IDs of one conversation rendered through `tokenizer`'s chat template (no generation prompt).

    transformers 5 returns a BatchEncoding (``return_dict=True`` by default); older versions return a list.
    Message keys whose value is None (Arrow's fill for missing fields) are dropped before rendering.
    """
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    out = tokenizer.apply_chat_template(clean, tokenize=True, add_generation_prompt=False)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor | np.ndarray):
        out = out.tolist()
    if isinstance(out, list) and len(out) == 1 and isinstance(out[0], list):  # a batch of one
        out = out[0]
    if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected a list of token IDs")
    return out


def visit_order(num_conversations: int, seed: int) -> np.ndarray:
    """The permutation in which conversations are visited for `seed`."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    return np.random.Generator(np.random.PCG64(int(seed))).permutation(num_conversations)


def sample_calibration(
    conversations: Sequence[list[dict]],
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int,
    short_policy: str = "pack",
) -> torch.Tensor:
    """Draw `num_samples` chat-template-rendered samples of `seq_len` tokens (policy: module docstring).

    Returns an int32 tensor of shape ``[num_samples, seq_len]``.
    """
    for label, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}: expected a positive int, got {value!r}")
    if short_policy not in SHORT_POLICIES:
        raise ValueError(f"short_policy: expected one of {SHORT_POLICIES}, got {short_policy!r}")
    order = visit_order(len(conversations), seed)

    samples: list[list[int]] = []
    buffer: list[int] = []
    for index in order:
        ids = render_chat(tokenizer, conversations[int(index)])
        if len(ids) >= seq_len:
            samples.append(ids[:seq_len])
        elif short_policy == "pack":
            buffer.extend(ids)
            if len(buffer) >= seq_len:
                samples.append(buffer[:seq_len])
                buffer = []
        if len(samples) == num_samples:
            break
    else:
        raise ValueError(
            f"only {len(samples)} of {num_samples} calibration samples of {seq_len} tokens could be made "
            f"from {len(conversations)} conversations (short_policy={short_policy!r}, seed={seed})"
        )
    tensor = torch.tensor(samples, dtype=torch.int64)
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) > 2**31 - 1):
        raise ValueError("sample_calibration: token IDs outside the int32 range")
    return tensor.to(torch.int32)
