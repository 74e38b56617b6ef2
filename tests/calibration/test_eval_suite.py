"""The evaluation suite's windows and the content check that keeps them out of the calibration data."""

from __future__ import annotations

import pytest
from mixquant.calibration.disjoint import MIN_UNIT_CHARS, EvalOverlapError, check_disjoint, document_sha256
from mixquant.calibration.eval_suite import EvalSuiteError, draw_domain
from transformers import AutoTokenizer

from tests.workflow.conftest import REPO

LONG = "a sentence long enough to count as content of its own, " * 2


def chat(*contents: str) -> dict:
    return {
        "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)
        ]
    }


def test_a_document_sharing_a_calibration_message_is_refused_in_one_line():
    calibration = [chat("What is x?", LONG), chat("y", "z")]
    domains = {
        "docs": ([{"text": "entirely new prose " * 4}], "text", None),
        "chat": (
            [chat("new question " * 4), chat("another", "  " + LONG.replace(" ", "  "))],
            None,
            "messages",
        ),
    }
    with pytest.raises(EvalOverlapError) as error:
        check_disjoint(domains, (calibration, "messages"), where={"chat": "chat.jsonl"})
    line = str(error.value)
    assert "\n" not in line
    assert (
        "kld.eval domain 'chat': document 1 of chat.jsonl shares content with the calibration dataset" in line
    )


def test_short_units_do_not_count_and_domains_must_not_share():
    calibration = [chat("Yes.", "No.")]
    short = {"t": ([{"text": "Yes."}], "text", None)}  # shorter than MIN_UNIT_CHARS: not content
    assert len("Yes.") < MIN_UNIT_CHARS
    assert check_disjoint(short, (calibration, "messages"))["shared"] == 0
    twice = {"a": ([{"text": LONG}], "text", None), "b": ([chat("q", LONG)], None, "messages")}
    with pytest.raises(EvalOverlapError, match="domain 'b': document 0 of b shares content with domain 'a'"):
        check_disjoint(twice, (calibration, "messages"))


def test_document_identity_ignores_whitespace_only():
    assert document_sha256({"text": "a  b\nc"}, "text", None) == document_sha256(
        {"text": "a b c"}, "text", None
    )
    assert document_sha256({"text": "a b c"}, "text", None) != document_sha256(
        {"text": "a b d"}, "text", None
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(REPO / "data" / "toy-laguna"))


def test_windows_are_the_first_tokens_of_seeded_documents(tokenizer):
    rows = [{"text": f"document {i} " + "word " * (20 + 10 * i)} for i in range(12)]
    domain = {"name": "docs", "text_field": "text", "messages_field": None, "windows": 4}
    first = draw_domain(tokenizer, rows, domain, 0, window_tokens=32, seed=0)
    again = draw_domain(tokenizer, rows, domain, 0, window_tokens=32, seed=0)
    other = draw_domain(tokenizer, rows, domain, 0, window_tokens=32, seed=1)
    assert first == again and first != other
    windows, documents = first
    assert len(windows) == 4 and all(len(w) == 32 for w in windows)
    assert len({d["document"] for d in documents}) == 4  # one window per document
    for window, doc in zip(windows, documents, strict=True):
        assert window == tokenizer(rows[doc["document"]]["text"])["input_ids"][:32]
    with pytest.raises(EvalSuiteError, match="domain 'docs': only 0 of its 12 documents have 4096 tokens"):
        draw_domain(tokenizer, rows, domain, 0, window_tokens=4096, seed=0)
