"""The deterministic safetensors writer (mixquant.checkpoint.writer): its files are byte for byte what
safetensors' own writer makes of the same tensors, from memory and from byte ranges of other files."""

from __future__ import annotations

import json

import torch
from byte_checks import assert_byte_identical
from mixquant.checkpoint.writer import (
    TensorRecord,
    safetensors_header,
    save_file_sorted,
    tensor_record,
    write_safetensors,
)
from safetensors import safe_open
from safetensors.torch import save, save_file


def test_writer_bytes_equal_save_file(tmp_path):
    """The streaming writer's file == safetensors.torch.save_file's, from memory and from file ranges."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.10.w": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "model.layers.2.w": torch.randn(7, generator=gen).to(torch.bfloat16),
        "scale": torch.tensor(0.25),
        "s2": torch.randn((), generator=gen).to(torch.float32),
        "packed": torch.randint(0, 255, (4, 8), generator=gen, dtype=torch.uint8),
        "fp8": torch.randn(4, 16, generator=gen).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(2, generator=gen).to(torch.float8_e5m2),
        "half": torch.randn(3, generator=gen).to(torch.float16),
        "i64": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(3, dtype=torch.int8),
        "f64": torch.randn(2, generator=gen, dtype=torch.float64),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "ü-name": torch.ones(1),
    }
    for metadata in ({"format": "pt"}, None):
        expected = save(tensors, metadata=metadata)
        ours = tmp_path / "ours.safetensors"
        write_safetensors(ours, [tensor_record(n, t) for n, t in tensors.items()], metadata=metadata)
        assert ours.read_bytes() == expected
        header, ordered = safetensors_header([tensor_record(n, t) for n, t in tensors.items()], metadata)
        assert expected.startswith(header) and len(ordered) == len(tensors)
    # the same bytes, streamed from byte ranges of another file (here: save_file's own output)
    src = tmp_path / "src.safetensors"
    save_file(tensors, str(src), metadata={"format": "pt"})
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    records = [
        TensorRecord(
            name,
            info["dtype"],
            tuple(info["shape"]),
            info["data_offsets"][1] - info["data_offsets"][0],
            path=src,
            offset=8 + n + info["data_offsets"][0],
        )
        for name, info in reversed(list(header.items()))  # input order does not matter
    ]
    write_safetensors(tmp_path / "copy.safetensors", records, fsync=False)
    assert (tmp_path / "copy.safetensors").read_bytes() == raw
    with safe_open(tmp_path / "copy.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert_byte_identical({k: handle.get_tensor(k) for k in handle.keys()}, tensors)  # noqa: SIM118


def test_save_file_sorted_equals_save_file_for_the_stages_metadata(tmp_path):
    """The stages' safetensors files (no metadata, one key, the checkpoint's): save_file's bytes."""
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "logits": torch.randn(2, 3, 5, generator=gen),
        "b": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "w": torch.randint(0, 255, (3, 8), generator=gen, dtype=torch.uint8),
    }
    for metadata in (None, {"sha256": "ab" * 32}, {"format": "pt"}):
        save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
        save_file_sorted(tensors, tmp_path / "ours.safetensors", metadata)
        assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
