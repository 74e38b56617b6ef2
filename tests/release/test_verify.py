"""Published hashes compared: match / mismatch / not pinned, the logits comparison, the stage and its key."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from mixquant.config import validate_config
from mixquant.keys.artifacts import resolve_artifacts
from mixquant.keys.manifest import read_manifest
from mixquant.release.hashes import HASH_NAMES, HashSourceError, release_hashes
from mixquant.release.verify import (
    MATCH,
    MISMATCH,
    NOT_PINNED,
    HashMismatchError,
    VerifyInputError,
    format_report,
    mismatch_line,
    run_verify_hashes,
    verify_artifacts,
    verify_dirs,
)

REPO = Path(__file__).resolve().parents[2]


def sources(dirs):
    return {name: dirs[name] for name in ("prompt", "reference_logits", "checkpoint")}


def actual(dirs):
    records = release_hashes(dirs["prompt"], dirs["reference_logits"], dirs["checkpoint"])
    return {name: record.sha256 for name, record in records.items()}


def test_all_four_match(release_dirs):
    report = verify_dirs(actual(release_dirs), **sources(release_dirs))
    assert report.ok and [c.status for c in report.checks] == [MATCH] * 4
    assert [c.name for c in report.checks] == list(HASH_NAMES)
    document = report.to_json()
    assert document["counts"] == {MATCH: 4, MISMATCH: 0, NOT_PINNED: 0}
    assert document["hashes"]["quant_config"]["artifact"]["file"] == "hf_quant_config.json"
    assert format_report(report).splitlines()[-1] == "4 match, 0 mismatch, 0 not pinned"


@pytest.mark.parametrize("changed", HASH_NAMES)
def test_one_changed_published_hash_is_the_only_mismatch(release_dirs, changed):
    published = actual(release_dirs)
    got = published[changed]
    published[changed] = "0" * 64
    report = verify_dirs(published, **sources(release_dirs))
    assert not report.ok
    statuses = {c.name: c.status for c in report.checks}
    assert statuses == {name: MISMATCH if name == changed else MATCH for name in HASH_NAMES}
    (mismatch,) = report.mismatches
    assert (mismatch.expected, mismatch.got) == ("0" * 64, got)
    line = mismatch_line(report)
    assert "\n" not in line and f"{changed} is {got}, published {'0' * 64}" in line
    text = format_report(report)
    assert f"{changed}: mismatch" in text and mismatch.record.encoding in text
    assert text.splitlines()[-1] == "3 match, 1 mismatch, 0 not pinned"


def test_unpinned_hashes_are_reported_not_pinned(release_dirs):
    published = actual(release_dirs)
    published["prompt_token_ids"] = None
    report = verify_dirs(published, **sources(release_dirs))
    assert report.ok
    assert [c.status for c in report.checks] == [NOT_PINNED, MATCH, MATCH, MATCH]
    assert report.checks[0].got is not None  # computed all the same, to pin it


def test_missing_file_is_an_error_only_when_pinned(release_dirs):
    (release_dirs["checkpoint"] / "hf_quant_config.json").unlink()  # an all-BF16 export writes none
    published = dict.fromkeys(HASH_NAMES)
    report = verify_dirs(published, **sources(release_dirs))
    check = next(c for c in report.checks if c.name == "quant_config")
    assert check.status == NOT_PINNED and check.got is None and "hf_quant_config.json not found" in check.note
    json.dumps(report.to_json())
    format_report(report)
    published["quant_config"] = "1" * 64
    with pytest.raises(HashSourceError, match="^export_checkpoint .*hf_quant_config.json not found"):
        verify_dirs(published, **sources(release_dirs))


def test_malformed_published_value_names_the_field(release_dirs):
    published = actual(release_dirs)
    published["safetensors_index"] = "ABC"
    with pytest.raises(ValueError, match=r"^published.safetensors_index: expected 64 lowercase hex"):
        verify_dirs(published, **sources(release_dirs))


def _published_logits(release_dirs, make_keyed_dir, reference_writer, delta: float):
    """A second reference_logits output: ours with one logit moved by `delta` and a different engine."""
    theirs = release_dirs["logits"].clone()
    theirs[2, 3] += delta
    directory = make_keyed_dir("reference_logits", "published")
    sha = reference_writer(directory, theirs, engine={"engine": "hf", "device": "cuda:0", "threads": 2})
    return directory, sha, theirs


def _kl(p_logits, q_logits):
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_logits_mismatch_reports_how_close_the_published_logits_are(
    release_dirs, make_keyed_dir, reference_writer
):
    theirs_dir, sha, theirs = _published_logits(release_dirs, make_keyed_dir, reference_writer, 0.25)
    published = actual(release_dirs)
    published["reference_logits"] = sha
    report = verify_dirs(published, **sources(release_dirs), results_dir=release_dirs["results"])
    comparison = report.logits_comparison
    assert comparison["found"] and comparison["against"] == str(theirs_dir)
    assert comparison["against_is_published"] is True
    assert comparison["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert comparison["positions"] == 5
    assert comparison["mean_kl"] == pytest.approx(_kl(theirs, release_dirs["logits"]), rel=1e-5)
    assert comparison["mean_kl"] > 0
    assert comparison["engine_differences"] == [
        {"field": "engine.device", "published": "cuda:0", "ours": "cpu"}
    ]
    text = format_report(report)
    assert "max |diff| 0.25" in text and 'engine.device: published "cuda:0", ours "cpu"' in text
    json.dumps(report.to_json())


def test_logits_mismatch_without_the_published_logits_says_so(release_dirs):
    published = actual(release_dirs)
    published["reference_logits"] = "2" * 64
    report = verify_dirs(published, **sources(release_dirs), results_dir=release_dirs["results"])
    assert report.logits_comparison["found"] is False
    assert "no reference_logits output" in report.logits_comparison["note"]
    assert "--against" in format_report(report)


def test_against_compares_with_the_given_directory(release_dirs, make_keyed_dir, reference_writer):
    theirs_dir, _, _ = _published_logits(release_dirs, make_keyed_dir, reference_writer, -1.0)
    published = actual(release_dirs)
    published["reference_logits"] = "3" * 64  # the given logits are not the published ones: said so
    report = verify_dirs(published, **sources(release_dirs), against=theirs_dir)
    comparison = report.logits_comparison
    assert comparison["found"] and comparison["against_is_published"] is False
    assert comparison["max_abs_diff"] == pytest.approx(1.0, abs=1e-6)
    assert "NOT the published hash" in format_report(report)
    with pytest.raises(VerifyInputError, match="--against .*: no logits.safetensors"):
        verify_dirs(published, **sources(release_dirs), against=release_dirs["checkpoint"])


def test_stage_writes_verify_json_on_match_and_nothing_on_mismatch(release_dirs, tmp_path):
    from mixquant.keys.canonical import canonical_sha256

    published = actual(release_dirs)
    preimage = {"stage": "verify_hashes", "config": {"published": published}}
    out = tmp_path / "results" / "verify_hashes" / canonical_sha256(preimage)
    run_verify_hashes(out, **sources(release_dirs), settings={"published": published}, preimage=preimage)
    document = json.loads((out / "verify.json").read_text())
    assert document["ok"] is True and document["counts"][MATCH] == 4
    assert read_manifest(out)["summary"]["counts"][MATCH] == 4

    published["quant_config"] = "4" * 64
    preimage = {"stage": "verify_hashes", "config": {"published": published}}
    out = tmp_path / "results" / "verify_hashes" / canonical_sha256(preimage)
    with pytest.raises(
        HashMismatchError, match=r"^published hash mismatch: quant_config is [0-9a-f]{64}, publ"
    ):
        run_verify_hashes(out, **sources(release_dirs), settings={"published": published}, preimage=preimage)
    assert not out.exists() and not list(out.parent.glob(".tmp-*"))


def test_unbuilt_artifact_names_its_stage(release_dirs):
    def art(path, done=True):
        return SimpleNamespace(path=path, done=done)

    artifacts = {
        "prompt": art(release_dirs["prompt"]),
        "reference_logits": art(release_dirs["reference_logits"], done=False),
        "checkpoint": art(release_dirs["checkpoint"]),
    }
    with pytest.raises(VerifyInputError, match="^reference_logits: .* is not built; run the workflow"):
        verify_artifacts(artifacts, actual(release_dirs), results_dir=release_dirs["results"])
    del artifacts["checkpoint"]
    artifacts["reference_logits"] = art(release_dirs["reference_logits"])
    artifacts["placement"] = art(Path("results/solve_placement/x"), done=False)
    with pytest.raises(VerifyInputError, match="^export_checkpoint: the checkpoint is not planned yet"):
        verify_artifacts(artifacts, actual(release_dirs), results_dir=release_dirs["results"])
    artifacts["checkpoint"] = art(release_dirs["checkpoint"])
    assert verify_artifacts(artifacts, actual(release_dirs), results_dir=release_dirs["results"]).ok


# ------------------------------------------------------------------------------------ the stage's key


@pytest.fixture(scope="module")
def explicit_raw():
    """The default config with an explicit placement: the checkpoint is planned without a solve."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["placement"]["source"] = "explicit"
    return config


