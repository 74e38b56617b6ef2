"""Loading pinned chat datasets through `datasets`."""

from __future__ import annotations

import hashlib

import pytest
from mixquant.calibration.dataset import (
    ConversationView,
    DatasetPinError,
    conversations,
    load_chat_dataset,
)


@pytest.fixture
def chat_file(tmp_path, make_conversation, write_jsonl):
    rows = [{"messages": make_conversation(i, 3), "id": i} for i in range(12)]
    return write_jsonl(tmp_path / "chat.jsonl", rows), rows


def test_local_load_with_matching_pin(chat_file, tmp_path):
    path, rows = chat_file
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    ds = load_chat_dataset(path=path, sha256=sha, cache_dir=tmp_path / "cache")
    assert len(ds) == len(rows)
    assert "messages" in ds.column_names
    convs = conversations(ds)
    assert convs == [r["messages"] for r in rows]
    view = ConversationView(ds)
    assert len(view) == len(rows)
    assert view[3] == rows[3]["messages"]
    assert view[1:3] == [rows[1]["messages"], rows[2]["messages"]]


def test_local_pin_mismatch_is_one_line_naming_file_and_both_hashes(chat_file, tmp_path):
    path, _ = chat_file
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    wrong = "0" * 64
    with pytest.raises(DatasetPinError) as err:
        load_chat_dataset(path=path, sha256=wrong, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and got in message and wrong in message
    assert isinstance(err.value, ValueError)
    assert not (tmp_path / "cache").exists()  # refused before anything was loaded


def test_malformed_pin_is_refused(chat_file, tmp_path):
    path, _ = chat_file
    with pytest.raises(ValueError, match="64 lowercase hex"):
        load_chat_dataset(path=path, sha256="abc", cache_dir=tmp_path / "cache")


def test_exactly_one_source(chat_file, tmp_path):
    path, _ = chat_file
    for kwargs in ({}, {"path": path, "hub_repo": "org/data", "revision": "a" * 40}):
        with pytest.raises(ValueError, match="exactly one of") as err:
            load_chat_dataset(cache_dir=tmp_path / "cache", **kwargs)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("revision", [None, "main", "v1.0", "a" * 39, "A" * 40, "g" * 40])
def test_hub_refuses_unpinned_revision(revision, tmp_path):
    with pytest.raises(DatasetPinError, match="refusing unpinned revision") as err:
        load_chat_dataset(hub_repo="org/data", revision=revision, cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_pinned_hub_revision_reaches_load_dataset(monkeypatch, tmp_path, make_conversation):
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"messages": make_conversation(0, 2)}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    sha = "0123456789abcdef0123456789abcdef01234567"
    ds = load_chat_dataset(
        hub_repo="org/chat", name="default", revision=sha, split="test", cache_dir=tmp_path
    )
    assert len(ds) == 1
    assert calls == [
        (("org/chat", "default"), {"revision": sha, "split": "test", "cache_dir": str(tmp_path)})
    ]


def test_missing_messages_field(chat_file, tmp_path):
    path, _ = chat_file
    with pytest.raises(ValueError, match="no 'conversation' column") as err:
        load_chat_dataset(path=path, messages_field="conversation", cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_rows_must_be_role_content_lists(tmp_path, make_conversation, write_jsonl):
    rows = [{"messages": make_conversation(0, 2)}, {"messages": [{"role": "user", "text": "hi"}]}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 1 field 'messages'.*'content'") as err:
        load_chat_dataset(path=path, cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_chat_dataset(path=tmp_path / "nope.jsonl", cache_dir=tmp_path / "cache")


def test_default_cache_is_temporary(chat_file):
    """Without cache_dir the Arrow files go to a private temporary directory, not the global HF cache."""
    import datasets

    path, rows = chat_file
    ds = load_chat_dataset(path=path)
    assert len(ds) == len(rows)
    files = [f["filename"] for f in ds.cache_files]
    assert files and all("mixquant-datasets-" in f for f in files)
    assert not any(f.startswith(str(datasets.config.HF_DATASETS_CACHE)) for f in files)


def test_committed_corpus_matches_its_readme_and_loads(tmp_path):
    """data/corpus/python-stdlib-chat.jsonl is what its README says, and is a valid chat dataset."""
    import re
    from pathlib import Path

    corpus_dir = Path(__file__).resolve().parents[2] / "data" / "corpus"
    path = corpus_dir / "python-stdlib-chat.jsonl"
    readme = (corpus_dir / "README.md").read_text(encoding="utf-8")
    raw = path.read_bytes()
    sha = re.search(r"SHA-256 \| `([0-9a-f]{64})`", readme).group(1)
    size = int(re.search(r"Size \| (\d+) bytes", readme).group(1))
    records = int(re.search(r"Records \| (\d+) conversations", readme).group(1))
    assert hashlib.sha256(raw).hexdigest() == sha
    assert len(raw) == size and len(raw) >= 1_000_000
    assert raw.count(b"\n") == records and raw.endswith(b"\n") and b"\r" not in raw
    ds = load_chat_dataset(path=path, sha256=sha, cache_dir=tmp_path / "cache")
    assert len(ds) == records and ds.column_names == ["messages"]
