"""Typed workflow configuration: the single source of truth for config keys.

Every model forbids unknown fields, and every field has a description and a default where one
makes sense. ``workflow/schemas/config.schema.json`` is generated from these models
(``mixquant schema``; a test keeps it in sync) and Snakemake validates ``config`` against it, so
a misspelled or mistyped key is an error, never a silently ignored parameter. Errors are reported
as one line naming the key (``ConfigError``).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mixquant.model.toy_settings import ToyArchitecture, ToyOutliers, ToyTokenizer, ToyTraining

SHA256_PATTERN = r"^[0-9a-f]{64}$"
COMMIT_PATTERN = r"^[0-9a-f]{40}$"
Sha256 = Annotated[str, Field(pattern=SHA256_PATTERN)]
Format = Literal["nvfp4_w4a16", "fp8", "bf16"]
LAYER_RANGE_PATTERN = r"^\d+(-\d+)?(,\d+(-\d+)?)*$"


def parse_layer_ranges(text: str) -> list[int]:
    """'1-4,7' -> [1, 2, 3, 4, 7] (inclusive ranges, sorted, no duplicates)."""
    layers: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        start, stop = int(first), int(last or first)
        if stop < start:
            raise ValueError(f"layer range {part!r} runs backwards")
        layers.update(range(start, stop + 1))
    return sorted(layers)


class ConfigError(ValueError):
    """A config problem, reported as one line that names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------------------- model


class HubPin(Strict):
    repo: str = Field(description="Hugging Face hub repository id, e.g. 'poolside/Laguna-S-2.1'.")
    revision: str | None = Field(
        default=None,
        description="Full 40-hex commit SHA. Planning accepts null; a real run refuses an unpinned revision.",
    )

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        if value is not None and not re.match(COMMIT_PATTERN, value):
            raise ValueError(f"must be a 40-hex commit SHA, got {value!r}")
        return value


class LocalModel(Strict):
    path: str = Field(description="Directory of a Hugging Face model (config.json, safetensors shards).")
    sha256: Sha256 | None = Field(
        default=None,
        description="Content pin: SHA-256 of the directory's file inventory (every file's path, size and "
        "SHA-256; `mixquant pin-model DIR` prints it). Planning stops when the directory differs.",
    )
    toy: bool = Field(
        default=False,
        description="The directory is the embedded toy Laguna made by build_toy_model (the model card says "
        "so); the default config ships it in data/toy-laguna.",
    )


class ToyModel(Strict):
    arch: ToyArchitecture = Field(default_factory=ToyArchitecture, description="Toy Laguna geometry.")
    tokenizer: ToyTokenizer = Field(default_factory=ToyTokenizer, description="Toy BPE tokenizer.")
    training: ToyTraining = Field(default_factory=ToyTraining, description="Toy training run.")
    outliers: ToyOutliers = Field(
        default_factory=ToyOutliers,
        description="Outlier channels applied after training so that MoE layers differ in NVFP4 sensitivity.",
    )
    seed: int = Field(
        default=0, description="Seed for initialisation and data order (training is deterministic)."
    )
    threads: int = Field(default=2, ge=1, description="torch CPU threads for training (part of the key).")
    num_shards: int = Field(default=2, ge=2, description="Safetensors shards of the saved BF16 checkpoint.")


