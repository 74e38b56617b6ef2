"""Reading a JSON file with one-line errors that name the file (each caller picks its error class), writing
one atomically (:mod:`mixquant.checkpoint.atomic`), and the leaf-level differences between two JSON
values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixquant.checkpoint.atomic import atomic_open

MAX_JSON_BYTES = 64 << 20  # the largest JSON file mixquant reads (a 1T model's index is a few MB)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are unique (``json`` would silently keep the last of a repeated name)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate name {key[:80]!r}")
        out[key] = value
    return out


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` refusing repeated object names and nesting too deep for the parser (ValueError)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_object)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(
    path: str | Path,
    what: str = "JSON",
    *,
    error: type[Exception] = ValueError,
    who: str = "",
    max_bytes: int = MAX_JSON_BYTES,
) -> Any:
    """``json.loads`` of the UTF-8 file at ``path`` (at most ``max_bytes``, checked before reading).

    Failures raise ``error`` with one line: ``[who: ]<path>: <what> not found`` / ``cannot read <what>
    (<reason>)`` / ``corrupt <what> (<reason>)`` (not UTF-8, not JSON, a repeated name, nested too
    deeply) / ``<what> of N bytes is larger than ...``.
    """
    path = Path(path)
    prefix = f"{who}: {path}" if who else str(path)
    try:
        size = path.stat().st_size
        raw = path.read_bytes() if size <= max_bytes else None
    except FileNotFoundError as exc:
        raise error(f"{prefix}: {what} not found") from exc
    except OSError as exc:
        raise error(f"{prefix}: cannot read {what} ({exc.strerror or exc})") from exc
    if raw is None:
        raise error(f"{prefix}: {what} of {size} bytes is larger than mixquant reads ({max_bytes} bytes)")
    try:
        return loads_strict(raw.decode("utf-8"))
    except ValueError as exc:
        raise error(f"{prefix}: corrupt {what} ({str(exc)[:200]})") from exc


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file beside it and a rename: a reader sees
    the old file or the new one, never a part (the temporary file does not survive a failure)."""
    with atomic_open(path, "w", encoding="utf-8") as out:
        json.dump(data, out)


def diff_values(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Leaf-level differences between two JSON values as (dotted path, a, b)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append((sub, "<absent>", b[key]))
            elif key not in b:
                out.append((sub, a[key], "<absent>"))
            else:
                out.extend(diff_values(a[key], b[key], sub))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for index, (left, right) in enumerate(zip(a, b, strict=True)):
            out.extend(diff_values(left, right, f"{path}[{index}]"))
        return out
    return [] if a == b else [(path, a, b)]
