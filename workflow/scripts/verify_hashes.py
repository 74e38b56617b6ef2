"""Rule verify_hashes: the published SHA-256 values re-derived and compared (mixquant.release.verify)."""

import sys
from pathlib import Path

# mixquant from the workflow directory: no conda environment installs it (envs/*.yaml), and Snakemake's
# own sys.path, which it appends to a script's, must not supply another copy
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.interrupt import interrupt_to_log

interrupt_to_log(snakemake.log[0])  # a Ctrl-C's traceback to the log, also during the imports

from mixquant.release.verify import run_verify_hashes
from mixquant.rulelog import rule_logging

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    run_verify_hashes(snakemake.output.verify, **dict(snakemake.input.items()), **snakemake.params.stage)
