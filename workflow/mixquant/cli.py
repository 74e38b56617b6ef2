"""The `mixquant` command: paths, explain, plan, run, verify, inspect, predict, schema."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from mixquant import __version__
from mixquant.config import (
    ConfigError,
    MixquantConfig,
    read_config_file,
    select_workflow_config,
    validate_config,
)
from mixquant.jsonio import diff_values
from mixquant.keys.hashing import is_sha256_hex
from mixquant.keys.manifest import ManifestError, read_manifest

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


def _load(args: argparse.Namespace) -> MixquantConfig:
    """The validated config as a Snakemake run with the same ``--configfile`` and ``--config`` reads it,
    checked for planning (paths, context, budget, layers) as Snakemake does."""
    from mixquant.model.families import WORKDIR_CACHE, cache_architectures
    from mixquant.planning import check_plan

    cache_architectures(WORKDIR_CACHE)  # as the workflow keeps them
    merged, overrides = with_overrides(read_config_file(args.configfile), getattr(args, "config", None) or [])
    # worded as the workflow words it (common.smk's CONFIG_SOURCE)
    source = str(args.configfile) + (f" with --config {' '.join(sorted(overrides))}" if overrides else "")
    given = [] if args.configfile == DEFAULT_CONFIG else [args.configfile]  # a run's --configfile
    cfg = validate_config(select_workflow_config(merged, given, merged if given else overrides), source)
    check_plan(cfg, source)
    return cfg


def _profile(args: argparse.Namespace) -> str | None:
    """The Snakemake profile a command plans as: --profile, else $SNAKEMAKE_PROFILE (as Snakemake)."""
    return getattr(args, "profile", None) or os.environ.get("SNAKEMAKE_PROFILE") or None


def _deployment(args: argparse.Namespace) -> str:
    """How Snakemake would deploy the jobs under this command's profile: "conda" or "venv"."""
    profile = _profile(args)
    return "conda" if profile and _profile_uses_conda(profile) else "venv"


def _artifacts(cfg: MixquantConfig, args: argparse.Namespace, **kwargs):
    """The artifact graph as Snakemake plans it under the command's profile (software.deployment: auto)."""
    from mixquant.keys.artifacts import resolve_artifacts
    from mixquant.planning import check_deployment

    deployment = check_deployment(cfg, _deployment(args), str(args.configfile))
    return resolve_artifacts(
        cfg, hash_cache_dir=Path(".snakemake") / "mixquant-hashes", deployment=deployment, **kwargs
    )


# ------------------------------------------------------------------------------------------ paths


def cmd_paths(args: argparse.Namespace) -> int:
    from mixquant.planning import artifact_state
    from mixquant.rulelog import stage_log_path

    cfg = _load(args)
    artifacts = _artifacts(cfg, args)
    table = {}
    for name, art in artifacts.items():
        state = artifact_state(art, cfg.results_dir)
        software = art.settings["software"]
        row = {
            "key": art.key,
            "path": str(art.path),
            "done": state == "done",
            "state": state,
            "stage": art.stage,
            # where the job runs and the package versions its key holds
            "env": f"envs/{software['env']}.yaml" if software["env"] else software["python"] or "venv",
            "packages": art.preimage["packages"],
        }
        if state == "failed":
            row["log"] = str(stage_log_path(cfg.results_dir, art.stage, art.key))
        table[name] = row
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        for name, row in table.items():
            log = f"  (log: {row['log']})" if "log" in row else ""
            print(f"{name:22} {row['state']:6}  {row['path']}{log}")
    return 0


# ---------------------------------------------------------------------------------------- explain


SHORT_KEY_MIN = 8  # hex digits of the shortest key prefix accepted (mixquant prints 12)
_HEX_PREFIX = re.compile(rf"^[0-9a-f]{{{SHORT_KEY_MIN},64}}$")


def find_keyed_dir(ref: str, results_dir: str | Path) -> Path:
    """A keyed output directory from a key or an unambiguous prefix of one (>= 8 hex digits, as mixquant
    prints 12), searched under results/*/, or a directory path."""
    path = Path(ref)
    if path.is_dir():
        return path
    if not _HEX_PREFIX.match(ref):  # checked before it becomes part of a glob
        raise ValueError(
            f"{ref!r} is neither an output directory nor a key (64 hex digits, or at least "
            f"{SHORT_KEY_MIN} of its first)"
        )
    matches = sorted(p for p in Path(results_dir).glob(f"*/{ref}*") if p.is_dir() and is_sha256_hex(p.name))
    if not matches:
        raise ValueError(f"no output directory with key {ref} under {results_dir}/")
    if len(matches) > 1:
        shown = ", ".join(f"{p.parent.name}/{p.name[:16]}" for p in matches[:4])
        raise ValueError(
            f"key prefix {ref} is ambiguous under {results_dir}/: {len(matches)} directories ({shown})"
        )
    return matches[0]


