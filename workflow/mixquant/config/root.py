"""The whole workflow configuration: every section under one root."""

from __future__ import annotations

from pydantic import Field

from mixquant.config.base import Strict
from mixquant.config.calibration import CalibrationSection, DatasetSection, PromptSection
from mixquant.config.kld import KldSection
from mixquant.config.model import ModelSection, TokenizerSection
from mixquant.config.placement import PlacementSection
from mixquant.config.quantize import ExportSection, QuantizeSection
from mixquant.config.release import ExpectedStructure, PublishedHashes, ReleaseSection
from mixquant.config.runtime import NumericsSection, SoftwareSection


class MixquantConfig(Strict):
    """The whole workflow configuration (config/config.yaml, config/laguna-s-2.1.yaml)."""

    results_dir: str = Field(
        default="results", description="Where keyed outputs land (relative to the workdir)."
    )
    allow_outside_workdir: bool = Field(
        default=False,
        description="Allow config paths (results_dir, model.local.path, model.geometry, dataset.local.path, "
        "prompt.token_ids_file, kld.candidates[].local.path, kld.eval.domains[].local.path) outside the "
        "working directory: an absolute path elsewhere, '..' climbing out, or a symlink below a top-level "
        "entry leading out. Off: "
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
