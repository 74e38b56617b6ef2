"""Rule kld_report (mixquant.kld.run.run_kld_report)."""

import sys
from pathlib import Path

# mixquant from the workflow directory: no conda environment installs it (envs/*.yaml), and Snakemake's
# own sys.path, which it appends to a script's, must not supply another copy
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.interrupt import interrupt_to_log

interrupt_to_log(snakemake.log[0])  # a Ctrl-C's traceback to the log, also during the imports

from mixquant.kld.run import run_kld_report
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    stage["settings"] = {**stage["settings"], "threads": snakemake.threads}
    run_kld_report(snakemake.output[0], **dict(snakemake.input.items()), **stage)
