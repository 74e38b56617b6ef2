"""Cluster glue: per-job resource requests, the dry-run plan with cost estimates, and resuming a killed run.

The numbers come from :mod:`mixquant.costs` (the cost model, from the model geometry alone); this module
maps workflow jobs (artifacts) onto it and reads ``snakemake -n`` (the one parser of its output).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.checkpoint.atomic import write_text_atomic
from mixquant.config import MixquantConfig
from mixquant.costs import StageCost, job_gpus, rule_resources, stage_cost
from mixquant.facts import FALLBACK_REQUEST, Geometry
from mixquant.graph import Artifact
from mixquant.rulelog import existing_ancestor

KEY_IN_PATH = re.compile(r"/([0-9a-f]{64})(?:/|$)")


def engine_gpus(cfg: MixquantConfig, stage: str) -> int:
    """GPUs a job of ``stage`` uses (mixquant.costs.job_gpus): vLLM's tensor-parallel size for the KLD
    stages, one for a stage computing on a CUDA numerics.device, else 0."""
    return job_gpus(cfg, stage)


def job_shape(art: Artifact) -> dict[str, Any]:
    """The cost-model arguments of one job: a quantize_layer window's format and layer count, a score
    pass's sequence count, whether a reference_logits job is the evaluation suite's."""
    settings = art.settings or {}
    if art.stage == "score_sensitivity":
        first, stop = settings["sequences"]
        return {"sequences": int(stop) - int(first)}
    if art.stage == "reference_logits":
        return {"suite": "reference_form" in settings}
    layers = settings.get("layers")
    return {"fmt": settings.get("format"), "layers": len(layers) if isinstance(layers, list) else 1}


def job_request(cfg: MixquantConfig, geometry: Geometry | None, art: Artifact, attempt: int = 1) -> dict:
    """Resources of one job: mem_mb and runtime (minutes), doubled per retry (attempt 2 -> x2), disk_mb,
    gpu (vLLM's tensor-parallel size for its stages, one for a stage computing on a CUDA numerics.device,
    else 0) and nodes (1: every job, a tensor-parallel vLLM server included, must stay on one node; the
    SLURM plugin adds --nodes only when asked, and a --gpus=4 job could otherwise be split over two)."""
    gpus = engine_gpus(cfg, art.stage)
    if geometry is None:
        base = dict(FALLBACK_REQUEST)
    else:
        base = rule_resources(cfg, geometry, art.stage, gpus=gpus, **job_shape(art))
    request = {name: int(base[name]) * max(1, attempt) for name in ("mem_mb", "runtime")}
    # what a job writes does not grow on a retry
    return {**request, "disk_mb": int(base["disk_mb"]), "gpu": gpus, "nodes": 1}


# ------------------------------------------------------------------------------------------ dry run


@dataclass
class PlannedJob:
    rule: str
    outputs: list[str] = field(default_factory=list)
    reason: str = ""
    resources: dict[str, str] = field(default_factory=dict)
    threads: int = 1
    sbatch: str | None = None  # the options the SLURM plugin submits it with (mixquant.slurm), under SLURM

    @property
    def key(self) -> str | None:
        for output in self.outputs:
            if match := KEY_IN_PATH.search(output.rstrip("/") + "/"):
                return match.group(1)
        return None


_JOB = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
_FIELD = re.compile(r"^\s+(output|reason|resources|threads): (.*)$")


def parse_dry_run_jobs(text: str) -> list[PlannedJob]:
    """Every job of ``snakemake -n`` output (rule, outputs, reason, resources), in printed order."""
    jobs: list[PlannedJob] = []
    for line in text.splitlines():
        if not line[:1].isspace() and (match := _JOB.match(line.strip())):
            jobs.append(PlannedJob(match.group(1)))
        elif jobs and (match := _FIELD.match(line)):
            name, value = match.groups()
            if name == "output":
                jobs[-1].outputs = [part.strip() for part in value.split(",")]
            elif name == "reason":
                jobs[-1].reason = value
            elif name == "threads":
                jobs[-1].threads = int(value)
            else:
                jobs[-1].resources = dict(
                    part.strip().split("=", 1) for part in value.split(", ") if "=" in part
                )
    return [job for job in jobs if job.rule != "all"]


def parse_dry_run(text: str) -> dict[str, dict[str, Any]]:
    """{rule: {"jobs": n, "reasons": {reason: count}}} from the text of `snakemake -n` (its jobs by rule,
    in printed order, each reason counted once per job that gives it)."""
    rules: dict[str, dict[str, Any]] = {}
    for job in parse_dry_run_jobs(text):
        row = rules.setdefault(job.rule, {"jobs": 0, "reasons": {}})
        row["jobs"] += 1
        if job.reason:
            for part in job.reason.split(";"):
                reason = part.split(":")[0].strip()
                row["reasons"][reason] = row["reasons"].get(reason, 0) + 1
    return rules


# ---------------------------------------------------------------------------------------- estimates


@dataclass
class StageEstimate:
    stage: str
    jobs: int = 0
    gpus_per_job: int = 0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    peak_host_bytes: int = 0
    peak_gpu_bytes: int = 0
    wall_s_per_job: float = 0.0
    after_solve: bool = False

    def add(self, cost: StageCost, cpus_allocated: int | None = None) -> None:
        """One job; CPU core-hours as allocated: the job's cores (the profile's cpus_per_task, else the
        threads it computes with) x its wall time."""
        self.jobs += 1
        self.gpus_per_job = max(self.gpus_per_job, cost.gpus)
        self.gpu_hours += cost.gpu_hours
        self.cpu_hours += (cpus_allocated or cost.cpus) * cost.runtime_s / 3600
        self.bytes_read += cost.bytes_read
        self.bytes_written += cost.bytes_written
        self.peak_host_bytes = max(self.peak_host_bytes, cost.peak_host_bytes)
        self.peak_gpu_bytes = max(self.peak_gpu_bytes, cost.peak_gpu_bytes)
        self.wall_s_per_job = max(self.wall_s_per_job, cost.runtime_s)


def _gpus_requested(job: PlannedJob | None, cfg: MixquantConfig, stage: str) -> int:
    """GPUs the plan gives a job: the profile's request (``gpu``/``gpus`` resource) if any."""
    if job is not None:
        for name in ("gpu", "gpus"):
            if str(job.resources.get(name, "")).isdigit():
                return int(job.resources[name])
    return engine_gpus(cfg, stage)


