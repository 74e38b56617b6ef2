"""The CLI surface: predict on the committed Laguna-S-2.1 config, one-line errors, explain."""

import json
from pathlib import Path

from mixquant.cli import main
from mixquant.jsonio import diff_values

REPO = Path(__file__).resolve().parents[1]
LAGUNA = str(REPO / "data/models/laguna-s-2.1/config.json")


def test_predict_reference_release(capsys):
    assert (
        main(
            [
                "predict",
                "--model-config",
                LAGUNA,
                "--placement-counts",
                "nvfp4_w4a16=39,fp8=3,bf16=5",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"]["total"] == 101_377
    assert report["payload_bytes"] == 92_433_871_744
    assert round(report["routed_effective_bits"], 4) == 5.9468


def test_predict_bad_counts_is_one_line(capsys):
    assert main(["predict", "--model-config", LAGUNA, "--placement-counts", "nvfp4=39"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixquant: ") and "\n" not in err


def test_inspect_missing_directory_is_one_line(capsys, tmp_path):
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nowhere" in err and "\n" not in err


def test_explain_diff_names_leaf_paths():
    a = {"config": {"calibration": {"num_samples": 64, "seed": 0}}, "upstream": {"model": "a" * 64}}
    b = {"config": {"calibration": {"num_samples": 16, "seed": 0}}, "upstream": {"model": "a" * 64}}
    assert diff_values(a, b) == [("config.calibration.num_samples", 64, 16)]
