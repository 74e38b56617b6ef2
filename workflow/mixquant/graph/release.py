"""The release's artifacts: verify_hashes against the published hashes, and assemble_release; what a
config's planned artifacts are made from (``published.made_from``)."""

from __future__ import annotations

from typing import Any

from mixquant.config import MixquantConfig
from mixquant.graph.artifact import Artifact, GraphBuilder
from mixquant.keys.canonical import canonical_sha256
from mixquant.release.published import SETTINGS_SECTIONS, SOURCE_ARTIFACTS
from mixquant.release.recipe import recipe_document

# The artifacts the published hashes are read from (prompt, reference_logits, checkpoint).
HASHED_ARTIFACTS = tuple(SOURCE_ARTIFACTS)


def settings_fingerprint(cfg: MixquantConfig) -> dict[str, str]:
    """{config section: the first 16 hex of its canonical SHA-256} (``published.made_from.settings``)."""
    document = cfg.model_dump(mode="json")
    return {section: canonical_sha256(document[section])[:16] for section in SETTINGS_SECTIONS}


def made_from(artifacts: dict[str, Artifact], cfg: MixquantConfig) -> dict[str, Any]:
    """``published.made_from`` for this config's planned artifacts: the recipe of each artifact the
    hashes are read from and the short hash of each config section (``mixquant verify --made-from``)."""
    pins: dict[str, Any] = {name: artifacts[name].recipe for name in HASHED_ARTIFACTS if name in artifacts}
    pins["settings"] = settings_fingerprint(cfg)
    return pins


def add_verify(graph: GraphBuilder) -> None:
    """verify_hashes: the published values and the keys of the prompt, the reference and the checkpoint.

    ``published`` enters this key only: pinning a hash never moves an upstream stage. The planned recipes
    (``made_from``) are settings, not key: the upstream keys decide them; the section hashes only name
    what differs when a recipe is not the published one.
    """
    planned = made_from(graph.artifacts, graph.cfg)
    published = {"published": graph.cfg.published.model_dump(mode="json")}
    upstream = {"prompt": "prompt", "reference_logits": "reference_logits", "checkpoint": "checkpoint"}
    graph.add("verify", "verify_hashes", published, {**published, "planned": planned}, upstream)


def add_release(graph: GraphBuilder, placement: dict[int, str]) -> None:
    """assemble_release: the checkpoint, its recipe and audits, the KLD aggregates and the model card.

    Its key holds the recipe (the resolved config with the placement written down; the card is made from
    it and the upstream outputs) and the keys of everything the bundle copies or quotes. Planned only once
    every candidate's gate and the verdict are known: a release is never assembled past a failed gate.
    """
    if "kld_verdict" not in graph.artifacts or "checkpoint" not in graph.artifacts:
        return
    cfg = graph.cfg
    upstream = {
        "model": "model",
        "checkpoint": "checkpoint",
        "prompt": "prompt",
        "reference": "reference_logits",
        "verdict": "kld_verdict",
        "kld_report": "kld_report",
    }
    if "placement" in graph.artifacts:
        upstream["placement"] = "placement"
    if "refined" in graph.artifacts:
        upstream["refined"] = "refined"
    for candidate in cfg.kld.candidates:
        for kv in cfg.kld.kv_cache_dtypes:
            upstream[f"gate_{candidate.name}_{kv}"] = f"gate/{candidate.name}/{kv}"
    release_slice = {"recipe": recipe_document(cfg, placement)}
    graph.add("release", "assemble_release", release_slice, release_slice, upstream)