class ModelSection(Strict):
    source: Literal["toy", "hub", "local"] = Field(
        default="toy",
        description="toy: build and train the embedded Laguna (build_toy_model); hub: pinned hub "
        "revision (fetch_model); local: a local model directory identified by content (fetch_model).",
    )
    toy: ToyModel = Field(default_factory=ToyModel, description="Settings of the embedded toy model.")
    hub: HubPin | None = Field(default=None, description="The BF16 weights on the hub (source: hub).")
    local: LocalModel | None = Field(default=None, description="The BF16 weights on disk (source: local).")
    trust_remote_code: bool = Field(
        default=False, description="Allow the model's own code; only honoured with a pinned hub revision."
    )
    geometry: str | None = Field(
        default=None,
        description="The config.json of a hub/local model (a path relative to the working directory): "
        "planning (resources and cost estimates) reads the geometry from it without the weights.",
    )
    moe_layers: Annotated[str, Field(pattern=LAYER_RANGE_PATTERN)] | None = Field(
        default=None,
        description="MoE layer indices of a real model, e.g. '1-47' (planning needs them without weights); "
        "derived from the geometry for the toy.",
    )

    @model_validator(mode="after")
    def _selected_present(self) -> ModelSection:
        if self.source == "hub" and self.hub is None:
            raise ValueError("source is 'hub' but model.hub is not set")
        if self.source == "local" and self.local is None:
            raise ValueError("source is 'local' but model.local is not set")
        if self.source != "toy" and self.moe_layers is None:
            raise ValueError("model.moe_layers must name the MoE layers of a real model (e.g. '1-47')")
        if self.trust_remote_code and (self.source != "hub" or self.hub is None or self.hub.revision is None):
            raise ValueError("trust_remote_code needs a hub source with a pinned revision")
        return self


class TokenizerSection(Strict):
    source: Literal["model", "hub"] = Field(
        default="model", description="model: the tokenizer files of the model; hub: a pinned hub revision."
    )
    hub: HubPin | None = Field(default=None, description="Tokenizer repository and revision (source: hub).")

    @model_validator(mode="after")
    def _selected_present(self) -> TokenizerSection:
        if self.source == "hub" and self.hub is None:
            raise ValueError("source is 'hub' but tokenizer.hub is not set")
        return self


# --------------------------------------------------------------------------------------- dataset


class LocalDataset(Strict):
    path: str = Field(description="Chat JSONL file: one {'messages': [{'role', 'content'}, ...]} per line.")
    sha256: Sha256 = Field(description="SHA-256 of the file's bytes; the file is checked before use.")


class HubDatasetMember(Strict):
    repo: str = Field(description="Hub dataset repository id.")
    revision: str | None = Field(
        default=None, description="40-hex commit SHA; a real run refuses an unpinned dataset."
    )
    name: str | None = Field(default=None, description="Dataset configuration name, if any.")
    splits: list[str] = Field(
        default_factory=lambda: ["train"], min_length=1, description="Splits to draw from."
    )

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        return HubPin._commit(value)


class DatasetSection(Strict):
    source: Literal["local", "hub"] = Field(
        default="local", description="local: a pinned JSONL; hub: members."
    )
    local: LocalDataset | None = Field(default=None, description="The local chat JSONL (source: local).")
    hub: list[HubDatasetMember] | None = Field(
        default=None,
        description="Hub datasets (source: hub); samples are split evenly across members, "
        "like ModelOpt's dataset combos.",
    )
    messages_field: str = Field(default="messages", description="Column holding the chat messages.")

    @model_validator(mode="after")
    def _selected_present(self) -> DatasetSection:
        if self.source == "local" and self.local is None:
            raise ValueError("source is 'local' but dataset.local is not set")
        if self.source == "hub" and not self.hub:
            raise ValueError("source is 'hub' but dataset.hub lists no member")
        return self


class CalibrationSection(Strict):
    num_samples: int = Field(default=64, ge=1, description="Calibration samples N.")
    seq_len: int = Field(default=256, ge=2, description="Tokens per sample T.")
    seed: int = Field(default=0, description="Seed of the sample order.")
    short_policy: Literal["pack", "skip"] = Field(
        default="pack",
        description="Conversations shorter than seq_len: pack (concatenate with the next) or skip.",
    )


class PromptSection(Strict):
    seq_len: int = Field(default=512, ge=2, description="Prompt length T in tokens (KLD uses T-1 positions).")
    source: Literal["chat_sample", "token_ids_file"] = Field(
        default="chat_sample",
        description="chat_sample: a conversation of the dataset through the chat template; "
        "token_ids_file: a safetensors (input_ids) or JSON list of token IDs.",
    )
    sample_index: int = Field(default=0, ge=0, description="Conversation index (source: chat_sample).")
    token_ids_file: str | None = Field(default=None, description="Token-ID file (source: token_ids_file).")
    sha256: Sha256 | None = Field(
        default=None,
        description="Pinned SHA-256 of the prompt token IDs (int32 little-endian); a mismatch stops the run.",
    )

    @model_validator(mode="after")
    def _selected_present(self) -> PromptSection:
        if self.source == "token_ids_file" and not self.token_ids_file:
            raise ValueError("source is 'token_ids_file' but prompt.token_ids_file is not set")
        return self


