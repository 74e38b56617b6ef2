"""SIGTERM as SLURM sends it: at a job's time limit and on preemption, KillWait seconds (30 by default)
before SIGKILL. A long streamed pass takes the request at its next layer boundary, saves its state and
stops with :class:`Preempted`; the retry SLURM or Snakemake starts resumes from that state. Jobs that hold
no resumable state keep SIGTERM's default (they stop at once; their keyed output is published whole or not
at all).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_requested = threading.Event()


class Preempted(RuntimeError):
    """A pass stopped on SIGTERM after saving its state (one line: where it stopped, that the retry
    resumes)."""


def stop_requested() -> bool:
    """Whether a SIGTERM arrived while :func:`stop_at_checkpoints` was active."""
    return _requested.is_set()


@contextmanager
def stop_at_checkpoints() -> Iterator[None]:
    """While active, SIGTERM only sets :func:`stop_requested` (the pass checks it after each layer); the
    previous handler comes back on exit. A no-op outside the main thread, where Python takes no handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum, frame) -> None:
        if not _requested.is_set():
            print(
                "mixquant: SIGTERM: stopping after this layer, saving the pass's state for the retry",
                file=sys.stderr,
                flush=True,
            )
            log.warning("SIGTERM received: the pass stops after this layer and saves its state")
        _requested.set()

    _requested.clear()
    previous = signal.signal(signal.SIGTERM, request)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _requested.clear()
