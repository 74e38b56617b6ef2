"""Rule reference_logits (mixquant.kld.run.run_reference_logits)."""

from mixquant.kld.run import run_reference_logits
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0]):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_reference_logits(snakemake.output[0], **dict(snakemake.input.items()), **stage)
