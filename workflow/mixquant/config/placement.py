"""Config section ``placement``: the candidate formats, the budget, and how the placement is found (the
KL-sensitivity search, with its pins and job sizes) or given (the explicit map)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from mixquant.config.base import LAYER_RANGE_PATTERN, Format, Strict, parse_layer_ranges
from mixquant.formats.facts import BF16, FORMATS


class LayerFormat(Strict):
    layers: Annotated[str, Field(pattern=LAYER_RANGE_PATTERN)] = Field(
        description="MoE layer indices, inclusive ranges: '1-39', '40,41', '43-47'."
    )
    format: Format = Field(description="Format of those layers' routed experts.")


class ExplicitPlacement(Strict):
    default_format: Format = Field(
        default=BF16, description="Format of MoE layers that no entry of `layers` names."
    )
    layers: list[LayerFormat] = Field(default_factory=list, description="Layer ranges and their formats.")

    @model_validator(mode="after")
    def _disjoint(self) -> ExplicitPlacement:
        seen: set[int] = set()
        for entry in self.layers:
            overlap = seen.intersection(parse_layer_ranges(entry.layers))
            if overlap:
                raise ValueError(f"layer {min(overlap)} is placed twice")
            seen.update(parse_layer_ranges(entry.layers))
        return self


class PlacementPin(Strict):
    layers: Annotated[str, Field(pattern=LAYER_RANGE_PATTERN)] = Field(
        description="MoE layer indices the pin applies to: '47', '1-3,47'."
    )
    format: Format = Field(description="The format those layers must take (it must be a candidate format).")


class RefineSettings(Strict):
    candidates: int = Field(
        default=8,
        ge=2,
        description="Placements measured: the ILP's K lowest predicted within the budget (and the solve's "
        "own, when another method chose it); the one with the lowest measured KL is kept.",
    )
    holdout_samples: int = Field(
        default=16,
        ge=1,
        description="Calibration sequences the candidates are measured on: drawn after the scored ones "
        "(same dataset, seed and length, none of their conversations); never the evaluation suite.",
    )


class SearchSettings(Strict):
    method: Literal["ilp", "minimax"] = Field(
        default="ilp",
        description="ilp: exact integer program (pulp CBC) minimising summed scores under the budget; "
        "minimax: ModelOpt's kl_div threshold bisection (for parity).",
    )
    calibration: Literal["rebuild", "max"] = Field(
        default="rebuild",
        description="Weights the search scores: rebuild (the very weights quantize_layer ships, with the "
        "`quantize` settings) or max (max calibration, as ModelOpt's auto_quantize searches).",
    )
    pins: list[PlacementPin] = Field(
        default_factory=list, description="Layers whose format is fixed (e.g. layer 47 stays bf16)."
    )
    batch_size: int = Field(
        default=8,
        ge=1,
        description="Calibration sequences per scoring forward (a micro-batch; with stack_branches off the "
        "scores are bit-identical to a whole-model scorer at this batch size).",
    )
    macro_batch: int | None = Field(
        default=None,
        ge=1,
        description="Calibration sequences per score_sensitivity job: one streamed pass over the weights "
        "scores every (MoE layer, format) on them, carrying the reference and every diverged branch "
        "(a multiple of batch_size). null: the largest that fits one GPU's memory (a B200's), or a CPU "
        "job's, resolved at planning (mixquant.facts.score_macro_batch).",
    )
    stack_branches: bool = Field(
        default=False,
        description="Run the live branches of a micro-batch as one stacked batch per layer (fewer, larger "
        "GEMMs: the GPU setting). false runs each branch alone: exact, bit for bit the per-layer scorer.",
    )
    checkpoint_interval_s: float | None = Field(
        default=None,
        ge=0,
        description="A score job saves its hidden states after a layer at most this often (0: every "
        "layer; null: every quarter of the wall time the job was given), so a killed job resumes from its "
        "last saved layer with identical scores. On SIGTERM (SLURM's time limit or a preemption) it also "
        "saves them after the layer it is in, then stops for the retry to resume.",
    )
    frontier_points: int = Field(
        default=25, ge=2, description="Budgets on the bits-to-KL frontier, evenly spaced min..max bits."
    )
    refine: RefineSettings | None = Field(
        default=None,
        description="Refine the solved placement by measured KL (refine_placement): each of the K best "
        "placements measured end to end with all its layers quantized, on held-out calibration sequences. "
        "null: the solve's placement ships.",
    )

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> SearchSettings:
        if self.macro_batch is not None and self.macro_batch % self.batch_size:
            raise ValueError(
                f"macro_batch {self.macro_batch} is not a multiple of batch_size {self.batch_size}"
            )
        return self


class PlacementSection(Strict):
    formats: list[Format] = Field(
        default_factory=lambda: list(FORMATS),
        min_length=1,
        description="Candidate formats for each MoE layer's routed experts.",
    )
    target_effective_bits: float = Field(
        default=6.0, gt=0, description="Budget on routed-expert effective bits (NVFP4 4.5, FP8 8, BF16 16)."
    )
    cost_model: Literal["numel", "active_moe"] = Field(
        default="numel",
        description="Bit cost per group: plain numel, or ModelOpt's active-MoE weighting (routed experts "
        "weighted by top_k / num_experts).",
    )
    recipe: str | None = Field(default=None, description="ModelOpt recipe the settings mirror (provenance).")
    source: Literal["search", "explicit"] = Field(
        default="search",
        description="search: KL-sensitivity scores + solve_placement; explicit: the `explicit` map below.",
    )
    search: SearchSettings = Field(default_factory=SearchSettings, description="The KL-sensitivity search.")
    explicit: ExplicitPlacement = Field(
        default_factory=ExplicitPlacement, description="Explicit layer -> format placement."
    )

    @model_validator(mode="after")
    def _pins_are_candidates(self) -> PlacementSection:
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"placement.formats lists a format twice: {self.formats}")
        seen: set[int] = set()
        for pin in self.search.pins:
            if pin.format not in self.formats:
                raise ValueError(
                    f"pin {pin.layers!r} -> {pin.format} is not a candidate format {self.formats}"
                )
            overlap = seen.intersection(parse_layer_ranges(pin.layers))
            if overlap:
                raise ValueError(f"layer {min(overlap)} is pinned twice")
            seen.update(parse_layer_ranges(pin.layers))
        return self
