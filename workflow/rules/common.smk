# Config selection, validation and the artifact graph (keys and paths) — all via the library.
import os
import shutil
import sys

from snakemake.logging import logger as snakemake_logger
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

from mixquant.cluster import (
    active_run_line,
    clear_stale_lock,
    job_request,
    record_run_owner,
    release_run_owner,
)
from mixquant.faults import point as fault_point
from mixquant.console import job_name as console_job_name, quiet_console
from mixquant.interrupt import interrupted_line, watch_interrupt
from mixquant.config import ConfigError, select_workflow_config, validate_config
from mixquant.facts import geometry_missing_line, planning_geometry
from mixquant.graph import (
    artifact_by_key,
    final_targets,
    made_from,
    resolve_artifacts,
)
from mixquant.keys.stages import stage_env
from mixquant.model.families import (
    cache_architectures,
    workflow_cache as workflow_architecture_cache,
)
from mixquant.planning import (
    check_deployment,
    check_device,
    check_plan,
    check_run_deployment,
    check_run_start,
    check_vllm,
    device_problem,
    report_run_end,
    snakemake_invocation,
)
from mixquant.release.published import planned_comparability
from mixquant.store import hold_results_store, release_results_store, restart_run
from mixquant.numerics import apply_environment as apply_numerics_environment

# A Ctrl-C: Snakemake's account of the stopped jobs stays in its log file, off the console (mixquant.interrupt).
INTERRUPT = watch_interrupt(snakemake_logger) if workflow.is_main_process else None
# How Snakemake was started (dry run, executor, lock), read before Snakemake itself knows.
INVOCATION = snakemake_invocation() if workflow.is_main_process else None
SELECTED_CONFIG = select_workflow_config(
    config, workflow.overwrite_configfiles, workflow.config_settings.overwrite_config
)
CONFIG_SOURCE = (
    " ".join(map(str, workflow.overwrite_configfiles)) or "config/config.yaml"
) + (  # an error in a --config value says it came from there
    f" with --config {' '.join(sorted(workflow.config_settings.config))}"
    if workflow.config_settings.config
    else ""
)
# A model's derived architecture (transformers' meta model, ~5 s) is read from here on every later start.
cache_architectures(workflow_architecture_cache())
# Where the jobs run (the conda environments of envs/, or this venv) decides the versions in the keys.
# `mixquant plan` on a machine without conda plans a conda profile with --sdm env-modules and says so in
# MIXQUANT_PLAN_DEPLOYMENT; a run checks at its start that the jobs really run where the keys say.
SNAKEMAKE_DEPLOYMENT = (
    "conda"
    if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
    else "venv"
)
if SNAKEMAKE_DEPLOYMENT == "conda" and shutil.which("conda") is None:
    sys.exit(
        "mixquant: this run deploys conda environments (--sdm conda or the profile's "
        "software-deployment-method) but conda is not installed here, and Snakemake needs it even to plan "
        "(-n): plan with `mixquant plan --profile ...`, which plans the same jobs and keys without conda, "
        "or add --sdm env-modules"
    )
try:
    # One line naming the key first (the config, then what planning can check: paths, context,
    # budget, layers, where the jobs run); then the committed JSON schema, as Snakemake users expect.
    CFG = validate_config(SELECTED_CONFIG, source=CONFIG_SOURCE)
    check_plan(CFG, CONFIG_SOURCE)
    DEPLOYMENT = check_deployment(
        CFG,
        os.environ.get("MIXQUANT_PLAN_DEPLOYMENT") or SNAKEMAKE_DEPLOYMENT,
        CONFIG_SOURCE,
    )
    # CUDA jobs on this machine need CUDA here (a cluster's jobs run on nodes that have their own): a run
    # stops, a plan (-n) says so and plans, as planning needs neither the weights nor the GPU
    if INVOCATION is not None and INVOCATION.executes:
        check_device(CFG, INVOCATION.local, CONFIG_SOURCE)
    elif (
        INVOCATION is not None
        and INVOCATION.dry_run
        and (problem := device_problem(CFG, INVOCATION.local))
    ):
        print(f"warning: {CONFIG_SOURCE}: {problem}; a run stops here", file=sys.stderr)
