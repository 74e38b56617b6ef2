"""Rule fetch_model: pin a real model by hub revision or local content (mixquant.model.run)."""

from mixquant.model.run import run_fetch_model
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_fetch_model(snakemake.output.model, **snakemake.params.stage)