class KeyedPreimages:
    """The key preimage of a key, a key prefix or an output directory: a built output's manifest, else
    the planned artifact's of that key (the config's plan, computed once when first needed)."""

    def __init__(self, results_dir: str | Path, plan: Any = None) -> None:
        self.results_dir = results_dir
        self._plan = plan  # () -> {name: Artifact}
        self._planned: list | None = None

    def planned(self, ref: str) -> Any:
        """The one planned artifact whose key ``ref`` is (or starts), or None."""
        if self._plan is None or not _HEX_PREFIX.match(ref):
            return None
        if self._planned is None:
            self._planned = list({art.key: art for art in self._plan().values()}.values())
        matches = [art for art in self._planned if art.key.startswith(ref)]
        return matches[0] if len(matches) == 1 else None

    def __call__(self, ref: str) -> tuple[str, dict]:
        """(how to show it, its preimage)."""
        try:
            found = find_keyed_dir(ref, self.results_dir)
        except ValueError as error:
            art = self.planned(Path(ref).name)  # a key, or the path the plan gives it
            if art is None:
                plan = " nor among the config's planned outputs" if self._plan is not None else ""
                raise ValueError(f"{error}{plan}") from None
            return f"{art.path} (planned, not built)", art.preimage
        return str(found), read_manifest(found)["preimage"]


def explain(a: str, b: str, preimages: KeyedPreimages, depth: int = 0) -> list[str]:
    """Human-readable reasons why two keys (built or planned) differ (recursing upstream)."""
    pre_a, pre_b = preimages(a)[1], preimages(b)[1]
    indent = "  " * depth
    lines = []
    if pre_a == pre_b:
        return [f"{indent}identical preimages: same key"]
    for where, left, right in diff_values(pre_a, pre_b):
        lines.append(f"{indent}{where}: {json.dumps(left)} -> {json.dumps(right)}")
        if where.startswith("upstream.") and is_sha256_hex(left) and is_sha256_hex(right):
            try:
                deeper = explain(left, right, preimages, depth + 2)
            except ValueError as error:
                lines.append(f"{indent}  (cannot look further: {error})")
                continue
            lines.append(f"{indent}  because:")
            lines.extend(deeper)
    return lines


def cmd_explain(args: argparse.Namespace) -> int:
    """Built outputs from their manifests; a key that is not built from the config's plan (with the same
    --configfile and --config as the run that will build it)."""

    def plan() -> dict:
        return _artifacts(_load(args), args)

    preimages = KeyedPreimages(args.results_dir or _results_dir(args), plan)
    (shown_a, _), (shown_b, _) = preimages(args.a), preimages(args.b)
    print(f"A: {shown_a}\nB: {shown_b}")
    print("\n".join(explain(args.a, args.b, preimages)))
    return 0


def _results_dir(args: argparse.Namespace) -> str:
    """The config's results_dir as written, or the default where the config cannot be read (outputs named
    by path need none)."""
    try:
        raw, _ = with_overrides(read_config_file(args.configfile), args.config)
    except ConfigError:
        raw = {}
    return str(raw.get("results_dir") or MixquantConfig.model_fields["results_dir"].default)


# ------------------------------------------------------------------------------------------- plan

_JOB = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
_REASON = re.compile(r"^\s+reason: (.*)$")


def parse_dry_run(text: str) -> dict[str, dict[str, Any]]:
    """{rule: {"jobs": n, "reasons": {reason: count}}} from the text of `snakemake -n`."""
    rules: dict[str, dict[str, Any]] = {}
    current = None
    for line in text.splitlines():
        if match := _JOB.match(line.strip()) if not line[:1].isspace() else None:
            current = match.group(1)
            rules.setdefault(current, {"jobs": 0, "reasons": {}})
            rules[current]["jobs"] += 1
        elif current and (match := _REASON.match(line)):
            reasons = rules[current]["reasons"]
            for part in match.group(1).split(";"):
                reason = part.split(":")[0].strip()
                reasons[reason] = reasons.get(reason, 0) + 1
    rules.pop("all", None)
    return rules


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


