"""Deterministic calibration sampling through the chat template."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mixquant.calibration.sample import render_chat, sample_calibration, visit_order

SEQ = 64


class CountingTokenizer:
    """Wraps a tokenizer and counts apply_chat_template calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def test_render_matches_template_text(chat_tokenizer, make_conversation):
    conv = make_conversation(3, 2)
    ids = render_chat(chat_tokenizer, conv)
    text = chat_tokenizer.decode(ids)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)


def test_render_accepts_plain_list_and_batched_returns(make_conversation):
    class ListTok:
        def apply_chat_template(self, messages, **kw):
            assert kw == {"tokenize": True, "add_generation_prompt": False}
            assert all(None not in m.values() for m in messages)
            return [7, 8, 9]

    class BatchTok:
        def apply_chat_template(self, messages, **kw):
            return {"input_ids": [[4, 5]]}

    conv = [dict(m, name=None) for m in make_conversation(0, 1)]  # Arrow-style None fill is dropped
    assert render_chat(ListTok(), conv) == [7, 8, 9]
    assert render_chat(BatchTok(), conv) == [4, 5]


def test_shape_dtype_and_determinism(chat_tokenizer, mixed_conversations):
    a = sample_calibration(mixed_conversations, chat_tokenizer, num_samples=6, seq_len=SEQ, seed=0)
    b = sample_calibration(mixed_conversations, chat_tokenizer, num_samples=6, seq_len=SEQ, seed=0)
    c = sample_calibration(mixed_conversations, chat_tokenizer, num_samples=6, seq_len=SEQ, seed=1)
    assert a.dtype == torch.int32 and a.shape == (6, SEQ)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_visit_order_is_pcg64_permutation():
    expected = np.random.Generator(np.random.PCG64(5)).permutation(10)
    assert np.array_equal(visit_order(10, 5), expected)
    with pytest.raises(ValueError):
        visit_order(10, -1)


def test_long_conversation_gives_its_first_seq_len_tokens(chat_tokenizer, make_conversation):
    convs = [make_conversation(i, 80) for i in range(5)]
    out = sample_calibration(convs, chat_tokenizer, num_samples=5, seq_len=SEQ, seed=3)
    order = visit_order(5, 3)
    for row, index in zip(out, order, strict=True):
        assert row.tolist() == render_chat(chat_tokenizer, convs[int(index)])[:SEQ]


def test_pack_concatenates_short_conversations_in_visit_order(chat_tokenizer, short_conversations):
    out = sample_calibration(short_conversations, chat_tokenizer, num_samples=3, seq_len=SEQ, seed=7)
    order = [int(i) for i in visit_order(len(short_conversations), 7)]
    expected, buffer = [], []
    for index in order:
        buffer += render_chat(chat_tokenizer, short_conversations[index])
        if len(buffer) >= SEQ:
            expected.append(buffer[:SEQ])  # the last conversation is truncated, its remainder dropped
            buffer = []
        if len(expected) == 3:
            break
    assert out.tolist() == expected
    # every sample starts at a conversation boundary
    start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(row[0] == start for row in out.tolist())


def test_skip_ignores_short_conversations(chat_tokenizer, mixed_conversations, short_conversations):
    skip = sample_calibration(
        mixed_conversations, chat_tokenizer, num_samples=10, seq_len=SEQ, seed=2, short_policy="skip"
    )
    long_rows = {tuple(render_chat(chat_tokenizer, c)[:SEQ]) for c in mixed_conversations[::2]}
    assert {tuple(r) for r in skip.tolist()} == long_rows
    with pytest.raises(ValueError, match=r"only 0 of 1 calibration samples"):
        sample_calibration(
            short_conversations, chat_tokenizer, num_samples=1, seq_len=SEQ, seed=0, short_policy="skip"
        )
    packed = sample_calibration(short_conversations, chat_tokenizer, num_samples=1, seq_len=SEQ, seed=0)
    assert packed.shape == (1, SEQ)


def test_running_out_reports_how_many_could_be_made(chat_tokenizer, mixed_conversations):
    # 10 long conversations give 10 samples; 10 short ones (~40 tokens) pack into at most 5 more
    with pytest.raises(ValueError) as err:
        sample_calibration(mixed_conversations, chat_tokenizer, num_samples=100, seq_len=SEQ, seed=0)
    message = str(err.value)
    assert "\n" not in message
    assert "of 100 calibration samples" in message and "20 conversations" in message
    made = int(message.split()[1])
    assert 10 <= made < 20


def test_stops_rendering_once_enough_samples(chat_tokenizer, make_conversation):
    convs = [make_conversation(i, 80) for i in range(200)]
    counting = CountingTokenizer(chat_tokenizer)
    sample_calibration(convs, counting, num_samples=4, seq_len=SEQ, seed=0)
    assert counting.calls == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_samples": 0, "seq_len": SEQ, "seed": 0},
        {"num_samples": 1, "seq_len": 0, "seed": 0},
        {"num_samples": 1, "seq_len": SEQ, "seed": 0, "short_policy": "pad"},
        {"num_samples": 1, "seq_len": SEQ, "seed": -1},
    ],
)
def test_argument_validation(chat_tokenizer, short_conversations, kwargs):
    with pytest.raises(ValueError):
        sample_calibration(short_conversations, chat_tokenizer, **kwargs)
