"""What a Ctrl-C prints (mixquant.interrupt): the console filter, the job's hook, the closing line."""

from __future__ import annotations

import io
import logging
import signal
import subprocess
import sys

from mixquant.interrupt import interrupted_line, watch_interrupt


def test_the_console_goes_quiet_from_the_interrupt_on_and_the_log_file_keeps_everything(tmp_path):
    logger = logging.getLogger("test-interrupt")
    console, log_file = io.StringIO(), tmp_path / "run.log"
    logger.addHandler(logging.StreamHandler(console))
    logger.addHandler(logging.FileHandler(log_file))
    logger.setLevel(logging.INFO)
    watch = watch_interrupt(logger)
    logger.info("rule quantize_layer")
    assert not watch.interrupted
    logger.info("Terminating processes on user request, this might take some time.")
    logger.error("Command 'python quantize_layer.py' died with <Signals.SIGINT: 2>.")
    assert watch.interrupted
    assert console.getvalue() == "rule quantize_layer\n"
    assert "died with <Signals.SIGINT: 2>" in log_file.read_text()
    assert interrupted_line([".snakemake/log/x.snakemake.log"]) == (
        "mixquant: interrupted; rerun the same command to resume (what each job was doing: "
        ".snakemake/log/x.snakemake.log and the jobs' logs)"
    )


def test_a_job_interrupted_during_its_imports_writes_the_traceback_to_its_log_and_dies_of_sigint(tmp_path):
    log = tmp_path / "stage.log"
    script = (
        "import os, signal\n"
        "from mixquant.interrupt import interrupt_to_log\n"
        f"interrupt_to_log({str(log)!r})\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"  # as the terminal's Ctrl-C would, mid-import
        "import time; time.sleep(5)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT
    assert done.stderr == ""
    assert "KeyboardInterrupt" in log.read_text()
