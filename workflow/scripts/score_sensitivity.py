"""Rule score_sensitivity: KL sensitivity of a chunk of MoE layers to one format (mixquant.search.run)."""

from mixquant.rulelog import rule_logging
from mixquant.search.run import run_score_sensitivity

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_score_sensitivity(snakemake.output.scores, **dict(snakemake.input.items()), **stage)