except ConfigError as error:
    sys.exit(f"mixquant: {error}")
# What the keys are made of: the config as mixquant read it (a quoted number from a YAML file or a
# nested --config 'section={key: 8}' is the number it names), checked against the committed schema.
validate(
    CFG.model_dump(mode="json", by_alias=True),
    workflow.source_path("../schemas/config.schema.json"),
    set_default=False,
)

# The CPU numerics profile, set before any job imports torch: every job process inherits it (and
# checks that it took effect, mixquant.numerics.enter), whatever the shell exported.
apply_numerics_environment(CFG.numerics.cpu, CFG.numerics.threads)

# The placement search is the long chain every release waits on (calibration -> activation statistics ->
# quantize_layer -> score_sensitivity -> solve_placement, a checkpoint whose downstream jobs Snakemake
# cannot see before it is done): its jobs go first, the baselines' evaluations fill the cores around it.
SEARCH_PRIORITY = 10

HASH_CACHE = Path(".snakemake") / "mixquant-hashes"

# A run killed with SIGKILL leaves Snakemake's lock behind; the next run on this host removes it once
# the process that held it is gone (keyed outputs are published whole, so nothing half-written stays).
if workflow.is_main_process and (message := clear_stale_lock()):
    print(message, file=sys.stderr)
if workflow.is_main_process and (message := active_run_line()):
    # a run stops here, before Snakemake's own lock error, whose advice (--unlock) would break the live run
    if INVOCATION is not None and INVOCATION.executes and INVOCATION.lock:
        sys.exit(message)
    print(message, file=sys.stderr)


onstart:
    try:  # before any job: a run that would download from an unpinned revision stops here, and one whose
        # jobs would run elsewhere than their keys say
        check_run_start(CFG, CONFIG_SOURCE)
        check_run_deployment(CFG, DEPLOYMENT, SNAKEMAKE_DEPLOYMENT, CONFIG_SOURCE)
        check_device(CFG, workflow.local_exec, CONFIG_SOURCE)
        check_vllm(
            CFG,
            DEPLOYMENT,
            {job.rule.name for job in workflow.dag.needrun_jobs()},
            CONFIG_SOURCE,
        )
    except ConfigError as error:
        sys.exit(f"mixquant: {error}")
    record_run_owner()
    # one run at a time per results store (mixquant.store): after waiting for another workflow's run,
    # plan again so that what it published is reused, not computed (and deleted) a second time
    if hold_results_store(CFG.results_dir):
        print(
            "mixquant: the other run is done; planning again to reuse what it published",
            file=sys.stderr,
        )
        release_run_owner()
        workflow.persistence.unlock()
        restart_run()
    fault_point(
        "run-start", "snakemake"
    )  # locks taken, no job started (the kill campaign's hook)


onsuccess:
    fault_point(
        "run-end", "snakemake"
    )  # every job done, the run's bookkeeping not yet
    release_results_store(CFG.results_dir)
    release_run_owner()
    # where the release and the checkpoint are
    for line in report_run_end(
        CFG, HASH_CACHE, succeeded=True, deployment=DEPLOYMENT
    ):
        print(line, file=sys.stderr)


onerror:
    release_results_store(CFG.results_dir)
    release_run_owner()
    if INTERRUPT is not None and INTERRUPT.interrupted:
        print(interrupted_line(log), file=sys.stderr)
    else:
        for line in report_run_end(
            CFG, HASH_CACHE, succeeded=False, deployment=DEPLOYMENT
        ):
            print(line, file=sys.stderr)


try:
    # root inputs are read here (local model content, its pin): a mismatch is one line too
    ART = resolve_artifacts(CFG, hash_cache_dir=HASH_CACHE, deployment=DEPLOYMENT)
except (ValueError, OSError) as error:
    sys.exit(f"mixquant: {CONFIG_SOURCE}: {error}")
_PLACED = {}
# Whether ModelOpt's AutoQuantize placement was built when ART was resolved (its artifact's `done` reads the
# disk, and turns true mid-run once its job finishes: ART still lacks what follows it).
PLACED_AT_START = {"autoquantize": "autoquantize" in ART and ART["autoquantize"].done}


