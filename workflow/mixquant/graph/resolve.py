"""A config's whole artifact graph, in dependency order, and what `rule all` and the rules look up in it.

Nothing here reads a stage's output (the solved placement aside, once it is built), so ``snakemake -n``
shows exactly which keyed directories will be built.
"""

from __future__ import annotations

from pathlib import Path

from mixquant.config import MixquantConfig
from mixquant.export.placement import load_placement
from mixquant.facts import placement_from_config
from mixquant.graph.artifact import Artifact, GraphBuilder, deployment_of
from mixquant.graph.inputs import add_calibration, add_eval, add_model, add_prompt
from mixquant.graph.kld import add_autoquantize, add_kld
from mixquant.graph.rebuild import (
    add_activations,
    add_export,
    add_rebuild,
    add_search,
    searched_placement_artifact,
)
from mixquant.graph.release import add_release, add_verify
from mixquant.search.run import PLACEMENT_FILE


def resolve_artifacts(
    cfg: MixquantConfig,
    hash_cache_dir: Path | None = None,
    placement: dict[int, str] | None = None,
    deployment: str | None = None,
    autoquantized: dict[int, str] | None = None,
) -> dict[str, Artifact]:
    """{artifact name: Artifact} for every stage the config asks for, in dependency order.

    With ``placement.source: search`` the rebuild and the export depend on ``solve_placement``'s result:
    they are resolved from ``placement`` when given, else from the placement artifact's ``placement.json``
    once it is built; before that the graph ends at the placement. A ``modelopt_autoquantize`` candidate
    likewise waits for ModelOpt's placement (``autoquantized``, else the autoquantize artifact's
    ``placement.json`` once built). ``deployment``: how Snakemake deploys
    the jobs ("conda" or "venv"; what ``software.deployment: auto`` follows, :func:`deployment_of`).
    """
    graph = GraphBuilder(cfg, hash_cache_dir, deployment_of(cfg, deployment))
    add_model(graph)
    add_calibration(graph)
    add_prompt(graph)
    add_activations(graph)
    if cfg.placement.source == "explicit":
        placement = placement_from_config(cfg)
    else:
        add_search(graph)
        searched = graph.artifacts[searched_placement_artifact(graph.artifacts)]
        if placement is None and searched.done:
            placement = load_placement(searched.path / PLACEMENT_FILE)
    if placement is not None:
        add_rebuild(graph, placement)
        add_export(graph, placement)
    if cfg.kld.eval is not None:
        add_eval(graph)
    if any(c.source == "modelopt_autoquantize" for c in cfg.kld.candidates):
        add_autoquantize(graph)
        if autoquantized is None and graph.artifacts["autoquantize"].done:
            autoquantized = load_placement(graph.artifacts["autoquantize"].path / PLACEMENT_FILE)
    add_kld(graph, placement is not None, autoquantized)
    if placement is not None:
        add_verify(graph)
        add_release(graph, placement)
    return graph.artifacts


def layer_artifacts(artifacts: dict[str, Artifact]) -> list[Artifact]:
    return [art for art in artifacts.values() if art.stage == "quantize_layer"]


def artifact_by_key(artifacts: dict[str, Artifact], key: str) -> Artifact:
    for art in artifacts.values():
        if art.key == key:
            return art
    raise KeyError(f"no artifact with key {key} in this plan")


def final_targets(artifacts: dict[str, Artifact]) -> list[str]:
    """Directories `rule all` asks for (checkpoint, verdict, verification, release once placed)."""
    names = (
        "model",
        "calibration",
        "prompt",
        "eval",
        "placement",
        "refined",
        "autoquantize",
        "checkpoint",
        "kld_verdict",
        "verify",
        "release",
    )
    targets = [str(artifacts[name].path) for name in names if name in artifacts]
    # gates known before the placement (candidates that do not depend on it) can run early
    return targets + [str(a.path) for a in artifacts.values() if a.stage == "gate_kld"]