# ------------------------------------------------------------- later stages (recorded, validated)


class LayerFormat(Strict):
    layers: Annotated[str, Field(pattern=LAYER_RANGE_PATTERN)] = Field(
        description="MoE layer indices, inclusive ranges: '1-39', '40,41', '43-47'."
    )
    format: Format = Field(description="Format of those layers' routed experts.")


class ExplicitPlacement(Strict):
    default_format: Format = Field(
        default="bf16", description="Format of MoE layers that no entry of `layers` names."
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
        "(a multiple of batch_size). null: the largest that fits the device's memory by the cost model "
        "(mixquant.costs.score_macro_batch).",
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

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> SearchSettings:
        if self.macro_batch is not None and self.macro_batch % self.batch_size:
            raise ValueError(
                f"macro_batch {self.macro_batch} is not a multiple of batch_size {self.batch_size}"
            )
        return self


class PlacementSection(Strict):
    formats: list[Format] = Field(
        default_factory=lambda: ["nvfp4_w4a16", "fp8", "bf16"],
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


class Nvfp4Params(Strict):
    calibration: Literal["fp8_sweep", "mse", "max"] = Field(
        default="fp8_sweep",
        description="Per-16-block E4M3 scales: fp8_sweep (ModelOpt mse + fp8_scale_sweep over the 126 E4M3 "
        "codes), mse (ModelOpt's multiplier search 0.25..4.0), max (block amax).",
    )


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
    kv_cache_quant: Literal["fp8"] | None = Field(
        default=None,
        description="fp8: write static k_scale/v_scale per layer from the activation statistics "
        "(kv_cache_quant_algo FP8); null: no KV-cache scales.",
    )

    @model_validator(mode="after")
    def _one_shard_rule(self) -> ExportSection:
        if self.num_shards is not None and self.max_shard_bytes is not None:
            raise ValueError("set num_shards or max_shard_bytes, not both")
        return self


class KldCandidate(Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")] = Field(
        description="Candidate name (lowercase, digits, '._-'): names its outputs and table rows."
    )
    source: Literal["searched", "uniform", "explicit", "bf16", "hub", "local"] = Field(
        description="searched: the placement the search chose; uniform: every MoE layer in `format`; "
        "explicit: the `explicit` map; bf16: the BF16 source model itself (a self-check); hub / local: an "
        "external checkpoint (pinned revision / directory pinned by content)."
    )
    format: Format | None = Field(default=None, description="uniform: the format of every MoE layer.")
    explicit: ExplicitPlacement | None = Field(default=None, description="explicit: the layer -> format map.")
    hub: HubPin | None = Field(default=None, description="hub: the checkpoint's repository and revision.")
    local: LocalModel | None = Field(default=None, description="local: the checkpoint directory.")

    @model_validator(mode="after")
    def _fields_for_source(self) -> KldCandidate:
        needs = {"uniform": "format", "explicit": "explicit", "hub": "hub", "local": "local"}
        for source, name in needs.items():
            if (self.source == source) != (getattr(self, name) is not None):
                raise ValueError(
                    f"candidate {self.name!r}: `{name}` is "
                    + ("required" if self.source == source else f"only for source {source!r}")
                )
        return self


def _default_candidates() -> list[KldCandidate]:
    return [
        KldCandidate(name="searched", source="searched"),
        KldCandidate(name="uniform-nvfp4", source="uniform", format="nvfp4_w4a16"),
        KldCandidate(name="bf16", source="bf16"),
    ]


class KldGates(Strict):
    max_mean_kld: float | None = Field(
        default=None, gt=0, description="Largest allowed mean KLD (mean over the runs), per candidate x KV."
    )
    max_run_spread: float | None = Field(
        default=None, ge=0, description="Largest allowed spread (max - min) of the runs' mean KLD."
    )
    min_improvement: float | None = Field(
        default=None,
        description="Required reduction of mean KLD vs the baseline (0.2 = 20%), judged on the lower "
        "bound of its paired bootstrap confidence interval; not applied to the baseline itself.",
    )
    bootstrap_samples: int = Field(default=10000, ge=100, description="Paired bootstrap resamples.")
    confidence: float = Field(default=0.95, gt=0, lt=1, description="Confidence level of the interval.")
    gated: list[str] | None = Field(
        default=None, description="Candidates the gates apply to (default: all but the baseline)."
    )


class KldSection(Strict):
    engine: Literal["hf", "vllm"] = Field(
        default="hf", description="Engine for reference and candidate logits."
    )
    runs: int = Field(default=5, ge=1, description="Fresh-engine runs per candidate and KV dtype.")
    kv_cache_dtypes: list[Literal["bfloat16", "fp8"]] = Field(
        default_factory=lambda: ["bfloat16", "fp8"], min_length=1, description="KV-cache variants."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="Tensor parallel size (vllm).")
    dtype: Literal["bfloat16"] = Field(default="bfloat16", description="Compute dtype.")
    enforce_eager: bool = Field(default=True, description="Eager execution (no CUDA graphs).")
    seed: int = Field(default=0, description="Engine seed.")
    enable_prefix_caching: bool = Field(default=False, description="Prefix caching (off for the protocol).")
    max_model_len: int | None = Field(
        default=None, ge=2, description="vllm: context length to reserve (Laguna's config says 1M)."
    )
    candidates: list[KldCandidate] = Field(
        default_factory=_default_candidates, min_length=1, description="Checkpoints compared to BF16."
    )
    baseline: str | None = Field(
        default="uniform-nvfp4", description="Name of the candidate the others are compared with."
    )
    gates: KldGates = Field(default_factory=KldGates, description="Verdict rules.")

    @model_validator(mode="after")
    def _names(self) -> KldSection:
        names = [c.name for c in self.candidates]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"candidate name {duplicated[0]!r} is used twice")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not a candidate ({', '.join(names)})")
        for name in self.gates.gated or []:
            if name not in names:
                raise ValueError(f"gates.gated names {name!r}, which is not a candidate")
        if len(set(self.kv_cache_dtypes)) != len(self.kv_cache_dtypes):
            raise ValueError(f"kv_cache_dtypes lists a dtype twice: {self.kv_cache_dtypes}")
        return self


class MadeFrom(Strict):
    """What the published hashes were made from (`mixquant verify --made-from` prints it for a config)."""

    prompt: Sha256 | None = Field(
        default=None, description="Recipe of the pin_prompt output the prompt token IDs were read from."
    )
    reference_logits: Sha256 | None = Field(
        default=None, description="Recipe of the reference_logits output the reference logits were read from."
    )
    checkpoint: Sha256 | None = Field(
        default=None,
        description="Recipe of the export_checkpoint output hf_quant_config.json and the index came from.",
    )
    settings: dict[str, Annotated[str, Field(pattern="^[0-9a-f]{16}$")]] | None = Field(
        default=None,
        description="Short hash (16 hex) of each config section of the published config: names the sections "
        "that differ when a recipe is not the published one.",
    )


class PublishedHashes(Strict):
    """What `mixquant verify` and verify_hashes compare with; null: not pinned. Enters only their key."""

    prompt_token_ids: Sha256 | None = Field(
        default=None, description="SHA-256 of the prompt token IDs (little-endian int32, no header)."
    )
    reference_logits: Sha256 | None = Field(
        default=None,
        description="SHA-256 of the BF16 reference logits (float32 [T-1, V], little-endian, no header).",
    )
    quant_config: Sha256 | None = Field(
        default=None, description="SHA-256 of the exported hf_quant_config.json's bytes."
    )
    safetensors_index: Sha256 | None = Field(
        default=None, description="SHA-256 of the exported model.safetensors.index.json's bytes."
    )
    numerics: dict[str, Any] | None = Field(
        default=None,
        description="The decisive numerics fingerprint the published reference logits were made under (a "
        "release's numerics.json: device, profile, threads, cpu_capability, mkl_cbwr, mkldnn, libraries, "
        "python). A reference-logits mismatch under a different fingerprint is reported 'not reproducible "
        "bit for bit here' and passes (`mixquant verify --strict` fails); under an equal one, or with null "
        "(unknown), it fails.",
    )
    made_from: MadeFrom | None = Field(
        default=None,
        description="The recipe (the key without code and package versions) of each artifact the hashes were "
        "read from. A hash of an artifact this config makes from another recipe (another budget, more "
        "calibration samples) is 'not comparable', with the config sections that differ, and passes; null: "
        "every pinned hash is compared.",
    )
    strict: bool = Field(
        default=False,
        description="verify_hashes fails as `mixquant verify --strict` does: on a not comparable hash and on "
        "reference logits not reproducible bit for bit here.",
    )

    @field_validator("numerics")
    @classmethod
    def _decisive_fingerprint(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # A mistyped field would make the fingerprints differ and so excuse a logits mismatch: refuse it.
        from mixquant.numerics import DECISIVE_FIELDS

        if value is None:
            return None
        if "decisive" in value:
            raise ValueError("give the fingerprint's decisive part (a release's numerics.json), not all")
        unknown = sorted(set(value) - set(DECISIVE_FIELDS))
        if unknown:
            known = ", ".join(DECISIVE_FIELDS)
            raise ValueError(f"unknown fingerprint field {unknown[0]!r} (known: {known})")
        if "device" not in value:
            raise ValueError("the fingerprint names no device")
        return value


class PlacementCounts(Strict):
    nvfp4_w4a16: int = Field(ge=0, description="MoE layers whose routed experts are NVFP4 W4A16.")
    fp8: int = Field(ge=0, description="MoE layers whose routed experts are FP8.")
    bf16: int = Field(ge=0, description="MoE layers whose routed experts stay BF16.")


class ExpectedStructure(Strict):
    placement_counts: PlacementCounts | None = Field(
        default=None, description="Routed-expert formats per layer."
    )
    routed_effective_bits: float | None = Field(default=None, description="Effective routed-expert bits.")
    tensors: int | None = Field(default=None, ge=0, description="Tensors in the exported checkpoint.")
    payload_bytes: int | None = Field(default=None, ge=0, description="Sum of tensor bytes.")
    audited_bytes: int | None = Field(default=None, ge=0, description="Audited on-disk bytes of the release.")
    shards: int | None = Field(default=None, ge=1, description="Safetensors shards.")


HUB_REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"  # namespace/name


class ReleaseSection(Strict):
    name: str | None = Field(
        default=None,
        description="Name of the release: the model card's title. Default: the name part of `repo_id`, else "
        "derived from the source model and the placement.",
    )
    repo_id: Annotated[str, Field(pattern=HUB_REPO_ID_PATTERN)] | None = Field(
        default=None,
        description="Hugging Face repository id the release is uploaded to ('org/name'): the model card's "
        "`vllm serve` commands name it. null: the card names a placeholder `<your-org>/<name>` and "
        "`mixquant plan` warns.",
    )
    license: str = Field(
        default="other",
        description="Model card `license` (a Hugging Face license identifier); the base model's license "
        "applies to a quantized release.",
    )
    license_name: str | None = Field(
        default=None, description="Model card `license_name` (with license: other), e.g. 'psf-2.0'."
    )
    license_link: str | None = Field(
        default=None,
        description="Model card `license_link`: where the license text is (a URL). The Hub expects it with "
        "license: other; `mixquant plan` warns when it is missing there.",
    )


# -------------------------------------------------------------------------------------- numerics


class NumericsSection(Strict):
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="Where the forward stages (collect_activation_stats, score_sensitivity, the hf engine's "
        "reference_logits and run_kld) and quantize_layer compute: cpu, cuda or cuda:N. Streamed a decoder "
        "layer at a time on either. The device type and its numerics enter those stages' keys (the "
        "rebuild keeps ModelOpt's export numerics on every device).",
    )
    cpu: Literal["portable", "native"] = Field(
        default="portable",
        description="CPU numerics profile of every process that computes on CPU (mixquant.numerics): "
        "portable pins ATen's CPU capability (AVX2), oneDNN off, MKL_CBWR=COMPATIBLE and the thread count, "
        "so any x86-64 host with AVX2 (Intel or AMD, with or without AVX512) gives the same bits; native "
        "leaves the host's defaults (faster; the host's ISA then enters the keys). GPU runs are unaffected.",
    )
    threads: int = Field(
        default=1,
        ge=1,
        description="Intra-op threads of every computing process (torch, OpenMP, MKL); part of the profile "
        "and of the keys. One thread per job lets Snakemake run jobs side by side.",
    )


# -------------------------------------------------------------------------------------- software


class SoftwareSection(Strict):
    deployment: Literal["auto", "conda", "venv"] = Field(
        default="auto",
        description="Where jobs run, which decides the package versions in every key: conda (the "
        "environments Snakemake builds from envs/quant.yaml and envs/serve.yaml: their exact pins and file "
        "hashes enter the keys), venv (the Python environment Snakemake runs in: its installed versions), "
        "or auto (as Snakemake deploys: conda under --sdm conda or a profile that sets it, else venv; "
        "`mixquant` commands follow their --profile). A run deployed otherwise than a conda or venv setting "
        "says stops at planning.",
    )
    vllm_python: str | None = Field(
        default=None,
        description="venv deployment with kld.engine: vllm: the Python of a separate venv that has vLLM "
        "(vLLM pins its own torch and transformers, so it cannot share mixquant's venv). The vLLM stages run "
        "their engine there, and its package versions enter their keys. null: vLLM must be importable where "
        "Snakemake runs. Not used under conda (envs/serve.yaml has vLLM).",
    )


# ------------------------------------------------------------------------------------------ root


class MixquantConfig(Strict):
    """The whole workflow configuration (config/config.yaml, config/laguna-s-2.1.yaml)."""

    results_dir: str = Field(
        default="results", description="Where keyed outputs land (relative to the workdir)."
    )
    allow_outside_workdir: bool = Field(
        default=False,
        description="Allow config paths (results_dir, model.local.path, model.geometry, dataset.local.path, "
        "prompt.token_ids_file, kld.candidates[].local.path) outside the working directory: an absolute "
        "path elsewhere, '..' climbing out, or a symlink below a top-level entry leading out. Off: "
        "planning refuses such a path with one line naming the key.",
    )
    model: ModelSection = Field(default_factory=ModelSection, description="The BF16 source model.")
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection, description="Tokenizer source.")
    dataset: DatasetSection = Field(description="Chat dataset for calibration (and chat-sample prompts).")
    calibration: CalibrationSection = Field(
        default_factory=CalibrationSection, description="Calibration data."
    )
    prompt: PromptSection = Field(default_factory=PromptSection, description="The hash-pinned KLD prompt.")
    placement: PlacementSection = Field(default_factory=PlacementSection, description="Placement search.")
    quantize: QuantizeSection = Field(default_factory=QuantizeSection, description="Rebuild numerics.")
    export: ExportSection = Field(default_factory=ExportSection, description="The exported checkpoint.")
    kld: KldSection = Field(default_factory=KldSection, description="KLD protocol.")
    numerics: NumericsSection = Field(
        default_factory=NumericsSection, description="CPU numerics profile (same bits on any AVX2 host)."
    )
    software: SoftwareSection = Field(
        default_factory=SoftwareSection,
        description="Where jobs run (conda environments or this venv): the package versions in the keys.",
    )
    published: PublishedHashes = Field(
        default_factory=PublishedHashes,
        description="Published SHA-256 values: `mixquant verify` and verify_hashes compare with them "
        "(null: not pinned).",
    )
    expected: ExpectedStructure = Field(
        default_factory=ExpectedStructure, description="Structure numbers the release is expected to have."
    )
    release: ReleaseSection = Field(
        default_factory=ReleaseSection, description="The release bundle's model card (assemble_release)."
    )


