"""The model card: YAML front matter a hub can parse, the sections of a release, numbers from its inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mixquant.config import load_config_file
from mixquant.kld.suite_tables import decomposition, domain_rows
from mixquant.release.card import CardInputs, model_card, parse_front_matter
from mixquant.release.recipe import recipe_document
from mixquant.release.serving import serve_commands

REPO = Path(__file__).resolve().parents[2]
TOY_PLACEMENT = {1: "nvfp4_w4a16", 2: "nvfp4_w4a16", 3: "fp8", 4: "nvfp4_w4a16", 5: "bf16", 6: "fp8",
                 7: "nvfp4_w4a16", 8: "bf16"}  # fmt: skip
HASHES = {
    "prompt_token_ids": ("pin_prompt", "prompt.safetensors", "1" * 64),
    "reference_logits": ("reference_logits", "logits.safetensors", "2" * 64),
    "quant_config": ("export_checkpoint", "hf_quant_config.json", "3" * 64),
    "safetensors_index": ("export_checkpoint", "model.safetensors.index.json", "4" * 64),
}
SECTIONS = (
    "## Precision placement",
    "## KL divergence vs BF16",
    "## Serving with vLLM",
    "## Provenance",
    "## Status and limitations",
    "## Files",
)


def _gate(candidate, kv, mean_kld, reduction=None):
    improvement = None
    if reduction is not None:
        improvement = {"reduction": reduction, "ci_low": reduction - 0.05, "ci_high": reduction + 0.05}
    return {
        "candidate": candidate,
        "kv_cache_dtype": kv,
        "aggregate": {
            "runs": 5,
            "mean_kld": mean_kld,
            "run_spread": 0.0,
            "identical_runs": True,
            "summary": {"mean_kld_se": 1e-4, "same_top_pct": 97.5, "rms_dp": 0.01, "ppl_ratio": 1.001},
        },
        "improvement": improvement,
        "verdict": {"passed": True, "checks": [{"name": "max_mean_kld", "passed": True}]},
    }


def _inputs(config="config/config.yaml", placement=None) -> CardInputs:
    placement = placement or TOY_PLACEMENT
    recipe = recipe_document(load_config_file(REPO / config), placement)
    counts = {fmt: sum(1 for f in placement.values() if f == fmt) for fmt in ("nvfp4_w4a16", "fp8", "bf16")}
    quantized = {
        f"model.layers.{layer}.mlp.experts": (
            {"quant_algo": "W4A16_NVFP4", "group_size": 16} if fmt == "nvfp4_w4a16" else {"quant_algo": "FP8"}
        )
        for layer, fmt in placement.items()
        if fmt != "bf16"
    }
    gates = []
    for kv, searched, uniform in (("bfloat16", 0.0123, 0.0210), ("fp8", 0.0150, 0.0232)):
        gates += [
            _gate("searched", kv, searched, 0.4123 if kv == "bfloat16" else 0.3351),
            _gate("uniform-nvfp4", kv, uniform),
            _gate("bf16", kv, 0.0 if kv == "bfloat16" else 0.0007, 0.99),
        ]
    return CardInputs(
        recipe=recipe,
        inspection={
            "placement_counts": counts,
            "routed_effective_bits": 7.1875,
            "tensors": {"routed": {"nvfp4_w4a16": 1536, "fp8": 768, "bf16": 256}, "total": 2700},
            "payload_bytes": 12_345_678,
            "shards": [
                {"file": "model-00001-of-00002.safetensors"},
                {"file": "model-00002-of-00002.safetensors"},
            ],
            "layer_formats": {str(layer): fmt for layer, fmt in placement.items()},
        },
        hf_quant_config={
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {
                "quant_algo": "MIXED_PRECISION",
                "kv_cache_quant_algo": None,
                "quantized_layers": quantized,
            },
        },  # fmt: skip
        gates=gates,
        hashes={
            name: {
                "name": name,
                "sha256": sha,
                "artifact": {"stage": stage, "key": "5" * 64, "file": file, "path": "x"},
                "encoding": "the file's bytes as written",
            }
            for name, (stage, file, sha) in HASHES.items()
        },
        keys={"model": "a" * 64, "checkpoint": "b" * 64, "placement": "c" * 64},
        producer={
            "name": "mixquant",
            "version": "0.1.0",
            "numerics": {"name": "modelopt", "version": "0.47.0"},
        },
        verdict={"passed": True, "verdicts": [{}] * 6},
        placement_audit={
            "method": "ilp",
            "objective": 0.0456,
            "budget": {"target_effective_bits": 8.0, "effective_bits": 7.1875, "cost_model": "numel"},
            "groups": [
                {"layer": layer, "scores": {"nvfp4_w4a16": 0.001 * layer, "fp8": 0.0001 * layer, "bf16": 0.0}}
                for layer in placement
            ],
        },
        model_type="laguna",
        files=["config.json", "quantization_recipe.yaml"],
    )


def test_front_matter_parses_and_names_what_a_hub_needs():
    card = model_card(_inputs())
    meta = parse_front_matter(card)
    assert meta["license"] == "other" and meta["license_name"] == "psf-2.0"  # config/config.yaml release
    assert meta["license_link"] == "https://docs.python.org/3/license.html"
    # what NVIDIA's ModelOpt checkpoints declare: transformers cannot load a ModelOpt MIXED_PRECISION one
    assert meta["library_name"] == "Model Optimizer" and meta["pipeline_tag"] == "text-generation"
    assert {"mixquant", "modelopt", "nvfp4", "fp8", "mixed-precision", "laguna"} <= set(meta["tags"])
    assert "base_model" not in meta  # the toy has no hub repository to point at
    quant = meta["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION" and quant["routed_effective_bits"] == 7.1875
    assert quant["routed_expert_layers"] == {"nvfp4_w4a16": 4, "fp8": 2, "bf16": 2}
    assert quant["modelopt_version"] == "0.47.0" and quant["mixquant_version"] == "0.1.0"
    body = card.split("\n---\n", 1)[1]
    positions = [body.index(section) for section in SECTIONS]
    assert positions == sorted(positions)


def test_hub_source_gives_base_model_and_the_cluster_serving_flags():
    inputs = _inputs("config/laguna-s-2.1.yaml", {layer: "nvfp4_w4a16" for layer in range(1, 48)})
    meta = parse_front_matter(model_card(inputs))
    assert meta["base_model"] == "poolside/Laguna-S-2.1" and meta["base_model_relation"] == "quantized"
    assert "fp8" not in meta["tags"]  # no FP8 layer placed
    bf16, fp8 = serve_commands(inputs.recipe, "org/release")
    assert bf16.startswith("vllm serve org/release")
    for command, kv in ((bf16, "bfloat16"), (fp8, "fp8")):
        flags = command.split()
        assert flags[flags.index("--kv-cache-dtype") + 1] == kv  # never auto
        assert flags[flags.index("--tensor-parallel-size") + 1] == "4"
        assert flags[flags.index("--max-model-len") + 1] == "4096"
        assert "--quantization" not in flags  # vLLM detects ModelOpt from hf_quant_config.json


def test_numbers_come_from_the_inputs():
    inputs = _inputs()
    card = model_card(inputs)
    assert "Routed-expert effective bits: 7.1875" in card
    assert "| NVFP4 W4A16 | 4.5 | 4 | 1,536 |" in card and "| FP8 W8A8 | 8 | 2 | 768 |" in card
    assert "Tensors: 2,700; tensor payload: 12,345,678 bytes in 2 safetensors shard(s)" in card
    assert "lists 6 quantized modules" in card
    assert "41.23% below `uniform-nvfp4` [36.23%, 46.23%]" in card  # searched, BF16 KV
    assert "33.51% below `uniform-nvfp4`" in card  # searched, FP8 KV
    assert "| 3 | FP8 W8A8 | 0.003 | 0.0003 |" in card  # per-layer row: format and both scores
    for _, _, sha in HASHES.values():
        assert f"`{sha}`" in card
    assert f"`{'b' * 64}`" in card and f"`{'a' * 64}`" in card  # checkpoint and model keys
    # another input, another card: nothing is typed in by hand
    other = dataclasses.replace(inputs, inspection={**inputs.inspection, "routed_effective_bits": 5.9468})
    changed = model_card(other)
    assert "Routed-expert effective bits: 5.9468" in changed and "effective bits: 7.1875" not in changed
    assert parse_front_matter(changed)["quantization"]["routed_effective_bits"] == 5.9468
    assert model_card(inputs) == card  # deterministic


def test_published_hashes_are_compared_and_a_failed_verdict_is_stated():
    inputs = _inputs()
    recipe = dict(inputs.recipe, published={"quant_config": "3" * 64, "safetensors_index": "f" * 64})
    card = model_card(dataclasses.replace(inputs, recipe=recipe, verdict={"passed": False, "verdicts": []}))
    assert f"`{'3' * 64}` (= published)" in card and f"`{'4' * 64}` (≠ published)" in card
    assert "KLD gates: FAILED" in card
    assert (
        "Published hashes: 1 of 2 pinned in the recipe match this release (differing: safetensors_index)."
        in card
    )


def test_explicit_placement_card_has_no_search_numbers():
    inputs = dataclasses.replace(_inputs(), placement_audit=None)
    card = model_card(inputs)
    assert "placement was given explicitly" in card and "KL/token if" not in card
    assert "| 3 | FP8 W8A8 |" in card


def test_front_matter_must_be_there():
    with pytest.raises(ValueError, match="no YAML front matter"):
        parse_front_matter("# title\n")
    with pytest.raises(ValueError, match="not closed"):
        parse_front_matter("---\nlicense: other\n")


def test_provenance_names_the_numerics_fingerprint_and_the_hash_kinds(decisive):
    inputs = dataclasses.replace(_inputs(), numerics=decisive)
    card = model_card(inputs)
    assert (
        "- Numerics fingerprint of the BF16 reference logits (`numerics.json`, shipped with them in "
        "`reference/`): device cpu, profile portable, threads 1, ATen CPU capability AVX2, MKL CBWR "
        "COMPATIBLE, oneDNN (mkldnn) off; mkl 2024.2, onednn 3.12.0, torch 2.13.0+cpu, transformers 5.24.0; "
        "Python 3.11.7."
    ) in card
    assert "| what | kind | SHA-256 | file | encoding |" in card
    assert f"| BF16 reference logits | numerical | `{'2' * 64}`" in card
    assert f"| quant config (hf_quant_config.json) | content | `{'3' * 64}`" in card
    assert model_card(inputs) == card  # deterministic
    assert "Numerics fingerprint" not in model_card(_inputs())  # none recorded, none named


def test_a_published_fingerprint_is_compared_and_is_no_hash(decisive):
    inputs = dataclasses.replace(_inputs(), numerics=decisive)
    recipe = dict(inputs.recipe, published={"quant_config": "3" * 64, "numerics": decisive})
    card = model_card(dataclasses.replace(inputs, recipe=recipe))
    assert "Published hashes: 1 of 1 pinned in the recipe match this release." in card
    assert "- Published numerics fingerprint (`published.numerics`): equal to this release's." in card
    other = {**decisive, "cpu_capability": "AVX512"}
    recipe = dict(inputs.recipe, published={"numerics": other})
    card = model_card(dataclasses.replace(inputs, recipe=recipe))
    assert "No published hashes are pinned" in card
    assert "(`published.numerics`): differs in `cpu_capability`; this release's reference logits" in card


DOMAINS = ("docs", "code", "chat")


def _suite_gate(gate: dict, mean: float, reduction: float | None, word: str = "pass") -> dict:
    """``gate`` as gate_kld writes it with an evaluation suite: 24 windows of 256 tokens over three domains,
    the window-level mean and (against a baseline) reduction with intervals, and the verdict word."""
    domains = {
        name: {"mean": mean * (1 + 0.1 * i), "ci_low": mean * 0.8, "ci_high": mean * 1.5, "windows": 8,
               "positions": 8 * 255}
        for i, name in enumerate(DOMAINS)
    }  # fmt: skip
    improvement = None
    if reduction is not None:
        improvement = {
            "reduction": reduction, "ci_low": reduction - 0.12, "ci_high": reduction + 0.1, "windows": 24,
            "domains": {name: {"reduction": reduction + 0.05 * (i - 1), "ci_low": reduction - 0.2,
                               "ci_high": reduction + 0.2, "windows": 8} for i, name in enumerate(DOMAINS)},
        }  # fmt: skip
    suite = {
        "aggregate": {**gate["aggregate"], "mean_kld": mean},
        "mean": {"mean": mean, "ci_low": mean * 0.85, "ci_high": mean * 1.2, "windows": 24,
                 "positions": 24 * 255, "domains": domains},
        "improvement": improvement,
        "baseline_mean_kld": 0.0321,
        "noise_floor": 0.0,
        "engine_floor": 0.0,
        "windows": 24,
        "window_tokens": 256,
        "positions": 24 * 255,
    }  # fmt: skip
    checks = [
        {"name": "min_improvement", "value": reduction, "limit": 0.1, "word": word, "passed": word == "pass"}
    ]
    verdict = {"word": word, "passed": word == "pass", "checks": checks}
    return {**gate, "protocol": "suite", "suite": suite, "verdict": verdict}


def _report(inputs: CardInputs) -> dict:
    """kld_report's report.json for ``inputs``' gates: the suite's facts, decomposition, domains, widths."""
    documents = {(g["candidate"], g["kv_cache_dtype"]): g for g in inputs.gates}
    return {
        "baseline": "uniform-nvfp4",
        "protocol": "suite",
        "verdicts": [],
        "suite": {
            "domains": [
                {"name": name, "source": f"data/eval/{name}.jsonl", "documents": 80, "windows": 8,
                 "tokens": 8 * 256}
                for name in DOMAINS
            ],
            "window_tokens": 256,
            "windows": 24,
            "tokens": 24 * 256,
            "positions": 24 * 255,
            "token_ids_sha256": "e" * 64,
            "disjoint_from_calibration": {"calibration_units": 1234, "eval_units": 567, "shared": 0},
            "noise_floor": 0.0,
            "engine_floor": 0.0,
        },
        "decomposition": decomposition(documents, "bf16"),
        "domains": domain_rows(documents),
        "interval_widths": {
            "candidate": "searched", "baseline": "uniform-nvfp4", "kv_cache_dtype": "bfloat16",
            "prompt": {"reduction": 0.4123, "ci_low": 0.3623, "ci_high": 0.4623, "width": 0.1},
            "suite": {"reduction": 0.35, "ci_low": 0.23, "ci_high": 0.45, "width": 0.22},
            "ratio": 2.2,
        },
    }  # fmt: skip


