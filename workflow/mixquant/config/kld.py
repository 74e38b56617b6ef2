"""Config section ``kld``: the KLD protocol (engine, runs, KV-cache variants), the candidates compared with
the BF16 reference, and the gates that judge them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from mixquant.config.base import Format, Strict
from mixquant.config.model import HubPin, LocalModel
from mixquant.config.placement import ExplicitPlacement


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
