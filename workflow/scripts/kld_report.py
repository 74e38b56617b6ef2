"""Rule kld_report (mixquant.kld.run.run_kld_report)."""

from mixquant.kld.run import run_kld_report
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_kld_report(snakemake.output[0], **dict(snakemake.input.items()), **stage)
