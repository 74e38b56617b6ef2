"""Byte-for-byte comparison of tensor dicts, shared by the writer, export and quantize tests."""

from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_byte_identical(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype, name
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(as_bytes(ours[name]), as_bytes(tensor)), name
