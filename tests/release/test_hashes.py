"""The four release hashes re-derived from keyed artifacts: golden encodings, sources, one-line errors."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from mixquant.calibration.tokens import save_token_ids
from mixquant.release.hashes import (
    HASH_NAMES,
    HashSourceError,
    prompt_token_ids_hash,
    quant_config_hash,
    reference_logits_hash,
    release_hashes,
    safetensors_index_hash,
)


def test_prompt_hash_is_little_endian_int32_without_header(release_dirs):
    record = prompt_token_ids_hash(release_dirs["prompt"])
    golden = hashlib.sha256(np.asarray(release_dirs["ids"].numpy(), dtype="<i4").tobytes()).hexdigest()
    assert record.sha256 == golden
    assert record.artifact.stage == "pin_prompt" and record.artifact.file == "prompt.safetensors"
    assert record.artifact.key == release_dirs["prompt"].name
    assert "int32 little-endian" in record.encoding and "token_ids_sha256" in record.encoding


def test_prompt_hash_ignores_a_leading_batch_dimension(release_dirs, make_keyed_dir):
    batched = make_keyed_dir("pin_prompt", "batched")
    save_token_ids(batched / "prompt.safetensors", release_dirs["ids"][None, :], {})
    assert prompt_token_ids_hash(batched).sha256 == prompt_token_ids_hash(release_dirs["prompt"]).sha256


def test_reference_logits_hash_is_float32_little_endian_row_major(release_dirs):
    record = reference_logits_hash(release_dirs["reference_logits"])
    golden = hashlib.sha256(np.asarray(release_dirs["logits"].numpy(), dtype="<f4").tobytes()).hexdigest()
    assert record.sha256 == golden
    assert (record.artifact.stage, record.artifact.file) == ("reference_logits", "logits.safetensors")
    assert "float32 little-endian" in record.encoding and "logits_sha256" in record.encoding


def test_reference_logits_are_rehashed_not_copied_from_the_record(release_dirs):
    document_path = release_dirs["reference_logits"] / "reference.json"
    document = json.loads(document_path.read_text())
    document["sha256"] = "a" * 64
    document_path.write_text(json.dumps(document))
    with pytest.raises(
        HashSourceError, match=r"^reference_logits [0-9a-f]{64}: logits.safetensors hashes to"
    ):
        reference_logits_hash(release_dirs["reference_logits"])


def test_checkpoint_hashes_are_the_files_bytes(release_dirs):
    checkpoint = release_dirs["checkpoint"]
    quant, index = quant_config_hash(checkpoint), safetensors_index_hash(checkpoint)
    assert quant.sha256 == hashlib.sha256((checkpoint / "hf_quant_config.json").read_bytes()).hexdigest()
    assert (
        index.sha256 == hashlib.sha256((checkpoint / "model.safetensors.index.json").read_bytes()).hexdigest()
    )
    assert (
        quant.artifact.file == "hf_quant_config.json"
        and index.artifact.file == "model.safetensors.index.json"
    )
    assert quant.artifact.stage == index.artifact.stage == "export_checkpoint"
    # one byte more (a trailing newline) is a different hash: bytes, not parsed JSON
    path = checkpoint / "hf_quant_config.json"
    path.write_bytes(path.read_bytes() + b"\n")
    assert quant_config_hash(checkpoint).sha256 != quant.sha256


def test_release_hashes_returns_the_four_in_published_order(release_dirs):
    records = release_hashes(
        release_dirs["prompt"], release_dirs["reference_logits"], release_dirs["checkpoint"]
    )
    assert tuple(records) == HASH_NAMES
    assert all(name == record.name for name, record in records.items())
    as_json = records["quant_config"].to_json()
    assert as_json["artifact"]["key"] == release_dirs["checkpoint"].name
    assert set(as_json) == {"name", "kind", "sha256", "artifact", "encoding"}
    # token IDs and file bytes are content; the float logits are numerical (they follow the numerics)
    assert {name: record.kind for name, record in records.items()} == {
        "prompt_token_ids": "content",
        "reference_logits": "numerical",
        "quant_config": "content",
        "safetensors_index": "content",
    }
    json.dumps({name: record.to_json() for name, record in records.items()})


def test_missing_file_is_one_line_naming_stage_and_file(release_dirs):
    (release_dirs["checkpoint"] / "model.safetensors.index.json").unlink()
    with pytest.raises(
        HashSourceError, match=r"^export_checkpoint [0-9a-f]{64}: model.safetensors.index.json not"
    ):
        safetensors_index_hash(release_dirs["checkpoint"])


def test_a_directory_that_is_not_keyed_is_refused(tmp_path):
    (tmp_path / "not-a-key").mkdir()
    with pytest.raises(ValueError, match="expected 64 lowercase hex digits"):
        quant_config_hash(tmp_path / "not-a-key")


def test_reference_logits_without_a_logits_tensor(make_keyed_dir):
    from safetensors.torch import save_file

    directory = make_keyed_dir("reference_logits", "empty")
    save_file({"other": torch.zeros(2)}, str(directory / "logits.safetensors"))
    with pytest.raises(HashSourceError, match="has no 'logits' tensor"):
        reference_logits_hash(directory)
