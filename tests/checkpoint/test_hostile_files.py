"""Hostile and broken checkpoint files: each refused with one line naming the file, before any tensor byte
is read or anything is allocated for a declared size; a fuzzer (hypothesis) over headers and bytes finds
nothing else escaping (only CheckpointError, or a file that reads back exactly as declared)."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixquant.checkpoint.headers import DTYPE_BYTES, CheckpointError, check_inside, read_safetensors_header
from mixquant.checkpoint.shards import ShardReader
from mixquant.jsonio import read_json
from mixquant.model.families import UnsupportedArchitecture, architecture
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every machine: CI time is bounded and failures reproduce
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def raw_shard(path: Path, header: object | bytes, data: bytes = b"") -> Path:
    """A file in the safetensors layout: 8-byte little-endian header length, the header, the data."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def one_line_refusal(call, path_hint: str | Path, exc_type=CheckpointError) -> str:
    """Run ``call``: it raises ``exc_type`` with one line naming ``path_hint``, allocating < 4 MiB."""
    tracemalloc.start()
    try:
        with pytest.raises(exc_type) as error:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert "\n" not in message and str(path_hint) in message, message
    assert peak < 4 << 20, f"{peak} bytes allocated before refusing"
    return message


HOSTILE_HEADERS = {
    "overlapping ranges": (
        {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)},
        12,
        "overlaps a",
    ),
    "a gap between ranges": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, 12, "gap of 4"),
    "range beyond the file": ({"a": entry("F32", [4], 0, 16)}, 8, "truncated"),
    "huge dimension product": ({"a": entry("BF16", [1 << 40, 1 << 40], 0, 8)}, 8, "byte range [0, 8)"),
    "negative dimension": ({"a": entry("F32", [-2, -1], 0, 8)}, 8, "header entry for a"),
    "float offsets": ({"a": entry("F32", [1], 0.0, 4.0)}, 4, "header entry for a"),
    "boolean dimension": ({"a": entry("F32", [True], 0, 4)}, 4, "header entry for a"),
    "unknown dtype": ({"a": entry("F128", [1], 0, 16)}, 16, "unknown dtype 'F128'"),
    "nine dimensions": ({"a": entry("U8", [1] * 9, 0, 1)}, 1, "9 dimensions"),
    "extra entry keys": ({"a": {**entry("U8", [1], 0, 1), "offset": 7}}, 1, "header entry for a"),
    "entry that is a list": ({"a": [0, 1]}, 1, "header entry for a"),
    "header that is a list": ([1, 2, 3], 0, "not a JSON object"),
    "metadata that is not strings": (
        {"__metadata__": {"x": 1}, "a": entry("U8", [1], 0, 1)},
        1,
        "__metadata__",
    ),
    "bytes after the last tensor": ({"a": entry("U8", [1], 0, 1)}, 9, "8 bytes after the last tensor"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_a_hostile_header_is_one_line_before_any_read(tmp_path, case):
    header, data_bytes, expected = HOSTILE_HEADERS[case]
    path = raw_shard(tmp_path / "model.safetensors", header, b"\0" * data_bytes)
    message = one_line_refusal(lambda: read_safetensors_header(path), path)
    assert expected in message
    # the reader refuses the same file when it maps the checkpoint, before reading a byte of data
    if isinstance(header, dict):
        one_line_refusal(lambda: ShardReader(tmp_path).check_all(), path)


@pytest.mark.parametrize(
    "blob, expected",
    [
        (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}', "duplicate name 'a'"),
        (b'{"a": \xff\xfe}', "corrupt safetensors header"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b'{"a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_001, "nested too deeply"),
    ],
    ids=["duplicated names", "non-UTF-8", "deeply nested list", "deeply nested objects"],
)
def test_a_header_that_is_not_plain_json_is_one_line(tmp_path, blob, expected):
    path = raw_shard(tmp_path / "model.safetensors", blob, b"\0")
    assert expected in one_line_refusal(lambda: read_safetensors_header(path), path)


def test_a_header_length_beyond_the_limit_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    assert "header of" in one_line_refusal(lambda: read_safetensors_header(path), path)


# -------------------------------------------------------------------------- paths that leave the model


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"model.embed_tokens.weight": torch.arange(6, dtype=torch.float32)}, model / "s1.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "s1.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", ""]
)
def test_an_index_naming_a_shard_outside_the_directory_is_refused(checkpoint, shard):
    (checkpoint.parent / "outside.safetensors").write_bytes((checkpoint / "s1.safetensors").read_bytes())
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
    message = one_line_refusal(lambda: ShardReader(checkpoint), index)
    assert "not a file in" in message


