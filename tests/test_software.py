"""Every conda environment file resolves as Snakemake and conda will build it: the copy in
.snakemake/conda/, pip run from that directory over the env's pip section, pip's real resolver against the
package index (``--dry-run``), no local wheels or pip configuration. Needs the package index (marked
``network``; CI reaches it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixquant.keys.environments import EnvFile, env_names, env_path, read_env_file
from mixquant.software import cached_resolution, key_problem, resolve_env, snakemake_env_copy

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def resolutions(env_resolutions):
    """Each env file of envs/ resolved (once per test session: tests/conftest.py)."""
    return env_resolutions[1]


def test_the_env_files_are_the_ones_the_rules_use():
    assert env_names() == ["quant", "serve"]


@pytest.mark.network
@pytest.mark.parametrize("name", ["quant", "serve"])
def test_every_env_file_resolves_from_the_package_index(resolutions, name):
    resolution = resolutions[name]
    assert resolution.status == "resolves", resolution.detail
    env = read_env_file(env_path(name))
    for package, version in env.pins.items():  # every exact pin is what pip installs
        assert resolution.installs[package] == version, package
    if name == "serve":
        assert resolution.installs["vllm"] == "0.33.0" and "nvidia-modelopt" not in resolution.installs
    print(f"{name}: {resolution.detail} in {resolution.seconds:.0f} s")


@pytest.mark.network
def test_an_editable_install_of_the_parent_fails_as_it_did_under_snakemake(tmp_path):
    """The old envs/quant.yaml's ``-e ../``: from .snakemake/conda/ it names .snakemake/, not the project."""
    env = EnvFile("old-quant", tmp_path / "old-quant.yaml", "0" * 64, ("python=3.11", "pip"), ("-e ../",))
    env.path.write_text("dependencies:\n  - python=3.11\n  - pip\n  - pip:\n      - -e ../\n")
    resolution = resolve_env(env, tmp_path)
    assert resolution.status == "fails"
    assert "does not appear to be a Python project" in resolution.detail, resolution.detail


@pytest.mark.network
def test_vllm_034_does_not_resolve(tmp_path):
    """Why envs/serve.yaml pins vLLM 0.33.0: 0.34.0 pins a flashinfer-python that was never published."""
    env_file = tmp_path / "serve-034.yaml"
    env_file.write_text("dependencies:\n  - python=3.11\n  - pip\n  - pip:\n      - vllm==0.34.0\n")
    resolution = resolve_env(read_env_file(env_file), tmp_path)
    assert resolution.status == "fails"
    assert "No matching distribution found for flashinfer-python==0.7.3" in resolution.detail


def test_the_copy_is_where_snakemake_puts_it(tmp_path):
    env = read_env_file(env_path("serve"))
    copy = snakemake_env_copy(env, tmp_path)
    assert copy.parent == tmp_path / ".snakemake" / "conda"
    assert copy.name.endswith("_.yaml") and len(copy.name) == len("0" * 32 + "_.yaml")


def test_a_package_the_keys_do_not_name_is_a_failure():
    """A resolution that installs a numerics package the env file does not list: keys would say 'not
    installed' while the env has it."""
    env = read_env_file(env_path("serve"))
    installs = {**{name: version for name, version in env.pins.items()}, "nvidia-modelopt": "0.47.0"}
    problem = key_problem(env, installs)
    assert problem is not None and "installs nvidia-modelopt 0.47.0" in problem
    assert key_problem(env, dict(env.pins)) is None


def test_resolutions_are_remembered_per_env_content(tmp_path, monkeypatch):
    calls = []

    def fake_resolve(env, **kwargs):
        from mixquant.software import EnvResolution

        calls.append(env.name)
        return EnvResolution(f"envs/{env.name}.yaml", "resolves", "3 packages", {"torch": "2.13.0"})

    monkeypatch.setattr("mixquant.software.resolve_env", fake_resolve)
    env = read_env_file(env_path("quant"))
    first = cached_resolution(env, cache_dir=tmp_path)
    second = cached_resolution(env, cache_dir=tmp_path)
    assert calls == ["quant"] and first == second
    assert json.loads(next(tmp_path.glob("quant-*.json")).read_text())["status"] == "resolves"
