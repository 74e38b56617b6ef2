"""Rule reference_logits (mixquant.kld.run.run_reference_logits)."""

import sys
from pathlib import Path

# envs/serve.yaml (vLLM) does not install mixquant: import it from the workflow directory.
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.kld.run import run_reference_logits
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_reference_logits(snakemake.output[0], **dict(snakemake.input.items()), **stage)
