"""Rule quantize_layer: a window of MoE layers' routed experts in one format (mixquant.quantize.run)."""

from mixquant.quantize.run import run_quantize_layer
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_quantize_layer(
        snakemake.output.layers,
        model=snakemake.input.model,
        activations=snakemake.input.get("activations"),
        **snakemake.params.stage,
    )
