"""Shared test helpers: the CPU numerics profile and the small random Laguna most unit tests build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixquant.numerics import apply_environment

# Every test process computes under the portable CPU numerics profile, as the workflow's jobs do: set before
# any test module imports torch, so the hashes tests compare are the ones any AVX2 host produces.
apply_environment("portable", 1)

# The order pytest-xdist hands test files to its two workers (pyproject: --dist loadfile
# --no-loadscope-reorder): the longest first, so that no long file starts last. The kill campaign first (it
# builds the session's default run, then runs about 10 minutes), then the family DAGs (they need no default
# run: the other worker's work while it is built), then the other workflow tests, then the unit tests.
FIRST_FILES = (
    "tests/workflow/test_kill_campaign.py",
    "tests/workflow/test_family_dags.py",
    "tests/workflow/",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next(
            (i for i, prefix in enumerate(FIRST_FILES) if item.nodeid.startswith(prefix)), len(FIRST_FILES)
        )

    items.sort(key=rank)  # stable: within a rank, pytest's own order


@pytest.fixture(scope="session", autouse=True)
def shared_architecture_cache(tmp_path_factory):
    """One architecture cache for every working directory of the session (the xdist workers' too): a fresh
    workdir's first Snakemake start, `mixquant paths` or `mixquant plan` then reads what another derived
    (transformers' meta model: 5-20 s on two cores) instead of deriving it again. Set in this process's
    environment, so every Snakemake run and job started from a test inherits it."""
    import os

    from mixquant.model.families import CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ[CACHE_ENV] = str(shared / "architectures")
    yield
    os.environ.pop(CACHE_ENV, None)


# Dense layer 0 + 4 MoE layers of 16 experts (top-2), every matrix input a multiple of 16 (NVFP4 blocks).
SMALL_LAGUNA = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def small_laguna_config():
    """Factory: ``LagunaConfig`` of the small random Laguna, with keyword overrides."""
    from transformers import LagunaConfig

    def make(**overrides):
        unknown = sorted(set(overrides) - set(SMALL_LAGUNA))
        if unknown:
            raise TypeError(f"not a small-Laguna setting: {unknown}")
        return LagunaConfig(**{**SMALL_LAGUNA, **overrides})

    return make


@pytest.fixture(scope="session")
def env_resolutions(tmp_path_factory):
    """Every envs/*.yaml resolved once per test session as conda will build it (mixquant.software; about
    30 s for quant and 55 s for serve, network to the package index): a cache directory of
    ``cached_resolution`` files shared by the pytest-xdist workers (the first to ask resolves, under a lock),
    and the resolutions."""
    import fcntl
    import os

    from mixquant.keys.environments import env_names, env_path, read_env_file
    from mixquant.software import cached_resolution

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = shared / "env-resolutions"
    with open(shared / "env-resolutions.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        resolutions = {
            name: cached_resolution(read_env_file(env_path(name)), cache_dir=cache, workdir=shared)
            for name in env_names()
        }
    return cache, resolutions


# The reference release's settings and geometry (config/laguna-s-2.1.yaml, its committed config.json): the
# planning facts and the cost model are tested on them. Torch-free imports, after the numerics profile.
LAGUNA_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def laguna_cfg():
    from mixquant.config import load_config_file

    return load_config_file(LAGUNA_ROOT / "config/laguna-s-2.1.yaml")


@pytest.fixture(scope="module")
def laguna(laguna_cfg):
    """The Laguna-S-2.1 geometry (mixquant.facts.Geometry)."""
    from mixquant.facts import geometry_from_hf_config

    config = json.loads((LAGUNA_ROOT / "data/models/laguna-s-2.1/config.json").read_text("utf-8"))
    return geometry_from_hf_config(config, laguna_cfg.model.moe_layers)


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, ModelOpt, the test modules): the collector
    then stops rescanning those objects in every full collection the tests trigger (mixquant.heap does the
    same for a job process)."""
    import gc

    gc.collect()
    gc.freeze()
