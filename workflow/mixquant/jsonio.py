"""Reading a JSON file with one-line errors that name the file (each caller picks its error class)."""

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
