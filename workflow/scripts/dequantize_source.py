"""Rule dequantize_source: a block-FP8 source checkpoint as BF16 (mixquant.model.run)."""

from mixquant.model.run import run_dequantize_source
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_dequantize_source(snakemake.output.model, **dict(snakemake.input.items()), **snakemake.params.stage)
