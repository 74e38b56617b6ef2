"""Rule export_checkpoint: the audited, sharded ModelOpt checkpoint (mixquant.export.run)."""

from mixquant.export.run import run_export_checkpoint
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_export_checkpoint(
        snakemake.output.checkpoint, **dict(snakemake.input.items()), **snakemake.params.stage
    )
