"""A job process's garbage collector (mixquant.heap): fewer young collections, and what survives a quiet
point frozen; outside a job (this test process) a plain collection that freezes nothing."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from mixquant.heap import JOB_THRESHOLDS, collect, freeze_imports

LIBRARY = Path(__file__).resolve().parents[1] / "workflow"


def test_outside_a_job_nothing_is_frozen_and_cycles_are_collected():
    class Node:
        pass

    before_threshold, before_frozen = gc.get_threshold(), gc.get_freeze_count()
    node = Node()
    node.self = node  # a cycle: only the collector frees it
    seen = []
    gc.callbacks.append(lambda phase, info: seen.append(info["collected"]) if phase == "stop" else None)
    try:
        del node
        freeze_imports()
        collect()
    finally:
        gc.callbacks.pop()
    assert gc.get_freeze_count() == before_frozen
    assert gc.get_threshold() == before_threshold
    assert sum(seen) >= 1


def test_a_job_freezes_its_imports_and_what_survives_a_collection_but_not_a_released_cycle():
    script = """
import gc, json, weakref
from mixquant.heap import collect, freeze_imports, tune_for_job
tune_for_job()
import decimal, email.message  # a runner's imports
freeze_imports()
after_imports = gc.get_freeze_count()
class Model: pass
model = Model(); model.self = model  # a released model's cycle
alive = weakref.ref(model)
del model
collect()
print(json.dumps({"threshold": gc.get_threshold(), "after_imports": after_imports,
                  "after_collect": gc.get_freeze_count(), "model_freed": alive() is None}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=LIBRARY, capture_output=True, text=True, check=True
    ).stdout
    got = json.loads(out)
    assert tuple(got["threshold"]) == JOB_THRESHOLDS
    assert got["after_imports"] > 1000  # the interpreter's and the imports' objects
    assert got["after_collect"] > got["after_imports"]  # the class and the weakref made since, frozen
    assert got["model_freed"] is True  # collected before the freeze, not frozen with the survivors
