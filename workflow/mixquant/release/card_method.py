"""Model-card lines on how the routed experts were made: the NVFP4 rounding and the placement's refinement
by measured KL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["numerics_line", "refine_lines"]


def numerics_line(quantize: Mapping[str, Any]) -> str:
    """How the routed experts were rounded: round-to-nearest (ModelOpt's export, bit for bit) or GPTQ."""
    nvfp4 = quantize["nvfp4_w4a16"]
    scales = (
        f"- Numerics: NVFP4 W4A16 block scales `{nvfp4['calibration']}`, FP8 weight scales "
        f"`{quantize['fp8']['weight_calibration']}` with static input scales from activation statistics"
    )
    if nvfp4.get("rounding", "rtn") == "rtn":
        return (
            f"{scales}; NVFP4 rounding `rtn` (round to nearest): bit-identical to ModelOpt's own "
            "`mtq.quantize` + `export_hf_checkpoint`."
        )
    gptq = nvfp4["gptq"]
    return (
        f"{scales}; NVFP4 rounding `gptq`: each routed expert's E2M1 codes chosen by GPTQ against the "
        f"calibration tokens its router sent it (damping {gptq['damping']:g}, block size "
        f"{gptq['block_size']}, {gptq['order']} column order; experts with fewer than "
        f"{gptq['min_tokens']} tokens rounded to nearest), under the same block scales as ModelOpt's "
        "export, so the tensors and "
        "`hf_quant_config.json` are exactly the format ModelOpt writes and vLLM loads."
    )


def refine_lines(refine: Mapping[str, Any] | None) -> list[str]:
    """What the refinement measured (``refine_audit.json``): predicted against measured per candidate."""
    if refine is None:
        return []
    candidates = refine["candidates"]
    chosen = candidates[refine["chosen"] - 1]
    optimum = candidates[refine["ilp_optimum"] - 1]
    holdout = refine["holdout"]
    lines = [
        "",
        f"Refined by measured KL: the {len(candidates)} best placements the ILP predicts within the budget, "
        f"each measured with all its layers quantized on {holdout['sequences']} held-out calibration "
        f"sequences of {holdout['seq_len']} tokens (never the evaluation suite); kept: the candidate of "
        f"predicted rank {chosen['predicted_rank']}, measured KL per token {chosen['measured']:.6g} against "
        f"the ILP optimum's {optimum['measured']:.6g} "
        f"({100 * refine['measured_reduction_vs_ilp_optimum']:.1f} % lower; `refine_audit.json`).",
        "",
        "| predicted rank | measured rank | predicted KL/token | measured KL/token | effective bits |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c in candidates:
        mark = " (kept)" if c is chosen else ""
        lines.append(
            f"| {c['predicted_rank']}{mark} | {c['measured_rank']} | {c['predicted']:.6g} | "
            f"{c['measured']:.6g} | {c['effective_bits']:.4f} |"
        )
    return lines
