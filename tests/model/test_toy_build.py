"""A short toy build end to end: files, determinism of the bytes, loss goes down, reload equality."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from mixquant.model import layout, toy_layout
from mixquant.model.toy import DEFAULT_TOY_TRAINING
from mixquant.model.toy_build import build_toy_model
from mixquant.model.toy_training import lr_at
from safetensors import safe_open
from transformers import AutoTokenizer, LagunaForCausalLM

SHORT_TRAINING = {
    "steps": 8,
    "batch_size": 8,
    "seq_len": 64,
    "warmup_steps": 2,
    "lr": 5e-3,
    "heldout_every": 10,
    "eval_sequences": 8,
}


def stdlib_conversations() -> list[list[dict]]:
    """Chat conversations from stdlib docstrings (deterministic for a Python version, no downloads)."""
    import collections
    import functools
    import itertools
    import json as json_module
    import pathlib
    import textwrap

    convs = []
    for module in (json_module, collections, functools, itertools, pathlib, textwrap):
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                convs.append(
                    [
                        {"role": "system", "content": "You answer questions about Python."},
                        {"role": "user", "content": f"What does `{module.__name__}.{name}` do?"},
                        {"role": "assistant", "content": doc},
                    ]
                )
    return convs


def build(out, conversations, seed=0):
    out.mkdir()
    return build_toy_model(
        out,
        conversations=conversations,
        arch={},
        tokenizer_spec={"vocab_size": 512},
        training=SHORT_TRAINING,
        seed=seed,
        threads=2,
        num_shards=2,
        progress=False,
    )


@pytest.fixture(scope="module")
def conversations():
    return stdlib_conversations()


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory, conversations):
    root = tmp_path_factory.mktemp("toy")
    return [(root / name, build(root / name, conversations)) for name in ("a", "b")]


EXPECTED_FILES = {
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_report.json",
}


def test_build_writes_checkpoint(two_builds):
    out, report = two_builds[0]
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
    written = json.loads((out / "training_report.json").read_text())
    assert "timings_s" in report and "timings_s" not in written  # run-dependent facts stay out of files
    assert written == json.loads(json.dumps({k: v for k, v in report.items() if k != "timings_s"}))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "laguna" and config["architectures"] == ["LagunaForCausalLM"]
    assert config["dtype"] == "bfloat16" and config["num_hidden_layers"] == 9
    names = set()
    for shard in out.glob("model-*.safetensors"):
        with safe_open(shard, "pt") as handle:
            names.update(handle.keys())
    assert sorted(names, key=layout.natural_key) == toy_layout.upstream_tensor_names(config)
    assert report["checkpoint"]["logits_bit_identical_after_reload"] is True
    assert report["checkpoint"]["num_shards"] == 2
    model = report["model"]
    assert model["num_attention_heads_per_layer"] == [4, 6, 6, 6, 4, 6, 6, 6, 4]
    assert model["parameters"]["routed_experts"] > model["parameters"]["total"] / 2
    assert model["vocab_size"] % 16 == 0 and model["tokenizer_size"] <= model["vocab_size"]
    assert report["router_bias"]["nonzero"] == 8 * 16
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.bos_token_id == config["bos_token_id"]


def test_loss_decreases(two_builds):
    _, report = two_builds[0]
    loss = report["loss"]
    assert loss["first_step"] > loss["train"] + 0.5
    assert loss["heldout"] < loss["uniform"]
    assert report["heldout_eval"]["mean_max_prob"] > report["uniform_baseline"]["max_prob"]


def test_two_builds_are_byte_identical(two_builds):
    (a, report_a), (b, report_b) = two_builds
    for path in sorted(a.iterdir()):  # every file, the training report included
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    strip = ("timings_s",)
    assert {k: v for k, v in report_a.items() if k not in strip} == {
        k: v for k, v in report_b.items() if k not in strip
    }


def test_reload_generates(two_builds):
    out, _ = two_builds[0]
    model = LagunaForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does `json.dumps` do?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5 or generated[0, -1].item() in model.config.eos_token_id


def test_build_refuses_non_empty_dir(tmp_path):
    (tmp_path / "stale").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build_toy_model(tmp_path, conversations=[], arch={}, tokenizer_spec={}, training={}, seed=0)


def test_lr_schedule():
    training = {**DEFAULT_TOY_TRAINING, "steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1}
    assert lr_at(0, training) == pytest.approx(0.1)
    assert lr_at(9, training) == pytest.approx(1.0)
    assert lr_at(99, training) == pytest.approx(0.1)
    values = [lr_at(s, training) for s in range(10, 100)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("field", ["arch", "tokenizer_spec", "training"])
def test_unknown_setting_is_rejected(tmp_path, field):
    kwargs = {"arch": {}, "tokenizer_spec": {}, "training": {}}
    kwargs[field] = {"typo_key": 1}
    with pytest.raises(ValueError, match="unknown .* keys \\['typo_key'\\]"):
        build_toy_model(tmp_path, conversations=[], seed=0, **kwargs)
