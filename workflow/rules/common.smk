# Config selection, validation and the artifact graph (keys and paths) — all via the library.
import sys

from snakemake.utils import validate

from mixquant.config import ConfigError, select_workflow_config, validate_config
from mixquant.keys.artifacts import artifact_by_key, final_targets, resolve_artifacts

SELECTED_CONFIG = select_workflow_config(
    config, workflow.overwrite_configfiles, workflow.config_settings.overwrite_config
)
try:
    # One line naming the key first; then the committed JSON schema, as Snakemake users expect.
    CFG = validate_config(
        SELECTED_CONFIG,
        source=" ".join(map(str, workflow.overwrite_configfiles))
        or "config/config.yaml",
    )
except ConfigError as error:
    sys.exit(f"mixquant: {error}")
validate(
    SELECTED_CONFIG,
    workflow.source_path("../schemas/config.schema.json"),
    set_default=False,
)

ART = resolve_artifacts(CFG, hash_cache_dir=Path(".snakemake") / "mixquant-hashes")


def all_targets(wildcards):
    return final_targets(ART)


def artifact_path(name):
    return str(ART[name].path)


def stage_log(name):
    return f"{CFG.results_dir}/logs/{ART[name].stage}/{ART[name].key}.log"


def stage_benchmark(name):
    return f"{CFG.results_dir}/benchmarks/{ART[name].stage}/{ART[name].key}.tsv"


def stage_params(name):
    """JSON-serializable settings and key preimage handed to the rule script."""
    return {"settings": ART[name].settings, "preimage": ART[name].preimage}


def layer_artifact(wildcards):
    return artifact_by_key(ART, wildcards.key)


def quantize_layer_inputs(wildcards):
    """The model, and for FP8 layers the activation statistics."""
    art = layer_artifact(wildcards)
    return {role: str(ART[name].path) for role, name in art.upstream.items()}


def quantize_layer_params(wildcards):
    art = layer_artifact(wildcards)
    return {"settings": art.settings, "preimage": art.preimage}


def export_inputs(wildcards):
    """The model, every placed layer x format result (layer_L), and activations for KV scales."""
    return {
        role: str(ART[name].path) for role, name in ART["checkpoint"].upstream.items()
    }
