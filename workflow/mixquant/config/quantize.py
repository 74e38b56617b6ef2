"""Config sections ``quantize`` (the rebuild's numerics and job sizes) and ``export`` (the checkpoint's shards
and KV-cache scales)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mixquant.config.base import Strict
from mixquant.formats.facts import KV_CACHE_FORMATS


class GptqSettings(Strict):
    damping: float = Field(
        default=0.01,
        gt=0,
        le=1,
        description="Added to the Hessian's diagonal, as a fraction of its mean (llm-compressor's "
        "dampening_frac).",
    )
    block_size: int = Field(
        default=128, ge=1, description="Columns per lazy batch update of the error feedback."
    )
    order: Literal["natural", "activation"] = Field(
        default="natural",
        description="Column order: natural, or activation (descending Hessian diagonal, GPTQ's act-order; "
        "the block scales stay with their columns).",
    )
    min_tokens: int = Field(
        default=64,
        ge=1,
        description="An expert the router sent fewer calibration tokens is rounded to nearest (the audit "
        "lists it): its Hessian would be fitted to too few inputs.",
    )


class Nvfp4Params(Strict):
    calibration: Literal["fp8_sweep", "mse", "max"] = Field(
        default="fp8_sweep",
        description="Per-16-block E4M3 scales: fp8_sweep (ModelOpt mse + fp8_scale_sweep over the 126 E4M3 "
        "codes), mse (ModelOpt's multiplier search 0.25..4.0), max (block amax).",
    )
    rounding: Literal["rtn", "gptq"] = Field(
        default="rtn",
        description="Which E2M1 code each element takes under those scales: rtn (round to nearest, "
        "ModelOpt's export) or gptq (each routed expert's rounding error fed forward through the inverse "
        "Hessian of the tokens the router sent it in calibration; same scales, same tensors).",
    )
    gptq: GptqSettings = Field(
        default_factory=GptqSettings, description="GPTQ rounding's settings (read with rounding: gptq)."
    )

    def rebuild_params(self) -> dict:
        """What a quantize_layer job reads of these settings (and its key holds): the GPTQ settings only
        with gptq rounding, so an unused knob moves nothing, and rtn keeps the slice it has always had."""
        if self.rounding == "rtn":
            return {"calibration": self.calibration}
        return self.model_dump(mode="json")


class Fp8Params(Strict):
    weight_calibration: Literal["mse", "max"] = Field(
        default="mse",
        description="Per-tensor weight scale: mse (ModelOpt's multiplier sweep) or max (amax/448).",
    )


class QuantizeSection(Strict):
    nvfp4_w4a16: Nvfp4Params = Field(default_factory=Nvfp4Params, description="NVFP4 W4A16 parameters.")
    fp8: Fp8Params = Field(default_factory=Fp8Params, description="FP8 W8A8 (static) parameters.")
    activation_batch_size: int = Field(
        default=8, ge=1, description="Sequences per forward when collecting activation statistics."
    )
    layers_per_job: int | None = Field(
        default=None,
        ge=1,
        description="MoE layers per quantize_layer job, in fixed windows of the MoE layer list (one job "
        "quantizes its window's every layer in one format); null: all MoE layers in one job per format. "
        "1 gives the widest cluster fan-out.",
    )


class ExportSection(Strict):
    num_shards: int | None = Field(
        default=None, ge=1, description="Safetensors shards of the export (whole layers per shard)."
    )
    max_shard_bytes: int | None = Field(
        default=None, ge=1, description="Or: maximum bytes per shard (default 5 GB when neither is set)."
    )
    kv_cache_quant: Literal[KV_CACHE_FORMATS] | None = Field(
        default=None,
        description="fp8: write static k_scale/v_scale per layer from the activation statistics "
        "(kv_cache_quant_algo FP8); null: no KV-cache scales.",
    )

    @model_validator(mode="after")
    def _one_shard_rule(self) -> ExportSection:
        if self.num_shards is not None and self.max_shard_bytes is not None:
            raise ValueError("set num_shards or max_shard_bytes, not both")
        return self