def dry_run(configfile: str | None, extra: list[str], profile: str | None = None) -> str:
    command = [sys.executable, "-m", "snakemake", "-n"]
    command += ["--profile", profile] if profile else ["--cores", "1"]
    env = dict(os.environ)
    if profile and _profile_uses_conda(profile) and shutil.which("conda") is None:
        # Snakemake hashes conda environments even in a dry run and needs conda for that; without
        # conda on the planning machine, plan without software deployment (the jobs are the same, and the
        # keys still name the conda environments: MIXQUANT_PLAN_DEPLOYMENT, read in dry runs only).
        print(
            "note: conda is not installed here: planning without the profile's conda environments "
            "(the keys are those of the conda run)",
            file=sys.stderr,
        )
        command += ["--software-deployment-method", "env-modules"]
        env["MIXQUANT_PLAN_DEPLOYMENT"] = "conda"
    if configfile:
        command += ["--configfile", configfile]
    result = subprocess.run(command + nested_config_args(extra), capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"snakemake -n failed: {snakemake_error(result.stdout, result.stderr)}")
    return result.stdout + result.stderr


# Snakemake's first stderr line, printed on every run: never the cause of a failure.
_PROFILE_NOTE = "Using workflow specific profile"
_EXCEPTION_LINE = re.compile(r"^\w*(?:Error|Exception): \S")


def snakemake_error(stdout: str, stderr: str) -> str:
    """The one line that says why a Snakemake run failed.

    The Snakefile's own ``mixquant:`` line when there is one; else the last ``SomeError: message`` line
    (a traceback's or a schema validation's, which Snakemake prints to stdout while its stderr holds only
    the profile note); else the last line of stderr, or of stdout.
    """
    streams = [
        [line.strip() for line in text.splitlines() if line.strip() and _PROFILE_NOTE not in line]
        for text in (stderr, stdout)
    ]
    lines = streams[0] + streams[1]
    ours = [line for line in lines if line.startswith("mixquant: ")]
    if ours:
        return ours[-1].removeprefix("mixquant: ")
    for stream in streams:
        if errors := [line for line in stream if _EXCEPTION_LINE.match(line)]:
            return errors[-1]
    return lines[-1] if lines else "(no output)"


def _profile_settings(profile: str | None) -> dict:
    """A Snakemake profile's config.yaml as a dict (empty without a profile)."""
    import yaml

    if not profile:
        return {}
    path = Path(profile)
    if not path.exists() and (Path("profiles") / profile).exists():
        path = Path("profiles") / profile
    path = path / "config.yaml" if path.is_dir() else path
    return (yaml.safe_load(path.read_text()) if path.is_file() else {}) or {}


def _profile_uses_conda(profile: str) -> bool:
    data = _profile_settings(profile)
    method = data.get("software-deployment-method") or data.get("sdm") or []
    return "conda" in ([method] if isinstance(method, str) else method)


def plan_estimates(
    cfg: MixquantConfig, jobs: list, planned: dict, slots: int | None = None, deployment: str | None = None
) -> tuple[list, dict]:
    """Cost-model estimates of the planned jobs (``planned``: the artifact graph as planned now) and of
    those that follow the placement's solve, and the critical path of all of them with ``slots`` jobs at
    once (the profile's ``jobs``)."""
    from mixquant.cluster import after_solve_artifacts, critical_path, estimate_plan, planning_geometry
    from mixquant.keys.artifacts import placement_from_config, resolve_artifacts

    geometry = planning_geometry(cfg)
    if geometry is None:
        return [], {}
    cache = Path(".snakemake") / "mixquant-hashes"
    later, whole = [], planned
    if "checkpoint" not in planned and cfg.placement.explicit is not None:
        # Stand-in for the placement the solve will choose: placement.explicit.
        whole = resolve_artifacts(
            cfg, hash_cache_dir=cache, placement=placement_from_config(cfg), deployment=deployment
        )
        later = after_solve_artifacts(cfg, planned, whole)
    costs: dict = {}
    warnings: list[str] = []
    estimates = estimate_plan(cfg, geometry, jobs, planned, later, costs=costs, warnings=warnings)
    todo = {name: art for name, art in whole.items() if art.key in costs or not art.done}
    after = [name for name, art in whole.items() if art in later]
    seconds, chain = critical_path(todo, costs, slots=slots, after=after)
    return estimates, {"seconds": seconds, "chain": chain, "slots": slots, "warnings": warnings}


