"""`mixquant predict` with its defaults, on the toy's config.json and the placement the default run chose,
predicts the toy's export exactly: every tensor name of its index, and its payload bytes."""

from __future__ import annotations

import json

import pytest
from mixquant.checkpoint.shards import read_safetensors_header

pytestmark = pytest.mark.slow


def test_predict_defaults_describe_the_toy_export(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    checkpoint = wd.root / paths["checkpoint"]["path"]
    placement = wd.root / paths["placement"]["path"] / "placement.json"
    out = wd.mixquant(
        "predict", "--model-config", "data/toy-laguna/config.json", "--placement", str(placement), "--json"
    )
    prediction = json.loads(out.stdout)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert prediction["tensors"]["kv_scales"] == 0
    assert prediction["tensors"]["total"] == len(index["weight_map"])
    payload = 0
    for shard in sorted(set(index["weight_map"].values())):
        header = read_safetensors_header(checkpoint / shard)
        payload += sum(
            info["data_offsets"][1] - info["data_offsets"][0]
            for name, info in header.items()
            if name != "__metadata__"
        )
    assert prediction["payload_bytes"] == payload
