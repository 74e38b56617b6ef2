"""Logging for rule scripts: everything to the rule's log file, one clear line on failure.

A stage that fails also leaves a failure marker beside its log (``results/logs/<stage>/<key>.failed``,
holding the one line), removed when the stage runs again: `mixquant paths` shows the stage as failed.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def stage_log_path(results_dir: str | Path, stage: str, key: str) -> Path:
    """results/logs/<stage>/<key>.log: where a stage's rule writes its log (workflow/rules/*.smk)."""
    return Path(results_dir) / "logs" / stage / f"{key}.log"


def failure_marker(log_path: str | Path) -> Path:
    """The failure marker beside a stage's log: <key>.failed next to <key>.log."""
    return Path(log_path).with_suffix(".failed")


@contextmanager
def rule_logging(log_path: str, stage: Any = None) -> Iterator[None]:
    """Send logging to `log_path`; on an exception write the traceback there and exit with one line.

    The one line (``mixquant: <stage error>``) goes to stderr, where Snakemake shows it; the full
    traceback stays in the log for whoever needs it. When the stage's settings name a numerics profile
    (stages whose numbers torch computes), the process enters it first (mixquant.numerics): a process
    that cannot compute under it stops here with one line.
    """
    handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    marker = failure_marker(log_path)
    marker.unlink(missing_ok=True)  # a new attempt: not failed (yet)
    try:
        numerics = (stage or {}).get("settings", {}).get("numerics") if hasattr(stage, "get") else None
        if numerics:
            from mixquant.numerics import enter

            logging.getLogger("mixquant.numerics").info(
                "numerics %s",
                enter(numerics["profile"], numerics["threads"], numerics.get("device", "cpu")),
            )
        yield
    except Exception as error:  # noqa: BLE001 - reported as one line, traceback in the log
        logging.getLogger("mixquant").error("stage failed:\n%s", traceback.format_exc())
        handler.flush()
        marker.write_text((str(error).splitlines() or [type(error).__name__])[0] + "\n", encoding="utf-8")
        print(f"mixquant: {error} (details: {log_path})", file=sys.stderr)
        sys.exit(1)
    finally:
        root.removeHandler(handler)
        handler.close()
