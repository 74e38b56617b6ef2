"""Named points where the reliability tests stop a run to kill it (tests/workflow/test_kill_campaign.py).

``point(name, stage)`` does nothing unless ``MIXQUANT_FAULT_POINT`` names it (``name`` or
``name@stage``). Then the process writes ``MIXQUANT_FAULT_MARK`` (its pid and the point) and stops
itself (SIGSTOP), so that the harness finds the run frozen exactly there and SIGKILLs every process of
it, as a lost node or an out-of-memory kill would; without a mark file it SIGKILLs its own process
group. Points sit between the steps whose order makes publication safe: a stage's files written, its
manifest written, the rename that publishes it, and inside long computations (a layer, a shard, a run).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINT_ENV = "MIXQUANT_FAULT_POINT"
MARK_ENV = "MIXQUANT_FAULT_MARK"


def point(name: str, stage: str | None = None) -> None:
    """Stop here when the environment names this point (see the module docstring); else return."""
    wanted = os.environ.get(POINT_ENV)
    if not wanted or wanted not in (name, f"{name}@{stage}"):
        return
    mark = os.environ.get(MARK_ENV)
    if not mark:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    tmp = Path(f"{mark}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()} {name} {stage or ''}\n")
    os.replace(tmp, mark)
    os.kill(os.getpid(), signal.SIGSTOP)
