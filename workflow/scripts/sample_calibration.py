"""Rule sample_calibration: N x T calibration token IDs (mixquant.calibration.run)."""

from mixquant.calibration.run import run_sample_calibration
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_sample_calibration(
        snakemake.output.calibration,
        model=snakemake.input.model,
        **snakemake.params.stage,
    )
