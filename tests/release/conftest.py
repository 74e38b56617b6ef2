"""Tiny synthetic keyed artifacts (safetensors and JSON only) for the release hash and verify tests."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from mixquant.calibration.tokens import save_token_ids
from mixquant.kld.run import logits_sha256
from safetensors.torch import save_file

# A numerics fingerprint as mixquant.numerics.fingerprint() writes it (synthetic: the same on every host).
FINGERPRINT = {
    "decisive": {
        "device": "cpu",
        "profile": "portable",
        "threads": 1,
        "cpu_capability": "AVX2",
        "mkl_cbwr": "COMPATIBLE",
        "mkldnn": False,
        "libraries": {"torch": "2.13.0+cpu", "mkl": "2024.2", "onednn": "3.12.0", "transformers": "5.24.0"},
        "python": "3.11.7",
    },
    "host": {"vendor": "AuthenticAMD", "model": "AMD EPYC", "isa": "avx2", "machine": "x86_64"},
}


def keyed_dir(results: Path, stage: str, label: str) -> Path:
    directory = results / stage / hashlib.sha256(label.encode()).hexdigest()
    directory.mkdir(parents=True)
    return directory


def write_reference(
    directory: Path, logits: torch.Tensor, engine: dict | None = None, numerics: dict | None = FINGERPRINT
) -> str:
    """logits.safetensors and reference.json as reference_logits writes them (numerics None: not recorded)."""
    sha = logits_sha256(logits)
    save_file(
        {"logits": logits.contiguous()}, str(directory / "logits.safetensors"), metadata={"sha256": sha}
    )
    document = {
        "sha256": sha,
        "engine_settings": {"engine": "hf", "seed": 0, "kv_cache_dtype": "bfloat16"},
        "engine": engine or {"engine": "hf", "device": "cpu", "threads": 2},
    }
    if numerics is not None:
        document["numerics"] = copy.deepcopy(numerics)
        document["engine"] = {**document["engine"], "numerics": copy.deepcopy(numerics)}
    (directory / "reference.json").write_text(json.dumps(document), "utf-8")
    return sha


@pytest.fixture
def make_keyed_dir(tmp_path):
    """Factory: an empty results/<stage>/<sha256(label)> directory under tmp_path."""
    return lambda stage, label: keyed_dir(tmp_path / "results", stage, label)


@pytest.fixture
def reference_writer():
    """write_reference(directory, logits, engine=None, numerics=FINGERPRINT) -> the logits' SHA-256."""
    return write_reference


@pytest.fixture
def decisive():
    """A fresh copy of the decisive part of the fingerprint the synthetic reference records."""
    return copy.deepcopy(FINGERPRINT["decisive"])


@pytest.fixture
def release_dirs(tmp_path):
    """{"results", "prompt", "reference_logits", "checkpoint", "ids", "logits"}: one synthetic release."""
    results = tmp_path / "results"
    ids = torch.tensor([5, 1, 70000, 3, 2**31 - 1, 0], dtype=torch.int64)
    logits = torch.linspace(-4.0, 4.0, 5 * 7, dtype=torch.float32).reshape(5, 7)
    prompt = keyed_dir(results, "pin_prompt", "prompt")
    save_token_ids(prompt / "prompt.safetensors", ids, {"encoding": "int32-le-row-major"})
    reference = keyed_dir(results, "reference_logits", "ours")
    write_reference(reference, logits)
    checkpoint = keyed_dir(results, "export_checkpoint", "checkpoint")
    (checkpoint / "hf_quant_config.json").write_bytes(
        b'{\n    "quantization": {"quant_algo": "MIXED_PRECISION"}\n}'
    )
    (checkpoint / "model.safetensors.index.json").write_bytes(
        b'{"metadata": {"total_size": 8}, "weight_map": {}}\n'
    )
    return {
        "results": results,
        "prompt": prompt,
        "reference_logits": reference,
        "checkpoint": checkpoint,
        "ids": ids,
        "logits": logits,
    }