def conda_environments(cfg: MixquantConfig, check: bool = True) -> list[dict[str, Any]]:
    """Per conda environment this config's jobs run in: whether pip's resolver resolves it as conda will
    (mixquant.software, remembered per env file content), and the stages that use it."""
    from mixquant.software import env_report

    rows = []
    for resolution, env, stages in env_report(cfg.kld.engine, check=check):
        if resolution is None:
            status, detail = "not checked", "--no-env-check"
        else:
            status, detail = resolution.status, resolution.detail
            if resolution.status == "resolves":
                shown = ", ".join(
                    f"{name} {resolution.installs[name]}"
                    for name in ("vllm", "torch", "transformers", "nvidia-modelopt")
                    if name in resolution.installs
                )
                detail = f"{detail} ({shown})"
        rows.append({"env": f"envs/{env.name}.yaml", "status": status, "detail": detail, "stages": stages})
    return rows


def slurm_submissions(profile: dict, jobs: list) -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    """Under a SLURM profile: each job's sbatch options (set on the job), per rule the distinct option
    lines with their job counts, and what the cluster here would refuse (mixquant.slurm)."""
    from collections import Counter

    from mixquant.slurm import cluster_problems, read_partitions, sbatch_options, stand_in_job

    partitions = read_partitions(profile)
    by_rule: dict[str, Counter] = {}
    for job in jobs:
        job.sbatch = sbatch_options(job.rule, job.resources, partitions, job.threads)
        by_rule.setdefault(job.rule, Counter())[job.sbatch] += 1
    lines = {rule: sorted(counts.items(), key=lambda item: -item[1]) for rule, counts in by_rule.items()}
    stand_ins = [stand_in_job(job.rule, job.resources) for job in jobs]
    return lines, cluster_problems(profile, partitions, stand_ins)


def gpu_problem(cfg: MixquantConfig) -> str | None:
    """A GPU here smaller than the cost model assumes when it sizes the score jobs (placement.search
    .macro_batch: null), read with nvidia-smi where there is one."""
    from mixquant.costs import B200

    if not str(cfg.numerics.device).startswith("cuda") or cfg.placement.search.macro_batch is not None:
        return None
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        return None
    name, _, mib = done.stdout.strip().splitlines()[0].rpartition(",")
    have = int(float(mib)) * (1 << 20)
    if have >= B200.gpu_memory_bytes:
        return None
    return (
        f"this node's GPU ({name.strip()}, {have / (1 << 30):.0f} GiB) is smaller than the "
        f"{B200.gpu_memory_bytes / (1 << 30):.0f} GiB the score jobs are sized for: set "
        "placement.search.macro_batch"
    )


