"""The garbage collector of a job process (workflow/scripts/run_stage.py).

A job imports torch, transformers and often ModelOpt: about 600,000 objects that live until it exits. With
Python's default thresholds the collector runs hundreds of young collections and about a dozen full ones
while they are imported, and every full one (an engine's ``gc.collect()`` after each KLD pass included)
rescans all of them: about a tenth of a job's CPU time on two cores. So a job process collects its young
objects a tenth as often (:func:`tune_for_job`) and moves what survives a collection at a quiet point, when
nothing but the imports and the job's settings is alive, out of the collector's reach (:func:`collect`,
``gc.freeze``). Frozen objects are still freed by reference counting; only a reference cycle among them
would stay, which is why nothing is frozen while a model is loaded.

Elsewhere (a test, the CLI) :func:`collect` is a plain ``gc.collect()``.
"""

from __future__ import annotations

import gc

__all__ = ["collect", "freeze_imports", "tune_for_job"]

JOB_THRESHOLDS = (7000, 10, 10)  # Python's defaults are (700, 10, 10)
_job = False


def tune_for_job() -> None:
    """Called first by a job process, before it imports its runner."""
    global _job
    _job = True
    gc.set_threshold(*JOB_THRESHOLDS)


def freeze_imports() -> None:
    """In a job process, once its runner is imported: what is imported so far lives to the end."""
    if _job:
        gc.freeze()


def collect() -> None:
    """A full collection (a model was just released); in a job process, then freeze what survives: it is
    what the job keeps to the end (the imports of the pass that ran), which later collections then skip."""
    gc.collect()
    if _job:
        gc.freeze()
