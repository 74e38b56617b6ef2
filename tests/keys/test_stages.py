"""The stage registry is the one list of stages: the rules, the CLI and the cost model follow it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from mixquant.keys.stages import QUANT_ENV, SERVE_ENV, STAGES, stage_device, stage_env, stage_spec

REPO = Path(__file__).resolve().parents[2]
RULE = re.compile(r"^\s*(?:rule|checkpoint) (\w+):\n(.*?)(?=^\s*(?:rule|checkpoint) \w+:|\Z)", re.M | re.S)


def rule_blocks() -> dict[str, str]:
    blocks = {}
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for name, body in RULE.findall(path.read_text()):
            blocks[name] = body
    return blocks


def test_every_stage_has_a_rule_and_every_rule_is_a_stage():
    assert set(rule_blocks()) == set(STAGES)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_rules_take_their_env_and_output_from_the_registry(stage):
    body = rule_blocks()[stage]
    # the rule's conda env is the registry's (common.smk's conda_env reads stage_env), never a literal path
    assert re.search(rf'conda:\s*\n\s*conda_env\("{stage}"\)', body), body
    assert "envs/" not in body
    # the named output the rule script writes is the registry's output name
    output = re.search(r"output:\s*\n\s*(\w+)=", body)
    assert output is not None and output.group(1) == stage_spec(stage).output


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_runner_is_importable_and_takes_the_rule_arguments(stage):
    module, function = stage_spec(stage).runner.split(":")
    runner = getattr(importlib.import_module(module), function)
    params = runner.__code__.co_varnames[: runner.__code__.co_argcount + runner.__code__.co_kwonlyargcount]
    assert {"settings", "preimage"} <= set(params), stage


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_cost_function_is_named_by_the_registry_and_takes_a_job(stage):
    module, function = stage_spec(stage).cost.split(":")
    assert module.startswith("mixquant.costs."), stage
    cost = getattr(importlib.import_module(module), function)
    assert cost.__code__.co_varnames[: cost.__code__.co_argcount] == ("job",), stage


def test_the_vllm_stages_run_in_the_serve_env_only_with_the_vllm_engine():
    served = {stage for stage in STAGES if stage_env(stage, "vllm") == SERVE_ENV}
    assert served == {"reference_logits", "run_kld"}
    assert {stage_env(stage, "hf") for stage in STAGES} == {QUANT_ENV}


def test_device_rule():
    assert stage_device("quantize_layer", "cuda", "vllm") == "cuda"
    assert stage_device("reference_logits", "cuda", "hf") == "cuda"
    assert stage_device("reference_logits", "cuda", "vllm") == "cpu"  # vLLM places itself
    assert stage_device("solve_placement", "cuda", "hf") == "cpu"


def test_no_other_module_lists_the_stages():
    """No literal list, tuple, set or dict of stage names outside the registry (a second list drifts)."""
    names = set(STAGES)
    offenders = []
    for path in sorted((REPO / "workflow" / "mixquant").rglob("*.py")):
        if path.name == "stages.py" and path.parent.name == "keys":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                items = node.elts
            elif isinstance(node, ast.Dict):
                items = [key for key in node.keys if key is not None]
            else:
                continue
            found = {item.value for item in items if isinstance(item, ast.Constant) and item.value in names}
            if len(found) >= 3:
                offenders.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno} {sorted(found)}")
    assert not offenders, offenders


def test_unknown_stage_is_one_line():
    with pytest.raises(ValueError, match="unknown stage 'quantise_layer'"):
        stage_spec("quantise_layer")
