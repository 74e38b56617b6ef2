"""Rule verify_hashes: the published SHA-256 values re-derived and compared (mixquant.release.verify)."""

from mixquant.release.verify import run_verify_hashes
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_verify_hashes(snakemake.output.verify, **dict(snakemake.input.items()), **snakemake.params.stage)
