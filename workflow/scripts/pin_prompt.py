"""Rule pin_prompt: the hash-pinned KLD prompt (mixquant.calibration.run)."""

from mixquant.calibration.run import run_pin_prompt
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_pin_prompt(snakemake.output.prompt, model=snakemake.input.model, **snakemake.params.stage)
