"""What every config section shares: the strict model base, the one-line error, hash and layer-range types."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mixquant.formats.facts import FORMATS

SHA256_PATTERN = r"^[0-9a-f]{64}$"
COMMIT_PATTERN = r"^[0-9a-f]{40}$"
Sha256 = Annotated[str, Field(pattern=SHA256_PATTERN)]
Format = Literal[FORMATS]  # the routed-expert formats (mixquant.formats.facts)
LAYER_RANGE_PATTERN = r"^\d+(-\d+)?(,\d+(-\d+)?)*$"


def parse_layer_ranges(text: str) -> list[int]:
    """'1-4,7' -> [1, 2, 3, 4, 7] (inclusive ranges, sorted, no duplicates)."""
    layers: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        start, stop = int(first), int(last or first)
        if stop < start:
            raise ValueError(f"layer range {part!r} runs backwards")
        layers.update(range(start, stop + 1))
    return sorted(layers)


class ConfigError(ValueError):
    """A config problem, reported as one line that names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
