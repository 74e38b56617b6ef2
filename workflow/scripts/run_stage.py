"""Every rule's script: the rule's stage runner from the stage registry (mixquant.keys.stages), called with
the rule's output, its named inputs (upstream directories by role) and its params.stage (settings, key
preimage), logging to the rule's log (mixquant.rulelog)."""

import importlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by Snakemake (a test imports the functions below)
    # mixquant from the workflow directory: no conda environment installs it (envs/*.yaml), and Snakemake's
    # own sys.path, which it appends to a script's, must not supply another copy
    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))

from mixquant.heap import freeze_imports, tune_for_job
from mixquant.interrupt import interrupt_to_log
from mixquant.keys.stages import stage_spec
from mixquant.rulelog import rule_logging


def runner_arguments(
    rule: str, inputs: Mapping[str, str], stage: Mapping[str, Any], threads: int, resources: Mapping[str, Any]
) -> dict[str, Any]:
    """The runner's keyword arguments for one job of ``rule``: its named inputs and params.stage, with the
    job's own settings the registry names (``StageSpec.job_settings``) added to the stage's settings."""
    stage = dict(stage)
    wanted = stage_spec(rule).job_settings
    if wanted:
        job = {"threads": threads, "runtime_min": resources.get("runtime")}
        stage["settings"] = {**stage["settings"], **{name: job[name] for name in wanted}}
    return {**inputs, **stage}


def stage_runner(rule: str) -> Callable[..., Any]:
    """The runner the stage registry names for ``rule`` (each rule is named after its stage)."""
    module, function = stage_spec(rule).runner.split(":")
    return getattr(importlib.import_module(module), function)


if __name__ == "__main__":
    interrupt_to_log(snakemake.log[0])  # a Ctrl-C's traceback to the log, also while the runner is imported
    tune_for_job()  # fewer collections while torch & co. are imported (mixquant.heap)
    run = stage_runner(snakemake.rule)
    freeze_imports()
    with rule_logging(snakemake.log[0], snakemake.params.stage, snakemake.resources):
        inputs = dict(snakemake.input.items())
        run(
            snakemake.output[0],
            **runner_arguments(
                snakemake.rule, inputs, snakemake.params.stage, snakemake.threads, snakemake.resources
            ),
        )
