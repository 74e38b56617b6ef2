"""run_kld and gate_kld as stages: every run of one (candidate, KV dtype) in one job, each with a fresh engine
(in process for hf, a fresh process per run as vllm needs), kept per run under runs/<i>/ for the gate."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.calibration.tokens import save_token_ids  # noqa: E402
from mixquant.keys.canonical import canonical_sha256  # noqa: E402
from mixquant.keys.manifest import read_manifest  # noqa: E402
from mixquant.kld import run as kld_run  # noqa: E402
from mixquant.kld.gate import load_runs, run_gate_kld  # noqa: E402
from mixquant.kld.run import (  # noqa: E402
    AGGREGATE_JSON,
    PER_POSITION_FILE,
    RUN_JSON,
    KldRunError,
    run_dir,
    run_kld,
    run_reference_logits,
)
from mixquant.model import toy_layout  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

ENGINE = {
    "engine": "hf",
    "tensor_parallel_size": 1,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "seed": 0,
    "enable_prefix_caching": False,
    "max_model_len": None,
}
GATES = {
    "max_mean_kld": 0.05,
    "max_run_spread": 0.0,
    "min_improvement": 0.0,
    "bootstrap_samples": 200,
    "confidence": 0.95,
}


def keyed(root: Path, stage: str, preimage: dict) -> tuple[Path, dict]:
    return root / stage / canonical_sha256(preimage), preimage


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, small_laguna_config):
    """A random bf16 Laguna (upstream layout), a 24-token prompt and its reference logits."""
    root = tmp_path_factory.mktemp("kld")
    torch.manual_seed(0)
    model = LagunaForCausalLM(small_laguna_config())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model_dir = root / "model"
    model_dir.mkdir()
    (root / "prompt").mkdir()
    toy_layout.save_upstream_checkpoint(model, model_dir, num_shards=1)
    ids = torch.randint(4, 128, (24,), generator=torch.Generator().manual_seed(1))
    save_token_ids(root / "prompt" / "prompt.safetensors", ids, {})
    reference, preimage = keyed(root, "reference_logits", {"stage": "reference_logits"})
    settings = {"engine": ENGINE, "kv_cache_dtype": "bfloat16", "threads": 1}
    run_reference_logits(
        reference, model=model_dir, prompt=root / "prompt", settings=settings, preimage=preimage
    )
    return {"root": root, "model": model_dir, "prompt": root / "prompt", "reference": reference}


def kld_runs(inputs, kv: str, runs: int, name: str) -> Path:
    out, preimage = keyed(inputs["root"], "run_kld", {"stage": "run_kld", "kv": kv, "runs": runs, "n": name})
    settings = {"engine": ENGINE, "kv_cache_dtype": kv, "runs": runs, "threads": 1}
    return run_kld(
        out,
        reference=inputs["reference"],
        prompt=inputs["prompt"],
        candidate=inputs["model"],
        settings=settings,
        preimage=preimage,
    )


def test_one_job_keeps_every_run(inputs):
    out = kld_runs(inputs, "bfloat16", 3, "bf16")
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["0", "1", "2"]
    kl = []
    for run in range(3):
        document = json.loads((run_dir(out, run) / RUN_JSON).read_text())
        assert document["run"] == run and document["kv_cache_dtype"] == "bfloat16"
        kl.append(load_file(str(run_dir(out, run) / PER_POSITION_FILE))["kl"])
    # the BF16 model against its own reference: exactly zero, every fresh engine bit-identical
    assert all(torch.equal(k, torch.zeros_like(k)) for k in kl)
    summary = read_manifest(out)["summary"]
    assert summary == {"kv_cache_dtype": "bfloat16", "runs": 3, "mean_kld": [0.0, 0.0, 0.0]}
    assert f"runs/2/{RUN_JSON}" in read_manifest(out)["files"]


def test_gate_reads_the_runs_and_the_baselines_runs(inputs):
    own = kld_runs(inputs, "fp8", 2, "candidate")
    base = kld_runs(inputs, "fp8", 2, "baseline")
    out, preimage = keyed(inputs["root"], "gate_kld", {"stage": "gate_kld"})
    settings = {
        "candidate": "x",
        "source": "bf16",
        "kv_cache_dtype": "fp8",
        "baseline": "y",
        "gated": False,
        "gates": GATES,
        "require_exact_zero": False,
        "require_identical_runs": True,
    }
    run_gate_kld(out, runs=own, baseline_runs=base, settings=settings, preimage=preimage)
    document = json.loads((out / AGGREGATE_JSON).read_text())
    assert document["aggregate"]["runs"] == 2
    assert document["improvement"] is not None  # the paired comparison with the baseline's runs
    assert document["verdict"]["passed"] is True  # identical runs (hf is deterministic)


def test_a_gap_in_the_runs_is_refused(tmp_path):
    for run in (0, 2):
        run_dir(tmp_path, run).mkdir(parents=True)
    with pytest.raises(KldRunError, match=r"expected runs 0..n-1, found \[0, 2\]"):
        load_runs(tmp_path)


def _spec(inputs, out: Path, kv: str, model: Path | None = None) -> dict:
    settings = {"engine": ENGINE, "kv_cache_dtype": kv, "runs": 1, "threads": 1}
    task = {"windows": str(inputs["prompt"]), "out": str(out), "reference": str(inputs["reference"])}
    task.update(form="full", top_k=None)
    return {
        "model": str(model or inputs["model"]),
        "kv_cache_dtype": kv,
        "tasks": [task],
        "settings": settings,
    }


def test_a_fresh_process_pass_equals_the_in_process_pass(inputs, tmp_path):
    """The vllm path (the engine in a new process per run) on the hf engine: the same files as in-process."""
    here = kld_run._pass_here(_spec(inputs, tmp_path / "here", "fp8"))
    child = kld_run._pass_in_fresh_process(_spec(inputs, tmp_path / "child", "fp8"), None, "run 0")
    assert here["results"] == child["results"] and here["results"][0]["summary"]["mean_kld"] > 0
    for name in (PER_POSITION_FILE,):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "child" / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child", "here"]  # the scratch is gone


def test_a_failed_fresh_process_is_one_line(inputs, tmp_path):
    spec = _spec(inputs, tmp_path / "out", "bfloat16", model=tmp_path / "nowhere")
    with pytest.raises(KldRunError, match="run 0: the engine process exited with 1: .*nowhere"):
        kld_run._pass_in_fresh_process(spec, None, "run 0")


def test_a_run_is_judged_by_its_files_not_its_exit_status(inputs, tmp_path, monkeypatch):
    """vLLM's teardown has aborted (rc 134) after the output was complete: the files decide."""
    real_run = kld_run.subprocess.run

    def aborting_at_exit(command, **kwargs):
        done = real_run(command, **kwargs)
        assert done.returncode == 0
        return kld_run.subprocess.CompletedProcess(command, 134, done.stdout, "terminate called\n")

    monkeypatch.setattr(kld_run.subprocess, "run", aborting_at_exit)
    result = kld_run._pass_in_fresh_process(_spec(inputs, tmp_path / "a", "bfloat16"), None, "run 0")
    assert result["results"][0]["summary"]["positions"] == 23

    def aborting_early(command, **kwargs):  # no done.json: the output is not complete
        return kld_run.subprocess.CompletedProcess(
            command, 134, "", "terminate called without an active exception"
        )

    monkeypatch.setattr(kld_run.subprocess, "run", aborting_early)
    with pytest.raises(
        KldRunError,
        match="run 0: the engine process exited with 134: terminate called without an active exception",
    ):
        kld_run._pass_in_fresh_process(_spec(inputs, tmp_path / "b", "bfloat16"), None, "run 0")