def _cpus_allocated(job: PlannedJob | None) -> int | None:
    """Cores SLURM allocates a job: the profile's ``cpus_per_task`` (None: not set, the rule's threads)."""
    value = str((job.resources if job is not None else {}).get("cpus_per_task", ""))
    return int(value) if value.isdigit() else None


def estimate_plan(
    cfg: MixquantConfig,
    geometry: Geometry,
    jobs: Iterable[PlannedJob],
    artifacts: Mapping[str, Artifact],
    after_solve: Iterable[Artifact] = (),
    costs: dict[str, StageCost] | None = None,
    warnings: list[str] | None = None,
) -> list[StageEstimate]:
    """Per-stage totals of the cost model over the planned jobs (and the jobs that follow the solve);
    ``costs`` (when given) receives each job's :class:`StageCost` by key, ``warnings`` a line per stage
    whose jobs the profile gives fewer GPUs than they need (estimated with the GPUs they need)."""
    costs = {} if costs is None else costs
    warnings = [] if warnings is None else warnings
    by_key = {art.key: art for art in artifacts.values()}
    rows: dict[tuple[str, bool], StageEstimate] = {}
    gpus_by_stage: dict[str, int] = {}
    cpus_by_stage: dict[str, int | None] = {}

    def add(art: Artifact, job: PlannedJob | None, later: bool) -> None:
        gpus = (
            _gpus_requested(job, cfg, art.stage)
            if job
            else gpus_by_stage.get(art.stage, engine_gpus(cfg, art.stage))
        )
        needed = engine_gpus(cfg, art.stage)
        if gpus < needed:
            line = (
                f"{art.stage}: needs {needed} GPUs per job, the profile gives {gpus} (set its gpu resource)"
            )
            if line not in warnings:
                warnings.append(line)
            gpus = needed
        gpus_by_stage.setdefault(art.stage, gpus)
        cpus = _cpus_allocated(job) if job else cpus_by_stage.get(art.stage)
        cpus_by_stage.setdefault(art.stage, cpus)
        cost = stage_cost(cfg, geometry, art.stage, gpus=gpus, **job_shape(art))
        for line in cost.warnings:
            if line not in warnings:
                warnings.append(line)
        rows.setdefault((art.stage, later), StageEstimate(art.stage, after_solve=later)).add(cost, cpus)
        costs[art.key] = cost

    for job in jobs:
        art = by_key.get(job.key or "") or next(
            (a for a in artifacts.values() if str(a.path) in job.outputs), None
        )
        if art is not None:
            add(art, job, False)
    for art in after_solve:
        add(art, None, True)
    order: dict[str, int] = {}
    for art in [*artifacts.values(), *after_solve]:  # pipeline order, as the paths list it
        order.setdefault(art.stage, len(order))
    return sorted(rows.values(), key=lambda row: (row.after_solve, order.get(row.stage, len(order))))


