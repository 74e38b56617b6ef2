"""The run-end summary's KLD gate lines: the verdict word, the mean KL and the reduction vs the baseline, on
the evaluation suite with their intervals where the gate judged one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mixquant.release.summary import gate_line, run_summary


@dataclass
class _Artifact:
    path: Path
    done: bool = True


def _gate(tmp_path: Path, name: str, document: dict) -> _Artifact:
    directory = tmp_path / name
    directory.mkdir(parents=True)
    (directory / "aggregate.json").write_text(json.dumps(document), encoding="utf-8")
    return _Artifact(directory)


def _document(word: str | None, suite: bool, checks: int = 1) -> dict:
    verdict = {"passed": word in (None, "pass"), "checks": [{"name": "min_improvement"}] * checks}
    if word is not None:
        verdict["word"] = word
    document = {
        "candidate": "searched",
        "kv_cache_dtype": "fp8",
        "baseline": "uniform-nvfp4",
        "aggregate": {"mean_kld": 0.0123},
        "improvement": {"reduction": 0.412, "ci_low": 0.36, "ci_high": 0.46},
        "suite": None,
        "verdict": verdict,
    }
    if suite:
        document["suite"] = {
            "mean": {"mean": 0.0141, "ci_low": 0.0122, "ci_high": 0.0169},
            "improvement": {"reduction": 0.35, "ci_low": 0.23, "ci_high": 0.45},
        }
    return document


def test_a_suite_gate_says_its_word_and_the_suite_numbers_with_intervals(tmp_path):
    line = gate_line(_gate(tmp_path, "a", _document("pass", suite=True)))
    assert line == (
        "gate searched kv fp8: pass, mean KL 0.0141 on the suite [0.0122, 0.0169] "
        "(35.0% lower than uniform-nvfp4 [23.0%, 45.0%])"
    )
    line = gate_line(_gate(tmp_path, "b", _document("repeat-required", suite=True)))
    assert line.startswith("gate searched kv fp8: REPEAT-REQUIRED, mean KL 0.0141 on the suite")
    assert gate_line(_gate(tmp_path, "c", _document("fail", suite=True))).startswith(
        "gate searched kv fp8: FAIL,"
    )
    ungated = gate_line(_gate(tmp_path, "d", _document("pass", suite=True, checks=0)))
    assert ungated.startswith("gate searched kv fp8: not gated, mean KL 0.0141")


def test_a_prompt_gate_keeps_its_line_and_an_unreadable_one_does_not_fail_the_run(tmp_path):
    assert gate_line(_gate(tmp_path, "a", _document(None, suite=False))) == (
        "gate searched kv fp8: passed, mean KL 0.0123 (41.2% lower than uniform-nvfp4)"
    )
    failed = _document(None, suite=False)
    failed["verdict"]["passed"] = False
    assert gate_line(_gate(tmp_path, "b", failed)).startswith("gate searched kv fp8: FAILED, mean KL 0.0123")
    lines = run_summary({"gate/searched/fp8": _Artifact(tmp_path / "missing")})
    assert len(lines) == 1 and lines[0].startswith("gate/searched/fp8: cannot read (")
