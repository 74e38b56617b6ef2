"""The model card's lines on how the routed experts were made (mixquant.release.card_method): the rounding
that made the checkpoint, and what the refinement measured."""

from __future__ import annotations

from mixquant.config.quantize import QuantizeSection
from mixquant.release.card_method import numerics_line, refine_lines


def quantize_section(**nvfp4) -> dict:
    return QuantizeSection(nvfp4_w4a16=nvfp4).model_dump(mode="json")


def test_the_card_says_which_rounding_made_the_checkpoint():
    rtn = numerics_line(quantize_section())
    assert "NVFP4 rounding `rtn`" in rtn and "bit-identical to ModelOpt's own" in rtn
    gptq = numerics_line(quantize_section(rounding="gptq", gptq={"damping": 0.02, "order": "activation"}))
    assert "NVFP4 rounding `gptq`" in gptq and "bit-identical" not in gptq
    assert "damping 0.02" in gptq and "activation column order" in gptq and "fewer than 64 tokens" in gptq


def test_the_card_shows_predicted_against_measured_for_each_candidate():
    audit = {
        "candidates": [
            {
                "predicted_rank": 1,
                "measured_rank": 2,
                "predicted": 0.002,
                "measured": 0.0009,
                "effective_bits": 5.8,
            },
            {
                "predicted_rank": 2,
                "measured_rank": 1,
                "predicted": 0.0021,
                "measured": 0.0007,
                "effective_bits": 5.8,
            },
        ],
        "chosen": 2,
        "ilp_optimum": 1,
        "holdout": {"sequences": 16, "seq_len": 128, "tokens": 2048},
        "measured_reduction_vs_ilp_optimum": 1 - 0.0007 / 0.0009,
    }
    lines = "\n".join(refine_lines(audit))
    assert "predicted rank 2" in lines and "22.2 % lower" in lines and "16 held-out calibration" in lines
    assert "| 2 (kept) | 1 | 0.0021 | 0.0007 | 5.8000 |" in lines
    assert refine_lines(None) == []
