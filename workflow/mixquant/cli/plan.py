"""`mixquant plan`: what `snakemake -n` would run, with the cost model's estimates, the conda environments,
the sbatch options and what would stop the run."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mixquant.cli.context import (
    DEFAULT_CONFIG,
    config_entries,
    deployment_of,
    load_config,
    nested_config_args,
    profile_settings,
    profile_uses_conda,
)
from mixquant.cluster import (
    after_solve_artifacts,
    critical_path,
    disk_space_warning,
    estimate_plan,
    estimate_table,
    parse_dry_run,
    parse_dry_run_jobs,
)
from mixquant.config import MixquantConfig
from mixquant.console import job_name
from mixquant.costs import B200
from mixquant.facts import placement_from_config, planning_geometry
from mixquant.graph import resolve_artifacts
from mixquant.planning import check_deployment, device_problem, plan_warnings, run_blockers
from mixquant.slurm import cluster_problems, plugin_version, read_partitions, sbatch_options, stand_in_job
from mixquant.software import env_report


def dry_run(configfile: str | None, extra: list[str], profile: str | None = None) -> str:
    command = [sys.executable, "-m", "snakemake", "-n"]
    command += ["--profile", profile] if profile else ["--cores", "1"]
    env = dict(os.environ)
    if profile and profile_uses_conda(profile) and shutil.which("conda") is None:
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


def plan_estimates(
    cfg: MixquantConfig, jobs: list, planned: dict, slots: int | None = None, deployment: str | None = None
) -> tuple[list, dict]:
    """Cost-model estimates of the planned jobs (``planned``: the artifact graph as planned now) and of
    those that follow the placement's solve, and the critical path of all of them with ``slots`` jobs at
    once (the profile's ``jobs``)."""
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
    return {art.key: job_name(art) for art in artifacts.values()}


@dataclass
class PlanReport:
    """What `mixquant plan` found: the dry run's rules and jobs, the estimates, what would stop the run."""

    plan: dict[str, dict[str, Any]]
    jobs: list
    names: dict[str, str]
    estimates: list
    critical: dict[str, Any]
    environments: list[dict[str, Any]]
    submissions: dict[str, list[tuple[str, int]]]
    blockers: list[str]
    warnings: list[str]


def plan_report(args: argparse.Namespace) -> PlanReport:
    """Plan the config of ``args`` with `snakemake -n` and read the plan against the library."""
    extra = args.snakemake_args + (["--config", *args.config] if args.config else [])
    args.config = config_entries(extra)  # also those given after `--`, as the dry run reads them
    cfg = load_config(args)  # the config's own error in one line, before Snakemake is started
    deployment = check_deployment(cfg, deployment_of(args), str(args.configfile))
    configfile = None if args.configfile == DEFAULT_CONFIG else args.configfile
    text = dry_run(configfile, extra, args.profile)
    plan = parse_dry_run(text)
    jobs = parse_dry_run_jobs(text)
    profile = profile_settings(args.profile)
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
    return PlanReport(
        plan,
        jobs,
        job_names(artifacts),
        estimates,
        critical,
        environments,
        submissions,
        blockers,
        plan_warnings(cfg, artifacts),
    )


def plan_json(report: PlanReport) -> dict[str, Any]:
    """`mixquant plan --json`: the whole report, every job's sbatch options included."""
    return {
        "rules": report.plan,
        "jobs": [{**asdict(job), "name": report.names.get(job.key, job.rule)} for job in report.jobs],
        "estimates": [asdict(row) for row in report.estimates],
        "assumed_gpu": B200.assumed_gpu() if report.estimates else None,
        "critical_path": report.critical,
        "environments": report.environments,
        "sbatch": {rule: [list(row) for row in rows] for rule, rows in report.submissions.items()},
        "blockers": report.blockers,
        "ready": not report.blockers,
        "warnings": report.warnings,
    }


def print_environments(environments: list[dict[str, Any]]) -> None:
    print("Conda environments (Snakemake creates them before the first job; checked with pip's resolver):")
    for row in environments:
        print(f"  {row['env']:16} {row['status']}: {row['detail']}")
        print(f"  {'':16} used by {', '.join(row['stages'])}")
    print()


def print_jobs(report: PlanReport) -> None:
    """One line per planned job (`--jobs`): its name, key, resources and why it runs."""
    names = report.names
    width = max(len(names.get(job.key, job.rule)) for job in report.jobs)
    for job in report.jobs:
        resources = ", ".join(
            f"{k}={v}" for k, v in job.resources.items() if k not in ("tmpdir", "mem", "mem_mib")
        )
        print(f"{names.get(job.key, job.rule):{width}} {job.key or '-':.12}  {resources}  | {job.reason}")
    print()


def print_rules(plan: dict[str, dict[str, Any]]) -> None:
    print(f"{'rule':24} {'jobs':>4}  reasons")
    for rule, row in plan.items():
        reasons = ", ".join(f"{reason} ({count})" for reason, count in row["reasons"].items())
        print(f"{rule:24} {row['jobs']:>4}  {reasons}")
    print(f"{'total':24} {sum(row['jobs'] for row in plan.values()):>4}")
    if "solve_placement" in plan:
        print("then: quantize_layer for the placed layers not built yet, and export_checkpoint (planned once")
        print("      solve_placement has chosen the placement)")


def print_submissions(submissions: dict[str, list[tuple[str, int]]]) -> None:
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


def print_estimates(estimates: list, critical: dict[str, Any]) -> None:
    print()
    print(f"Estimates (cost model: docs/cost-model.md; they assume {B200.assumed_gpu()};")
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


def print_readiness(blockers: list[str]) -> None:
    print()
    if blockers:
        print(f"not ready to run: {len(blockers)} thing{'s' if len(blockers) > 1 else ''} will stop the run")
        for line in blockers:
            print(f"  - {line}")
    else:
        print("ready to run")


def cmd_plan(args: argparse.Namespace) -> int:
    report = plan_report(args)
    if args.json:
        print(json.dumps(plan_json(report), indent=2))
        return 0
    if report.environments:
        print_environments(report.environments)
    for line in report.warnings:
        print(f"warning: {line}")
    if not report.plan:
        print("nothing to do: every output is up to date")
        return 0
    if args.jobs:
        print_jobs(report)
    print_rules(report.plan)
    if report.submissions:
        print_submissions(report.submissions)
    if report.estimates:
        print_estimates(report.estimates, report.critical)
    print_readiness(report.blockers)
    return 0
