"""Logging for rule scripts: everything to the rule's log file, one clear line on failure.

A stage that fails also leaves a failure marker beside its log (``results/logs/<stage>/<key>.failed``,
holding the one line), removed when the stage runs again: `mixquant paths` shows the stage as failed.
"""

from __future__ import annotations

import logging
import shutil
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mixquant.faults import disk_full
from mixquant.keys.environments import check_software
from mixquant.numerics import enter


def stage_log_path(results_dir: str | Path, stage: str, key: str) -> Path:
    """results/logs/<stage>/<key>.log: where a stage's rule writes its log (workflow/rules/*.smk)."""
    return Path(results_dir) / "logs" / stage / f"{key}.log"


def failure_marker(log_path: str | Path) -> Path:
    """The failure marker beside a stage's log: <key>.failed next to <key>.log."""
    return Path(log_path).with_suffix(".failed")


def existing_ancestor(path: str | Path) -> Path:
    """``path`` or its nearest existing parent (whose filesystem a path not yet made will live on)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def disk_full_line(error: BaseException, log_path: str | Path, resources: Any = None) -> str:
    """One line for a job that ran out of disk: where, what the job asks for, what is free there."""
    full = disk_full(error)
    where = Path(getattr(full, "filename", None) or Path(log_path).parent)
    probe = existing_ancestor(where if where.is_dir() else where.parent)
    free = shutil.disk_usage(probe).free
    wanted = getattr(resources, "disk_mb", None) if resources is not None else None
    needs = f"this job asks for {int(wanted)} MB of disk" if wanted else "this job needs more"
    detail = str(getattr(full, "strerror", "") or "").removeprefix("No space left on device").strip(" ()")
    return f"no space left on device writing {where}: {needs}, {free / 1e6:.1f} MB are free on {probe}" + (
        f" ({detail})" if detail else ""
    )


def check_job_software(stage: Any) -> None:
    """Stop (one line) when this job's packages are not the versions its key holds
    (:func:`mixquant.keys.environments.check_software`). A stage whose engine runs in another interpreter
    (``software.vllm_python``) is checked there, by the engine's own process."""
    if not hasattr(stage, "get") or "preimage" not in stage:
        return
    software = (stage.get("settings") or {}).get("software") or {}
    if software.get("python"):
        return
    check_software(stage["preimage"], software)


@contextmanager
def rule_logging(log_path: str, stage: Any = None, resources: Any = None) -> Iterator[None]:
    """Send logging to `log_path`; on an exception write the traceback there and exit with one line
    (a full disk: where, what the job asks for in ``resources.disk_mb``, what is free).

    The one line (``mixquant: <stage error>``) goes to stderr, where Snakemake shows it; the full
    traceback stays in the log for whoever needs it. The job first checks that its packages are the
    versions its key holds (:func:`check_job_software`); when the stage's settings name a numerics profile
    (stages whose numbers torch computes), the process then enters it (mixquant.numerics): a process
    that cannot compute under it stops here with one line.
    """
    logging.raiseExceptions = False  # a log write that fails (a full disk) must not print tracebacks
    handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    marker = failure_marker(log_path)
    marker.unlink(missing_ok=True)  # a new attempt: not failed (yet)
    try:
        check_job_software(stage)
        numerics = (stage or {}).get("settings", {}).get("numerics") if hasattr(stage, "get") else None
        if numerics:
            logging.getLogger("mixquant.numerics").info(
                "numerics %s",
                enter(numerics["profile"], numerics["threads"], numerics.get("device", "cpu")),
            )
        yield
    except Exception as error:  # noqa: BLE001 - reported as one line, traceback in the log
        line = disk_full_line(error, log_path, resources) if disk_full(error) else str(error)
        line = (line.splitlines() or [type(error).__name__])[0]
        try:  # on a full disk the log and the marker may not be writable either: the line still goes out
            logging.getLogger("mixquant").error("stage failed:\n%s", traceback.format_exc())
            handler.flush()
            marker.write_text(line + "\n", encoding="utf-8")
        except OSError:
            pass
        print(f"mixquant: {line} (details: {log_path})", file=sys.stderr)
        sys.exit(1)
    finally:
        root.removeHandler(handler)
        handler.close()
