"""Issue acceptance: on the trained toy, every tensor quantize_layer produced for a placement that
mixes NVFP4 W4A16 (fp8 scale sweep), FP8 (MSE) and BF16 equals what ModelOpt's own mtq.quantize +
export_hf_checkpoint writes for the same placement and algorithm, bit for bit."""

import json
from pathlib import Path

import pytest
import torch
from mixquant.calibration.tokens import load_token_ids
from mixquant.keys.manifest import read_manifest
from mixquant.model.fetch import resolve_model_dir
from mixquant.quantize.reference import modelopt_reference_export
from safetensors import safe_open

pytestmark = pytest.mark.slow


def _read_all(paths) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in paths:
        with safe_open(str(path), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _placed(wd, paths) -> tuple[dict[int, str], dict[str, dict]]:
    """The explicit checkpoint's placement (from its key preimage) and its layer x format artifacts (the
    paths also list the uniform-NVFP4 KLD candidate's layers)."""
    config = read_manifest(wd.root / paths["checkpoint"]["path"])["preimage"]["config"]
    placement = {int(layer): fmt for layer, fmt in config["placement"].items()}
    layers = {}
    for layer, fmt in placement.items():
        for name, row in paths.items():  # the quantize_layer window of that format holding the layer
            if name.startswith(f"layers/{fmt}/"):
                first, last = map(int, name.rsplit("/", 1)[1].split("-"))
                if first <= layer <= last:
                    layers[f"layer/{layer}/{fmt}"] = {
                        "window": row["path"],
                        "path": f"{row['path']}/layer_{layer}",
                    }
    assert len(layers) == len(placement)
    return placement, layers


@pytest.fixture(scope="module")
def explicit(built_workdir):
    """The default config with its explicit placement mixing all three formats, run to the export."""
    config = built_workdir.config()
    config["placement"]["source"] = "explicit"
    name = built_workdir.write_config("config/explicit.yaml", config)
    built_workdir.snakemake(built_workdir.paths(name)["checkpoint"]["path"], "--configfile", name)
    return built_workdir.paths(name)


def test_quantize_layer_equals_modelopt_export(built_workdir, explicit, tmp_path):
    wd = built_workdir
    paths = explicit
    placement, layers = _placed(wd, paths)
    assert sorted(set(placement.values())) == ["bf16", "fp8", "nvfp4_w4a16"]

    model_dir = resolve_model_dir(wd.root / paths["model"]["path"])
    ids = load_token_ids(wd.root / paths["calibration"]["path"] / "calibration.safetensors")
    config = wd.config()
    reference_dir = tmp_path / "modelopt"
    modelopt_reference_export(
        model_dir,
        ids,
        placement,
        reference_dir,
        nvfp4_algorithm=config["quantize"]["nvfp4_w4a16"]["calibration"],
        fp8_weight_algorithm=config["quantize"]["fp8"]["weight_calibration"],
        batch_size=config["quantize"]["activation_batch_size"],
    )
    reference = _read_all(sorted(reference_dir.glob("*.safetensors")))

    compared = 0
    for name, row in layers.items():
        layer = int(name.split("/")[1])
        ours = _read_all([Path(wd.root / row["path"]) / "layer.safetensors"])
        prefix = f"model.layers.{layer}.mlp.experts."
        theirs = {key for key in reference if key.startswith(prefix) and key.split(".")[5].isdigit()}
        assert set(ours) == theirs, name
        for key, tensor in ours.items():
            expected = reference[key]
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, key
            assert torch.equal(
                tensor.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
            ), key
            compared += 1
        assert read_manifest(wd.root / row["window"])["preimage"]["config"]["format"] == placement[layer]
    # 16 experts x 3 projections: BF16 1 tensor each (2 layers), NVFP4 3 (4 layers), FP8 3 (2 layers)
    assert compared == 16 * 3 * (2 * 1 + 4 * 3 + 2 * 3)


def _without_producer(data: dict) -> dict:
    data = json.loads(json.dumps(data))
    data.pop("producer", None)
    if isinstance(data.get("quantization"), dict):
        data["quantization"].pop("producer", None)
    if isinstance(data.get("quantization_config"), dict):
        data["quantization_config"].pop("producer", None)
    return data


def test_export_equals_modelopt_export_and_audit_agrees(built_workdir, explicit, tmp_path):
    """The export equals ModelOpt's export_hf_checkpoint for the same placement
    and algorithm (tensor names, dtypes, shapes, bytes; JSON apart from producer fields), and the
    audit agrees with `mixquant predict` and with an independent count from the safetensors headers."""
    wd = built_workdir
    paths = explicit
    placement, _ = _placed(wd, paths)
    model_dir = resolve_model_dir(wd.root / paths["model"]["path"])
    ids = load_token_ids(wd.root / paths["calibration"]["path"] / "calibration.safetensors")
    config = wd.config()
    reference_dir = tmp_path / "modelopt"
    modelopt_reference_export(
        model_dir,
        ids,
        placement,
        reference_dir,
        nvfp4_algorithm=config["quantize"]["nvfp4_w4a16"]["calibration"],
        fp8_weight_algorithm=config["quantize"]["fp8"]["weight_calibration"],
        batch_size=config["quantize"]["activation_batch_size"],
    )
    export_dir = wd.root / paths["checkpoint"]["path"]
    ours = _read_all(sorted(export_dir.glob("*.safetensors")))
    theirs = _read_all(sorted(reference_dir.glob("*.safetensors")))
    assert set(ours) == set(theirs)
    for key, tensor in ours.items():
        expected = theirs[key]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, key
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), key

    def load(directory, name):
        return json.loads((directory / name).read_text())

    assert _without_producer(load(export_dir, "hf_quant_config.json")) == _without_producer(
        load(reference_dir, "hf_quant_config.json")
    )
    assert load(export_dir, "hf_quant_config.json")["producer"]["numerics"]["name"] == "modelopt"
    ours_cfg = _without_producer(load(export_dir, "config.json"))
    for key, value in _without_producer(load(reference_dir, "config.json")).items():
        if key != "transformers_version":  # ModelOpt re-serialises with the installed transformers
            assert ours_cfg.get(key) == value, key

    audit = json.loads((export_dir / "checkpoint_audit.json").read_text())
    assert all(audit["agreement"].values())
    inspected = json.loads(wd.mixquant("inspect", str(export_dir), "--json").stdout)
    assert inspected["tensors"]["total"] == len(ours) == audit["predicted"]["tensors"]["total"]
    assert inspected["payload_bytes"] == sum(t.numel() * t.element_size() for t in ours.values())
    assert inspected["payload_bytes"] == audit["predicted"]["payload_bytes"]
