"""One run at a time per results store: two workflows on one ``results_dir`` take turns.

A keyed directory is computed once and then only read, but Snakemake does not know that another
workflow (another working directory, the same ``results_dir``) is computing it: it would start the
same job (the same key) and, once the other run has published it, delete the directory to run the job
again. So the first run of a store holds an exclusive ``flock`` on ``<results_dir>/.mixquant-store.lock``
for as long as it executes jobs; the kernel releases it when the process ends, however it ends (a
SIGKILL leaves no stale lock). A second run waits for it, saying who holds it, and then plans again,
so that it reuses what the first published instead of computing it twice.

Dry runs, linting and the jobs themselves never take it (only a workflow's ``onstart`` does).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

STORE_LOCK = ".mixquant-store.lock"
_held: dict[str, int] = {}


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file (best effort)."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(owner["since"])))
        return f"the run of pid {owner['pid']} on {owner['host']} in {owner['workdir']} (since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another run"


def hold_results_store(results_dir: str | Path, say=None) -> bool:
    """Take the store's lock for the rest of this process; True when another run held it and this one
    waited (what that run published was not in this run's plan: plan again)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    root = Path(results_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = str(root.resolve())
    if name in _held:
        return False
    fd = os.open(root / STORE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # group: the umask
    waited = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"mixquant: {results_dir}/ is in use by {_holder(fd)}; waiting for it to finish")
        fcntl.flock(fd, fcntl.LOCK_EX)
        waited = True
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "workdir": os.getcwd(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode("utf-8"), 0)
    _held[name] = fd
    return waited


def release_results_store(results_dir: str | Path) -> None:
    """Give the store's lock back (at the end of a run; the process's end does the same)."""
    fd = _held.pop(str(Path(results_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def restart_run() -> None:
    """Run this Snakemake command again in this process (after waiting: its plan is out of date)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
