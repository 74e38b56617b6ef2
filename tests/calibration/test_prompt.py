"""The fixed evaluation prompt and its pin."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest
import torch
from mixquant.calibration.prompt import PromptPinError, build_prompt, check_prompt_pin
from mixquant.calibration.sample import render_chat
from mixquant.calibration.tokens import save_token_ids, token_ids_sha256

SEQ = 64


def test_chat_prompt_is_deterministic_and_exact_length(chat_tokenizer, mixed_conversations):
    a = build_prompt(seq_len=SEQ, conversations=mixed_conversations, tokenizer=chat_tokenizer, sample_index=2)
    b = build_prompt(seq_len=SEQ, conversations=mixed_conversations, tokenizer=chat_tokenizer, sample_index=2)
    assert a.dtype == torch.int32 and a.shape == (SEQ,)
    assert torch.equal(a, b)
    assert a.tolist() == render_chat(chat_tokenizer, mixed_conversations[2])[:SEQ]
    other = build_prompt(
        seq_len=SEQ, conversations=mixed_conversations, tokenizer=chat_tokenizer, sample_index=4
    )
    assert not torch.equal(a, other)


def test_short_chat_sample_continues_with_following_conversations(chat_tokenizer, short_conversations):
    out = build_prompt(
        seq_len=SEQ, conversations=short_conversations, tokenizer=chat_tokenizer, sample_index=5
    )
    expected = render_chat(chat_tokenizer, short_conversations[5])
    assert len(expected) < SEQ
    expected += render_chat(chat_tokenizer, short_conversations[6])
    expected += render_chat(chat_tokenizer, short_conversations[7])
    assert out.tolist() == expected[:SEQ]


def test_chat_prompt_running_off_the_end(chat_tokenizer, short_conversations):
    with pytest.raises(ValueError, match=r"conversations 39\.\.39 render to only \d+ tokens") as err:
        build_prompt(
            seq_len=SEQ, conversations=short_conversations, tokenizer=chat_tokenizer, sample_index=39
        )
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="sample_index"):
        build_prompt(
            seq_len=SEQ, conversations=short_conversations, tokenizer=chat_tokenizer, sample_index=40
        )


def test_source_arguments_are_exclusive(chat_tokenizer, short_conversations, tmp_path):
    with pytest.raises(ValueError, match="needs conversations"):
        build_prompt(seq_len=SEQ, conversations=short_conversations, tokenizer=chat_tokenizer)
    with pytest.raises(ValueError, match="either token_ids_file"):
        build_prompt(seq_len=SEQ, token_ids_file=tmp_path / "x.json", tokenizer=chat_tokenizer)


@pytest.mark.parametrize("shape", [(100,), (1, 100)])
def test_safetensors_token_file(tmp_path, shape):
    ids = torch.arange(100, dtype=torch.int64).reshape(shape) + 3
    path = tmp_path / "prompt.safetensors"
    save_token_ids(path, ids, {"source": "test"})
    out = build_prompt(seq_len=SEQ, token_ids_file=path)
    assert out.dtype == torch.int32 and out.shape == (SEQ,)
    assert out.tolist() == list(range(3, 3 + SEQ))


def test_safetensors_token_file_bad_shape(tmp_path):
    path = tmp_path / "prompt.safetensors"
    save_token_ids(path, torch.zeros(2, 100, dtype=torch.int32), {})
    with pytest.raises(ValueError, match=r"shape \[T\] or \[1, T\]"):
        build_prompt(seq_len=SEQ, token_ids_file=path)


def test_json_token_file(tmp_path):
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(list(range(70))))
    assert build_prompt(seq_len=SEQ, token_ids_file=path).tolist() == list(range(SEQ))
    path.write_text(json.dumps([1, 2.5]))
    with pytest.raises(ValueError, match="list of integer token IDs"):
        build_prompt(seq_len=SEQ, token_ids_file=path)


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_token_file_too_short_is_one_line_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"short{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(list(range(10))))
    else:
        save_token_ids(path, torch.arange(10), {})
    with pytest.raises(ValueError) as err:
        build_prompt(seq_len=SEQ, token_ids_file=path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "holds 10 tokens" in message and str(SEQ) in message


def test_pin_match(chat_tokenizer, mixed_conversations):
    ids = build_prompt(
        seq_len=SEQ, conversations=mixed_conversations, tokenizer=chat_tokenizer, sample_index=0
    )
    expected = hashlib.sha256(np.asarray(ids.tolist(), dtype="<i4").tobytes()).hexdigest()
    assert token_ids_sha256(ids) == expected
    assert check_prompt_pin(ids, expected) == {
        "sha256": expected,
        "pinned_sha256": expected,
        "pin_status": "match",
    }


def test_pin_mismatch_is_one_line_with_both_hashes():
    ids = torch.arange(SEQ, dtype=torch.int32)
    got = token_ids_sha256(ids)
    pin = "f" * 64
    with pytest.raises(PromptPinError) as err:
        check_prompt_pin(ids, pin)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"prompt token IDs SHA-256 {got} does not match the pinned {pin}")
    assert isinstance(err.value, ValueError)


def test_pin_must_be_hex():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        check_prompt_pin(torch.arange(4), "not-a-hash")


def test_missing_pin_warns(caplog):
    ids = torch.arange(SEQ, dtype=torch.int32)
    with caplog.at_level(logging.WARNING, logger="mixquant.calibration.prompt"):
        result = check_prompt_pin(ids, None)
    assert result == {"sha256": token_ids_sha256(ids), "pinned_sha256": None, "pin_status": "not pinned"}
    assert any("not pinned" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
