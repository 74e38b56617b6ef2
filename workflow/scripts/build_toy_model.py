"""Rule build_toy_model: train the embedded toy Laguna (mixquant.model.run.run_build_toy_model)."""

from mixquant.model.run import run_build_toy_model
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_build_toy_model(snakemake.output.model, **snakemake.params.stage)
