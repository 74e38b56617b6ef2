"""The stage registry: every stage's runner, software environment, compute device, output, key inputs and
cost function.

One table (``STAGES``) read by everyone who needs to know about stages: the artifact graph (what enters a
key), the rules (their ``conda:`` environment, via ``workflow/rules/common.smk``), the cost model (each
stage's cost function, which serve a model), ``mixquant run`` (the runner) and ``mixquant paths`` (the
environment).
Nothing else lists stages.

KEY_SCHEMA_VERSION changes when the layout of the preimage itself changes (every key moves).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

from mixquant.keys.code_identity import code_identity
from mixquant.keys.environments import (
    env_path,
    env_versions,
    installed_versions,
    python_versions,
    read_env_file,
)

KEY_SCHEMA_VERSION = 1

# Packages whose versions are recorded in every manifest (the environment that produced it).
RECORDED_PACKAGES = (
    "mixquant",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "datasets",
    "nvidia-modelopt",
    "pandas",
    "pulp",
    "matplotlib",
    "numpy",
    "snakemake",
    "huggingface-hub",
    "vllm",
)

# Where a stage computes: "cpu" always; "configured": numerics.device (the layer-streamed forward stages and
# the rebuild); "engine": numerics.device with the hf engine, while vLLM places itself on its own GPUs.
Device = Literal["cpu", "configured", "engine"]
# The conda environment a stage's rule runs in: envs/quant.yaml, or "engine": envs/serve.yaml when the KLD
# engine is vLLM (its own torch and transformers), else envs/quant.yaml.
QUANT_ENV = "quant"
SERVE_ENV = "serve"


@dataclass(frozen=True)
class StageSpec:
    """One stage: what decides its numbers (library modules, packages), how it runs and where."""

    name: str
    runner: str  # "module:function", called as runner(out_dir, **{role: upstream path}, settings, preimage)
    output: str  # the rule's named output (the keyed directory)
    numerics_modules: tuple[str, ...]
    numerics_packages: tuple[str, ...]
    env: str = QUANT_ENV  # QUANT_ENV, or "engine" (see above)
    device: Device = "cpu"
    # "module:function" of the cost model's estimate of one job, called as cost(job) on a
    # mixquant.costs.job.CostJob it fills in (mixquant.costs.stage_cost)
    cost: str = ""
    # What the runner reads of its job beyond params.stage, added to its settings by the rule script: the
    # thread count the rule gives the job ("threads"), its wall time in minutes ("runtime_min")
    job_settings: tuple[str, ...] = ()

    @property
    def serves_model(self) -> bool:
        """Whether the stage runs the KLD engine (vLLM: a tensor-parallel model server of its own)."""
        return self.env == "engine"


_ENGINE_MODULES = (
    "mixquant.kld.capture",
    "mixquant.kld.stats",
    "mixquant.kld.topk",
    "mixquant.kld.engines",
    "mixquant.kld.settings",
    "mixquant.kld.checkpoints",
    "mixquant.kld.hf_engine",
    "mixquant.kld.vllm_engine",
    "mixquant.kld.run",
    "mixquant.model.dequant",
    "mixquant.formats.dequant",
    "mixquant.model.experts",
    "mixquant.model.attention",
    "mixquant.formats.facts",
    "mixquant.checkpoint.writer",
)
_ENGINE_PACKAGES = ("torch", "transformers", "nvidia-modelopt", "safetensors", "vllm")

# In pipeline order (the cost table's rows follow it).
STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        # Downloads and content hashes: no numerics, so no package decides the result.
        StageSpec(
            "fetch_model",
            "mixquant.source.run:run_fetch_model",
            "model",
            ("mixquant.model.fetch",),
            (),
            cost="mixquant.costs.sources:fetch_model",
        ),
        # A block-FP8 source made BF16 by the publisher's dequantization.
        StageSpec(
            "dequantize_source",
            "mixquant.source.run:run_dequantize_source",
            "model",
            (
                "mixquant.checkpoint.fp8_source",
                "mixquant.checkpoint.fp8_config",
                "mixquant.checkpoint.writer",
            ),
            ("torch", "safetensors"),
            cost="mixquant.costs.sources:dequantize_source",
        ),
        StageSpec(
            "build_toy_model",
            "mixquant.source.run:run_build_toy_model",
            "model",
            (
                "mixquant.model.toy",
                "mixquant.model.toy_training",
                "mixquant.model.toy_build",
                "mixquant.model.toy_layout",
                "mixquant.model.toy_settings",
                "mixquant.model.tokenizer",
                "mixquant.model.layout",
                "mixquant.checkpoint.writer",
            ),
            ("torch", "transformers", "tokenizers", "safetensors"),
            cost="mixquant.costs.sources:build_toy_model",
        ),
        StageSpec(
            "sample_calibration",
            "mixquant.calibration.run:run_sample_calibration",
            "calibration",
            (
                "mixquant.calibration.sample",
                "mixquant.calibration.dataset",
                "mixquant.calibration.tokens",
                "mixquant.checkpoint.writer",
            ),
            ("transformers", "tokenizers", "datasets"),
            cost="mixquant.costs.sources:sample_calibration",
        ),
        StageSpec(
            "pin_prompt",
            "mixquant.calibration.run:run_pin_prompt",
            "prompt",
            (
                "mixquant.calibration.prompt",
                "mixquant.calibration.dataset",
                "mixquant.calibration.tokens",
                "mixquant.checkpoint.writer",
            ),
            ("transformers", "tokenizers", "datasets"),
            cost="mixquant.costs.sources:pin_prompt",
        ),
        # The evaluation suite's windows, checked disjoint from the calibration data by content.
        StageSpec(
            "sample_eval",
            "mixquant.calibration.eval_suite:run_sample_eval",
            "eval",
            (
                "mixquant.calibration.eval_suite",
                "mixquant.calibration.disjoint",
                "mixquant.calibration.sample",
                "mixquant.calibration.dataset",
                "mixquant.calibration.tokens",
                "mixquant.checkpoint.writer",
            ),
            ("transformers", "tokenizers", "datasets"),
            cost="mixquant.costs.sources:sample_eval",
        ),
        StageSpec(
            "collect_activation_stats",
            "mixquant.quantize.run:run_collect_activation_stats",
            "activations",
            (
                "mixquant.quantize.activations",
                "mixquant.model.attention",
                "mixquant.model.experts",
                "mixquant.checkpoint.writer",
                "mixquant.formats.facts",
            ),
            ("torch", "transformers", "safetensors"),
            device="configured",
            cost="mixquant.costs.rebuild:collect_activation_stats",
        ),
        # What each routed expert received in calibration, for the GPTQ rebuild (rounding: gptq only).
        StageSpec(
            "collect_expert_inputs",
            "mixquant.quantize.expert_inputs:run_collect_expert_inputs",
            "expert_inputs",
            (
                "mixquant.quantize.expert_inputs",
                "mixquant.model.experts",
                "mixquant.checkpoint.writer",
            ),
            ("torch", "transformers", "safetensors"),
            device="configured",
            cost="mixquant.costs.rebuild:collect_expert_inputs",
        ),
        StageSpec(
            "quantize_layer",
            "mixquant.quantize.run:run_quantize_layer",
            "layers",
            (
                "mixquant.quantize.layer",
                "mixquant.quantize.gptq",
                "mixquant.formats.nvfp4_gptq",
                "mixquant.model.layer_reader",
                "mixquant.formats.facts",
                "mixquant.formats.nvfp4",
                "mixquant.formats.nvfp4_amax",
                "mixquant.formats.fp8",
                "mixquant.formats.dequant",
                "mixquant.checkpoint.writer",
            ),
            ("torch", "nvidia-modelopt", "safetensors"),
            device="configured",
            cost="mixquant.costs.rebuild:quantize_layer",
        ),
        # Scores: the scorer (its numerics come from quantize_layer's results, which are upstream).
        StageSpec(
            "score_sensitivity",
            "mixquant.search.run:run_score_sensitivity",
            "scores",
            (
                "mixquant.search.score",
                "mixquant.search.branches",
                "mixquant.search.run",
                "mixquant.model.experts",
                "mixquant.formats.dequant",
            ),
            ("torch", "transformers", "nvidia-modelopt", "safetensors"),
            device="configured",
            cost="mixquant.costs.rebuild:score_sensitivity",
            job_settings=("threads", "runtime_min"),  # a score job saves its state every quarter of its time
        ),
        # The placement, its audit, the frontier and the plots are all outputs of the solve.
        StageSpec(
            "solve_placement",
            "mixquant.search.run:run_solve_placement",
            "placement",
            (
                "mixquant.search.solve",
                "mixquant.search.groups",
                "mixquant.search.ilp",
                "mixquant.search.minimax",
                "mixquant.search.run",
                "mixquant.search.plots",
            ),
            ("pulp", "matplotlib"),
            cost="mixquant.costs.rebuild:solve_placement",
        ),
        # The solved placement refined by measured KL: its measurement's numerics are the streamed forward's
        # and the layer x format results' (upstream); the K-best solve is the ILP's.
        StageSpec(
            "refine_placement",
            "mixquant.search.refine:run_refine_placement",
            "placement",
            (
                "mixquant.search.refine",
                "mixquant.search.ilp",
                "mixquant.search.groups",
                "mixquant.search.score",
                "mixquant.search.run",
                "mixquant.search.plots",
                "mixquant.model.experts",
                "mixquant.formats.dequant",
            ),
            ("torch", "transformers", "nvidia-modelopt", "safetensors", "pulp", "matplotlib"),
            device="configured",
            cost="mixquant.costs.rebuild:refine_placement",
        ),
        # ModelOpt's own auto_quantize placement (the KLD gate's anchor): its search, calibration and fake
        # quant decide it, at mixquant's budget.
        StageSpec(
            "autoquantize_placement",
            "mixquant.search.autoquantize:run_autoquantize_placement",
            "placement",
            (
                "mixquant.search.autoquantize",
                "mixquant.search.reference",
                "mixquant.search.groups",
                "mixquant.search.score",
                "mixquant.search.run",
                "mixquant.calibration.tokens",
                "mixquant.formats.cpu_fake_quant",
            ),
            ("torch", "transformers", "nvidia-modelopt", "safetensors"),
            device="configured",
            cost="mixquant.costs.rebuild:autoquantize_placement",
            job_settings=("threads",),
        ),
        # The checkpoint audit (inspect, predict) is part of the output, so its code is in the key.
        StageSpec(
            "export_checkpoint",
            "mixquant.export.run:run_export_checkpoint",
            "checkpoint",
            (
                "mixquant.export.checkpoint",
                "mixquant.export.inputs",
                "mixquant.export.modelopt_config",
                "mixquant.export.shard_plan",
                "mixquant.export.inspect",
                "mixquant.export.inspect_checks",
                "mixquant.model.families.naming",
                "mixquant.export.predict",
                "mixquant.checkpoint.writer",
                "mixquant.formats.facts",
                "mixquant.quantize.reference",
            ),
            ("nvidia-modelopt", "safetensors", "transformers"),
            cost="mixquant.costs.rebuild:export_checkpoint",
        ),
        # Logits: the engine (and what it loads a checkpoint with) decides them.
        StageSpec(
            "reference_logits",
            "mixquant.kld.run:run_reference_logits",
            "reference",
            _ENGINE_MODULES,
            _ENGINE_PACKAGES,
            env="engine",
            device="engine",
            cost="mixquant.costs.kld:reference_logits",
            job_settings=("threads",),
        ),
        StageSpec(
            "run_kld",
            "mixquant.kld.run:run_kld",
            "runs",
            _ENGINE_MODULES,
            _ENGINE_PACKAGES,
            env="engine",
            device="engine",
            cost="mixquant.costs.kld:run_kld",
            job_settings=("threads",),
        ),
        StageSpec(
            "gate_kld",
            "mixquant.kld.gate:run_gate_kld",
            "gate",
            (
                "mixquant.kld.gate",
                "mixquant.kld.report",
                "mixquant.kld.suite_gates",
                "mixquant.kld.windows",
                "mixquant.checkpoint.writer",
            ),
            ("torch",),
            cost="mixquant.costs.kld:gate_kld",
            job_settings=("threads",),
        ),
        StageSpec(
            "kld_report",
            "mixquant.kld.compare:run_kld_report",
            "report",
            (
                "mixquant.kld.compare",
                "mixquant.kld.report",
                "mixquant.kld.plots",
                "mixquant.kld.suite_tables",
                "mixquant.kld.windows",
            ),
            ("pandas", "matplotlib"),
            cost="mixquant.costs.kld:kld_report",
            job_settings=("threads",),
        ),
        StageSpec(
            "check_kld_gates",
            "mixquant.kld.gate:run_check_kld_gates",
            "verdict",
            ("mixquant.kld.gate",),
            (),
            cost="mixquant.costs.kld:check_kld_gates",
            job_settings=("threads",),
        ),
        # Hashes of bytes the upstream stages wrote: the encodings live in the code, no package decides.
        StageSpec(
            "verify_hashes",
            "mixquant.release.verify:run_verify_hashes",
            "verify",
            (
                "mixquant.release.hashes",
                "mixquant.release.published",
                "mixquant.release.verify",
                "mixquant.release.report",
                "mixquant.release.closeness",
            ),
            (),
            cost="mixquant.costs.release:verify_hashes",
        ),
        # The bundle copies upstream files and writes the recipe, the KLD table and the model card (which
        # names the mixquant version, so it enters the key).
        StageSpec(
            "assemble_release",
            "mixquant.release.bundle:run_assemble_release",
            "release",
            (
                "mixquant.release.bundle",
                "mixquant.release.card",
                "mixquant.release.card_kld",
                "mixquant.kld.suite_tables",
                "mixquant.release.serving",
                "mixquant.release.recipe",
                "mixquant.release.hashes",
                "mixquant.kld.report",
            ),
            ("mixquant", "pandas"),
            cost="mixquant.costs.release:assemble_release",
        ),
    )
}


def stage_spec(stage: str) -> StageSpec:
    try:
        return STAGES[stage]
    except KeyError:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}") from None


def stage_env(stage: str, kld_engine: str) -> str:
    """The conda environment (envs/<name>.yaml) ``stage``'s rule runs in, for the configured KLD engine."""
    env = stage_spec(stage).env
    if env == "engine":
        return SERVE_ENV if kld_engine == "vllm" else QUANT_ENV
    return env


