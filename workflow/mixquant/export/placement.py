"""A placement: which format each MoE layer's routed experts take, as a file or as per-format counts.

Placement file (``--placement``, JSON), written by hand or by a placement stage::

    {"layers": {"1": "nvfp4_w4a16", "2": "fp8", "3": "bf16", ...}, "metadata": {...}}

``layers`` maps MoE layer indices (decimal strings, as JSON requires) to one of ``nvfp4_w4a16``, ``fp8``,
``bf16``; MoE layers not named stay BF16 (as in
:func:`mixquant.quantize.reference.modelopt_reference_export`).
``metadata`` is optional, free-form and ignored (provenance); any other top-level key is an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixquant.formats.facts import FORMATS

__all__ = ["PlacementError", "load_placement", "parse_placement", "parse_placement_counts"]

_COUNT_ITEM_RE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*([+-]?\d+)\s*$")


class PlacementError(ValueError):
    """A bad placement (counts string, placement file, layer map); the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def parse_placement_counts(text: str) -> dict[str, int]:
    """``"nvfp4_w4a16=39,fp8=3,bf16=5"`` -> ``{"nvfp4_w4a16": 39, "fp8": 3, "bf16": 5}``.

    Formats not named count 0. Raises :class:`PlacementError` (one line) for an empty string, an item
    that is not ``format=count``, an unknown format, a negative count or a format named twice.
    """
    if not str(text).strip():
        raise PlacementError("placement counts: empty (expected e.g. 'nvfp4_w4a16=39,fp8=3,bf16=5')")
    counts = dict.fromkeys(FORMATS, 0)
    seen: set[str] = set()
    for item in str(text).split(","):
        match = _COUNT_ITEM_RE.match(item)
        if not match:
            raise PlacementError(f"placement counts: {item.strip()!r} is not format=count (in {text!r})")
        fmt, count = match.group(1), int(match.group(2))
        if fmt not in counts:
            raise PlacementError(f"placement counts: unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
        if fmt in seen:
            raise PlacementError(f"placement counts: {fmt} given twice (in {text!r})")
        if count < 0:
            raise PlacementError(f"placement counts: {fmt}={count} is negative")
        seen.add(fmt)
        counts[fmt] = count
    return counts


def parse_placement(data: Any, source: str = "placement") -> dict[int, str]:
    """Validate a placement document (see the module docstring) and return ``{layer: format}``."""
    if not isinstance(data, Mapping):
        raise PlacementError(
            f"{source}: expected a JSON object with a 'layers' map, got {type(data).__name__}"
        )
    extra = sorted(set(data) - {"layers", "metadata"})
    if extra:
        raise PlacementError(f"{source}: unknown top-level keys {extra} (allowed: 'layers', 'metadata')")
    layers = data.get("layers")
    if not isinstance(layers, Mapping):
        raise PlacementError(f"{source}: 'layers' must be an object mapping layer index to format")
    out: dict[int, str] = {}
    for key, fmt in layers.items():
        if not re.fullmatch(r"\d+", str(key)):
            raise PlacementError(f"{source}: layer key {key!r} is not a non-negative integer")
        if fmt not in FORMATS:
            raise PlacementError(
                f"{source}: layer {key}: unknown format {fmt!r} (formats: {', '.join(FORMATS)})"
            )
        if int(key) in out:
            raise PlacementError(f"{source}: layer {int(key)} given twice")
        out[int(key)] = fmt
    return dict(sorted(out.items()))


def load_placement(path: str | Path) -> dict[int, str]:
    """Read a placement JSON file (see the module docstring); errors are one line naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlacementError(f"{path}: cannot read placement ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise PlacementError(f"{path}: not valid JSON ({exc})") from exc
    return parse_placement(data, str(path))