def critical_path(
    graph: Mapping[str, Artifact],
    costs: Mapping[str, StageCost],
    *,
    slots: int | None = None,
    after: Iterable[str] = (),
) -> tuple[float, list[str]]:
    """(wall seconds, artifact names on the longest chain) of the planned jobs with the cluster's
    parallelism: jobs start when their inputs are done and a slot is free (``slots``: the profile's
    ``jobs``, None: unlimited), longest-remaining-path first. Finished artifacts take no time. The
    ``after`` artifacts exist only once the placement is solved: they wait for it too."""
    names = {art.key: name for name, art in graph.items()}
    deps = {
        name: [graph[up].key for up in art.upstream.values() if up in graph] for name, art in graph.items()
    }
    for name in after:
        if "placement" in graph and name in deps:
            deps[name].append(graph["placement"].key)
    seconds = {name: costs[art.key].runtime_s if art.key in costs else 0.0 for name, art in graph.items()}
    tail: dict[str, float] = {}  # longest path from a job to the end, itself included

    def remaining(name: str) -> float:
        if name not in tail:
            after = [n for n, up in deps.items() if graph[name].key in up]
            tail[name] = seconds[name] + max((remaining(n) for n in after), default=0.0)
        return tail[name]

    finish: dict[str, float] = {}
    chain: dict[str, str | None] = {}
    running: list[float] = []  # finish times of the jobs holding a slot
    pending = sorted(graph, key=lambda n: -remaining(n))
    clock = 0.0
    while pending:
        ready = [n for n in pending if all(names[k] in finish for k in deps[n])]
        for name in ready:
            start = max([finish[names[k]] for k in deps[name]], default=0.0)
            if seconds[name] and slots is not None:
                running = sorted(t for t in running if t > start)
                if len(running) >= slots:
                    start = max(start, running[len(running) - slots])
            finish[name] = start + seconds[name]
            if seconds[name]:
                running.append(finish[name])
            chain[name] = max((names[k] for k in deps[name]), key=lambda n: finish[n], default=None)
            pending.remove(name)
        clock = max(finish.values(), default=0.0)
    last = max(finish, key=lambda n: finish[n], default=None)
    path = []
    while last is not None:
        path.append(last)
        last = chain.get(last)
    return clock, [name for name in reversed(path) if seconds[name]]


