"""One keyed artifact and the builder that adds artifacts to a graph: what enters a key, and the path.

Keys are Merkle-style: a stage's preimage holds the config slice it reads, the keys of its upstream
artifacts, its code identity and package versions (``stage_preimage``). Each artifact also carries
``settings``: what the stage function needs to run (paths included), a superset of the key slice. Paths
never enter a key; content identities do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.config import MixquantConfig
from mixquant.facts import compute_device
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.hashing import require_sha256_hex
from mixquant.keys.manifest import MANIFEST
from mixquant.keys.stages import stage_preimage, stage_software, torch_decides_numbers
from mixquant.numerics import numerics_key


@dataclass(frozen=True)
class Artifact:
    name: str
    stage: str
    key: str
    path: Path
    preimage: dict[str, Any]
    settings: dict[str, Any]
    upstream: dict[str, str] = field(default_factory=dict)  # role -> artifact name
    # What the artifact is made from: the key without code, packages and environment (only config slices,
    # recursively); equal recipes, equal bytes for the content stages. `mixquant verify` compares a
    # published hash only when the planned artifact's recipe is the one the hash was pinned with.
    recipe: str = ""

    @property
    def done(self) -> bool:
        return (self.path / MANIFEST).is_file()


def deployment_of(cfg: MixquantConfig, snakemake_deployment: str | None = None) -> str:
    """Where jobs run, "conda" or "venv": ``software.deployment``, or with ``auto`` how Snakemake deploys
    this run (``snakemake_deployment``; None outside Snakemake: venv)."""
    if cfg.software.deployment != "auto":
        return cfg.software.deployment
    return snakemake_deployment or "venv"


def keyed_path(results_dir: str | Path, stage: str, key: str) -> Path:
    """results/<stage>/<key>; the key is validated as hex before it becomes a path."""
    return Path(results_dir) / stage / require_sha256_hex(key, f"{stage} key")


class GraphBuilder:
    """A config's artifacts as they are added, upstream first (:func:`mixquant.graph.resolve_artifacts`)."""

    def __init__(self, cfg: MixquantConfig, hash_cache_dir: Path | None, deployment: str):
        self.cfg = cfg
        self.hash_cache_dir = hash_cache_dir
        self.deployment = deployment
        self.artifacts: dict[str, Artifact] = {}

    def add(
        self, name: str, stage: str, config_slice: Any, settings: dict, upstream: dict[str, str]
    ) -> Artifact:
        upstream_keys = {role: self.artifacts[target].key for role, target in upstream.items()}
        if torch_decides_numbers(stage):
            # the device and its numerics profile decide this stage's numbers: they enter the key, and
            # the job enters the profile before torch is imported (mixquant.numerics)
            numerics = self.cfg.numerics
            device = compute_device(self.cfg, stage)
            config_slice = {
                **config_slice,
                "numerics": numerics_key(device, numerics.cpu, numerics.threads),
            }
            settings = {
                **settings,
                "numerics": {"profile": numerics.cpu, "threads": numerics.threads, "device": device},
            }
        # the software that runs the stage: its versions (and, under conda, its env file) enter the key
        software = stage_software(
            stage,
            deployment=self.deployment,
            kld_engine=self.cfg.kld.engine,
            vllm_python=self.cfg.software.vllm_python,
        )
        settings = {**settings, "software": software.settings}
        preimage = stage_preimage(stage, config_slice, upstream_keys, software.packages, software.env)
        key = canonical_sha256(preimage)
        recipe = canonical_sha256(
            {
                "stage": stage,
                "config": config_slice,
                "upstream": {
                    role: self.artifacts[target].recipe for role, target in sorted(upstream.items())
                },
            }
        )
        artifact = Artifact(
            name,
            stage,
            key,
            keyed_path(self.cfg.results_dir, stage, key),
            preimage,
            settings,
            dict(upstream),
            recipe,
        )
        self.artifacts[name] = artifact
        return artifact