def test_symlinks_that_leave_the_model_directory_are_refused(checkpoint, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((checkpoint / "s1.safetensors").read_bytes())
    (checkpoint / "s1.safetensors").unlink()
    (checkpoint / "s1.safetensors").symlink_to(outside)
    message = one_line_refusal(lambda: ShardReader(checkpoint), checkpoint)
    assert "shard s1.safetensors leaves the model directory" in message
    # the index itself as a link out of the directory
    moved = tmp_path / "index.json"
    os.replace(checkpoint / "model.safetensors.index.json", moved)
    (checkpoint / "model.safetensors.index.json").symlink_to(moved)
    assert "index model.safetensors.index.json leaves" in one_line_refusal(
        lambda: ShardReader(checkpoint), checkpoint
    )
    # planning hashes a local model for its key only once no link leaves it
    from mixquant.checkpoint.headers import check_links_inside
    from mixquant.cli import main

    assert "leaves the model directory" in one_line_refusal(
        lambda: check_links_inside(checkpoint), checkpoint
    )
    assert main(["pin-model", str(checkpoint)]) == 2


def test_the_hub_cache_layout_links_into_its_blobs(tmp_path):
    """snapshots/<rev>/file -> ../../blobs/<sha> is how the Hugging Face cache stores every file."""
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("c" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file({"w": torch.ones(3)}, blobs / "1234")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/1234"))
    reader = ShardReader(snapshot)
    assert torch.equal(reader.read(["w"])["w"], torch.ones(3))
    assert check_inside(snapshot, "model.safetensors") == snapshot / "model.safetensors"


# ---------------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    "key, value",
    [("num_hidden_layers", 10**9), ("hidden_size", 1 << 40), ("num_experts", -1), ("vocab_size", "big")],
)
def test_a_config_with_absurd_sizes_is_refused_before_transformers_builds_it(tmp_path, key, value):
    config = json.loads((REPO / "data" / "models" / "qwen3-235b-a22b" / "config.json").read_text())
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: architecture(tmp_path), f"config.json {key}", UnsupportedArchitecture)
    assert "is not a whole number in 1.." in message


def test_json_files_too_large_nested_or_repeated_are_one_line(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:  # sparse: the size is checked before a byte is read
        handle.truncate((64 << 20) + 1)
    assert "larger than mixquant reads" in one_line_refusal(lambda: read_json(big), big, ValueError)
    repeated = tmp_path / "config.json"
    repeated.write_text('{"model_type": "qwen3_moe", "model_type": "laguna"}')
    assert "duplicate name 'model_type'" in one_line_refusal(
        lambda: architecture(tmp_path), repeated, UnsupportedArchitecture
    )


# ---------------------------------------------------------------------------------------------- fuzzing

DTYPES = sorted(DTYPE_BYTES)
names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)
shapes = st.lists(st.integers(min_value=-2, max_value=6), max_size=4)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPES, "F128", ""]),
        "shape": shapes,
        "data_offsets": st.lists(st.integers(min_value=-4, max_value=300), min_size=0, max_size=3),
    }
)


def reads_back_or_is_refused(path: Path) -> None:
    """Either every tensor reads back with its declared shape and bytes, or one CheckpointError line."""
    try:
        header = read_safetensors_header(path)
    except CheckpointError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        return
    reader = ShardReader(path.parent)
    loaded = reader.read(list(header)) if all(h["dtype"] != "F8_E8M0" for h in header.values()) else {}
    for name, tensor in loaded.items():
        begin, end = header[name]["data_offsets"]
        assert list(tensor.shape) == header[name]["shape"]
        assert tensor.numel() * tensor.element_size() == end - begin


@FUZZ
@given(header=st.dictionaries(names, entries, max_size=4), data=st.binary(max_size=300))
def test_fuzzed_headers_read_back_or_are_refused(tmp_path, header, data):
    reads_back_or_is_refused(raw_shard(tmp_path / "model.safetensors", header, data))


@FUZZ
@given(position=st.integers(min_value=0, max_value=10_000), byte=st.integers(min_value=0, max_value=255))
def test_a_flipped_byte_anywhere_in_a_real_shard_reads_back_or_is_refused(tmp_path, position, byte):
    path = tmp_path / "model.safetensors"
    save_file(
        {"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5, dtype=torch.float32)},
        path,
    )
    blob = bytearray(path.read_bytes())
    blob[position % len(blob)] = byte
    path.write_bytes(bytes(blob))
    reads_back_or_is_refused(path)
