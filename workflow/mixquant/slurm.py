"""What snakemake-executor-plugin-slurm will submit for each planned job, and whether the cluster has what the
profile names.

The sbatch options come from the plugin's own code, applied to the resources ``snakemake -n`` printed for the
job: ``submit_string.get_submit_command`` (time, memory, nodes, tasks, cores), ``utils.set_gres_string``
(GPUs) and, where the job names no partition, ``partitions.get_best_partition`` over the profile's partition
file (``slurm-partition-config``). Left out: what differs on every submission (job name, SLURM log file,
comment, working directory) and the account the plugin guesses from ``sacct`` when the profile sets none.
The plugin is imported only here and only when asked: planning never needs it otherwise.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Parts of the plugin's sbatch line that are per submission, not per job.
_PER_SUBMISSION = re.compile(
    r"^(?:--parsable|--export=ALL)$|^--(?:job-name|output|comment)$|^-D$|^--wrap=|^/dev/stdin$"
)
_VALUED = {"--job-name", "--output", "--comment", "-D"}


class _Resources(dict):
    """A job's resources as the plugin reads them: ``.get(name)`` and ``.name``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _QuietLogger:
    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _value(text: str) -> Any:
    """A resource value from ``snakemake -n`` output: an int where it is one, else the string."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def stand_in_job(rule: str, resources: Mapping[str, str], threads: int = 1) -> SimpleNamespace:
    """The attributes of a Snakemake job the plugin's submission code reads."""
    values = _Resources({name: _value(str(value)) for name, value in resources.items()})
    return SimpleNamespace(
        name=rule,
        rule=SimpleNamespace(name=rule),
        resources=values,
        threads=threads,
        wildcards={},
        is_group=lambda: False,
    )


def read_partitions(profile: Mapping[str, Any]) -> list | None:
    """The partitions of the profile's ``slurm-partition-config`` file (the plugin's reader), or None."""
    path = profile.get("slurm-partition-config")
    if not path:
        return None
    from snakemake_executor_plugin_slurm.partitions import read_partition_file

    return read_partition_file(Path(path))


def sbatch_options(rule: str, resources: Mapping[str, str], partitions: list | None, threads: int = 1) -> str:
    """The sbatch options the plugin submits one job with (module docstring), normalized to single spaces."""
    from snakemake_executor_plugin_slurm.partitions import get_best_partition
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = stand_in_job(rule, resources, threads)
    partition = job.resources.get("slurm_partition")
    if not partition and partitions:
        partition = get_best_partition(partitions, job, _QuietLogger())
    account = job.resources.get("slurm_account")
    params = {
        "run_uuid": "RUN",
        "slurm_logfile": "LOG",
        "comment_str": "COMMENT",
        "account": f" -A {shlex.quote(str(account))}" if account else "",
        "partition": f" -p {shlex.quote(str(partition))}" if partition else "",
        "workdir": "WORKDIR",
    }
    call = get_submit_command(job, params) + set_gres_string(job)
    return submitted_options(call)


def submitted_options(call: str) -> str:
    """An sbatch command line without ``sbatch`` and its per-submission parts (module docstring)."""
    words = shlex.split(call)
    if words and words[0] == "sbatch":
        words = words[1:]
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in _VALUED:
            skip = True
            continue
        if _PER_SUBMISSION.match(word):
            continue
        kept.append(word)
    return " ".join(kept)


def plugin_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("snakemake-executor-plugin-slurm")
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------ what the cluster has


def cluster_problems(profile: Mapping[str, Any], partitions: list | None, jobs: Iterable[Any]) -> list[str]:
    """What SLURM here would refuse, checked where its commands exist (a login node): an account the profile
    names that ``sacctmgr``/``sshare`` do not list (the plugin's own check), a partition the profile or its
    partition file names that ``sinfo`` does not list. Empty where nothing can be checked."""
    problems: list[str] = []
    named = set()
    for job in jobs:
        for name in ("slurm_partition",):
            if value := job.resources.get(name):
                named.add(str(value).strip("'\""))
    named |= {partition.name for partition in partitions or []}
    if named and shutil.which("sinfo"):
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=False)
        if done.returncode == 0:
            existing = {name.rstrip("*") for name in done.stdout.split()}
            for name in sorted(named - existing):
                problems.append(
                    f"partition {name!r} (the profile's) does not exist here: sinfo lists "
                    f"{', '.join(sorted(existing)) or 'none'}"
                )
    account = (profile.get("default-resources") or {}).get("slurm_account")
    if account and (shutil.which("sacctmgr") or shutil.which("sshare")):
        from snakemake_executor_plugin_slurm.accounts import validate_account
        from snakemake_interface_common.exceptions import WorkflowError

        try:
            validate_account(str(account), _QuietLogger())
        except WorkflowError as error:
            problems.append(f"slurm_account {account!r}: {' '.join(str(error).split())}")
    return problems
