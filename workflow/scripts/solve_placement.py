"""Checkpoint solve_placement: the exact placement under the bit budget (mixquant.search.run)."""

from mixquant.rulelog import rule_logging
from mixquant.search.run import run_solve_placement

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_solve_placement(snakemake.output.placement, **dict(snakemake.input.items()), **snakemake.params.stage)
