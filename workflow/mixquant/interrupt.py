"""What a Ctrl-C prints: one line on the console, the tracebacks in the logs.

The terminal sends SIGINT to every process of the run (Snakemake and each job it started). Each job
writes its KeyboardInterrupt traceback to its own log (:func:`interrupt_to_log`, the first thing a rule
script does) and dies of the signal as Python's default would have it; Snakemake's own account of the
stopped jobs stays in its log file (.snakemake/log/) but leaves the console (:class:`InterruptFilter`), and
the run ends with :func:`interrupted_line`. Keyed outputs are published whole, so a rerun resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterable
from types import TracebackType

# Snakemake's own words when a Ctrl-C reaches its scheduler (snakemake.scheduling.job_scheduler), and
# when a job died of the signal (subprocess.CalledProcessError's text)
_SCHEDULER_INTERRUPTED = "Terminating processes on user request"
_JOB_INTERRUPTED = "died with <Signals.SIGINT"


def interrupt_to_log(log_path: str) -> None:
    """In a rule script: a KeyboardInterrupt that reaches the top (a Ctrl-C, also during the imports)
    writes its traceback to ``log_path`` instead of the console, and the job dies of SIGINT."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, error, tb)
            return
        try:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write("interrupted (SIGINT):\n" + "".join(traceback.format_exception(kind, error, tb)))
        except OSError:
            pass
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # die of the signal, as an unhandled SIGINT would
        os.kill(os.getpid(), signal.SIGINT)

    sys.excepthook = hook


class InterruptFilter(logging.Filter):
    """On Snakemake's console handlers: from the first sign of a Ctrl-C on, nothing more reaches the
    console (the log file's handler keeps every record)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.interrupted:
            try:
                message = str(record.getMessage())
            except (TypeError, ValueError):
                message = str(record.msg)
            self.interrupted = _SCHEDULER_INTERRUPTED in message or _JOB_INTERRUPTED in message
        return not self.interrupted


def watch_interrupt(logger: logging.Logger) -> InterruptFilter:
    """Install an :class:`InterruptFilter` on every console handler of ``logger`` (Snakemake's)."""
    watch = InterruptFilter()
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.addFilter(watch)
    return watch


def interrupted_line(logfiles: Iterable[str | os.PathLike]) -> str:
    """The line an interrupted run ends with."""
    where = ", ".join(map(str, logfiles))
    return "mixquant: interrupted; rerun the same command to resume" + (
        f" (what each job was doing: {where} and the jobs' logs)" if where else ""
    )
