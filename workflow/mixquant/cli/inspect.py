"""`mixquant inspect` (audit a checkpoint), `mixquant predict` (an export's structure from config.json) and
`mixquant schema` (the config's JSON schema and key table)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mixquant.config import config_keys_markdown, json_schema
from mixquant.export.inspect import inspect_checkpoint
from mixquant.export.inspect_text import format_inspection
from mixquant.export.placement import load_placement, parse_placement_counts
from mixquant.export.predict import format_prediction, predict_structure
from mixquant.model.families import architecture, cache_architectures, workflow_cache


def cmd_inspect(args: argparse.Namespace) -> int:
    """Audit any ModelOpt checkpoint directory from its headers, index and JSON files."""
    report = inspect_checkpoint(args.directory)
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspection(report))
    return 0 if report["ok"] else 1


def cmd_predict(args: argparse.Namespace) -> int:
    """Predict tensor count, payload bytes and effective routed bits from config.json alone."""
    config = json.loads(Path(args.model_config).read_text("utf-8"))
    # a workflow's directory: its architecture cache, as `load_config` keeps it
    if Path(".snakemake").is_dir():
        cache_architectures(workflow_cache())
    counts = parse_placement_counts(args.placement_counts) if args.placement_counts else None
    placement = load_placement(args.placement) if args.placement else None
    kv = None if args.kv_cache_quant == "none" else args.kv_cache_quant
    if kv is not None:
        arch = architecture(config)
        if not arch.kv_cache_scales:
            print(
                f"mixquant: --kv-cache-quant {kv}: KV-cache scales are not supported for {arch.model_type}",
                file=sys.stderr,
            )
            return 2
    report = predict_structure(config, counts, placement, kv_cache_quant=kv)
    print(json.dumps(report, indent=2, default=str) if args.json else format_prediction(report))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        text = "| key | default | meaning |\n|---|---|---|\n" + "\n".join(config_keys_markdown()) + "\n"
    else:
        text = json.dumps(json_schema(), indent=2) + "\n"
    if args.write:
        Path(args.write).write_text(text, "utf-8")
    else:
        sys.stdout.write(text)
    return 0
