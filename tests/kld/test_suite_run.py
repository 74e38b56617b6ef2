"""The KLD stages on an evaluation suite (several windows over domains): the reference with its noise floor,
runs that score the prompt and the windows with one engine, the window-level gate and the decomposition --
on a small random Laguna through the real hf engine."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.calibration.eval_suite import EVAL_JSON, WINDOWS_FILE  # noqa: E402
from mixquant.calibration.tokens import save_token_ids  # noqa: E402
from mixquant.keys.canonical import canonical_sha256  # noqa: E402
from mixquant.kld.capture import load_windows  # noqa: E402
from mixquant.kld.gate import run_gate_kld  # noqa: E402
from mixquant.kld.run import (  # noqa: E402
    AGGREGATE_JSON,
    PER_POSITION_FILE,
    REFERENCE_JSON,
    SUITE_DIR,
    run_dir,
    run_kld,
    run_reference_logits,
)
from mixquant.kld.suite_tables import decomposition  # noqa: E402
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
    "max_domain_regression": 0.0,
    "max_engine_floor": 0.0,
    "bootstrap_samples": 200,
    "confidence": 0.95,
}
DOMAINS = ("docs", "code", "chat")


def keyed(root: Path, stage: str, **what) -> tuple[Path, dict]:
    preimage = {"stage": stage, **what}
    return root / stage / canonical_sha256(preimage), preimage


@pytest.fixture(scope="module")
def suite(tmp_path_factory, small_laguna_config):
    """A random bf16 Laguna, a 20-token prompt, six 12-token windows over three domains, both references."""
    root = tmp_path_factory.mktemp("suite")
    torch.manual_seed(0)
    model = LagunaForCausalLM(small_laguna_config())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model_dir = root / "model"
    model_dir.mkdir()
    toy_layout.save_upstream_checkpoint(model, model_dir, num_shards=1)
    generator = torch.Generator().manual_seed(1)
    (root / "prompt").mkdir()
    save_token_ids(
        root / "prompt" / "prompt.safetensors", torch.randint(4, 128, (20,), generator=generator), {}
    )
    (root / "eval").mkdir()
    windows = torch.randint(4, 128, (6, 12), generator=generator)
    save_token_ids(root / "eval" / WINDOWS_FILE, windows, {})
    listed = [{"domain": DOMAINS[w % 3], "document": w, "document_sha256": "0" * 64} for w in range(6)]
    (root / "eval" / EVAL_JSON).write_text(json.dumps({"windows": listed}))
    settings = {"engine": ENGINE, "kv_cache_dtype": "bfloat16", "threads": 1}
    reference, preimage = keyed(root, "reference_logits", what="prompt")
    run_reference_logits(
        reference, model=model_dir, prompt=root / "prompt", settings=settings, preimage=preimage
    )
    suite_reference, preimage = keyed(root, "reference_logits", what="suite")
    suite_settings = {**settings, "reference_form": "full", "top_k": None, "captures": 2}
    run_reference_logits(
        suite_reference, model=model_dir, prompt=root / "eval", settings=suite_settings, preimage=preimage
    )
    return {
        "root": root,
        "model": model_dir,
        "prompt": root / "prompt",
        "eval": root / "eval",
        "reference": reference,
        "suite_reference": suite_reference,
    }


def runs(suite, kv: str, name: str, suite_reference: Path | None = None) -> Path:
    out, preimage = keyed(suite["root"], "run_kld", kv=kv, name=name)
    if out.is_dir():  # made by an earlier test of this module
        return out
    return run_kld(
        out,
        reference=suite["reference"],
        prompt=suite["prompt"],
        candidate=suite["model"],
        settings={"engine": ENGINE, "kv_cache_dtype": kv, "runs": 2, "threads": 1},
        preimage=preimage,
        suite_reference=suite_reference or suite["suite_reference"],
        suite=suite["eval"],
    )


def gate(suite, own: Path, name: str, kv: str, **roles) -> dict:
    out, preimage = keyed(suite["root"], "gate_kld", name=name, kv=kv, roles=sorted(roles))
    settings = {
        "candidate": name,
        "source": "bf16",
        "kv_cache_dtype": kv,
        "baseline": None,
        "gated": False,
        "gates": GATES,
        "require_exact_zero": kv == "bfloat16",
        "require_identical_runs": True,
    }
    run_gate_kld(
        out,
        runs=own,
        settings=settings,
        preimage=preimage,
        suite=suite["eval"],
        suite_reference=suite["suite_reference"],
        **roles,
    )
    return json.loads((out / AGGREGATE_JSON).read_text())


def test_the_reference_holds_every_window_and_a_zero_noise_floor(suite):
    document = json.loads((suite["suite_reference"] / REFERENCE_JSON).read_text())
    assert document["shape"][0] == 6 * 11 and document["positions"] == 66
    assert document["captures"] == 2 and document["noise_floor"] == 0.0  # hf on CPU: a repeat is exact
    assert not any(p.name.startswith(".capture") for p in suite["suite_reference"].iterdir())
    prompt = json.loads((suite["reference"] / REFERENCE_JSON).read_text())
    assert prompt["shape"][0] == 19 and prompt["noise_floor"] is None  # one capture: no floor claimed


def test_a_window_scores_as_it_would_alone(suite):
    """The engine carries every window through one layer-streamed pass; each window's logits equal its own
    single-window forward bit for bit (no window's result depends on another's)."""
    from mixquant.kld.engines import open_engine
    from mixquant.kld.settings import EngineSettings

    windows = load_windows(suite["eval"])
    engine = open_engine(suite["model"], EngineSettings(engine="hf", kv_cache_dtype="fp8", threads=1))
    try:
        together = list(engine.windows_logits(windows.ids))
        alone = [engine.prompt_logits(windows.ids[w]) for w in range(windows.ids.shape[0])]
    finally:
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))


def test_bf16_self_check_decomposes_into_exact_zeros(suite):
    """Weights-only, deployment and KV-only of the BF16 model with a BF16 KV cache on the hf engine: each is
    exactly 0, on the prompt and on every window."""
    own = runs(suite, "bfloat16", "bf16")
    for run in range(2):
        for where in (run_dir(own, run), run_dir(own, run) / SUITE_DIR):
            kl = load_file(str(where / PER_POSITION_FILE))["kl"]
            assert torch.count_nonzero(kl) == 0
    document = gate(suite, own, "bf16", "bfloat16")
    assert document["protocol"] == "suite" and document["verdict"]["word"] == "pass"
    assert document["suite"]["mean"]["mean"] == 0.0 and document["suite"]["noise_floor"] == 0.0
    (row,) = decomposition({("bf16", "bfloat16"): document}, "bf16")
    assert (row["weights_only"], row["deployment"], row["kv_only"]) == (0.0, 0.0, 0.0)


def test_fp8_kv_is_measured_per_domain_and_gated_on_the_engine_floor(suite):
    bf16 = runs(suite, "bfloat16", "bf16")
    fp8 = runs(suite, "fp8", "bf16-fp8kv")
    document = gate(suite, fp8, "bf16", "fp8", floor_runs=bf16)
    suite_part = document["suite"]
    assert suite_part["mean"]["mean"] > 0 and set(suite_part["mean"]["domains"]) == set(DOMAINS)
    assert suite_part["engine_floor"] == 0.0
    low, high = suite_part["mean"]["ci_low"], suite_part["mean"]["ci_high"]
    assert low <= suite_part["mean"]["mean"] <= high
    assert suite_part["windows"] == 6 and suite_part["positions"] == 66


def test_a_topk_reference_bounds_the_exact_kl(suite):
    """The top-k reference (the form for real scale): each position's KL from it lies within its stated
    bounds around the exact full-vocabulary KL."""
    root = suite["root"]
    reference, preimage = keyed(root, "reference_logits", what="topk")
    settings = {"engine": ENGINE, "kv_cache_dtype": "bfloat16", "threads": 1}
    settings.update(reference_form="topk", top_k=8, captures=1)
    run_reference_logits(
        reference, model=suite["model"], prompt=suite["eval"], settings=settings, preimage=preimage
    )
    full = runs(suite, "fp8", "full")
    topk = runs(suite, "fp8", "topk", suite_reference=reference)
    exact = load_file(str(run_dir(full, 0) / SUITE_DIR / PER_POSITION_FILE))
    bounded = load_file(str(run_dir(topk, 0) / SUITE_DIR / PER_POSITION_FILE))
    tolerance = 1e-9 + 1e-6 * exact["kl"].abs()
    assert bool(((bounded["kl_low"] - tolerance) <= exact["kl"]).all())
    assert bool((exact["kl"] <= bounded["kl_high"] + tolerance).all())
    assert torch.equal(bounded["p_cand"], exact["p_cand"])
