"""SIGTERM, as SLURM sends it at a job's time limit or on preemption (KillWait seconds before SIGKILL): a
streamed scoring pass stops after the layer it is in, saves its hidden states, exits with one line, and the
retry reads only the layers after the saved one and gives identical scores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from mixquant.checkpoint.shards import ShardReader  # noqa: E402
from mixquant.model.streaming import StreamedModel  # noqa: E402
from mixquant.search.branches import PROGRESS_FILE  # noqa: E402
from streaming_helpers import laguna_config, score, write_random_checkpoint  # noqa: E402

LAYERS = 6
KILL_WAIT_S = 30  # SLURM's default KillWait

# A score job in a child process: rule_logging as a rule script, the pass under stop_at_checkpoints, one
# decoder layer load slowed so that the parent's SIGTERM lands mid-pass; it writes a marker per layer loaded.
CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {helpers!r})
from mixquant.numerics import enter
enter("portable", 1)
from mixquant.model.streaming import StreamedModel
from mixquant.preemption import stop_at_checkpoints
from mixquant.rulelog import rule_logging
from streaming_helpers import score

model_dir, state_dir, marks = sys.argv[1], sys.argv[2], Path(sys.argv[3])
with rule_logging(str(marks / "job.log")):
    with stop_at_checkpoints(), StreamedModel(model_dir) as stream:
        original = stream.load_layer

        def slow_load(layer):
            (marks / f"layer{{layer}}").touch()
            time.sleep(0.5)
            return original(layer)

        stream.load_layer = slow_load
        score(stream, state_dir=state_dir, checkpoint_interval_s=3600)  # no periodic save in this pass
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_random_checkpoint(laguna_config(num_hidden_layers=LAYERS), tmp_path_factory.mktemp("model"))


def test_sigterm_saves_the_pass_and_the_retry_resumes_to_the_same_scores(model, tmp_path):
    with StreamedModel(model) as stream:
        clean = score(stream)
    state, marks = tmp_path / "state", tmp_path / "marks"
    marks.mkdir()
    helpers = str(Path(__file__).resolve().parents[1] / "model")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(helpers=helpers), str(model), str(state), str(marks)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (marks / "layer2").exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.poll() is None, "the pass ended before it could be stopped"
    os.kill(child.pid, signal.SIGTERM)  # while layer 2 loads
    sent = time.monotonic()
    _, stderr = child.communicate(timeout=KILL_WAIT_S)
    stopped_in = time.monotonic() - sent
    assert child.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mixquant: ")]
    saved = json.loads((state / PROGRESS_FILE).read_text())["next_layer"]
    assert saved == 3  # layer 2 finished, then saved: nothing periodic ran (interval 3600 s)
    assert lines[-1].startswith(
        f"mixquant: stopped by SIGTERM after layer 2 of {LAYERS} (state saved: the retry resumes at layer 3)"
    ), stderr
    assert stopped_in < KILL_WAIT_S
    reader = ShardReader(model)
    with StreamedModel(model, reader=reader) as stream:
        resumed = score(stream, state_dir=state, checkpoint_interval_s=3600)
    assert resumed == clean
    assert sorted(reader.reads) == list(range(3, LAYERS))  # only the layers after the saved one
    print(f"SIGTERM to exit: {stopped_in:.2f} s (KillWait {KILL_WAIT_S} s)")


def test_outside_a_pass_sigterm_keeps_its_default(tmp_path):
    """The handler is the pass's only: after it, SIGTERM stops a process at once, as before."""
    code = (
        "import os, signal, time\n"
        "from mixquant.preemption import stop_at_checkpoints, stop_requested\n"
        "with stop_at_checkpoints():\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1); assert stop_requested()\n"
        "assert not stop_requested()\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('survived')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout, done.stderr
