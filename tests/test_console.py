"""A run's console: jobs by name in one line, Snakemake's scheduler chatter off, its log file untouched."""

import io
import logging
from pathlib import Path

import pytest
from mixquant.console import job_name, quiet_console
from mixquant.graph import Artifact


def _artifact(name: str, stage: str) -> Artifact:
    return Artifact(name=name, stage=stage, key="0" * 64, path=Path("results"), preimage={}, settings={})


@pytest.mark.parametrize(
    ("name", "stage", "expected"),
    [
        ("layers/nvfp4_w4a16/1-8", "quantize_layer", "quantize_layer nvfp4_w4a16 layers 1-8"),
        ("scores/0-31", "score_sensitivity", "score_sensitivity sequences 0-31"),
        ("kld/searched/fp8", "run_kld", "run_kld searched kv fp8"),
        ("gate/uniform-nvfp4/bfloat16", "gate_kld", "gate_kld uniform-nvfp4 kv bfloat16"),
        ("candidate/uniform-nvfp4", "export_checkpoint", "export_checkpoint uniform-nvfp4"),
        ("checkpoint", "export_checkpoint", "export_checkpoint"),
    ],
)
def test_a_job_is_named_by_its_stage_and_what_it_makes(name, stage, expected):
    assert job_name(_artifact(name, stage)) == expected


def _record(message: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("snakemake.logging", logging.INFO, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    return record


def test_the_console_names_jobs_in_one_line_and_the_log_file_keeps_the_blocks(tmp_path):
    console_stream = io.StringIO()
    console = logging.StreamHandler(console_stream)
    console.setFormatter(logging.Formatter("%(message)s"))
    log_file = logging.FileHandler(tmp_path / "run.log")
    log_file.setFormatter(logging.Formatter("%(message)s"))
    names = {"a" * 64: "quantize_layer fp8 layers 1-8"}
    quiet_console([console, log_file], lambda rule, key: names.get(key))

    block = "rule quantize_layer:\n    output: results/quantize_layer/" + "a" * 64
    job = _record(
        block, event="job_info", rule_name="quantize_layer", output=["results/quantize_layer/" + "a" * 64]
    )
    unnamed = _record("rule other:", event="job_info", rule_name="other", output=["results/x/" + "b" * 64])
    records = [
        _record("Select jobs to execute..."),
        _record("Execute 1 jobs...", event="job_started"),
        job,
        _record("Finished jobid: 3 (Rule: quantize_layer)", event="job_finished"),
        _record("1 of 2 steps (50%) done", event="progress"),
        unnamed,
    ]
    for record in records:
        console.handle(record)
        log_file.handle(record)
    log_file.close()
    lines = console_stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[1:] == ["1 of 2 steps (50%) done", "rule other:"]
    assert lines[0].endswith("] quantize_layer fp8 layers 1-8") and lines[0].startswith("[")
    assert (tmp_path / "run.log").read_text().splitlines() == [
        "Select jobs to execute...",
        "Execute 1 jobs...",
        *block.splitlines(),
        "Finished jobid: 3 (Rule: quantize_layer)",
        "1 of 2 steps (50%) done",
        "rule other:",
    ]
