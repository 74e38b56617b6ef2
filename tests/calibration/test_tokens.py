"""Canonical token-ID hashing and safetensors storage."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from mixquant.calibration.tokens import (
    load_token_ids,
    load_token_ids_metadata,
    save_token_ids,
    token_ids_bytes,
    token_ids_sha256,
)

# Computed independently: numpy '<i4' (little-endian int32) bytes in C order, hashed with hashlib.
GOLDEN_IDS = [[1, 2, 3], [256, -1, 2**31 - 1]]
GOLDEN_SHA = hashlib.sha256(np.asarray(GOLDEN_IDS, dtype="<i4").tobytes(order="C")).hexdigest()


def test_golden_value_matches_independent_little_endian_int32_hash():
    ids = torch.tensor(GOLDEN_IDS, dtype=torch.int64)
    assert token_ids_sha256(ids) == GOLDEN_SHA
    # written out by hand: little-endian int32, row-major, no header
    manual = b"".join(v.to_bytes(4, "little", signed=True) for row in GOLDEN_IDS for v in row)
    assert token_ids_bytes(ids) == manual
    assert token_ids_sha256(ids) == hashlib.sha256(manual).hexdigest()


def test_shape_is_not_hashed_and_dtype_does_not_matter():
    ids = torch.tensor(GOLDEN_IDS, dtype=torch.int32)
    assert token_ids_sha256(ids.flatten()) == GOLDEN_SHA
    assert token_ids_sha256(ids.reshape(1, -1)) == GOLDEN_SHA
    assert token_ids_sha256(ids.to(torch.int64)) == GOLDEN_SHA
    small = torch.tensor([1, 2, 300])
    assert token_ids_sha256(small.to(torch.uint16)) == token_ids_sha256(small.to(torch.int64))


def test_non_contiguous_input_hashes_in_logical_row_major_order():
    ids = torch.tensor([[1, 4], [2, 5], [3, 6]], dtype=torch.int32).t()  # logically [[1,2,3],[4,5,6]]
    assert not ids.is_contiguous()
    assert token_ids_sha256(ids) == token_ids_sha256(torch.tensor([1, 2, 3, 4, 5, 6]))


def test_order_matters():
    assert token_ids_sha256(torch.tensor([1, 2])) != token_ids_sha256(torch.tensor([2, 1]))


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
        torch.tensor([0, 2**31], dtype=torch.int64),
        torch.tensor([-(2**31) - 1], dtype=torch.int64),
        torch.tensor([2**40], dtype=torch.uint64),
        [1, 2, 3],
    ],
)
def test_rejects_non_integer_or_out_of_range(bad):
    with pytest.raises(ValueError) as err:
        token_ids_sha256(bad)
    assert "\n" not in str(err.value)


def test_save_load_roundtrip(tmp_path):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int64)
    path = tmp_path / "sub" / "calib.safetensors"
    sha = save_token_ids(path, ids, {"seed": "0", "tokenizer": "tiny"})
    assert sha == token_ids_sha256(ids)
    loaded = load_token_ids(path)
    assert loaded.dtype == torch.int32
    assert loaded.shape == (2, 4)
    assert torch.equal(loaded, ids.to(torch.int32))
    assert load_token_ids_metadata(path) == {"seed": "0", "tokenizer": "tiny"}
    assert [p.name for p in path.parent.iterdir()] == ["calib.safetensors"]  # no temp file left behind
    # safetensors, not pickle: the file starts with an 8-byte little-endian header length then JSON
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and len(raw) > 8 + header_len


def test_save_rejects_non_string_metadata(tmp_path):
    with pytest.raises(ValueError, match="str keys and values"):
        save_token_ids(tmp_path / "x.safetensors", torch.tensor([1]), {"seed": 0})  # type: ignore[dict-item]
    assert not list(tmp_path.iterdir())


def test_load_rejects_file_without_input_ids(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"labels": torch.tensor([1, 2], dtype=torch.int32)}, str(path))
    with pytest.raises(ValueError, match="no 'input_ids' tensor"):
        load_token_ids(path)


def test_load_rejects_garbage(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_token_ids(path)
