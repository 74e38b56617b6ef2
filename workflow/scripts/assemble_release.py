"""Rule assemble_release: the release bundle with its model card (mixquant.release.bundle)."""

from mixquant.release.bundle import run_assemble_release
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_assemble_release(snakemake.output.release, **dict(snakemake.input.items()), **snakemake.params.stage)
