"""Config section ``kld``: the KLD protocol (engine, runs, KV-cache variants), the candidates compared with
the BF16 reference, and the gates that judge them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from mixquant.config.base import Format, Strict
from mixquant.config.calibration import LocalDataset
from mixquant.config.model import HubPin, LocalModel
from mixquant.config.placement import ExplicitPlacement

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


class KldCandidate(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)] = Field(
        description="Candidate name (lowercase, digits, '._-'): names its outputs and table rows."
    )
    source: Literal["searched", "modelopt_autoquantize", "uniform", "explicit", "bf16", "hub", "local"] = (
        Field(
            description="searched: the placement the search chose; modelopt_autoquantize: the placement "
            "ModelOpt's own auto_quantize (method kl_div) picks over `placement.formats` at the same routed "
            "effective-bits target and cost model, rebuilt and exported by the same stages; uniform: every "
            "MoE layer in `format`; explicit: the `explicit` map; bf16: the BF16 source model itself (a "
            "self-check); hub / local: an external checkpoint (pinned revision / content-pinned directory)."
        )
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


class EvalHubDataset(Strict):
    repo: str = Field(description="Hub dataset repository id.")
    revision: str | None = Field(
        default=None, description="40-hex commit SHA; a real run refuses an unpinned dataset."
    )
    name: str | None = Field(default=None, description="Dataset configuration name, if any.")
    split: str = Field(default="train", description="Split to draw windows from.")

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        return HubPin._commit(value)


class EvalDomain(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)] = Field(
        description="Domain name (lowercase, digits, '._-'): names its rows, intervals and CDF curve."
    )
    local: LocalDataset | None = Field(
        default=None, description="A local JSONL file pinned by its SHA-256 (one document per line)."
    )
    hub: EvalHubDataset | None = Field(default=None, description="A hub dataset at a pinned revision.")
    text_field: str | None = Field(
        default=None, description="Column holding plain-text documents (tokenized as is)."
    )
    messages_field: str | None = Field(
        default=None,
        description="Column holding chat documents ([{role, content}, ...]), rendered through the chat "
        "template as calibration renders them.",
    )
    windows: int = Field(
        ge=1, description="Windows drawn from this domain: each the first T tokens of a document."
    )

    @model_validator(mode="after")
    def _one_source_one_field(self) -> EvalDomain:
        if (self.local is None) == (self.hub is None):
            raise ValueError(f"eval domain {self.name!r}: give exactly one of `local` and `hub`")
        if (self.text_field is None) == (self.messages_field is None):
            raise ValueError(
                f"eval domain {self.name!r}: give exactly one of `text_field` and `messages_field`"
            )
        return self


class EvalSuite(Strict):
    window_tokens: int = Field(
        default=512, ge=2, description="Tokens per window T (each window scores T-1 positions)."
    )
    seed: int = Field(
        default=0, description="Seed of each domain's document order (which documents are drawn)."
    )
    domains: list[EvalDomain] = Field(min_length=1, description="The suite's domains, each a pinned source.")
    reference: Literal["full", "topk"] = Field(
        default="full",
        description="How the BF16 reference is stored: full (float32 logits of every position, exact KL) or "
        "topk (the top_k log-probabilities, the tail mass and its entropy term per position: KL with a "
        "stated per-position bound, 1/64 of the storage at top_k 1024 and a 131K vocabulary).",
    )
    top_k: int = Field(default=1024, ge=1, description="topk: reference log-probabilities kept per position.")
    reference_captures: int = Field(
        default=2,
        ge=1,
        description="Reference captures, each a fresh engine: the KL between them is the runtime noise floor "
        "(exactly 0 on the deterministic hf engine).",
    )

    @model_validator(mode="after")
    def _names(self) -> EvalSuite:
        names = [d.name for d in self.domains]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"eval domain name {duplicated[0]!r} is used twice")
        return self


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
    max_domain_regression: float | None = Field(
        default=0.0,
        description="Suite: largest allowed per-domain regression vs the baseline (0.0: no domain's mean KLD "
        "may exceed the baseline's; null: not checked).",
    )
    max_engine_floor: float | None = Field(
        default=None,
        ge=0,
        description="Largest allowed engine floor: the mean KLD of the bf16 candidate with a BF16 KV cache "
        "through the gated engine against the reference path (needs a bf16 candidate).",
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
    eval: EvalSuite | None = Field(
        default=None,
        description="The evaluation suite the gates judge: windows over named domains, disjoint from the "
        "calibration sample. Null: the gates judge the pinned prompt (one window).",
    )

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