def torch_decides_numbers(stage: str) -> bool:
    """Whether torch computes this stage's numbers, on whichever device (so the device and, on a CPU, the
    numerics profile decide them: both enter its key)."""
    return "torch" in stage_spec(stage).numerics_packages


def stage_device(stage: str, configured: str, kld_engine: str) -> str:
    """Where ``stage`` computes: ``configured`` (numerics.device) for the forward stages and the rebuild (the
    KLD stages only with the hf engine: vLLM places itself), else the CPU."""
    device = stage_spec(stage).device
    if device == "configured" or (device == "engine" and kld_engine == "hf"):
        return configured
    return "cpu"


@dataclass(frozen=True)
class StageSoftware:
    """The software one stage's job runs with, as its key names it."""

    packages: dict[str, str | None]  # the stage's numerics packages -> version (None: not installed)
    env: dict[str, str] | None  # under conda: {"name", "sha256"} of envs/<name>.yaml; enters the key (when
    # packages decide the stage's numbers)
    settings: dict[str, Any]  # for the job (not the key): deployment, env, python, where (a readable place)


def stage_software(
    stage: str, *, deployment: str, kld_engine: str, vllm_python: str | None = None
) -> StageSoftware:
    """The packages (and, under conda, the env file) that enter ``stage``'s key.

    ``deployment`` "conda": the exact pins of the stage's envs/<name>.yaml and its content's SHA-256;
    "venv": the versions installed in this process's environment, or for the vLLM stages with
    ``vllm_python`` those of that interpreter (the engine runs there).
    """
    spec = stage_spec(stage)
    env_name = stage_env(stage, kld_engine)
    if deployment == "conda":
        env = read_env_file(env_path(env_name))
        return StageSoftware(
            env_versions(env, spec.numerics_packages, stage),
            # no package decides a download's or a hash check's result: its key keeps out of the env's
            {"name": env.name, "sha256": env.sha256} if spec.numerics_packages else None,
            {"deployment": "conda", "env": env.name, "python": None, "where": f"envs/{env.name}.yaml"},
        )
    if deployment != "venv":
        raise ValueError(f"unknown software deployment {deployment!r} (conda or venv)")
    if vllm_python and env_name == SERVE_ENV:
        return StageSoftware(
            python_versions(vllm_python, spec.numerics_packages),
            None,
            {"deployment": "venv", "env": None, "python": vllm_python, "where": "software.vllm_python"},
        )
    return StageSoftware(
        installed_versions(spec.numerics_packages),
        None,
        {
            "deployment": "venv",
            "env": None,
            "python": None,
            "where": f"the venv planning ran in, {sys.prefix}",
        },
    )


def stage_preimage(
    stage: str,
    config_slice: Any,
    upstream: dict[str, str],
    packages: dict[str, str | None] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The full key preimage of one stage run (its SHA-256 is the key).

    ``packages``: the versions of the stage's numerics packages in the environment that runs it (default:
    this process's); ``env``: the conda environment file it runs in (name and SHA-256), under conda only.
    """
    spec = stage_spec(stage)
    preimage = {
        "key_schema": KEY_SCHEMA_VERSION,
        "stage": stage,
        "config": config_slice,
        "upstream": dict(sorted(upstream.items())),
        "code": code_identity(spec.numerics_modules),
        "packages": packages if packages is not None else installed_versions(spec.numerics_packages),
    }
    if env is not None:
        preimage["env"] = env
    return preimage
