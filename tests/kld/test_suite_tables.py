"""The suite's tables: decomposed KLD (weights-only, deployment, KV-only) and per-domain rows, from synthetic
gate documents shaped as gate_kld writes them."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from mixquant.kld.suite_tables import (
    comparison_rows,
    decomposition,
    decomposition_markdown,
    domain_rows,
    domains_markdown,
    write_rows,
)
from mixquant.kld.windows import window_bootstrap, window_mean

WINDOW_TOKENS = 16
DOMAIN_OF = {0: "docs", 1: "docs", 2: "code", 3: "code", 4: "chat", 5: "chat"}
POSITION_WINDOW = np.repeat(np.arange(len(DOMAIN_OF)), WINDOW_TOKENS - 1)
KVS = ("bfloat16", "fp8")


def _kl(seed: int, scale: float) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).normal(size=POSITION_WINDOW.size)) * scale


def _document(kl: np.ndarray, base: np.ndarray | None, *, suite: bool = True) -> dict:
    """A gate document (aggregate.json) of per-position KL ``kl`` vs the baseline's ``base``."""
    document = {
        "aggregate": {"mean_kld": float(kl[:7].mean()), "runs": 2},
        "improvement": None,
        "suite": None,
    }
    if suite:
        mean = window_mean(kl, POSITION_WINDOW, DOMAIN_OF, samples=200)
        improvement = None
        if base is not None:
            improvement = window_bootstrap(kl, base, POSITION_WINDOW, DOMAIN_OF, samples=200)
        aggregate = {"mean_kld": mean["mean"], "runs": 2}
        document["suite"] = {"aggregate": aggregate, "mean": mean, "improvement": improvement, "windows": 6}
    document["protocol"] = "suite" if suite else "prompt"
    return document


def _documents(suite: bool = True) -> dict[tuple[str, str], dict]:
    """searched, uniform-nvfp4 (the baseline) and the bf16 self-check, with a BF16 and an FP8 KV cache; the
    bf16 candidate with a BF16 KV cache on the exact hf engine has KL exactly 0 everywhere."""
    out = {}
    for k, kv in enumerate(KVS):
        base = _kl(10 + k, 0.02)
        out[("searched", kv)] = _document(_kl(20 + k, 0.012), base, suite=suite)
        out[("uniform-nvfp4", kv)] = _document(base, None, suite=suite)
        bf16 = np.zeros(POSITION_WINDOW.size) if kv == "bfloat16" else _kl(30, 0.001)
        out[("bf16", kv)] = _document(bf16, base, suite=suite)
    return out


def _by_key(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(row["candidate"], row["kv_cache_dtype"]): row for row in rows}


def test_decomposition_puts_weights_only_deployment_and_kv_only_side_by_side():
    documents = _documents()
    rows = decomposition(documents, "bf16")
    assert [(r["candidate"], r["kv_cache_dtype"]) for r in rows] == list(documents)  # the documents' order
    by = _by_key(rows)
    mean = {key: document["suite"]["mean"]["mean"] for key, document in documents.items()}
    searched = by[("searched", "fp8")]
    assert searched["protocol"] == "suite"
    assert searched["weights_only"] == mean[("searched", "bfloat16")]
    assert searched["deployment"] == mean[("searched", "fp8")]
    assert searched["kv_only"] == mean[("bf16", "fp8")] > 0.0
    assert by[("searched", "bfloat16")]["weights_only"] == by[("searched", "bfloat16")]["deployment"]
    # the BF16 self-check with a BF16 KV cache on the hf engine: all three exactly 0
    self_check = by[("bf16", "bfloat16")]
    assert [self_check[k] for k in ("weights_only", "deployment", "kv_only")] == [0.0, 0.0, 0.0]
    assert all(type(self_check[k]) is float and self_check[k] == 0.0 for k in ("weights_only", "kv_only"))
    assert "| bf16 | bfloat16 | suite | 0 | 0 | 0 |" in decomposition_markdown(rows)


def test_decomposition_on_the_prompt_without_a_bf16_candidate_or_a_bf16_kv():
    documents = _documents(suite=False)
    rows = _by_key(decomposition(documents, None))
    searched = rows[("searched", "fp8")]
    assert searched["protocol"] == "prompt" and searched["kv_only"] is None
    assert searched["deployment"] == documents[("searched", "fp8")]["aggregate"]["mean_kld"]
    assert searched["weights_only"] == documents[("searched", "bfloat16")]["aggregate"]["mean_kld"]
    fp8_only = {key: doc for key, doc in documents.items() if key[1] == "fp8"}
    row = _by_key(decomposition(fp8_only, "bf16"))[("searched", "fp8")]
    assert (
        row["weights_only"] is None and row["kv_only"] == documents[("bf16", "fp8")]["aggregate"]["mean_kld"]
    )
    assert "| searched | fp8 | prompt | — |" in decomposition_markdown([row])


