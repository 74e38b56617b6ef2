"""The toy tokenizer: deterministic byte-level BPE with real special tokens and a ChatML chat template."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from mixquant.model.tokenizer import (
    BOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SAVE_KWARGS,
    SPECIAL_TOKENS,
    conversation_texts,
    render_conversation,
    special_token_ids,
    train_tokenizer,
)
from transformers import AutoTokenizer


def stdlib_conversations(limit: int = 300) -> list[list[dict]]:
    """Chat conversations from stdlib docstrings: deterministic for a Python version, no downloads."""
    import collections
    import functools
    import itertools
    import json as json_module
    import pathlib
    import textwrap

    convs = []
    for module in (json_module, collections, functools, itertools, pathlib, textwrap):
        for name, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if not name.startswith("_") else None
            if doc and len(doc) > 40 and (inspect.isclass(obj) or inspect.isfunction(obj)):
                convs.append(
                    [
                        {"role": "user", "content": f"What does `{module.__name__}.{name}` do?"},
                        {"role": "assistant", "content": doc},
                    ]
                )
    return convs[:limit]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(conversation_texts(stdlib_conversations()))


@pytest.fixture(scope="module")
def tokenizer(texts):
    return train_tokenizer(texts, vocab_size=512)


def test_vocab_size_and_special_token_ids(tokenizer):
    assert len(tokenizer) == 512
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert special_token_ids(tokenizer) == {"bos_token_id": 0, "eos_token_id": [0, 3], "pad_token_id": 1}
    # every special token is one id, never split into bytes
    for token in SPECIAL_TOKENS:
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [
            tokenizer.convert_tokens_to_ids(token)
        ]


def test_training_is_deterministic(tmp_path, texts, tokenizer):
    again = train_tokenizer(texts, vocab_size=512)
    for out, tok in (("a", tokenizer), ("b", again)):
        tok.save_pretrained(tmp_path / out, **SAVE_KWARGS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_training_is_deterministic_across_processes(tmp_path, texts, tokenizer):
    """A fresh interpreter (own rayon pool, parallelism env unset) trains byte-identical files."""
    corpus = tmp_path / "texts.json"
    corpus.write_text(json.dumps(texts))
    script = (
        "import json, sys\n"
        "from mixquant.model.tokenizer import train_tokenizer, SAVE_KWARGS\n"
        "texts = json.load(open(sys.argv[1]))\n"
        "train_tokenizer(texts, vocab_size=512).save_pretrained(sys.argv[2], **SAVE_KWARGS)\n"
    )
    env_script = ["env", "-u", "TOKENIZERS_PARALLELISM", sys.executable, "-c", script]
    subprocess.run([*env_script, str(corpus), str(tmp_path / "child")], check=True)
    tokenizer.save_pretrained(tmp_path / "here", **SAVE_KWARGS)
    assert (tmp_path / "child/tokenizer.json").read_bytes() == (tmp_path / "here/tokenizer.json").read_bytes()


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = render_conversation(tokenizer, messages)
    assert rendered == f"{BOS_TOKEN}{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi{IM_END}\n"
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + f"{IM_START}assistant\n"


def test_chat_template_roundtrip_through_ids(tokenizer):
    messages = stdlib_conversations(3)[2]
    rendered = render_conversation(tokenizer, messages)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == len(messages)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == len(messages)
    assert tokenizer.decode(ids) == rendered
    # arbitrary bytes survive (byte-level BPE has no unknown token)
    odd = "tab\tnul-free ünïcödé ✓ 漢字 \r\n    indent"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd


def test_saved_tokenizer_reloads_with_template(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path, **SAVE_KWARGS)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" in config and not (tmp_path / "chat_template.jinja").exists()
    assert config["bos_token"] == BOS_TOKEN and config["pad_token"] == PAD_TOKEN
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = stdlib_conversations(2)[1]
    assert reloaded.apply_chat_template(messages, tokenize=False) == render_conversation(tokenizer, messages)
    text = render_conversation(tokenizer, messages)
    assert (
        reloaded(text, add_special_tokens=False)["input_ids"]
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert (reloaded.bos_token_id, reloaded.pad_token_id) == (0, 1)


def test_rejects_tiny_vocab(texts):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, vocab_size=100)
