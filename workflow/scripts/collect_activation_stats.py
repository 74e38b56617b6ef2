"""Rule collect_activation_stats: expert-input and K/V amax over the calibration tokens."""

from mixquant.quantize.run import run_collect_activation_stats
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_collect_activation_stats(
        snakemake.output.activations,
        model=snakemake.input.model,
        calibration=snakemake.input.calibration,
        **snakemake.params.stage,
    )
