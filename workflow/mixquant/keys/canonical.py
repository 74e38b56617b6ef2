"""Canonical JSON: one byte string per value, so equal inputs give equal keys on every machine.

Rules (each one exists because a real config needs it):

- dicts whose keys are all str encode as JSON objects with sorted keys;
- dicts with any non-str key (ModelOpt quantizer configs carry ``{-1: 16}`` block sizes, next to
  str keys such as ``"type"``) encode as ``{"$map": [[key, value], ...]}`` sorted by the canonical
  encoding of the key, so ``{1: x}`` and ``{"1": x}`` stay different keys;
- tuples encode as lists (YAML cannot express tuples; a Python preset's ``(4, 3)`` and the same
  value read from YAML must hash alike);
- floats use Python's shortest round-trip repr; NaN and infinities are refused; ``True`` is not
  ``1``; ints are arbitrary precision;
- numpy / torch scalars become Python scalars; pathlib paths become strings; sets are refused
  (no order).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from mixquant.keys.hashing import bytes_sha256

MAP_TAG = "$map"


class CanonicalError(TypeError):
    """A value that has no canonical encoding (NaN, a set, an arbitrary object)."""


def _scalar(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) in ((), None):
        return item()
    return value


def _normalize(value: Any, where: str) -> Any:
    value = _scalar(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CanonicalError(f"{where}: {value!r} has no canonical encoding (not finite)")
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_normalize(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(key, str) for key in value):
            if MAP_TAG in value:
                raise CanonicalError(f"{where}: the key {MAP_TAG!r} is reserved for non-str-keyed maps")
            return {key: _normalize(item, f"{where}.{key}") for key, item in value.items()}
        pairs = []
        for key, item in value.items():
            key = _scalar(key)
            if not isinstance(key, (str, int, float, bool, tuple)) and key is not None:
                raise CanonicalError(
                    f"{where}: map key {key!r} of type {type(key).__name__} is not encodable"
                )
            normalized_key = _normalize(key, f"{where}<key>")
            pairs.append((_dumps(normalized_key), normalized_key, _normalize(item, f"{where}.{key}")))
        pairs.sort(key=lambda pair: pair[0])
        return {MAP_TAG: [[key, item] for _, key, item in pairs]}
    if hasattr(value, "model_dump"):  # pydantic models: their resolved, validated content
        return _normalize(value.model_dump(mode="json"), where)
    raise CanonicalError(f"{where}: {type(value).__name__} has no canonical encoding")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_json(value: Any) -> str:
    """The canonical JSON text of `value` (ASCII, sorted keys, no whitespace)."""
    return _dumps(_normalize(value, "$"))


def canonical_sha256(value: Any) -> str:
    """SHA-256 hex digest of the UTF-8 canonical JSON of `value`."""
    return bytes_sha256(canonical_json(value).encode("utf-8"))
