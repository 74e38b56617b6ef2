"""`mixquant verify`: the published hashes re-derived from this config's artifacts."""

from __future__ import annotations

import argparse
import json

import yaml

from mixquant.cli.context import load_config, planned_artifacts
from mixquant.graph import made_from
from mixquant.release.published import published_strict


def cmd_verify(args: argparse.Namespace) -> int:
    """The published hashes re-derived from this config's artifacts: 0 when the policy passes, else 1.

    The policy of verify_hashes (mixquant.release.verify): a content mismatch fails, a numerical one
    only under an equal (or unknown) numerics fingerprint; the hashes of an artifact made from other
    settings than the published one are not comparable and pass. With --strict (or published.strict)
    any mismatch and any not comparable hash fails. --made-from prints the published.made_from block of
    this config's artifacts (what to pin beside hashes it publishes).
    """
    # lazy: imports torch
    from mixquant.release.report import VerifyInputError, format_report
    from mixquant.release.verify import verify_artifacts

    cfg = load_config(args)
    artifacts = planned_artifacts(cfg, args)
    if args.made_from:
        if "checkpoint" not in artifacts:
            raise VerifyInputError(
                "export_checkpoint: the checkpoint is not planned yet (the placement search has not run); "
                "run the workflow first (snakemake)"
            )
        print(yaml.safe_dump({"made_from": made_from(artifacts, cfg)}, sort_keys=False), end="")
        return 0
    strict = args.strict or published_strict(cfg.published)
    try:
        report = verify_artifacts(
            artifacts,
            cfg.published,
            results_dir=cfg.results_dir,
            against=args.against,
            planned=made_from(artifacts, cfg),
        )
    except VerifyInputError as error:
        if not args.json:
            raise
        # what a script reading --json gets in place of the report: nothing verified yet, and why
        print(json.dumps({"ok": False, "built": False, "error": str(error), "strict": strict}, indent=2))
        return 2
    if args.json:
        print(json.dumps({**report.to_json(), "strict": strict}, indent=2))
    else:
        print(format_report(report, strict=strict))
    return 1 if report.failures(strict=strict) else 0
