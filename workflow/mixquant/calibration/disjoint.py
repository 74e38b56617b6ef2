"""Evaluation documents disjoint from calibration, checked by content.

A document's *content units* are its text (a plain-text document) or each message's content (a chat
document), whitespace-normalised; units shorter than :data:`MIN_UNIT_CHARS` characters ("Yes.", a bare
function name) are too common to mean a shared document and are ignored. Two documents share content when
they share a unit (SHA-256 of its UTF-8 bytes). The evaluation suite must share no unit with the calibration
dataset -- its whole file, not only the sampled conversations, so the check needs no tokenizer and holds for
any calibration seed -- nor between two of its domains.

Torch-free: planning (``snakemake -n``, ``mixquant plan``) runs the check on local files before any job;
the ``sample_eval`` stage runs it again on what it loaded (hub sources included).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mixquant.keys.hashing import file_sha256

MIN_UNIT_CHARS = 32


class EvalOverlapError(ValueError):
    """An evaluation document shares content with the calibration data or another domain (one line)."""


def normalized(text: str) -> str:
    return " ".join(str(text).split())


def document_units(row: Mapping[str, Any], text_field: str | None, messages_field: str | None) -> list[str]:
    """The normalised content units of one document (see the module docstring)."""
    if text_field is not None:
        texts = [row[text_field]]
    else:
        texts = [m.get("content") or "" for m in row[messages_field] if isinstance(m, Mapping)]
    return [unit for unit in (normalized(t) for t in texts) if len(unit) >= MIN_UNIT_CHARS]


def unit_hash(unit: str) -> str:
    return hashlib.sha256(unit.encode("utf-8")).hexdigest()


def document_sha256(row: Mapping[str, Any], text_field: str | None, messages_field: str | None) -> str:
    """A document's identity: SHA-256 of the canonical JSON of its normalised field."""
    if text_field is not None:
        value: Any = normalized(row[text_field])
    else:
        value = [[m.get("role"), normalized(m.get("content") or "")] for m in row[messages_field]]
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()


def read_jsonl(path: str | Path, sha256: str | None = None) -> list[dict[str, Any]]:
    """The rows of a local JSONL file, its bytes checked against ``sha256`` (one line on a mismatch)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    if sha256 is not None and (actual := file_sha256(path)) != sha256:
        raise ValueError(f"{path}: SHA-256 {actual} differs from the pinned {sha256}")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as error:
                    raise ValueError(f"{path}:{number}: not a JSON object ({error})") from error
    return rows


def units_of(
    rows: Iterable[Mapping[str, Any]], text_field: str | None, messages_field: str | None
) -> Iterator[tuple[int, str, str]]:
    """(document index, unit hash, unit) of every unit of ``rows``."""
    for index, row in enumerate(rows):
        for unit in document_units(row, text_field, messages_field):
            yield index, unit_hash(unit), unit


def check_disjoint(
    domains: Mapping[str, tuple[list[Mapping[str, Any]], str | None, str | None]],
    calibration: tuple[Iterable[Mapping[str, Any]], str],
    *,
    where: Mapping[str, str] | None = None,
    calibration_name: str = "the calibration dataset",
) -> dict[str, int]:
    """Raise :class:`EvalOverlapError` naming the first evaluation document that shares a unit with the
    calibration rows (``(rows, messages_field)``) or with an earlier domain; else the counts checked.

    ``domains``: name -> (rows, text_field, messages_field); ``where``: name -> how to name its source.
    """
    rows, messages_field = calibration
    seen = {digest for _, digest, _ in units_of(rows, None, messages_field)}
    calibration_units = len(seen)
    owner: dict[str, str] = {}
    eval_units = 0
    for name, (domain_rows, text_field, domain_messages) in domains.items():
        source = (where or {}).get(name, name)
        for index, digest, unit in units_of(domain_rows, text_field, domain_messages):
            eval_units += 1
            if digest in seen:
                other = owner.get(digest)
                with_what = f"domain {other!r}" if other is not None else calibration_name
                raise EvalOverlapError(
                    f"kld.eval domain {name!r}: document {index} of {source} shares content with {with_what} "
                    f"({unit[:48]!r}...): evaluation windows must be held out; remove the document or pick "
                    "another source"
                )
            if digest not in owner:
                owner[digest] = name
        seen.update(d for d, n in owner.items() if n == name)
    return {"calibration_units": calibration_units, "eval_units": eval_units, "shared": 0}
