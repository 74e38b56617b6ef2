"""What a config means, before anything runs: the planning facts are torch-free, and score-job sizing
enters keys only as a resolved number of sequences."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mixquant.config import load_config_file
from mixquant.facts import (
    explicit_placement,
    fitted_macro_batch,
    model_geometry,
    moe_layers,
    placement_from_config,
    score_jobs,
    score_macro_batch,
    toy_geometry,
)
from mixquant.facts.jobs import GIB, score_memory_budget

ROOT = Path(__file__).resolve().parents[2]
LAGUNA_CONFIG = ROOT / "data/models/laguna-s-2.1/config.json"
# the reference release: Laguna-S-2.1 parameters
LAGUNA_TOTAL = 117_561_977_600
LAGUNA_ROUTED = 113_548_197_888


def test_facts_import_no_torch_and_nothing_above_them():
    code = (
        "import sys, mixquant.facts; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'pulp') "
        "or m.startswith(('mixquant.graph', 'mixquant.costs', 'mixquant.cluster', 'mixquant.planning'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_score_jobs_are_sized_for_a_b200_by_default(laguna_cfg):
    """The resolved size is what enters the score keys: 2 passes of 256 for Laguna-S-2.1 on one B200."""
    assert score_macro_batch(laguna_cfg, ROOT) == 256
    geometry = model_geometry(laguna_cfg, ROOT)
    assert fitted_macro_batch(laguna_cfg, geometry) == 256
    assert fitted_macro_batch(laguna_cfg, geometry, score_memory_budget("cuda", 179 * GIB)) == 256
    # a smaller memory figure, passed in as a number, gives smaller jobs
    assert fitted_macro_batch(laguna_cfg, geometry, score_memory_budget("cuda", 80 * GIB)) < 256


def test_the_toy_scores_every_sequence_in_passes_of_its_macro_batch():
    cfg = load_config_file(ROOT / "config/config.yaml")
    size = score_macro_batch(cfg)
    jobs = score_jobs(cfg)
    assert jobs[0] == (0, size) and jobs[-1][1] == cfg.calibration.num_samples


def test_the_explicit_placement_covers_every_moe_layer():
    cfg = load_config_file(ROOT / "config/config.yaml")
    placement = placement_from_config(cfg)
    assert sorted(placement) == moe_layers(cfg)
    assert explicit_placement(cfg, cfg.placement.explicit, moe_layers(cfg)) == placement


def test_laguna_geometry_matches_published_counts(laguna):
    assert laguna.moe_layers == tuple(range(1, 48))
    assert laguna.total_params == LAGUNA_TOTAL
    assert laguna.routed_params == LAGUNA_ROUTED
    assert laguna.bf16_bytes == 2 * LAGUNA_TOTAL
    assert laguna.routed_bytes_per_layer == 256 * 3 * 3072 * 1024 * 2
    # "active ~8.45B": everything but the routed experts, plus top-10 of 256 per MoE layer
    assert laguna.active_params_per_token == LAGUNA_TOTAL - LAGUNA_ROUTED + 47 * 10 * 3 * 3072 * 1024
    assert round(laguna.active_params_per_token / 1e9, 2) == 8.45


def test_toy_geometry_equals_the_built_toy_model():
    import torch
    from mixquant.model.toy import parameter_counts, toy_laguna_config
    from transformers import LagunaForCausalLM

    cfg = load_config_file(ROOT / "config/config.yaml")

    class Tokenizer:  # the trained BPE tokenizer reaches its configured size
        def __len__(self) -> int:
            return cfg.model.toy.tokenizer.vocab_size

        def convert_tokens_to_ids(self, token: str) -> int:
            return 3

    config = toy_laguna_config(cfg.model.toy.arch.model_dump(), Tokenizer())
    with torch.device("meta"):
        counts = parameter_counts(LagunaForCausalLM(config))
    geometry = toy_geometry(cfg)
    assert geometry.total_params == counts["total"]
    assert geometry.routed_params == counts["routed_experts"]
    assert geometry.active_params_per_token == counts["active_per_token"]
    # the shipped toy's config.json, read through its family's architecture: the same model
    shipped = model_geometry(cfg)
    for attribute in ("total_params", "routed_params", "active_params_per_token", "moe_layers", "bf16_bytes"):
        assert getattr(shipped, attribute) == getattr(geometry, attribute), attribute
    assert [shipped.layer_params(layer) for layer in range(9)] == [
        geometry.layer_params(layer) for layer in range(9)
    ]


def test_model_geometry_of_a_hub_model_needs_its_config(laguna_cfg, laguna):
    assert model_geometry(laguna_cfg, ROOT) == laguna  # the committed config.json model.geometry names
    unset = laguna_cfg.model_copy(update={"model": laguna_cfg.model.model_copy(update={"geometry": None})})
    with pytest.raises(ValueError, match=r"^model\.geometry: planning a hub/local model needs its config"):
        model_geometry(unset, ROOT)
    elsewhere = laguna_cfg.model.model_copy(update={"geometry": "no.json"})
    missing = laguna_cfg.model_copy(update={"model": elsewhere})
    with pytest.raises(ValueError, match=r"^model\.geometry: cannot read .*no\.json"):
        model_geometry(missing, ROOT)