def after_solve_artifacts(
    cfg: MixquantConfig, planned: Mapping[str, Artifact], stand_in: Mapping[str, Artifact]
) -> list[Artifact]:
    """Jobs that only exist once the placement is known: in ``stand_in`` (the graph resolved with a stand-in
    placement) but not in the graph planned up front, and not built yet."""
    planned_keys = {art.key for art in planned.values()}
    return [art for art in stand_in.values() if art.key not in planned_keys and not art.done]


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def estimate_table(rows: list[StageEstimate]) -> str:
    """Markdown table of the per-stage estimates with a total line."""
    head = (
        "| stage | jobs | GPUs/job | GPU-h | CPU core-h | read | written | peak host mem | peak GPU mem/GPU "
        "| wall/job |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        stage = f"{r.stage} (after solve)" if r.after_solve else r.stage
        lines.append(
            f"| {stage} | {r.jobs} | {r.gpus_per_job} | {r.gpu_hours:.2f} | {r.cpu_hours:.2f} "
            f"| {format_bytes(r.bytes_read)} | {format_bytes(r.bytes_written)} "
            f"| {format_bytes(r.peak_host_bytes)} | {format_bytes(r.peak_gpu_bytes)} "
            f"| {r.wall_s_per_job / 60:.1f} min |"
        )
    lines.append(
        f"| total | {sum(r.jobs for r in rows)} | | {sum(r.gpu_hours for r in rows):.2f} "
        f"| {sum(r.cpu_hours for r in rows):.2f} | {format_bytes(sum(r.bytes_read for r in rows))} "
        f"| {format_bytes(sum(r.bytes_written for r in rows))} "
        f"| {format_bytes(max((r.peak_host_bytes for r in rows), default=0))} "
        f"| {format_bytes(max((r.peak_gpu_bytes for r in rows), default=0))} | |"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- resume

OWNER_FILE = "mixquant-run.json"


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (guards against a recycled PID), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def record_run_owner(snakemake_dir: str | Path = ".snakemake") -> None:
    """Note which process holds this working directory's Snakemake lock (called at workflow start)."""
    pid = os.getpid()
    owner = {"pid": pid, "host": socket.gethostname(), "start": _process_start(pid)}
    path = Path(snakemake_dir) / OWNER_FILE
    write_text_atomic(path, json.dumps(owner))


def release_run_owner(snakemake_dir: str | Path = ".snakemake") -> None:
    """Forget this process as the lock holder (at the end of a run; a dry run holds no lock)."""
    path = Path(snakemake_dir) / OWNER_FILE
    try:
        mine = json.loads(path.read_text()).get("pid") == os.getpid()
    except (OSError, ValueError):
        return
    if mine:
        path.unlink(missing_ok=True)


def disk_space_warning(results_dir: str | Path, bytes_to_write: int, free: int | None = None) -> str | None:
    """A warning when a plan writes more than the results filesystem has free (None when it fits)."""
    if free is None:
        free = shutil.disk_usage(existing_ancestor(Path(results_dir).absolute())).free
    if bytes_to_write <= free:
        return None
    return (
        f"the plan writes {bytes_to_write / 1e9:,.3f} GB to {results_dir}/, whose filesystem has "
        f"{free / 1e9:,.3f} GB free"
    )


def _recorded_owner(snakemake_dir: str | Path) -> tuple[dict, bool] | None:
    """The recorded holder of this working directory's lock when it ran on this host, and whether that
    process still runs (same PID, same start time); None when nothing is recorded or another host is."""
    try:
        owner = json.loads((Path(snakemake_dir) / OWNER_FILE).read_text())
        pid = int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if owner.get("host") != socket.gethostname():
        return None
    start = _process_start(pid)
    return owner, start is not None and start == owner.get("start")


def active_run_line(snakemake_dir: str | Path = ".snakemake") -> str | None:
    """One line naming the live run that holds this working directory (this host), else None."""
    recorded = _recorded_owner(snakemake_dir)
    if recorded is None or not recorded[1] or int(recorded[0]["pid"]) == os.getpid():
        return None
    owner = recorded[0]
    return (
        f"mixquant: this working directory is in use by the run of pid {owner['pid']} on {owner['host']}; "
        "wait for it or stop it (snakemake --unlock only once it is gone)"
    )


def clear_stale_lock(snakemake_dir: str | Path = ".snakemake") -> str | None:
    """Remove the lock a killed run left behind: its owner ran on this host and is gone.

    Returns a one-line message when it removed one, None otherwise (no owner recorded, another host,
    or the owner still running: then Snakemake reports the lock as usual).
    """
    recorded = _recorded_owner(snakemake_dir)
    if recorded is None or recorded[1]:
        return None
    owner, base = recorded[0], Path(snakemake_dir)
    locks = base / "locks"
    had_locks = locks.is_dir() and any(locks.iterdir())
    shutil.rmtree(locks, ignore_errors=True)
    (base / OWNER_FILE).unlink(missing_ok=True)
    if not had_locks:
        return None
    return f"mixquant: removed the lock of a killed run (pid {owner['pid']} on {owner['host']} is gone)"
