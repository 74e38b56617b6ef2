"""Logging for rule scripts: everything to the rule's log file, one clear line on failure."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def rule_logging(log_path: str) -> Iterator[None]:
    """Send logging to `log_path`; on an exception write the traceback there and exit with one line.

    The one line (``mixquant: <stage error>``) goes to stderr, where Snakemake shows it; the full
    traceback stays in the log for whoever needs it.
    """
    handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    except Exception as error:  # noqa: BLE001 - reported as one line, traceback in the log
        logging.getLogger("mixquant").error("stage failed:\n%s", traceback.format_exc())
        handler.flush()
        print(f"mixquant: {error} (details: {log_path})", file=sys.stderr)
        sys.exit(1)
    finally:
        root.removeHandler(handler)
        handler.close()
