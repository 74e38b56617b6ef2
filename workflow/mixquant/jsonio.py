"""Reading a JSON file with one-line errors that name the file (each caller picks its error class), and
the leaf-level differences between two JSON values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(
    path: str | Path, what: str = "JSON", *, error: type[Exception] = ValueError, who: str = ""
) -> Any:
    """``json.loads`` of the UTF-8 file at ``path``.

    Failures raise ``error`` with one line: ``[who: ]<path>: <what> not found`` / ``cannot read <what>
    (<reason>)`` / ``corrupt <what> (<reason>)``.
    """
    path = Path(path)
    prefix = f"{who}: {path}" if who else str(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise error(f"{prefix}: {what} not found") from exc
    except OSError as exc:
        raise error(f"{prefix}: cannot read {what} ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise error(f"{prefix}: corrupt {what} ({exc})") from exc


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