def placed_artifacts():
    """The graph including the rebuild and the export of the placement (and of ModelOpt's autoquantize
    placement, when a candidate asks for it).

    With a search, that needs solve_placement's result: the checkpoint's .get() raises until it is
    built, and Snakemake re-evaluates the DAG after it (then placement.json is read)."""
    if "checkpoint" in ART and (
        "autoquantize" not in ART or PLACED_AT_START["autoquantize"]
    ):
        return ART  # every placement was known when the graph was resolved
    if "checkpoint" not in ART:
        if "refined" in ART:
            checkpoints.refine_placement.get()
        else:
            checkpoints.solve_placement.get()
    if "autoquantize" in ART and not PLACED_AT_START["autoquantize"]:
        checkpoints.autoquantize_placement.get()
    if "graph" not in _PLACED:
        _PLACED["graph"] = resolve_artifacts(
            CFG, hash_cache_dir=HASH_CACHE, deployment=DEPLOYMENT
        )
    return _PLACED["graph"]


def all_targets(wildcards):
    """What is known up front (model, calibration, prompt, placement)."""
    return final_targets(ART)


def placed_targets(wildcards):
    """The checkpoint of the placement (after solve_placement for a search)."""
    return final_targets(placed_artifacts())


def artifact_path(name):
    return str(ART[name].path)


def stage_log(name):
    return f"{CFG.results_dir}/logs/{ART[name].stage}/{ART[name].key}.log"


def stage_benchmark(name):
    return f"{CFG.results_dir}/benchmarks/{ART[name].stage}/{ART[name].key}.tsv"


def stage_params(name):
    """JSON-serializable settings and key preimage handed to the rule script."""
    return {"settings": ART[name].settings, "preimage": ART[name].preimage}


def keyed_artifact(wildcards):
    """The artifact of a {key} wildcard: planned up front, or (rebuild, export) after the placement."""
    try:
        return artifact_by_key(ART, wildcards.key)
    except KeyError:
        return artifact_by_key(placed_artifacts(), wildcards.key)


def keyed_inputs(wildcards):
    """{upstream role: path} of a keyed artifact."""
    art = keyed_artifact(wildcards)
    graph = (
        ART if art.name in ART and ART[art.name].key == art.key else placed_artifacts()
    )
    return {role: str(graph[name].path) for role, name in art.upstream.items()}


def keyed_params(wildcards):
    art = keyed_artifact(wildcards)
    return {"settings": art.settings, "preimage": art.preimage}


# Per-job requests from the model geometry and the config (mixquant.cluster.job_request): mem_mb and runtime
# (minutes, doubled on each retry), disk_mb, gpu (numerics.device, kld.tensor_parallel_size) and nodes (1:
# every job runs on one node). The profile adds partitions (its partition file) and cores.
GEOMETRY = planning_geometry(CFG)
if workflow.is_main_process and (message := geometry_missing_line(CFG)):
    print(f"warning: {message}", file=sys.stderr)
# published hashes this config's artifacts cannot match: said before the run, not only by verify_hashes
if workflow.is_main_process and (
    message := planned_comparability(CFG.published, made_from(ART, CFG))
):
    print(f"warning: {message}", file=sys.stderr)


def artifact_request(name, resource):
    def request(wildcards, attempt):
        return job_request(CFG, GEOMETRY, ART[name], attempt)[resource]

    return request


def keyed_request(resource):
    def request(wildcards, attempt):
        return job_request(CFG, GEOMETRY, keyed_artifact(wildcards), attempt)[resource]

    return request


def conda_env(stage):
    """The stage's conda environment file (the stage registry's), relative to workflow/rules/."""
    return f"../../envs/{stage_env(stage, CFG.kld.engine)}.yaml"


def job_name(rule, key):
    """A job's name on the console (mixquant.console): its stage and what it makes, by its output's key."""
    for graph in (ART, _PLACED.get("graph") or {}):
        try:
            return console_job_name(artifact_by_key(graph, key))
        except KeyError:
            continue
    return rule


# A run's console names each job in one line; Snakemake's full job blocks stay in its log file and in
# `snakemake -n` (which `mixquant plan` reads).
if (
    workflow.is_main_process
    and not workflow.output_settings.dryrun
    and not workflow.output_settings.verbose
):
    quiet_console(snakemake_logger.handlers, job_name)
