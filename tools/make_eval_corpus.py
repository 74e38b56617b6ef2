#!/usr/bin/env python
"""Build the toy's KLD evaluation corpus: three license-clean domains, disjoint from calibration by content.

Everything comes from the running CPython 3.11's own standard library directory
(``sysconfig.get_paths()["stdlib"]``), read as text and parsed with :mod:`ast`; no module is imported.
The calibration corpus (``data/corpus/python-stdlib-chat.jsonl``, built by ``tools/make_corpus.py``) skips
exactly the parts used here, so the two share no source:

* ``docs.jsonl`` -- ``{"text": ...}``: prose of the Python documentation, from ``pydoc_data/topics.py``
  (the language-reference and built-in-types topics that ``help()`` shows), cut into documents at
  paragraph boundaries;
* ``chat.jsonl`` -- ``{"messages": [...]}``: the other half of those topic passages, each asked about by a
  user and given by the assistant in two turns, with question and follow-up sentences written for this
  tool (none of ``tools/make_corpus.py``'s templates);
* ``code.jsonl`` -- ``{"text": ...}``: whole top-level function and class sources from ``idlelib`` and
  ``tkinter``, keeping only files whose header names no copyright holder but the PSF and carries no other
  licence text (the header rules of ``tools/make_corpus.py``, without its exception for "Licensed to PSF
  under a Contributor Agreement" notices: that drops ``tkinter/simpledialog.py``).

Rules for every document: at least :data:`MIN_TOKENS` tokens of the toy tokenizer (``data/toy-laguna``; a
chat document measured through its chat template), at most :data:`DOCUMENTS` per domain, spread evenly
over the candidates. Disjointness, by content, whitespace-normalised: no document or message equal to a
calibration document or message, and no :data:`SHARED_CHARS`-character passage shared with the
calibration corpus or between two documents of this corpus (see :class:`PassageIndex`). Candidates that
break a rule are dropped while building; the written files are then checked again from scratch, and the
tool fails with one line naming the document if the check finds anything.

Determinism: sorted inputs and hash-based choices, no randomness; on the same Python patch version the
output is byte-identical (``--check`` compares against the committed files without writing).

Usage::

    .venv/bin/python tools/make_eval_corpus.py
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from make_corpus import _COPYRIGHT, _NOT_A_NOTICE, _OTHER_LICENSE, _header_text
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
MIN_TOKENS = 512  # every document holds at least one 512-token window
PROSE_TARGET_TOKENS = 560  # a prose document closes at the first paragraph end past this
MAX_DOC_CHARS = 6000  # longer candidates (huge tables, long classes) are skipped: size, not content
DOCUMENTS = 80  # per domain at most, spread evenly over the candidates
MIN_DOCUMENTS = 64  # per domain at least, or the tool fails
SHARED_CHARS = 200  # the content rule: no passage this long in common (whitespace-normalised)
MIN_DEDUP_PARAGRAPH = 80  # shorter paragraphs ("Changed in version 3.8.") repeat legitimately
# pdb's documentation: the calibration corpus holds pdb's docstrings, which repeat it nearly word for word
# (the only topic sharing even 100-character passages with the calibration corpus).
SKIP_TOPICS = {"debugger"}
CODE_DIRS = ("idlelib", "tkinter")
CODE_SKIP_DIRS = {"idle_test", "test", "tests", "__pycache__"}
DOMAINS = ("docs", "code", "chat")

ASK = [
    "I'm reading the Python reference on {subject}. What does it say?",
    "Walk me through {subject}, the way the official Python documentation explains it.",
    "How does the Python documentation describe {subject}?",
    "Could you go over {subject} in Python for me?",
    "I need the details on {subject}. What do the docs cover there?",
    "Where can I learn about {subject}? Please quote the documentation.",
]
LEAD = [
    "Here is the relevant part of the documentation.",
    "The documentation covers it like this:",
    "Sure. This is what the reference says:",
    "Of course, here it is:",
]
FOLLOW = [
    "Please continue.",
    "What else does that section say?",
    "Go on, I'd like to read the rest.",
    "And after that?",
    "Keep going, please.",
]


class OverlapError(ValueError):
    """A document shares content with the calibration corpus or with another document (one line)."""


def normalized(text: str) -> str:
    return " ".join(text.split())


def _pick(options: Sequence[str], key: str) -> str:
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


# ---------------------------------------------------------------------------------------------
# The content rule
# ---------------------------------------------------------------------------------------------

# Keys of KEY_CHARS characters every STRIDE characters of an indexed text: any common passage of
# SHARED_CHARS characters contains one whole key (KEY_CHARS + STRIDE - 1 == SHARED_CHARS), and each key
# hit is extended both ways to the full common run, so the check is exact, not probabilistic.
KEY_CHARS = SHARED_CHARS // 2 + 1
STRIDE = SHARED_CHARS - KEY_CHARS + 1


def _common_run(a: str, i: int, b: str, j: int) -> int:
    """Length of the common run of a and b through the equal keys at a[i:] and b[j:]."""
    back = 0
    while i - back > 0 and j - back > 0 and a[i - back - 1] == b[j - back - 1]:
        back += 1
    ahead = KEY_CHARS
    while i + ahead < len(a) and j + ahead < len(b) and a[i + ahead] == b[j + ahead]:
        ahead += 1
    return back + ahead


class PassageIndex:
    """Whitespace-normalised texts, hashed as character shingles, asked for shared passages.

    ``add`` stores a text's keys (``dict`` keys: hashed shingles); ``shared`` scans a text's every
    position and returns the label of the first indexed text that has at least :data:`SHARED_CHARS`
    consecutive characters in common with it, or None.
    """

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._labels: list[str] = []
        self._keys: dict[str, list[tuple[int, int]]] = {}

    def add(self, label: str, text: str) -> None:
        number = len(self._texts)
        self._texts.append(text)
        self._labels.append(label)
        for start in range(0, len(text) - KEY_CHARS + 1, STRIDE):
            self._keys.setdefault(text[start : start + KEY_CHARS], []).append((number, start))

    def shared(self, text: str) -> str | None:
        keys = self._keys
        for i in range(len(text) - KEY_CHARS + 1):
            hits = keys.get(text[i : i + KEY_CHARS])
            for number, start in hits or ():
                if _common_run(text, i, self._texts[number], start) >= SHARED_CHARS:
                    return self._labels[number]
        return None


def content_units(document: dict[str, Any]) -> list[str]:
    """The normalised texts whose equality counts: a text document's text, or a chat's each message."""
    if "text" in document:
        return [normalized(document["text"])]
    return [normalized(m["content"]) for m in document["messages"]]


def passage_text(document: dict[str, Any]) -> str:
    """The normalised text searched for shared passages: the document, messages joined by a space."""
    return " ".join(content_units(document))


def read_calibration(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class ContentGuard:
    """The calibration corpus's units and passages, plus every document accepted so far.

    Equal units count against the calibration corpus and between domains; inside one domain only shared
    passages do (two chat documents may both ask "Please continue.").
    """

    def __init__(self, calibration: list[dict[str, Any]], name: str) -> None:
        self.units: dict[str, tuple[str | None, str]] = {}  # unit -> (domain, or None: calibration; label)
        self.index = PassageIndex()
        for number, conversation in enumerate(calibration):
            label = f"{name} conversation {number}"
            for unit in content_units(conversation) + [passage_text(conversation)]:
                self.units.setdefault(unit, (None, label))
            self.index.add(label, passage_text(conversation))

    def conflict(self, document: dict[str, Any], domain: str) -> str | None:
        """What `document` of `domain` shares content with, or None."""
        for unit in content_units(document) + [passage_text(document)]:
            owner, label = self.units.get(unit, (domain, ""))
            if owner != domain:
                return f"{label} (equal text)"
        other = self.index.shared(passage_text(document))
        return f"{other} (a {SHARED_CHARS}-character passage)" if other else None

    def accept(self, document: dict[str, Any], domain: str, label: str) -> None:
        for unit in content_units(document) + [passage_text(document)]:
            self.units.setdefault(unit, (domain, label))
        self.index.add(label, passage_text(document))


def check_disjoint(
    domains: dict[str, list[dict[str, Any]]], calibration: list[dict[str, Any]], calibration_name: str
) -> None:
    """Raise :class:`OverlapError` naming the first document that shares content with the calibration
    corpus, with another domain, or a passage with an earlier document of its own domain (the build's rule,
    recomputed from the finished documents)."""
    guard = ContentGuard(calibration, calibration_name)
    for name, documents in domains.items():
        for number, document in enumerate(documents):
            if found := guard.conflict(document, name):
                raise OverlapError(
                    f"{name}.jsonl document {number} shares content with {found}: "
                    "evaluation text must be held out; fix the sources in tools/make_eval_corpus.py"
                )
            guard.accept(document, name, f"{name}.jsonl document {number}")


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def pydoc_topics(stdlib: Path) -> dict[str, str]:
    """The ``topics`` dict literal of pydoc_data/topics.py (read with ast, not imported)."""
    tree = ast.parse((stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{stdlib}/pydoc_data/topics.py: no `topics = {{...}}` literal; is this CPython 3.11?")


_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")  # blank lines; the next indent stays
_HEADING = re.compile(r"^(\S.*)\n([*=\-~^])\2+$")


@dataclass
class Passage:
    topic: str
    number: int  # within its topic
    subject: str  # the heading it starts under
    paragraphs: list[str]  # verbatim slices of the topic text

    @property
    def key(self) -> str:
        return f"{self.topic}:{self.number}"


def _paragraphs(text: str) -> list[str]:
    spans, start = [], 0
    for brk in _PARAGRAPH_BREAK.finditer(text):
        spans.append(text[start : brk.start()])
        start = brk.end()
    spans.append(text[start:].rstrip())
    return [p for p in spans if p.strip()]


def prose_passages(topics: dict[str, str], count_tokens) -> list[Passage]:
    """Topic text cut at paragraph ends into passages of at least PROSE_TARGET_TOKENS tokens.

    Topics are visited longest first, so a topic that contains another (``compound`` holds ``if``) is
    taken whole and the repeated paragraphs of the shorter one break its passages; a passage never spans a
    repeated paragraph, and a tail shorter than the target is dropped.
    """
    seen: set[str] = set()
    passages: list[Passage] = []
    for topic in sorted(set(topics) - SKIP_TOPICS, key=lambda t: (-len(topics[t]), t)):
        text = topics[topic]
        heading = text.splitlines()[0].strip()
        current: list[str] = []
        subject = heading
        number = 0
        for paragraph in _paragraphs(text):
            if match := _HEADING.match(paragraph.strip()):
                heading = match.group(1).strip()
            norm = normalized(paragraph)
            if len(norm) >= MIN_DEDUP_PARAGRAPH and norm in seen:
                current = []
                continue
            seen.add(norm)
            if not current:
                subject = heading
            current.append(paragraph)
            if count_tokens("\n\n".join(current)) >= PROSE_TARGET_TOKENS:
                passages.append(Passage(topic, number, subject, current))
                number += 1
                current = []
    return passages


def _psf_only(text: str, tree: ast.Module) -> bool:
    header = _header_text(text, tree)
    if _OTHER_LICENSE.search(header):
        return False
    notices = [ln for ln in header.splitlines() if _COPYRIGHT.search(ln) and not _NOT_A_NOTICE.search(ln)]
    return all("python software foundation" in ln.lower() for ln in notices)


def code_sources(stdlib: Path) -> Iterator[tuple[str, list[str]]]:
    """Per PSF-only file of CODE_DIRS (sorted), its top-level function and class sources, in file order."""
    for directory in CODE_DIRS:
        for path in sorted((stdlib / directory).rglob("*.py"), key=lambda p: p.as_posix()):
            rel = path.relative_to(stdlib)
            if CODE_SKIP_DIRS.intersection(rel.parts[:-1]):
                continue
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
            if not _psf_only(text, tree):
                continue
            lines = text.splitlines()
            sources = []
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    sources.append("\n".join(lines[first - 1 : node.end_lineno]))
            yield rel.as_posix(), sources


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------


def chat_document(passage: Passage) -> dict[str, Any]:
    """Two user/assistant turns over one passage: the first half of its paragraphs, then the rest."""
    paragraphs = passage.paragraphs
    half = max(1, len(paragraphs) // 2)
    first, rest = "\n\n".join(paragraphs[:half]), "\n\n".join(paragraphs[half:])
    messages = [
        {"role": "user", "content": _pick(ASK, "ask:" + passage.key).format(subject=passage.subject)},
        {"role": "assistant", "content": f"{_pick(LEAD, 'lead:' + passage.key)}\n\n{first}"},
    ]
    if rest:
        messages += [
            {"role": "user", "content": _pick(FOLLOW, "follow:" + passage.key)},
            {"role": "assistant", "content": rest},
        ]
    return {"messages": messages}


def spread(items: list[Any], count: int) -> list[Any]:
    """`count` items evenly spaced over `items` (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def _round_robin(groups: list[list[str]]) -> Iterator[str]:
    for depth in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if depth < len(group):
                yield group[depth]


def build(stdlib: Path, calibration_path: Path, tokenizer: Any) -> dict[str, list[dict[str, Any]]]:
    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_tokens(document: dict[str, Any]) -> int:
        out = tokenizer.apply_chat_template(document["messages"], tokenize=True, add_generation_prompt=False)
        return len(out["input_ids"] if hasattr(out, "keys") else out)

    calibration = read_calibration(calibration_path)
    guard = ContentGuard(calibration, calibration_path.name)

    # Prose passages alternate between docs and chat, so neither takes all of one long topic.
    candidates: dict[str, list[dict[str, Any]]] = {"docs": [], "chat": [], "code": []}
    for number, passage in enumerate(prose_passages(pydoc_topics(stdlib), count_tokens)):
        if number % 2 == 0:
            document = {"text": "\n\n".join(passage.paragraphs)}
            long_enough = count_tokens(document["text"]) >= MIN_TOKENS
        else:
            document = chat_document(passage)
            long_enough = chat_tokens(document) >= MIN_TOKENS
        if long_enough and len(passage_text(document)) <= MAX_DOC_CHARS:
            candidates["docs" if number % 2 == 0 else "chat"].append(document)
    files = sorted(code_sources(stdlib))
    for source in _round_robin([sources for _, sources in files]):
        if len(source) <= MAX_DOC_CHARS and count_tokens(source) >= MIN_TOKENS:
            candidates["code"].append({"text": source})

    domains: dict[str, list[dict[str, Any]]] = {}
    for name in ("docs", "chat", "code"):
        kept = []
        for document in candidates[name]:
            if guard.conflict(document, name) is None:
                guard.accept(document, name, f"{name} candidate {len(kept)}")
                kept.append(document)
        domains[name] = spread(kept, DOCUMENTS)
        print(
            f"{name}: {len(candidates[name])} candidates, {len(candidates[name]) - len(kept)} dropped for "
            f"shared content, {len(domains[name])} written",
            file=sys.stderr,
        )
    return {name: domains[name] for name in DOMAINS}


def render(documents: list[dict[str, Any]]) -> bytes:
    lines = [json.dumps(d, ensure_ascii=False, sort_keys=True) for d in documents]
    return ("\n".join(lines) + "\n").encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "data" / "eval")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument(
        "--calibration", type=Path, default=REPO / "data" / "corpus" / "python-stdlib-chat.jsonl"
    )
    parser.add_argument("--tokenizer", type=Path, default=REPO / "data" / "toy-laguna")
    parser.add_argument("--check", action="store_true", help="fail if --out-dir differs from a fresh build")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    domains = build(args.stdlib, args.calibration, tokenizer)
    check_disjoint(domains, read_calibration(args.calibration), args.calibration.name)
    for name, documents in domains.items():
        if len(documents) < MIN_DOCUMENTS:
            raise SystemExit(
                f"{name}.jsonl: only {len(documents)} documents of {MIN_TOKENS}+ tokens ({MIN_DOCUMENTS} "
                f"needed): build with CPython 3.11 ({sys.version.split()[0]} is running)"
            )
    status = 0
    for name, documents in domains.items():
        data = render(documents)
        out = args.out_dir / f"{name}.jsonl"
        sha = hashlib.sha256(data).hexdigest()
        if args.check:
            if not out.is_file() or out.read_bytes() != data:
                print(f"{out}: differs from a fresh build (fresh sha256 {sha})")
                status = 1
        else:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
        print(
            f"python {sys.version.split()[0]}  {name}: records {len(documents)}  bytes {len(data)}  "
            f"sha256 {sha}  -> {out}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
