"""Rule quantize_layer: one MoE layer's routed experts in one format (mixquant.quantize.run)."""

from mixquant.quantize.run import run_quantize_layer
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0]):
    run_quantize_layer(
        snakemake.output.layer,
        model=snakemake.input.model,
        activations=snakemake.input.get("activations"),
        **snakemake.params.stage,
    )
