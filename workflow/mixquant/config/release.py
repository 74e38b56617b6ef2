"""Config sections ``published`` (the hashes `mixquant verify` compares with, and what they were made from),
``expected`` (the release's structure numbers) and ``release`` (the bundle's model card)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from mixquant.config.base import Sha256, Strict
from mixquant.numerics import DECISIVE_FIELDS


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