def _keys(raw):
    return {name: art.key for name, art in resolve_artifacts(validate_config(raw)).items()}


def test_published_moves_only_the_verify_key(explicit_raw):
    """`published` enters verify_hashes' key (and the release's, which quotes it), never a stage upstream."""
    art = resolve_artifacts(validate_config(explicit_raw))
    base = {name: a.key for name, a in art.items()}
    downstream = {name for name, a in art.items() if a.stage in ("verify_hashes", "assemble_release")}
    assert "verify" in downstream and len(base) - len(downstream) > 30
    for name in HASH_NAMES:
        changed = copy.deepcopy(explicit_raw)
        changed.setdefault("published", {})[name] = "5" * 64
        keys = _keys(changed)
        moved = {n for n in base if keys[n] != base[n]}
        assert "verify" in moved and moved <= downstream, (name, moved)


def test_verify_key_follows_the_prompt_reference_and_checkpoint(explicit_raw):
    art = resolve_artifacts(validate_config(explicit_raw))
    verify = art["verify"]
    assert verify.stage == "verify_hashes"
    assert verify.preimage["upstream"] == {
        "checkpoint": art["checkpoint"].key,
        "prompt": art["prompt"].key,
        "reference_logits": art["reference_logits"].key,
    }
    assert set(verify.preimage["config"]) == {"published"}
    assert str(verify.path).startswith("results/verify_hashes/")
    changed = copy.deepcopy(explicit_raw)
    changed["export"]["num_shards"] = 1  # moves the checkpoint only
    keys = _keys(changed)
    assert keys["verify"] != art["verify"].key and keys["prompt"] == art["prompt"].key


def test_cli_verify_before_the_workflow_ran_exits_2_naming_the_stage(
    explicit_raw, tmp_path, monkeypatch, capsys
):
    from mixquant.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(explicit_raw))
    assert main(["verify", "--configfile", "config.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixquant: pin_prompt: results/pin_prompt/") and "run the workflow first" in err
    assert "\n" not in err
