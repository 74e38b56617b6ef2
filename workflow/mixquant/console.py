"""What a run prints on the console: each job as one line naming its stage and what it makes (at the end,
what the run made: mixquant.release.summary).

Snakemake's own job blocks (every input and output as a 64-hex path, the reason, resources) stay in its
log file under .snakemake/log/ and in `snakemake -n`; :func:`quiet_console` changes only the console of a
run. Reads Snakemake's log records by their attributes (``event``, ``rule_name``, ``output``): the library
never imports Snakemake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from mixquant.graph import Artifact

# Snakemake's scheduler lines between jobs: said again for every job, they add nothing to the job lines
_SCHEDULER_CHATTER = ("Select jobs to execute...",)
_CHATTER_EVENTS = ("job_started", "job_finished")  # "Execute 1 jobs...", "Finished jobid: 3 (Rule: x)"


def job_name(art: Artifact) -> str:
    """A job's name for people: its stage and what it makes (``quantize_layer nvfp4_w4a16 layers 1-8``,
    ``run_kld searched kv fp8``), from the artifact's name in the graph."""
    kind, *rest = art.name.split("/")
    if kind == "layers" and len(rest) == 2:
        detail = f"{rest[0]} layers {rest[1]}"
    elif kind == "scores" and len(rest) == 1:  # a window of calibration sequences
        detail = f"sequences {rest[0]}"
    elif kind in ("kld", "gate") and len(rest) == 2:
        detail = f"{rest[0]} kv {rest[1]}"
    else:
        detail = " ".join(rest)
    return f"{art.stage} {detail}".rstrip()


class _RunConsole(logging.Filter, logging.Formatter):
    """On Snakemake's console handler: a job's block becomes one timed line with its name, and the
    scheduler's chatter is left out (the log file keeps all of it: filters and formatters are per handler).
    """

    def __init__(self, inner: logging.Formatter | None, name_of: Callable[[str, str], str | None]) -> None:
        logging.Filter.__init__(self)
        logging.Formatter.__init__(self)
        self.inner = inner or logging.Formatter()
        self.name_of = name_of

    def filter(self, record: logging.LogRecord) -> bool:
        if str(getattr(record, "event", "") or "") in _CHATTER_EVENTS:
            return False
        return record.getMessage() not in _SCHEDULER_CHATTER

    def format(self, record: logging.LogRecord) -> str:
        if str(getattr(record, "event", "") or "") == "job_info":
            outputs = list(getattr(record, "output", None) or [])
            rule = str(getattr(record, "rule_name", ""))
            name = self.name_of(rule, Path(outputs[0]).name) if outputs else rule
            if name:
                return f"[{time.strftime('%H:%M:%S', time.localtime(record.created))}] {name}"
        return self.inner.format(record)


def quiet_console(handlers: Iterable[logging.Handler], name_of: Callable[[str, str], str | None]) -> None:
    """Shorten a run's console (the handlers writing to a terminal, not to files): ``name_of(rule, key)``
    names a job from its rule and the key of its first output (None: Snakemake's own block)."""
    for handler in handlers:
        if isinstance(handler, logging.FileHandler) or not isinstance(handler, logging.StreamHandler):
            continue
        console = _RunConsole(handler.formatter, name_of)
        handler.addFilter(console)
        handler.setFormatter(console)