def job_names(artifacts: dict[str, Any]) -> dict[str, str]:
    """{key: the job's name for people} of the planned jobs (mixquant.console: stage and what it makes,
    e.g. ``quantize_layer nvfp4_w4a16 layers 1-8``)."""
    from mixquant.console import job_name

    return {art.key: job_name(art) for art in artifacts.values()}


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from mixquant.cluster import disk_space_warning, estimate_table, parse_dry_run_jobs
    from mixquant.costs import B200
    from mixquant.keys.artifacts import resolve_artifacts
    from mixquant.planning import check_deployment, device_problem, plan_warnings, run_blockers

    extra = args.snakemake_args + (["--config", *args.config] if args.config else [])
    args.config = config_entries(extra)  # also those given after `--`, as the dry run reads them
    cfg = _load(args)  # the config's own error in one line, before Snakemake is started
    deployment = check_deployment(cfg, _deployment(args), str(args.configfile))
    configfile = None if args.configfile == DEFAULT_CONFIG else args.configfile
    text = dry_run(configfile, extra, args.profile)
    plan = parse_dry_run(text)
    jobs = parse_dry_run_jobs(text)
    profile = _profile_settings(args.profile)
    slots = profile.get("jobs")
    artifacts = resolve_artifacts(
        cfg, hash_cache_dir=Path(".snakemake") / "mixquant-hashes", deployment=deployment
    )
    estimates, critical = (
        plan_estimates(cfg, jobs, artifacts, int(slots) if slots else None, deployment) if plan else ([], {})
    )
    if critical and (
        disk := disk_space_warning(cfg.results_dir, sum(row.bytes_written for row in estimates))
    ):
        critical["warnings"].append(disk)
    environments = conda_environments(cfg, check=not args.no_env_check) if deployment == "conda" else []
    submissions, cluster = (
        slurm_submissions(profile, jobs) if profile.get("executor") == "slurm" else ({}, [])
    )
    blockers = run_blockers(cfg, deployment)
    blockers += [f"{row['env']} {row['detail']}" for row in environments if row["status"] == "fails"]
    blockers += cluster + [line for line in [gpu_problem(cfg)] if line]
    if line := device_problem(cfg, local=profile.get("executor") in (None, "local")):
        blockers.append(line)
    names = job_names(artifacts)
    warnings = plan_warnings(cfg, artifacts)
    if args.json:
        print(
            json.dumps(
                {
                    "rules": plan,
                    "jobs": [{**asdict(job), "name": names.get(job.key, job.rule)} for job in jobs],
                    "estimates": [asdict(row) for row in estimates],
                    "assumed_gpu": B200.assumed_gpu() if estimates else None,
                    "critical_path": critical,
                    "environments": environments,
                    "sbatch": {rule: [list(row) for row in rows] for rule, rows in submissions.items()},
                    "blockers": blockers,
                    "ready": not blockers,
                    "warnings": warnings,
                },
                indent=2,
            )
        )
        return 0
    if environments:
        print(
            "Conda environments (Snakemake creates them before the first job; checked with pip's resolver):"
        )
        for row in environments:
            print(f"  {row['env']:16} {row['status']}: {row['detail']}")
            print(f"  {'':16} used by {', '.join(row['stages'])}")
        print()
    for line in warnings:
        print(f"warning: {line}")
    if not plan:
        print("nothing to do: every output is up to date")
        return 0
    if args.jobs:
        width = max(len(names.get(job.key, job.rule)) for job in jobs)
        for job in jobs:
            resources = ", ".join(
                f"{k}={v}" for k, v in job.resources.items() if k not in ("tmpdir", "mem", "mem_mib")
            )
            print(f"{names.get(job.key, job.rule):{width}} {job.key or '-':.12}  {resources}  | {job.reason}")
        print()
    print(f"{'rule':24} {'jobs':>4}  reasons")
    for rule, row in plan.items():
        reasons = ", ".join(f"{reason} ({count})" for reason, count in row["reasons"].items())
        print(f"{rule:24} {row['jobs']:>4}  {reasons}")
    print(f"{'total':24} {sum(row['jobs'] for row in plan.values()):>4}")
    if "solve_placement" in plan:
        print("then: quantize_layer for the placed layers not built yet, and export_checkpoint (planned once")
        print("      solve_placement has chosen the placement)")
    if submissions:
        from mixquant.slurm import plugin_version

        print()
        print(
            f"sbatch options (snakemake-executor-plugin-slurm {plugin_version()}'s own code; job name, log, "
            "comment and working directory aside):"
        )
        for rule, rows in submissions.items():
            for options, count in rows[:3]:
                print(f"  {rule:24} {count:>4} x  {options}")
            if len(rows) > 3:
                print(f"  {rule:24} (+{len(rows) - 3} more option lines: `--json` has every job's)")
    if estimates:
        print()
        print(f"Estimates (cost model: README, 'Cluster cost model'; they assume {B200.assumed_gpu()};")
        print("'after solve' rows assume placement.explicit as a stand-in for the placement the search will")
        print("choose):")
        print(estimate_table(estimates))
        if critical:
            for line in critical["warnings"]:
                print(f"warning: {line}")
            slots = f"{critical['slots']} jobs at once" if critical["slots"] else "unlimited parallel jobs"
            print()
            print(
                f"Critical path ({slots}): {critical['seconds'] / 3600:.2f} h through "
                + " -> ".join(critical["chain"])
            )
    print()
    if blockers:
        print(f"not ready to run: {len(blockers)} thing{'s' if len(blockers) > 1 else ''} will stop the run")
        for line in blockers:
            print(f"  - {line}")
    else:
        print("ready to run")
    return 0


