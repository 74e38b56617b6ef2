"""data/eval: the toy's evaluation corpus is what its README pins, long enough, held out from calibration."""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
import string
import sys
from pathlib import Path

import pytest
from mixquant.calibration.disjoint import check_disjoint as planning_check_disjoint
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "data" / "eval"
CALIBRATION = REPO / "data" / "corpus" / "python-stdlib-chat.jsonl"
DOMAINS = ("docs", "code", "chat")
TEXT_DOMAINS = ("docs", "code")


@pytest.fixture(scope="module")
def tool():
    """tools/make_eval_corpus.py as a module (it imports tools/make_corpus.py beside it)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module("make_eval_corpus")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.fixture(scope="module")
def readme() -> str:
    return (EVAL_DIR / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def domains() -> dict[str, list[dict]]:
    return {
        name: [json.loads(line) for line in (EVAL_DIR / f"{name}.jsonl").read_text("utf-8").splitlines()]
        for name in DOMAINS
    }


@pytest.fixture(scope="module")
def calibration() -> list[dict]:
    return [json.loads(line) for line in CALIBRATION.read_text("utf-8").splitlines()]


def test_files_are_what_the_readme_pins(readme):
    for name in DOMAINS:
        raw = (EVAL_DIR / f"{name}.jsonl").read_bytes()
        row = re.search(rf"\| `{name}\.jsonl` \| (\d+) \| (\d+) \| `([0-9a-f]{{64}})` \|", readme)
        assert row, f"README.md has no row for {name}.jsonl"
        records, size, sha = int(row.group(1)), int(row.group(2)), row.group(3)
        assert hashlib.sha256(raw).hexdigest() == sha
        assert len(raw) == size <= 400_000
        assert raw.count(b"\n") == records and raw.endswith(b"\n") and b"\r" not in raw


def test_shapes(domains):
    for name in TEXT_DOMAINS:
        for document in domains[name]:
            assert list(document) == ["text"] and isinstance(document["text"], str)
    for document in domains["chat"]:
        assert list(document) == ["messages"]
        roles = [m["role"] for m in document["messages"]]
        assert roles[0::2] == ["user"] * len(roles[0::2]) and roles[1::2] == ["assistant"] * len(roles[1::2])
        assert len(roles) % 2 == 0
        assert all(set(m) == {"role", "content"} and m["content"].strip() for m in document["messages"])


def test_every_domain_has_64_documents_of_512_toy_tokens(domains):
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data" / "toy-laguna"))
    for name, documents in domains.items():
        assert 64 <= len(documents) <= 96, name
        if name == "chat":
            lengths = [
                len(tokenizer.apply_chat_template(d["messages"], tokenize=True)["input_ids"])
                for d in documents
            ]
        else:
            lengths = [len(tokenizer(d["text"])["input_ids"]) for d in documents]
        assert min(lengths) >= 512, name


def test_disjoint_from_calibration_and_between_domains(tool, domains, calibration):
    tool.check_disjoint(domains, calibration, CALIBRATION.name)  # raises on any shared content
    counts = planning_check_disjoint(
        {name: (domains[name], "text", None) for name in TEXT_DOMAINS}
        | {"chat": (domains["chat"], None, "messages")},
        (calibration, "messages"),
    )
    assert counts["shared"] == 0 and counts["eval_units"] > 3 * 64


def _words(seed: int, length: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase + "     \n") for _ in range(length))


@pytest.mark.parametrize("shared, found", [(200, True), (199, False), (450, True)])
def test_passage_index_finds_exactly_200_shared_characters(tool, shared, found):
    passage = " ".join(_words(1, 2 * shared).split())[:shared]
    indexed = " ".join(_words(2, 777).split()) + "#" + passage + "%" + " ".join(_words(3, 300).split())
    checked = " ".join(_words(4, 333).split()) + "&" + passage + "@" + " ".join(_words(5, 50).split())
    index = tool.PassageIndex()
    index.add("calibration conversation 7", indexed)
    assert (index.shared(checked) == "calibration conversation 7") is found


def test_overlap_stops_the_build_in_one_line(tool, domains, calibration):
    """A document holding a calibration answer (reflowed) or another domain's document is named, refused."""
    answer = next(m["content"] for c in calibration for m in c["messages"] if len(m["content"]) > 600)
    leaking = dict(domains, code=domains["code"] + [{"text": "# intro\n" + "\n  ".join(answer.split(" "))}])
    with pytest.raises(tool.OverlapError, match=r"^code\.jsonl document 80 shares content with python-"):
        tool.check_disjoint(leaking, calibration, CALIBRATION.name)
    copied = dict(domains, docs=domains["docs"] + [{"text": domains["code"][3]["text"]}])
    with pytest.raises(tool.OverlapError) as error:
        tool.check_disjoint(copied, calibration, CALIBRATION.name)
    assert "code.jsonl document 3" in str(error.value) and "\n" not in str(error.value)
    excerpt = {"text": "Intro. " + domains["docs"][0]["text"][:150] + " Outro."}  # < 200 shared: allowed
    tool.check_disjoint(dict(domains, code=domains["code"] + [excerpt]), calibration, CALIBRATION.name)


def test_regenerates_byte_identical(tool, readme, tmp_path):
    made_with = re.search(r"Generated with CPython (3\.\d+\.\d+)", readme).group(1)
    running = sys.version.split()[0]
    if running != made_with:
        pytest.skip(f"the files were made with CPython {made_with}, this is {running}")
    assert tool.main(["--out-dir", str(tmp_path)]) == 0
    for name in DOMAINS:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (EVAL_DIR / f"{name}.jsonl").read_bytes(), name
