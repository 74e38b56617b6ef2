"""Rule dequantize_source: a block-FP8 source checkpoint as BF16 (mixquant.model.run)."""

import sys
from pathlib import Path

# mixquant from the workflow directory: no conda environment installs it (envs/*.yaml), and Snakemake's
# own sys.path, which it appends to a script's, must not supply another copy
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.interrupt import interrupt_to_log

interrupt_to_log(snakemake.log[0])  # a Ctrl-C's traceback to the log, also during the imports

from mixquant.model.run import run_dequantize_source
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_dequantize_source(snakemake.output.model, **dict(snakemake.input.items()), **snakemake.params.stage)
