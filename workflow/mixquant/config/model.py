"""Config sections ``model`` and ``tokenizer``: the BF16 source model (the embedded toy, a pinned hub
revision or a local directory pinned by content) and its tokenizer."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from mixquant.config.base import COMMIT_PATTERN, LAYER_RANGE_PATTERN, Sha256, Strict
from mixquant.model.toy_settings import ToyArchitecture, ToyOutliers, ToyTokenizer, ToyTraining


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
