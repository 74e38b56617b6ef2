"""The one rule script (workflow/scripts/run_stage.py): every rule runs it, and for every stage it finds the
registry's runner and calls it with arguments the runner takes (the DAG is not run)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import yaml
from mixquant.config import validate_config
from mixquant.facts import placement_from_config
from mixquant.graph import resolve_artifacts
from mixquant.keys.stages import STAGES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "workflow" / "scripts" / "run_stage.py"


def _script():
    spec = importlib.util.spec_from_file_location("run_stage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planned_jobs() -> dict[str, object]:
    """One planned artifact per stage: the default config (its placement.explicit standing in for the solve),
    the same config retraining the toy, the same config with GPTQ rounding and a refined placement and
    ModelOpt's AutoQuantize placement as a candidate, and a block-FP8 hub model."""
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    retrain = {**default, "model": {**default["model"], "source": "toy"}}
    refined = {
        **default,
        "quantize": {
            **default["quantize"],
            "nvfp4_w4a16": {**default["quantize"]["nvfp4_w4a16"], "rounding": "gptq"},
        },
        "placement": {
            **default["placement"],
            "search": {**(default["placement"].get("search") or {}), "refine": {"candidates": 2}},
        },
        "kld": {
            **default["kld"],
            "candidates": [
                *default["kld"]["candidates"],
                {"name": "modelopt-autoquantize", "source": "modelopt_autoquantize"},
            ],
        },
    }
    deepseek = yaml.safe_load((REPO / "config" / "deepseek-v3.yaml").read_text())
    jobs = {}
    for raw in (default, retrain, refined, deepseek):
        cfg = validate_config(raw)
        placement = placement_from_config(cfg) if cfg.placement.explicit is not None else None
        for art in resolve_artifacts(cfg, placement=placement).values():
            jobs.setdefault(art.stage, art)
    return jobs


def test_every_rule_runs_the_one_script():
    scripts = {}
    for path in (REPO / "workflow" / "rules").glob("*.smk"):
        text = path.read_text()
        for rule, body in re.findall(
            r"(?m)^\s*(?:rule|checkpoint) (\w+):\n((?:\s+.*\n)+?)(?=\s*(?:rule|checkpoint) |\Z)", text
        ):
            if match := re.search(r'script:\s*\n\s*"([^"]+)"', body):
                scripts[rule] = (path.parent / match.group(1)).resolve()
    assert sorted(scripts) == sorted(STAGES)
    assert set(scripts.values()) == {SCRIPT}


def test_the_script_calls_each_stage_runner_with_arguments_it_takes():
    script = _script()
    jobs = _planned_jobs()
    assert sorted(jobs) == sorted(STAGES)
    for stage, art in jobs.items():
        runner = script.stage_runner(stage)
        assert f"{runner.__module__}:{runner.__name__}" == STAGES[stage].runner
        inputs = {role: f"results/{name}" for role, name in art.upstream.items()}
        params = {"settings": art.settings, "preimage": art.preimage}
        arguments = script.runner_arguments(stage, inputs, params, 3, {"runtime": 90})
        inspect.signature(runner).bind(f"results/{stage}/{art.key}", **arguments)  # raises on a mismatch
        assert arguments["preimage"] is art.preimage
        job = {"threads": 3, "runtime_min": 90}
        changed = {
            name: value for name, value in arguments["settings"].items() if art.settings.get(name) != value
        }
        assert changed == {name: job[name] for name in STAGES[stage].job_settings}


@pytest.mark.parametrize(
    ("stage", "added"),
    [
        ("score_sensitivity", {"threads": 4, "runtime_min": 120}),
        ("run_kld", {"threads": 4}),
        ("quantize_layer", {}),
    ],
)
def test_a_job_adds_its_threads_and_wall_time_only_where_the_runner_reads_them(stage, added):
    """As the per-stage scripts did: the KLD stages read the job's threads, score_sensitivity also its wall
    time; the others get params.stage as it is (the same dict of settings)."""
    script = _script()
    params = {"settings": {"seed": 0}, "preimage": {"stage": stage}}
    arguments = script.runner_arguments(stage, {"model": "m"}, params, 4, {"runtime": 120})
    assert arguments == {"model": "m", "settings": {"seed": 0, **added}, "preimage": {"stage": stage}}
    assert params["settings"] == {"seed": 0}  # params.stage itself is not changed
