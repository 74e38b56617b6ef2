"""What every command reads first: the config as a Snakemake run with the same arguments reads it, the
Snakemake profile it plans under, and the artifact graph it plans."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import yaml

from mixquant.config import (
    ConfigError,
    MixquantConfig,
    read_config_file,
    select_workflow_config,
    validate_config,
)
from mixquant.graph import resolve_artifacts
from mixquant.model.families import cache_architectures, workflow_cache
from mixquant.planning import check_deployment, check_plan

DEFAULT_CONFIG = "config/config.yaml"
PROFILE_HELP = (
    "plan as under this Snakemake profile (e.g. profiles/slurm-blackwell; default: $SNAKEMAKE_PROFILE): "
    "with software.deployment: auto, its software-deployment-method decides the versions in the keys"
)


def with_overrides(raw: dict[str, Any], entries: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config file's mapping with ``--config KEY=VALUE ...`` merged over it, and the overrides, exactly as
    a Snakemake run makes them of the same arguments: Snakemake's own parser and merge (its syntax, e.g.
    ``placement={target_effective_bits: 5.0}``; dotted keys as :func:`nested_config_args`)."""
    if not entries:
        return raw, {}
    # the CLI's one use of Snakemake's code (the library never imports it): its --config syntax and merge
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    overrides = parse_config(nested_config_args(["--config", *entries])[1:])
    update_config(raw, overrides)
    return raw, overrides


def nested_config_args(args: list[str]) -> list[str]:
    """Snakemake arguments with each dotted ``--config`` entry (``calibration.num_samples=8``, which
    Snakemake's parser refuses) written as the nested mapping it takes (``calibration={num_samples: 8}``)."""
    out, in_config = [], False
    for arg in args:
        if arg.startswith("-"):
            in_config = arg in ("--config", "-C")
        elif in_config and "=" in arg and "." in arg.split("=", 1)[0]:
            key, value = arg.split("=", 1)
            first, *rest = key.split(".")
            nested = json.dumps(value)
            for part in reversed(rest):
                nested = f"{{{part}: {nested}}}"
            arg = f"{first}={nested}"
        out.append(arg)
    return out


def config_entries(args: list[str]) -> list[str]:
    """The ``KEY=VALUE`` entries of every ``--config`` (or ``-C``) in Snakemake arguments."""
    entries, in_config = [], False
    for arg in args:
        if arg.startswith("-"):
            in_config = arg in ("--config", "-C")
        elif in_config:
            entries.append(arg)
    return entries


def load_config(args: argparse.Namespace) -> MixquantConfig:
    """The validated config as a Snakemake run with the same ``--configfile`` and ``--config`` reads it,
    checked for planning (paths, context, budget, layers) as Snakemake does."""
    cache_architectures(workflow_cache())  # as the workflow keeps them
    merged, overrides = with_overrides(read_config_file(args.configfile), getattr(args, "config", None) or [])
    # worded as the workflow words it (common.smk's CONFIG_SOURCE)
    source = str(args.configfile) + (f" with --config {' '.join(sorted(overrides))}" if overrides else "")
    given = [] if args.configfile == DEFAULT_CONFIG else [args.configfile]  # a run's --configfile
    cfg = validate_config(select_workflow_config(merged, given, merged if given else overrides), source)
    check_plan(cfg, source)
    return cfg


def results_dir_of(args: argparse.Namespace) -> str:
    """The config's results_dir as written, or the default where the config cannot be read (outputs named
    by path need none)."""
    try:
        raw, _ = with_overrides(read_config_file(args.configfile), args.config)
    except ConfigError:
        raw = {}
    return str(raw.get("results_dir") or MixquantConfig.model_fields["results_dir"].default)


def profile_of(args: argparse.Namespace) -> str | None:
    """The Snakemake profile a command plans as: --profile, else $SNAKEMAKE_PROFILE (as Snakemake)."""
    return getattr(args, "profile", None) or os.environ.get("SNAKEMAKE_PROFILE") or None


def profile_settings(profile: str | None) -> dict:
    """A Snakemake profile's config.yaml as a dict (empty without a profile)."""
    if not profile:
        return {}
    path = Path(profile)
    if not path.exists() and (Path("profiles") / profile).exists():
        path = Path("profiles") / profile
    path = path / "config.yaml" if path.is_dir() else path
    return (yaml.safe_load(path.read_text()) if path.is_file() else {}) or {}


def profile_uses_conda(profile: str) -> bool:
    data = profile_settings(profile)
    method = data.get("software-deployment-method") or data.get("sdm") or []
    return "conda" in ([method] if isinstance(method, str) else method)


def deployment_of(args: argparse.Namespace) -> str:
    """How Snakemake would deploy the jobs under this command's profile: "conda" or "venv"."""
    profile = profile_of(args)
    return "conda" if profile and profile_uses_conda(profile) else "venv"


def planned_artifacts(cfg: MixquantConfig, args: argparse.Namespace, **kwargs):
    """The artifact graph as Snakemake plans it under the command's profile (software.deployment: auto)."""
    deployment = check_deployment(cfg, deployment_of(args), str(args.configfile))
    return resolve_artifacts(
        cfg, hash_cache_dir=Path(".snakemake") / "mixquant-hashes", deployment=deployment, **kwargs
    )
