"""What a failure means: a full disk behind any error, and the named points where the reliability tests
stop a run to kill it (tests/workflow/test_kill_campaign.py).

:func:`disk_full` finds the ENOSPC / EDQUOT behind an error, also where a library re-raised it as its own
(the job's one line and a keyed directory's publication name the disk, not the library).

``point(name, stage)`` does nothing unless ``MIXQUANT_FAULT_POINT`` names it (``name`` or
``name@stage``). Then the process writes ``MIXQUANT_FAULT_MARK`` (its pid and the point) and stops
itself (SIGSTOP), so that the harness finds the run frozen exactly there and SIGKILLs every process of
it, as a lost node or an out-of-memory kill would; without a mark file it SIGKILLs its own process
group. Points sit between the steps whose order makes publication safe: a stage's files written, its
manifest written, the rename that publishes it, and inside long computations (a layer, a shard, a run).
"""

from __future__ import annotations

import errno
import os
import signal

from mixquant.checkpoint.atomic import write_text_atomic

POINT_ENV = "MIXQUANT_FAULT_POINT"
MARK_ENV = "MIXQUANT_FAULT_MARK"

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(error: BaseException) -> OSError | bool:
    """The OSError (ENOSPC / EDQUOT) behind ``error``, also where a library re-raised it as its own
    exception (safetensors: "No space left on device (os error 28)"); else False."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            return error
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return error if isinstance(error, OSError) else True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def point(name: str, stage: str | None = None) -> None:
    """Stop here when the environment names this point (see the module docstring); else return."""
    wanted = os.environ.get(POINT_ENV)
    if not wanted or wanted not in (name, f"{name}@{stage}"):
        return
    mark = os.environ.get(MARK_ENV)
    if not mark:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    write_text_atomic(mark, f"{os.getpid()} {name} {stage or ''}\n")
    os.kill(os.getpid(), signal.SIGSTOP)