def _suite_inputs(word: str = "pass") -> CardInputs:
    inputs = _inputs()
    means = {"searched": 0.0141, "uniform-nvfp4": 0.0321, "bf16": 0.0}
    gates = []
    for gate in inputs.gates:
        name, kv = gate["candidate"], gate["kv_cache_dtype"]
        mean = means[name] if kv == "bfloat16" else means[name] * 1.2 + 0.0005
        reduction = None if name == "uniform-nvfp4" else (0.35 if name == "searched" else 0.98)
        gates.append(_suite_gate(gate, mean, reduction, word if name == "searched" else "pass"))
    files = [
        *inputs.files,
        "kld/kl_cdf_domains_bfloat16.png",
        "kld/kl_cdf_domains_fp8.png",
        "kld/report.json",
    ]
    inputs = dataclasses.replace(inputs, gates=gates, files=sorted(files))
    return dataclasses.replace(inputs, report=_report(inputs))


def _kld_section(card: str) -> str:
    return card[card.index("## KL divergence vs BF16") : card.index("## Serving with vLLM")]


def test_a_suite_card_shows_the_suite_the_decomposition_the_floors_and_the_verdict_words():
    inputs = _suite_inputs()
    card = model_card(inputs)
    kld = _kld_section(card)
    headings = (
        "### The evaluation suite",
        "### Decomposed KLD",
        "### Floors",
        "### Per domain",
        "### Interval width: one prompt against the suite",
        "### The published-hash protocol: the pinned prompt",
    )
    positions = [kld.index(heading) for heading in headings]
    assert positions == sorted(positions)
    assert "at each of 6,120 positions of 24 windows of 256 tokens over 3 domains (docs, code, chat)" in kld
    # the suite: each domain's pinned source (by content, never the builder's path), windows and tokens
    assert "| docs | a local JSONL file, SHA-256 `2b007856d26ffa66…` | 80 | 8 | 2,048 |" in kld
    assert "567 evaluation text units against 1,234 of the calibration dataset, 0 shared" in kld
    assert f"token IDs SHA-256 `{'e' * 64}`" in kld and "data/eval" not in card
    # the gated table: the verdict word on the suite's rows, the prompt's rows reported only
    assert "| searched | bfloat16 | 7.1875 | suite | 5 | 0.0141 ± 0.0001 |" in kld
    suite_row = next(
        line for line in kld.splitlines() if line.startswith("| searched | fp8 | 7.1875 | suite |")
    )
    prompt_row = next(
        line for line in kld.splitlines() if line.startswith("| searched | fp8 | 7.1875 | prompt |")
    )
    assert suite_row.endswith("| PASS |") and prompt_row.endswith("| n/a |")
    assert "mean KLD 0.0141 on the suite, 35.00% below `uniform-nvfp4` [23.00%, 45.00%]: pass" in kld
    # weights-only, deployment, KV-only side by side; the BF16 self-check with BF16 KV exactly 0 thrice
    assert (
        "| candidate | KV cache | protocol | weights-only (BF16 KV) | deployment | KV-only (BF16 weights) |"
        in kld
    )
    assert "| searched | fp8 | suite | 0.0141 | 0.01742 | 0.0005 |" in kld
    assert "| bf16 | bfloat16 | suite | 0 | 0 | 0 |" in kld
    assert "noise floor (mean KL between 2 fresh reference captures on the `hf` engine): 0 nats" in kld
    assert "against the reference path): 0 nats; gated at 0, never subtracted." in kld
    assert (
        "| searched | fp8 | chat | 8 | 2,040 | 0.0209 [0.01394, 0.02613] | 40.0 % [15.0 %, 55.0 %] |" in kld
    )
    assert "![KL(BF16 ‖ candidate) CDF per domain, fp8 KV cache](kld/kl_cdf_domains_fp8.png)" in kld
    assert "2.20× the prompt's width" in kld
    assert "its reduction moves from 30.00% (docs) to 40.00% (chat)" in kld
    # the status: the words counted and what the KLD measured
    assert "(6 candidate × KV checks on the evaluation suite: 6 pass, `check_kld_gates`)" in card
    assert "- KLD is gated on 24 held-out windows (6,120 positions) over 3 domains (docs, code, chat)" in card
    assert "The KLD protocol is one pinned prompt" not in card
    assert model_card(inputs) == card  # deterministic