def test_domain_rows_carry_each_domains_mean_and_reduction_with_intervals():
    documents = _documents()
    rows = domain_rows(documents)
    assert len(rows) == len(documents) * 3
    by = {(r["candidate"], r["kv_cache_dtype"], r["domain"]): r for r in rows}
    suite = documents[("searched", "fp8")]["suite"]
    code = by[("searched", "fp8", "code")]
    assert code["windows"] == 2 and code["positions"] == 2 * (WINDOW_TOKENS - 1)
    assert code["mean_kld"] == suite["mean"]["domains"]["code"]["mean"]
    assert code["ci_low"] <= code["mean_kld"] <= code["ci_high"]
    assert code["reduction"] == suite["improvement"]["domains"]["code"]["reduction"]
    assert code["reduction_ci_low"] <= code["reduction"] <= code["reduction_ci_high"]
    baseline = by[("uniform-nvfp4", "bfloat16", "docs")]  # no baseline to compare with
    assert baseline["reduction"] is None and baseline["reduction_ci_low"] is None
    assert [r["domain"] for r in rows[:3]] == ["docs", "code", "chat"]
    assert domain_rows(_documents(suite=False)) == []  # no suite, no domains
    md = domains_markdown(rows)
    assert md.count("\n") == 2 + len(rows)
    assert f"| searched | fp8 | code | 2 | {2 * (WINDOW_TOKENS - 1)} | {code['mean_kld']:.4g} [" in md
    assert "| uniform-nvfp4 | bfloat16 | docs | 2 | 30 |" in md and "| — |" in md


def test_write_rows_writes_full_precision_csv_and_the_markdown(tmp_path):
    rows = decomposition(_documents(), "bf16")
    csv_path, md_path = write_rows(rows, tmp_path / "out" / "decomposition")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["decomposition.csv", "decomposition.md"]
    assert md_path.read_text(encoding="utf-8") == decomposition_markdown(rows)
    with csv_path.open(encoding="utf-8", newline="") as handle:
        back = list(csv.DictReader(handle))
    assert list(back[0]) == [
        "candidate",
        "kv_cache_dtype",
        "protocol",
        "weights_only",
        "deployment",
        "kv_only",
    ]
    for row, read in zip(rows, back, strict=True):
        assert float(read["deployment"]) == row["deployment"]  # full precision: reads back equal
    domains = domain_rows(_documents())
    csv_path, md_path = write_rows(domains, tmp_path / "out" / "domains")
    assert md_path.read_text(encoding="utf-8") == domains_markdown(domains)
    with csv_path.open(encoding="utf-8", newline="") as handle:
        back = list(csv.DictReader(handle))
    assert float(back[0]["mean_kld"]) == domains[0]["mean_kld"]
    assert back[3]["reduction"] == "" and domains[3]["reduction"] is None  # the baseline's rows: no reduction
    with pytest.raises(ValueError, match="no rows"):
        write_rows([], tmp_path / "empty")
    with pytest.raises(ValueError, match="neither the decomposition nor the per-domain rows"):
        write_rows([{"candidate": "x"}], tmp_path / "other")
    assert not (tmp_path / "empty.csv").exists() and not (tmp_path / "other.md").exists()


def test_comparison_rows_put_the_verdict_on_the_protocol_that_gated():
    verdict = {"word": "repeat-required", "passed": False, "checks": [{"name": "min_improvement"}]}
    suite_doc = {
        "candidate": "searched",
        "kv_cache_dtype": "fp8",
        "verdict": verdict,
        **_document(_kl(1, 0.01), _kl(2, 0.02)),
    }
    ungated = {
        **suite_doc,
        "candidate": "uniform-nvfp4",
        "verdict": {"word": "pass", "passed": True, "checks": []},
    }
    prompt_doc = {**suite_doc, "candidate": "old", "suite": None, "protocol": "prompt"}
    rows = comparison_rows([suite_doc, ungated, prompt_doc])
    assert [(r["candidate"], r["protocol"]) for r in rows] == [
        ("searched", "prompt"), ("searched", "suite"), ("uniform-nvfp4", "prompt"),
        ("uniform-nvfp4", "suite"), ("old", "prompt"),
    ]  # fmt: skip
    assert [r["gates"] for r in rows] == [None, verdict, None, None, verdict]
    assert rows[1]["aggregate"]["mean_kld"] == suite_doc["suite"]["mean"]["mean"]
    assert rows[1]["improvement"] is suite_doc["suite"]["improvement"] and rows[0]["improvement"] is None
