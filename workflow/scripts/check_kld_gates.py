"""Rule check_kld_gates (mixquant.kld.run.run_check_kld_gates)."""

from mixquant.kld.run import run_check_kld_gates
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_check_kld_gates(snakemake.output[0], **dict(snakemake.input.items()), **stage)