def test_a_straddling_interval_says_repeat_required_and_the_tables_stand_without_the_report():
    card = model_card(_suite_inputs("repeat-required"))
    kld = _kld_section(card)
    suite_row = next(
        line for line in kld.splitlines() if line.startswith("| searched | bfloat16 | 7.1875 | suite |")
    )
    assert suite_row.endswith("| REPEAT-REQUIRED |")
    assert "[23.00%, 45.00%]: repeat-required" in kld
    assert "on the evaluation suite: 4 pass, 2 repeat-required" in card
    # without kld_report's report.json: the tables from the gate documents, no suite facts or widths
    bare = dataclasses.replace(_suite_inputs(), report=None)
    kld = _kld_section(model_card(bare))
    assert "### The evaluation suite" not in kld and "### Interval width" not in kld
    assert "| bf16 | bfloat16 | suite | 0 | 0 | 0 |" in kld and "### Per domain" in kld
    assert "noise floor (mean KL between 2 fresh reference captures on the `hf` engine): 0 nats" in kld


def test_a_prompt_card_says_the_prompt_is_all_it_measured():
    card = model_card(_inputs())
    assert "- The KLD protocol is one pinned prompt (2,047 positions of one text); it is not a task" in card
    for absent in ("### Decomposed KLD", "### The published-hash protocol", "on the evaluation suite"):
        assert absent not in card
    assert "| searched | bfloat16 | 7.1875 | prompt |" in card