# ------------------------------------------------------------------------------------ validation


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names allowed at `loc` (for 'did you mean' hints); empty if it cannot be resolved."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        current = None
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            for inner in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    current = inner
    return list(getattr(current, "model_fields", {}))


def _one_line(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(part) for part in loc) or "(root)"
    if first["type"] == "extra_forbidden":
        allowed = _known_fields(MixquantConfig, loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        suggestion = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (hint[0],))}'?" if hint else ""
        return f"{source}: unknown config key '{key}'{suggestion}"
    if first["type"] == "missing":
        return f"{source}: missing config key '{key}'"
    if "input" in first and first["input"] is None and loc:
        return f"{source}: config key '{key}' cannot be null: give it a value"
    message = first["msg"].replace("Value error, ", "")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    more = len(error.errors()) - 1
    return f"{source}: config key '{key}': {message}{shown}" + (f" [+{more} more]" if more else "")


# YAML's null spellings. Snakemake reads a --config value as YAML with every scalar a string (its
# BaseLoader: 'published={quant_config: null}' gives the string 'null'), so a string spelled so means null.
YAML_NULLS = frozenset({"null", "Null", "NULL", "~"})


def with_yaml_nulls(value: Any) -> Any:
    """`value` with every string spelled as YAML null (:data:`YAML_NULLS`) replaced by None, recursively."""
    if isinstance(value, dict):
        return {key: with_yaml_nulls(item) for key, item in value.items()}
    if isinstance(value, list):
        return [with_yaml_nulls(item) for item in value]
    return None if isinstance(value, str) and value in YAML_NULLS else value


