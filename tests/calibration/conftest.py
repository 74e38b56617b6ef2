"""Fixtures for the calibration tests: a tiny chat tokenizer and small chat corpora (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_text() -> list[str]:
    words = (
        "the quick brown fox jumps over a lazy dog while python code runs tests and returns values".split()
    )
    lines = []
    for i in range(300):
        lines.append(" ".join(words[(i + k) % len(words)] for k in range(3 + i % 7)) + f" {i}")
    return lines


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE (~300 tokens) trained in a fraction of a second, with a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _make_conversation(i: int, words: int) -> list[dict]:
    """A deterministic two-message conversation whose user turn has about `words` words."""
    body = " ".join(f"w{(i * 7 + k) % 97}" for k in range(words))
    return [
        {"role": "user", "content": f"question {i}: {body}"},
        {"role": "assistant", "content": f"answer {i}."},
    ]


@pytest.fixture
def short_conversations() -> list[list[dict]]:
    """40 short conversations (each well under 64 tokens)."""
    return [_make_conversation(i, 2 + i % 3) for i in range(40)]


@pytest.fixture
def mixed_conversations() -> list[list[dict]]:
    """Alternating long (>> 64 tokens) and short conversations."""
    return [_make_conversation(i, 80 if i % 2 == 0 else 2) for i in range(20)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def make_conversation():
    """make_conversation(i, words) -> a deterministic [user, assistant] conversation."""
    return _make_conversation


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, rows) -> path, one sorted-key JSON object per line."""
    return _write_jsonl
