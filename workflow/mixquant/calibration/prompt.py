"""The fixed evaluation prompt: from a chat sample or a token-ID file, checked against a pinned hash.

Sources (exactly one):

* **chat sample** -- ``conversations[sample_index]`` rendered through the tokenizer's chat template
  (``add_generation_prompt=False``). If it has fewer than `seq_len` tokens, the following conversations
  (``sample_index + 1``, ``sample_index + 2``, ...) are rendered the same way and concatenated, in order,
  until `seq_len` tokens are reached; there is no wrap-around, so running off the end is an error. The
  result is truncated to exactly `seq_len` tokens.
* **token-ID file** -- a safetensors file with an integer ``input_ids`` tensor of shape ``[T]`` or ``[1, T]``,
  or a ``.json`` file holding a flat list of ints. It must hold at least `seq_len` tokens; the first
  `seq_len` are used.

The prompt is an int32 tensor ``[seq_len]``; its pin is :func:`mixquant.calibration.tokens.token_ids_sha256`
(little-endian int32, C order, no header).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mixquant.calibration.sample import render_chat
from mixquant.calibration.tokens import as_int32_ids, load_token_ids, token_ids_sha256
from mixquant.keys.hashing import require_sha256_hex

log = logging.getLogger(__name__)


class PromptPinError(ValueError):
    """The prompt's token IDs do not hash to the pinned SHA-256."""


def build_prompt(
    *,
    seq_len: int,
    conversations: Sequence[list[dict]] | None = None,
    tokenizer: Any = None,
    sample_index: int | None = None,
    token_ids_file: str | Path | None = None,
) -> torch.Tensor:
    """Build the int32 ``[seq_len]`` prompt from a chat sample or a token-ID file (see module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: expected a positive int, got {seq_len!r}")
    chat_args = (conversations, tokenizer, sample_index)
    if token_ids_file is not None:
        if any(a is not None for a in chat_args):
            raise ValueError(
                "build_prompt: give either token_ids_file= or conversations/tokenizer/sample_index"
            )
        return _from_file(Path(token_ids_file), seq_len)
    if any(a is None for a in chat_args):
        raise ValueError(
            "build_prompt: a chat-sample prompt needs conversations=, tokenizer= and sample_index="
        )
    return _from_chat(conversations, tokenizer, sample_index, seq_len)


def _from_chat(
    conversations: Sequence[list[dict]], tokenizer: Any, sample_index: int, seq_len: int
) -> torch.Tensor:
    n = len(conversations)
    if isinstance(sample_index, bool) or not isinstance(sample_index, int) or not 0 <= sample_index < n:
        raise ValueError(f"sample_index: expected an int in [0, {n}), got {sample_index!r}")
    ids: list[int] = []
    index = sample_index
    while len(ids) < seq_len:
        if index >= n:
            raise ValueError(
                f"conversations {sample_index}..{n - 1} render to only {len(ids)} tokens; "
                f"the prompt needs {seq_len}"
            )
        ids.extend(render_chat(tokenizer, conversations[index]))
        index += 1
    return as_int32_ids(torch.tensor(ids[:seq_len], dtype=torch.int64), what="prompt token IDs")


def _from_file(path: Path, seq_len: int) -> torch.Tensor:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt token-ID file not found")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in data
        ):
            raise ValueError(f"{path}: expected a JSON list of integer token IDs")
        if not data:
            raise ValueError(f"{path}: holds 0 tokens; the prompt needs {seq_len}")
        if min(data) < -(2**31) or max(data) > 2**31 - 1:
            raise ValueError(f"{path}: token IDs outside the int32 range")
        ids = torch.tensor(data, dtype=torch.int64)
    else:
        ids = load_token_ids(path)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"{path}: input_ids must have shape [T] or [1, T], got {list(ids.shape)}")
    if ids.numel() < seq_len:
        raise ValueError(f"{path}: holds {ids.numel()} tokens; the prompt needs {seq_len}")
    return as_int32_ids(ids[:seq_len], what=f"{path}: input_ids")


def check_prompt_pin(ids: torch.Tensor, pinned_sha256: str | None) -> dict:
    """Compare the prompt's token-ID hash with its pin.

    Returns ``{"sha256", "pinned_sha256", "pin_status"}`` with status ``"match"`` or ``"not pinned"`` (a
    missing pin logs a warning). A mismatch raises :class:`PromptPinError` with one line giving both hashes.
    """
    got = token_ids_sha256(ids)
    if pinned_sha256 is None or pinned_sha256 == "":
        log.warning(
            "prompt token IDs are not pinned: SHA-256 %s (pin it to detect tokenizer/data drift)", got
        )
        return {"sha256": got, "pinned_sha256": None, "pin_status": "not pinned"}
    pin = require_sha256_hex(pinned_sha256, "pinned prompt SHA-256")
    if got != pin:
        raise PromptPinError(
            f"prompt token IDs SHA-256 {got} does not match the pinned {pin} "
            "(tokenizer, chat template, source data or seq_len changed)"
        )
    return {"sha256": got, "pinned_sha256": pin, "pin_status": "match"}
