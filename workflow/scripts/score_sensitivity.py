"""Rule score_sensitivity: KL sensitivity of a chunk of MoE layers to one format (mixquant.search.run)."""

import sys
from pathlib import Path

# mixquant from the workflow directory: no conda environment installs it (envs/*.yaml), and Snakemake's
# own sys.path, which it appends to a script's, must not supply another copy
sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.interrupt import interrupt_to_log

interrupt_to_log(snakemake.log[0])  # a Ctrl-C's traceback to the log, also during the imports

from mixquant.rulelog import rule_logging
from mixquant.search.run import run_score_sensitivity

with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
    stage = dict(snakemake.params.stage)
    # the wall time the job was given: by default its state is saved every quarter of it
    runtime = snakemake.resources.get("runtime")
    stage["settings"] = {
        **stage["settings"],
        "threads": snakemake.threads,
        "runtime_min": runtime,
    }
    run_score_sensitivity(snakemake.output.scores, **dict(snakemake.input.items()), **stage)