def validate_config(raw: dict[str, Any], source: str = "config") -> MixquantConfig:
    """Validate a raw config mapping; raise ConfigError with one line naming the offending key.

    ``null`` or ``~`` (also as a ``--config`` string) unsets a nullable key; a key that cannot be null
    set so is one line naming it.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(raw).__name__}")
    try:
        return MixquantConfig.model_validate(with_yaml_nulls(raw))
    except ValidationError as error:
        raise ConfigError(_one_line(error, source)) from None


def load_config_file(path: str | Path) -> MixquantConfig:
    return validate_config(read_config_file(path), str(path))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's mapping as written (not validated); a missing file or bad YAML is one line."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML: {problem}{where}") from None
    return raw or {}


def select_workflow_config(
    merged: dict[str, Any], cli_configfiles: list[str] | None, cli_config: dict[str, Any] | None
) -> dict[str, Any]:
    """The config the user meant, from what Snakemake hands the Snakefile.

    Snakemake *merges* ``--configfile`` files over the Snakefile's default ``configfile:``, which
    would mix the toy default's sections into the real model's config. When config files are given
    on the command line they replace the default; ``--config`` overrides still apply.
    """
    if cli_configfiles:
        return dict(cli_config or {})
    return merged


def json_schema() -> dict[str, Any]:
    """JSON schema of the config (draft 2020-12) with additionalProperties: false on every object."""
    schema = MixquantConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mixquant workflow configuration"
    return schema


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    found = []
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        for inner in (candidate, *getattr(candidate, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in found:
                found.append(inner)
    return found


def config_keys_markdown(model: type[BaseModel] = MixquantConfig, prefix: str = "") -> list[str]:
    """Table rows `| key | default | description |` for every key, depth first (config/README.md)."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _submodels(field.annotation)
        if field.is_required():
            default = "required"
        elif nested and field.default_factory is not None:
            default = "(section)"
        else:
            value = field.get_default(call_default_factory=True)
            default = f"`{value!r}`" if not isinstance(value, BaseModel) else "(section)"
        rows.append(f"| `{key}` | {default} | {field.description or ''} |")
        for sub in nested:
            rows.extend(config_keys_markdown(sub, key + "."))
    return rows
