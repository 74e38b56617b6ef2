"""tools/gpu_check.py's CPU smoke mode: every section measures, and the toy comparisons (CPU vs CPU, the
same library call twice) are bit-identical -- a check of the comparison code the GPU run relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "gpu_check.py"
SECTIONS = ("h2d", "laguna_layer", "stacked_branches", "lm_head_kl", "toy_gpu_vs_cpu", "gptq")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "x.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def test_the_run_finishes_with_a_header(report):
    assert report["schema"] == "mixquant-gpu-check/1"
    assert report["finished"] is True
    assert "error" not in report
    header = report["header"]
    assert header["torch"] and header["transformers"] and header["modelopt"]
    assert header["device"] == "cpu" and header["small"] is True
    assert all(status.startswith("ok") for status in header["imports"].values()), header["imports"]
    assert set(header["section_wall_s"]) == set(SECTIONS)
    assert positive(report["wall_s"])
    assert report["deterministic_errors"] == []


def test_every_section_measures(report):
    sections = report["sections"]
    assert list(sections) == list(SECTIONS)
    assert sections["h2d"]["skipped"] == "no cuda"
    for name in SECTIONS[1:]:
        assert "error" not in sections[name] and "skipped" not in sections[name], sections[name]
        assert positive(sections[name]["wall_s"])
        for case in sections[name].get("cases", {}).values():
            assert "error" not in case and "skipped" not in case, case


def test_layer_sections_report_throughput(report):
    layer = report["sections"]["laguna_layer"]
    assert layer["geometry"]["num_experts"] == 8 and layer["geometry"]["hidden_size"] == 256
    assert layer["geometry"]["experts_implementation"] == "eager"
    assert set(layer["cases"]) == {"1", "2"}
    for case in layer["cases"].values():
        assert positive(case["tokens_per_s"]) and positive(case["tflop_s"]) and positive(case["best_s"])
    stacked = report["sections"]["stacked_branches"]
    assert set(stacked["cases"]) == {"1", "2", "4"}
    for case in stacked["cases"].values():
        assert positive(case["per_branch_sequence_s"]) and positive(case["speedup_vs_1_branch"])
    assert stacked["cases"]["1"]["speedup_vs_1_branch"] == 1.0
    head = report["sections"]["lm_head_kl"]
    assert head["vocab"] == 4096
    for case in head["cases"].values():
        assert positive(case["branch"]["tokens_per_s"]) and positive(case["reference"]["tokens_per_s"])


def test_toy_comparisons_are_bit_equal_cpu_vs_cpu(report):
    toy = report["sections"]["toy_gpu_vs_cpu"]
    assert toy["compared"] == "cpu vs cpu"
    stats = toy["activation_stats"]
    assert stats["bit_equal"] is True
    assert all(entry["max_relative_difference"] == 0.0 for entry in stats["stats"].values())
    scores = toy["scores"]
    assert scores["bit_equal"] is True and scores["same_ranking"] is True
    assert set(scores["kl_sum_cpu"]) == {str(layer) for layer in range(1, 9)}
    assert all(positive(value) for value in scores["kl_sum_cpu"].values())
    assert all(value == 0.0 for value in scores["relative_difference"].values())
    for part in ("nvfp4_codes", "fp8_codes", "nvfp4_gptq_codes"):
        codes = toy[part]
        assert codes["bit_equal"] is True and codes["differing_tensors"] == 0, codes
        assert codes["layers"] == list(range(1, 9)) and codes["tensors"] == 8 * 16 * 3 * 3
    assert toy["nvfp4_codes"]["block_scale_elements"] > 0
    assert toy["nvfp4_codes"]["differing_block_scale_elements"] == 0


def test_gptq_section_times_batches_of_experts(report):
    gptq = report["sections"]["gptq"]
    assert set(gptq["cases"]) == {"1", "2"}
    for case in gptq["cases"].values():
        assert case["shape"] == [64, 64] and positive(case["s_per_expert"])
