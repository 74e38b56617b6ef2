"""`mixquant run` (one artifact's stage outside Snakemake), `mixquant pin-model` and `mixquant build-toy`."""

from __future__ import annotations

import argparse
import importlib
import logging

from mixquant.checkpoint.headers import check_links_inside
from mixquant.cli.context import load_config, planned_artifacts
from mixquant.graph import dataset_settings
from mixquant.keys.stages import stage_spec
from mixquant.model.fetch import identity_sha256, local_dir_identity
from mixquant.numerics import enter
from mixquant.rulelog import check_job_software
from mixquant.source.run import build_embedded_toy


def cmd_run(args: argparse.Namespace) -> int:
    """Run one artifact's stage outside Snakemake, with exactly the settings and key the rule uses."""
    artifacts = planned_artifacts(load_config(args), args)
    matches = [art for art in artifacts.values() if args.target in (art.name, art.stage)]
    if len(matches) != 1:
        names = ", ".join(artifacts)
        raise ValueError(f"{args.target!r} names {len(matches)} artifacts; give one of: {names}")
    art = matches[0]
    if art.done:
        print(f"{art.path} (already done)")
        return 0
    upstream = {role: artifacts[name] for role, name in art.upstream.items()}
    for role, up in upstream.items():
        if not up.done:
            raise ValueError(f"{art.name}: upstream {role} ({up.stage}) is not built yet: {up.path}")
    check_job_software({"settings": art.settings, "preimage": art.preimage})  # as the rule's job does
    numerics = art.settings.get("numerics")
    if numerics:  # the same numerics profile as the rule's job, entered before the stage imports torch
        enter(numerics["profile"], numerics["threads"], numerics.get("device", "cpu"))
    module, function = stage_spec(art.stage).runner.split(":")
    runner = getattr(importlib.import_module(module), function)
    paths = {role: up.path for role, up in upstream.items()}
    print(runner(art.path, **paths, settings=art.settings, preimage=art.preimage))
    return 0


def cmd_pin_model(args: argparse.Namespace) -> int:
    """The content pin (model.local.sha256) of a local model directory."""
    check_links_inside(args.directory)
    print(identity_sha256(local_dir_identity(args.directory)))
    return 0


def cmd_build_toy(args: argparse.Namespace) -> int:
    """Retrain the embedded toy from the config's model.toy settings into a new directory; print its pin."""
    cfg = load_config(args)
    enter(cfg.numerics.cpu, cfg.numerics.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pin = build_embedded_toy(
        args.out, toy=cfg.model.toy.model_dump(mode="json"), corpus=dataset_settings(cfg)
    )
    print(f"{args.out}: model.local.sha256 {pin}")
    return 0
