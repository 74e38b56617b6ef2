"""The `mixquant` command: paths, explain, plan, run, verify, inspect, predict, schema."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mixquant import __version__
from mixquant.cli.context import DEFAULT_CONFIG, PROFILE_HELP
from mixquant.cli.inspect import cmd_inspect, cmd_predict, cmd_schema
from mixquant.cli.paths import cmd_explain, cmd_paths
from mixquant.cli.plan import cmd_plan
from mixquant.cli.run import cmd_build_toy, cmd_pin_model, cmd_run
from mixquant.cli.verify import cmd_verify
from mixquant.config import ConfigError
from mixquant.keys.manifest import ManifestError
from mixquant.kld.run import KldGateFailure


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (argparse would read ``--config`` as ``--configfile``), in every subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixquant", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--configfile", default=DEFAULT_CONFIG, help="workflow config (default: %(default)s)")
        p.add_argument(
            "--config",
            nargs="+",
            action="extend",
            default=[],
            metavar="KEY=VALUE",
            help="overrides, as `snakemake --config` takes them (e.g. 'placement={target_effective_bits: "
            "5.0}' or calibration.num_samples=8): the config a run with the same arguments uses",
        )
        return p

    p = with_config(
        sub.add_parser("paths", help="key, path and state (done, failed, todo) of every artifact")
    )
    p.add_argument("--json", action="store_true", help="print JSON (with each job's env and packages)")
    p.add_argument("--profile", help=PROFILE_HELP)
    p.set_defaults(func=cmd_paths)

    p = with_config(sub.add_parser("explain", help="why two keys (or output directories) differ"))
    p.add_argument("a", help="a key (or its first 8+ hex digits) or output directory; built or planned")
    p.add_argument("b")
    p.add_argument("--results-dir", help="where the outputs are (default: the config's results_dir)")
    p.add_argument("--profile", help=PROFILE_HELP)
    p.set_defaults(func=cmd_explain)

    p = with_config(sub.add_parser("plan", help="summarize `snakemake -n`: jobs per rule and reasons"))
    p.add_argument("--json", action="store_true", help="print JSON (rules, jobs, estimates)")
    p.add_argument("--jobs", action="store_true", help="list every job with its resources and reason")
    p.add_argument("--profile", help=PROFILE_HELP)
    p.add_argument(
        "--no-env-check",
        action="store_true",
        help="under conda, do not ask pip's resolver whether each environment file resolves (needs the "
        "package index; results are remembered per env file under .snakemake/mixquant-envs/)",
    )
    p.add_argument("snakemake_args", nargs="*", help="extra snakemake arguments (after --)")
    p.set_defaults(func=cmd_plan)

    p = with_config(
        sub.add_parser("run", help="build one artifact outside Snakemake (same function, same key)")
    )
    p.add_argument("target", help="artifact name (see `mixquant paths`) or a stage with a single artifact")
    p.add_argument("--profile", help=PROFILE_HELP)
    p.set_defaults(func=cmd_run)

    p = with_config(
        sub.add_parser("verify", help="re-derive the four published SHA-256 values and compare them")
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--against",
        metavar="PATH",
        help="on a reference-logits mismatch, compare with these published logits: a reference_logits "
        "output, a release directory (reference/logits.safetensors) or a logits.safetensors file "
        "(default: a reference_logits output under results/ with the published hash)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on any mismatch, also on reference logits that are not reproducible bit for bit here "
        "(a different numerics fingerprint), and on hashes not comparable (an artifact made from other "
        "settings than the published one)",
    )
    p.add_argument(
        "--made-from",
        action="store_true",
        help="print the published.made_from block of this config's artifacts (to pin beside their hashes)",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("pin-model", help="print a local model directory's content pin (model.local.sha256)")
    p.add_argument("directory", help="the model directory")
    p.set_defaults(func=cmd_pin_model)

    p = with_config(
        sub.add_parser("build-toy", help="retrain the embedded toy (model.toy settings) into a new directory")
    )
    p.add_argument("out", help="a directory that does not exist yet, e.g. data/toy-laguna-new")
    p.set_defaults(func=cmd_build_toy)

    p = sub.add_parser("inspect", help="audit a ModelOpt checkpoint directory (any producer)")
    p.add_argument("directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("predict", help="predict an export's structure from config.json and a placement")
    p.add_argument("--model-config", required=True, metavar="CONFIG_JSON")
    placement = p.add_mutually_exclusive_group(required=True)
    placement.add_argument("--placement-counts", metavar="nvfp4_w4a16=39,fp8=3,bf16=5")
    placement.add_argument("--placement", metavar="PLACEMENT_JSON")
    p.add_argument(
        "--kv-cache-quant",
        default="none",
        choices=["FP8", "none"],
        help="KV-cache scales: none (default; mixquant's own export writes none) or FP8 (a ModelOpt export "
        "with calibrated KV-cache scales, such as the reference release)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("schema", help="print (or --write) the config JSON schema, or its key table")
    p.add_argument("--write", metavar="PATH")
    p.add_argument("--markdown", action="store_true", help="the key table of config/README.md instead")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ManifestError, ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"mixquant: {error}", file=sys.stderr)
        return 1 if _is_check_failure(error) else 2


def _is_check_failure(error: BaseException) -> bool:
    """A check that ran and failed (hashes differ, a KLD gate fails): exit 1, as ``mixquant verify`` and
    ``mixquant inspect`` do; anything else (config, missing inputs, usage) exits 2."""
    from mixquant.release.report import HashMismatchError  # lazy: imports torch

    return isinstance(error, (HashMismatchError, KldGateFailure))