# -------------------------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    """Run one artifact's stage outside Snakemake, with exactly the settings and key the rule uses."""
    import importlib

    artifacts = _artifacts(_load(args), args)
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
    from mixquant.keys.stages import stage_spec
    from mixquant.rulelog import check_job_software

    check_job_software({"settings": art.settings, "preimage": art.preimage})  # as the rule's job does
    numerics = art.settings.get("numerics")
    if numerics:  # the same numerics profile as the rule's job, entered before the stage imports torch
        from mixquant.numerics import enter

        enter(numerics["profile"], numerics["threads"], numerics.get("device", "cpu"))
    module, function = stage_spec(art.stage).runner.split(":")
    runner = getattr(importlib.import_module(module), function)
    paths = {role: up.path for role, up in upstream.items()}
    print(runner(art.path, **paths, settings=art.settings, preimage=art.preimage))
    return 0


# ----------------------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    """The published hashes re-derived from this config's artifacts: 0 when the policy passes, else 1.

    The policy of verify_hashes (mixquant.release.verify): a content mismatch fails, a numerical one
    only under an equal (or unknown) numerics fingerprint; the hashes of an artifact made from other
    settings than the published one are not comparable and pass. With --strict (or published.strict)
    any mismatch and any not comparable hash fails. --made-from prints the published.made_from block of
    this config's artifacts (what to pin beside hashes it publishes).
    """
    from mixquant.keys.artifacts import made_from
    from mixquant.release.verify import VerifyInputError, format_report, published_strict, verify_artifacts

    cfg = _load(args)
    artifacts = _artifacts(cfg, args)
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


# --------------------------------------------------------------------------------- the embedded toy


def cmd_pin_model(args: argparse.Namespace) -> int:
    """The content pin (model.local.sha256) of a local model directory."""
    from mixquant.checkpoint.shards import check_links_inside
    from mixquant.model.fetch import identity_sha256, local_dir_identity

    check_links_inside(args.directory)
    print(identity_sha256(local_dir_identity(args.directory)))
    return 0


def cmd_build_toy(args: argparse.Namespace) -> int:
    """Retrain the embedded toy from the config's model.toy settings into a new directory; print its pin."""
    from mixquant.keys.artifacts import dataset_settings
    from mixquant.numerics import enter

    cfg = _load(args)
    enter(cfg.numerics.cpu, cfg.numerics.threads)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mixquant.model.run import build_embedded_toy

    pin = build_embedded_toy(
        args.out, toy=cfg.model.toy.model_dump(mode="json"), corpus=dataset_settings(cfg)
    )
    print(f"{args.out}: model.local.sha256 {pin}")
    return 0


# --------------------------------------------------------------------------------- inspect, predict


def cmd_inspect(args: argparse.Namespace) -> int:
    """Audit any ModelOpt checkpoint directory from its headers, index and JSON files."""
    from mixquant.export.inspect import format_inspection, inspect_checkpoint

    report = inspect_checkpoint(args.directory)
    print(json.dumps(report, indent=2, default=str) if args.json else format_inspection(report))
    return 0 if report["ok"] else 1


def cmd_predict(args: argparse.Namespace) -> int:
    """Predict tensor count, payload bytes and effective routed bits from config.json alone."""
    from mixquant.export.predict import (
        format_prediction,
        load_placement,
        parse_placement_counts,
        predict_structure,
    )

    config = json.loads(Path(args.model_config).read_text("utf-8"))
    if Path(".snakemake").is_dir():  # a workflow's directory: its architecture cache, as `_load` keeps it
        from mixquant.model.families import WORKDIR_CACHE, cache_architectures

        cache_architectures(WORKDIR_CACHE)
    counts = parse_placement_counts(args.placement_counts) if args.placement_counts else None
    placement = load_placement(args.placement) if args.placement else None
    kv = None if args.kv_cache_quant == "none" else args.kv_cache_quant
    if kv is not None:
        from mixquant.model.families import architecture

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


# ----------------------------------------------------------------------------------------- schema


def cmd_schema(args: argparse.Namespace) -> int:
    from mixquant.config import config_keys_markdown, json_schema

    if args.markdown:
        text = "| key | default | meaning |\n|---|---|---|\n" + "\n".join(config_keys_markdown()) + "\n"
    else:
        text = json.dumps(json_schema(), indent=2) + "\n"
    if args.write:
        Path(args.write).write_text(text, "utf-8")
    else:
        sys.stdout.write(text)
    return 0


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
    from mixquant.kld.run import KldGateFailure
    from mixquant.release.verify import HashMismatchError

    return isinstance(error, (HashMismatchError, KldGateFailure))


if __name__ == "__main__":
    sys.exit(main())
