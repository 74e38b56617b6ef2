"""What enters each stage's key besides config and upstream keys: code identity and packages.

KEY_SCHEMA_VERSION changes when the layout of the preimage itself changes (every key moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

from mixquant.keys.code_identity import code_identity

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


@dataclass(frozen=True)
class StageSpec:
    """A stage's identity: the modules that decide its numbers and the packages that do too."""

    name: str
    numerics_modules: tuple[str, ...]
    numerics_packages: tuple[str, ...]


STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec(
            "build_toy_model",
            (
                "mixquant.model.toy",
                "mixquant.model.toy_settings",
                "mixquant.model.tokenizer",
                "mixquant.model.layout",
            ),
            ("torch", "transformers", "tokenizers", "safetensors"),
        ),
        # Downloads and content hashes: no numerics, so no package decides the result.
        StageSpec("fetch_model", ("mixquant.model.fetch",), ()),
        # A block-FP8 source made BF16 by the publisher's dequantization.
        StageSpec("dequantize_source", ("mixquant.checkpoint.fp8_source",), ("torch", "safetensors")),
        StageSpec(
            "sample_calibration",
            ("mixquant.calibration.sample", "mixquant.calibration.dataset", "mixquant.calibration.tokens"),
            ("transformers", "tokenizers", "datasets"),
        ),
        StageSpec(
            "pin_prompt",
            ("mixquant.calibration.prompt", "mixquant.calibration.dataset", "mixquant.calibration.tokens"),
            ("transformers", "tokenizers", "datasets"),
        ),
        StageSpec(
            "collect_activation_stats",
            ("mixquant.quantize.activations", "mixquant.model.attention"),
            ("torch", "transformers", "safetensors"),
        ),
        StageSpec(
            "quantize_layer",
            ("mixquant.quantize.layer", "mixquant.formats.nvfp4", "mixquant.formats.fp8"),
            ("torch", "nvidia-modelopt", "safetensors"),
        ),
        # Scores: the scorer (its numerics come from quantize_layer's results, which are upstream).
        StageSpec(
            "score_sensitivity",
            ("mixquant.search.score", "mixquant.search.run"),
            ("torch", "transformers", "nvidia-modelopt", "safetensors"),
        ),
        # The placement, its audit, the frontier and the plots are all outputs of the solve.
        StageSpec(
            "solve_placement",
            ("mixquant.search.solve", "mixquant.search.run", "mixquant.search.plots"),
            ("pulp", "matplotlib"),
        ),
        # Logits: the engine (and what it loads a checkpoint with) decides them.
        StageSpec(
            "reference_logits",
            (
                "mixquant.kld.engines",
                "mixquant.kld.run",
                "mixquant.export.dequant",
                "mixquant.search.score",
                "mixquant.model.attention",
            ),
            ("torch", "transformers", "nvidia-modelopt", "safetensors", "vllm"),
        ),
        StageSpec(
            "run_kld",
            (
                "mixquant.kld.engines",
                "mixquant.kld.stats",
                "mixquant.kld.run",
                "mixquant.export.dequant",
                "mixquant.search.score",
                "mixquant.model.attention",
            ),
            ("torch", "transformers", "nvidia-modelopt", "safetensors", "vllm"),
        ),
        StageSpec("gate_kld", ("mixquant.kld.report", "mixquant.kld.run"), ("torch",)),
        StageSpec("kld_report", ("mixquant.kld.report", "mixquant.kld.run"), ("pandas", "matplotlib")),
        StageSpec("check_kld_gates", ("mixquant.kld.run",), ()),
        # The checkpoint audit (inspect, predict) is part of the output, so its code is in the key.
        StageSpec(
            "export_checkpoint",
            ("mixquant.export.checkpoint", "mixquant.export.inspect", "mixquant.export.predict"),
            ("nvidia-modelopt", "safetensors", "transformers"),
        ),
        # Hashes of bytes the upstream stages wrote: the encodings live in the code, no package decides.
        StageSpec("verify_hashes", ("mixquant.release.hashes", "mixquant.release.verify"), ()),
        # The bundle copies upstream files and writes the recipe, the KLD table and the model card (which
        # names the mixquant version, so it enters the key).
        StageSpec(
            "assemble_release",
            (
                "mixquant.release.bundle",
                "mixquant.release.card",
                "mixquant.release.recipe",
                "mixquant.release.hashes",
                "mixquant.kld.report",
            ),
            ("mixquant", "pandas"),
        ),
    )
}


def installed_versions(names: tuple[str, ...] = RECORDED_PACKAGES) -> dict[str, str | None]:
    """{distribution: version or None when not installed}."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def computes_on_cpu(stage: str) -> bool:
    """Whether torch computes this stage's numbers (so the CPU numerics profile decides them)."""
    return "torch" in STAGES[stage].numerics_packages


def stage_preimage(stage: str, config_slice: Any, upstream: dict[str, str]) -> dict[str, Any]:
    """The full key preimage of one stage run (its SHA-256 is the key)."""
    spec = STAGES[stage]
    return {
        "key_schema": KEY_SCHEMA_VERSION,
        "stage": stage,
        "config": config_slice,
        "upstream": dict(sorted(upstream.items())),
        "code": code_identity(spec.numerics_modules),
        "packages": installed_versions(spec.numerics_packages),
    }
