"""The published hashes as a config pins them, and whether this config's artifacts can match them: what
`mixquant verify`, verify_hashes and planning (`mixquant plan`, `snakemake -n`) share. No torch: the
Snakefile imports it to warn before a run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixquant.keys.hashing import require_sha256_hex

# The order of PublishedHashes' fields (config ``published``), which is also the report's order.
HASH_NAMES = ("prompt_token_ids", "reference_logits", "quant_config", "safetensors_index")
# The config sections whose short hashes `published.made_from.settings` pins: those an artifact's recipe
# can be made from (results_dir, software, published, expected and release never enter one).
SETTINGS_SECTIONS = (
    "model",
    "tokenizer",
    "dataset",
    "calibration",
    "prompt",
    "placement",
    "quantize",
    "export",
    "kld",
    "numerics",
)
# The artifact each hash is read from, as the artifact graph (`mixquant.graph`) names it, and that
# artifact's stage.
HASH_SOURCES = {
    "prompt_token_ids": "prompt",
    "reference_logits": "reference_logits",
    "quant_config": "checkpoint",
    "safetensors_index": "checkpoint",
}
SOURCE_ARTIFACTS = {
    "prompt": "pin_prompt",
    "reference_logits": "reference_logits",
    "checkpoint": "export_checkpoint",
}


def published_values(published: Mapping[str, Any] | Any) -> dict[str, str | None]:
    """{hash name: published SHA-256 or None} from config ``published`` (a model or a dict)."""
    if not isinstance(published, Mapping):
        published = published.model_dump(mode="json")
    unknown = sorted(set(published) - set(HASH_NAMES) - {"numerics", "made_from", "strict"})
    if unknown:
        raise ValueError(f"published: unknown hash {unknown[0]!r} (known: {', '.join(HASH_NAMES)})")
    values = {}
    for name in HASH_NAMES:
        value = published.get(name)
        values[name] = None if value in (None, "") else require_sha256_hex(value, f"published.{name}")
    return values


def published_made_from(published: Mapping[str, Any] | Any) -> dict[str, Any]:
    """Config ``published.made_from`` as a dict ({} when not pinned: every pinned hash is compared)."""
    if not isinstance(published, Mapping):
        published = published.model_dump(mode="json")
    return dict(published.get("made_from") or {})


def published_strict(published: Mapping[str, Any] | Any) -> bool:
    """Config ``published.strict``: verify_hashes fails as ``mixquant verify --strict`` does."""
    if not isinstance(published, Mapping):
        published = published.model_dump(mode="json")
    return bool(published.get("strict"))


def comparability(pinned: Mapping[str, Any], planned: Mapping[str, Any] | None, source: str) -> str | None:
    """Why the hashes of artifact `source` cannot match the published ones (one phrase), None if they can.

    Comparable unless both the published and the planned recipe of `source` are known and differ; the
    reason names the config sections whose short hashes differ from ``made_from.settings``.
    """
    want, got = pinned.get(source), (planned or {}).get(source)
    if want is None or got is None or want == got:
        return None
    ours, theirs = (planned or {}).get("settings") or {}, pinned.get("settings") or {}
    differing = [
        section for section in SETTINGS_SECTIONS if section in theirs and theirs[section] != ours.get(section)
    ]
    what = (
        f"differs from the published config in {', '.join(differing)}"
        if differing
        else "the config sections are the published ones: the producer's version or a derived input differs"
    )
    return (
        f"the {source} ({SOURCE_ARTIFACTS[source]}) is made from other settings than the published one: "
        f"{what} (recipe {got[:12]}, published {want[:12]})"
    )


# The config sections an artifact's recipe cannot depend on, when it is not planned yet (the checkpoint of a
# placement search): the KLD candidates and the prompt come after it.
_NOT_UPSTREAM_OF = {"checkpoint": ("kld", "prompt")}


def planned_comparability(published: Mapping[str, Any] | Any, planned: Mapping[str, Any]) -> str | None:
    """What `mixquant plan` and `snakemake -n` say before a run: which pinned hashes this config's
    artifacts cannot match (verify will report them not comparable) and the config sections that differ
    from the published ones; None when every pinned hash can be compared.

    A source not planned yet (the checkpoint, before the placement is solved) is judged by the config
    sections it can depend on."""
    expected, pinned = published_values(published), published_made_from(published)
    if not pinned:
        return None
    ours, theirs = planned.get("settings") or {}, pinned.get("settings") or {}
    differing = [
        section for section in SETTINGS_SECTIONS if section in theirs and theirs[section] != ours.get(section)
    ]
    names = []
    for name in HASH_NAMES:
        source = HASH_SOURCES[name]
        if expected[name] is None or pinned.get(source) is None:
            continue
        if planned.get(source) is not None:
            if comparability(pinned, planned, source) is not None:
                names.append(name)
        elif set(differing) - set(_NOT_UPSTREAM_OF.get(source, ())):
            names.append(name)
    if not names:
        return None
    why = (
        f"it differs from the published one in {', '.join(differing)}"
        if differing
        else "its artifacts are made by another producer version or from other derived inputs"
    )
    return (
        f"published hashes {', '.join(names)} cannot match this config ({why}): verify reports them not "
        "comparable and passes; mixquant verify --strict and published.strict fail"
    )
