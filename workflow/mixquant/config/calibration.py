"""Config sections ``dataset``, ``calibration`` and ``prompt``: the chat data, the calibration samples
drawn from it and the hash-pinned KLD prompt."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from mixquant.config.base import Sha256, Strict
from mixquant.config.model import HubPin


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
