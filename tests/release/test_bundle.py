"""assemble_release on synthetic keyed outputs: layout, hardlinks, manifest, card and one-line refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mixquant.config import load_config_file
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.manifest import verify_manifest, write_manifest
from mixquant.release.bundle import ReleaseInputError, run_assemble_release
from mixquant.release.card import parse_front_matter
from mixquant.release.recipe import load_recipe, recipe_document

REPO = Path(__file__).resolve().parents[2]
PLACEMENT = {layer: "nvfp4_w4a16" for layer in range(1, 5)} | {5: "fp8", 6: "fp8", 7: "bf16", 8: "bf16"}
CANDIDATES = ("searched", "uniform-nvfp4", "bf16")
KV = ("bfloat16", "fp8")


def _json(path: Path, data) -> None:
    path.write_text(json.dumps(data), "utf-8")


def _gate(candidate, kv):
    reduction = 0.25 if candidate != "uniform-nvfp4" else None
    return {
        "candidate": candidate,
        "source": candidate,
        "kv_cache_dtype": kv,
        "aggregate": {"runs": 5, "mean_kld": 0.01, "run_spread": 0.0, "identical_runs": True, "summary": {}},
        "improvement": None if reduction is None else {"reduction": 0.25, "ci_low": 0.2, "ci_high": 0.3},
        "verdict": {"passed": True, "checks": []},
    }


@pytest.fixture
def upstream(release_dirs, make_keyed_dir):
    """Keyed outputs of every stage the release reads, each with a manifest."""
    checkpoint = release_dirs["checkpoint"]
    (checkpoint / "model-00001-of-00001.safetensors").write_bytes(b"\x08" + bytes(15))
    _json(checkpoint / "config.json", {"model_type": "laguna"})
    _json(checkpoint / "tokenizer.json", {"model": {}})
    counts = {"nvfp4_w4a16": 4, "fp8": 2, "bf16": 2}
    inspection = {
        "placement_counts": counts,
        "routed_effective_bits": 8.25,
        "tensors": {"routed": {"nvfp4_w4a16": 12, "fp8": 6, "bf16": 2}, "total": 40},
        "payload_bytes": 16,
        "shards": [{"file": "model-00001-of-00001.safetensors"}],
        "layer_formats": {str(layer): fmt for layer, fmt in PLACEMENT.items()},
    }
    producer = {"name": "mixquant", "version": "0.1.0", "numerics": {"name": "modelopt", "version": "0.47.0"}}
    audit = {"producer": producer, "inspection": inspection, "agreement": {"tensors": True}}
    _json(checkpoint / "checkpoint_audit.json", audit)
    dirs = {
        "model": make_keyed_dir("build_toy_model", "model"),
        "checkpoint": checkpoint,
        "prompt": release_dirs["prompt"],
        "reference": release_dirs["reference_logits"],
        "verdict": make_keyed_dir("check_kld_gates", "verdict"),
    }
    _json(dirs["verdict"] / "verdict.json", {"passed": True, "verdicts": [{}] * 6})
    for candidate in CANDIDATES:
        for kv in KV:
            gate = make_keyed_dir("gate_kld", f"{candidate}/{kv}")
            _json(gate / "aggregate.json", _gate(candidate, kv))
            dirs[f"gate_{candidate}_{kv}"] = gate
    for directory in dirs.values():
        write_manifest(directory, {"label": directory.name})
    return dirs


def _release(upstream, tmp_path, **changes):
    recipe = recipe_document(load_config_file(REPO / "config/config.yaml"), PLACEMENT)
    keys = {role: Path(path).name for role, path in upstream.items()}
    preimage = {"stage": "assemble_release", "config": {"recipe": recipe}, "upstream": keys}
    out = tmp_path / "results" / "assemble_release" / canonical_sha256(preimage)
    inputs = {role: str(path) for role, path in upstream.items()} | changes
    return run_assemble_release(out, settings={"recipe": recipe}, preimage=preimage, **inputs)


def test_release_layout_card_recipe_and_manifest(upstream, tmp_path):
    keyed = _release(upstream, tmp_path)
    out = keyed / "repo"  # what is published: only a model repository's files, the bookkeeping beside it
    assert sorted(p.name for p in keyed.iterdir()) == ["manifest.json", "repo"]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        [
            "README.md",
            "checkpoint_audit.json",
            "config.json",
            "hf_quant_config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json",
            "numerics.json",
            "quantization_recipe.yaml",
            "reference/logits.safetensors",
            "reference/reference.json",
            "tokenizer.json",
            *(f"kld/{c}.{kv}.json" for c in CANDIDATES for kv in KV),
        ]
    )
    assert verify_manifest(keyed) == []
    shard = "model-00001-of-00001.safetensors"
    assert os.path.samefile(out / shard, upstream["checkpoint"] / shard)  # hardlinked, not copied
    gate = json.loads((out / "kld/searched.fp8.json").read_text())
    assert gate == json.loads((upstream["gate_searched_fp8"] / "aggregate.json").read_text())
    card = (out / "README.md").read_text()
    assert parse_front_matter(card)["quantization"]["routed_effective_bits"] == 8.25
    assert "`kld/bf16.fp8.json`" in card and "`quantization_recipe.yaml`" in card
    recipe = load_recipe(out / "quantization_recipe.yaml")
    assert recipe.placement.source == "explicit"
    summary = json.loads((keyed / "manifest.json").read_text())["summary"]
    assert set(summary["hashes"]) == {
        "prompt_token_ids",
        "reference_logits",
        "quant_config",
        "safetensors_index",
    }
    assert summary["hashes"]["quant_config"] in card  # the card quotes the re-derived hashes


def test_release_ships_the_reference_logits_and_the_decisive_fingerprint(upstream, tmp_path, decisive):
    from mixquant.release.hashes import reference_logits_hash
    from mixquant.release.verify import published_logits

    keyed = _release(upstream, tmp_path)
    out = keyed / "repo"
    reference = upstream["reference"]
    assert os.path.samefile(out / "reference/logits.safetensors", reference / "logits.safetensors")
    assert json.loads((out / "numerics.json").read_text()) == decisive  # what published.numerics takes
    shipped = json.loads((out / "reference/reference.json").read_text())
    recorded = json.loads((reference / "reference.json").read_text())
    assert shipped["sha256"] == recorded["sha256"] == reference_logits_hash(reference).sha256
    # no host details in the release: only the fingerprint's decisive part
    assert shipped["numerics"] == {"decisive": decisive} and "host" in recorded["numerics"]
    assert shipped["engine"]["numerics"] == {"decisive": decisive}
    assert json.loads((keyed / "manifest.json").read_text())["summary"]["numerics"] == decisive
    # `mixquant verify --against RELEASE` finds the logits and the fingerprint there (the published repo
    # or the keyed directory around it)
    for against in (out, keyed):
        logits, _, numerics = published_logits(against)
        assert logits == out / "reference/logits.safetensors" and numerics == decisive
    card = (out / "README.md").read_text()
    assert "- Numerics fingerprint of the BF16 reference logits (`numerics.json`" in card
    assert "ATen CPU capability AVX2" in card and "AMD EPYC" not in card
    assert "`reference/logits.safetensors`" in card and "`numerics.json`" in card
    assert _release(upstream, tmp_path / "again").joinpath("repo", "README.md").read_text() == card


def test_a_reference_without_a_fingerprint_is_refused(upstream, tmp_path, release_dirs, reference_writer):
    reference_writer(upstream["reference"], release_dirs["logits"], numerics=None)
    with pytest.raises(ReleaseInputError, match=r"^reference_logits [0-9a-f]{64}: reference.json records no"):
        _release(upstream, tmp_path)


def test_a_failed_verdict_is_refused_with_one_line(upstream, tmp_path):
    (upstream["verdict"] / "verdict.json").write_text(json.dumps({"passed": False}))
    with pytest.raises(ReleaseInputError, match=r"check_kld_gates [0-9a-f]{64}: the KLD gates did not pass"):
        _release(upstream, tmp_path)
    assert not (tmp_path / "results" / "assemble_release").exists()  # refused before anything is written


def test_missing_gate_and_unfinished_inputs_are_named(upstream, tmp_path):
    gates = {role: path for role, path in upstream.items() if role != "gate_bf16_fp8"}
    with pytest.raises(ReleaseInputError, match="no gate_kld input for bf16 / fp8"):
        _release(gates, tmp_path)
    (upstream["checkpoint"] / "manifest.json").unlink()
    with pytest.raises(ReleaseInputError, match=r"export_checkpoint .*: not a finished mixquant output"):
        _release(upstream, tmp_path)
    with pytest.raises(ValueError, match="expected 64 lowercase hex digits"):
        _release(upstream, tmp_path, checkpoint=str(tmp_path / "not-a-key"))
