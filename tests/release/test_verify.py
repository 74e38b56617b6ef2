"""Published hashes compared: match / mismatch / not pinned, content vs numerical kinds, the numerics
fingerprints and the policy (strict or not), the logits comparison, the stage and its key."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from mixquant.config import validate_config
from mixquant.graph import resolve_artifacts
from mixquant.keys.manifest import read_manifest
from mixquant.release.hashes import HASH_NAMES, HashSourceError, release_hashes
from mixquant.release.report import (
    DIFFERENT,
    EQUAL,
    MATCH,
    MISMATCH,
    NOT_COMPARABLE,
    NOT_PINNED,
    UNKNOWN,
    HashMismatchError,
    VerifyInputError,
    format_report,
    mismatch_line,
)
from mixquant.release.verify import run_verify_hashes, verify_artifacts, verify_dirs
from safetensors.torch import save_file

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
    assert document["ok"] is document["passed"] is True
    assert format_report(report).splitlines()[-2:] == ["4 match, 0 mismatch, 0 not pinned", "passed"]


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
    assert f"{changed}: mismatch ({mismatch.kind} hash)" in text and mismatch.record.encoding in text
    assert text.splitlines()[-2] == "3 match, 1 mismatch, 0 not pinned"
    # no published fingerprint: any mismatch fails, content or numerical
    assert text.splitlines()[-1].startswith(f"FAILED: {mismatch.kind} mismatch: {changed}")


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
    assert comparison["top1_agreement"] == 1.0  # one logit below each row's top moved
    # the fingerprints are compared on their own (decisive fields), not as engine settings
    assert comparison["engine_differences"] == [
        {"field": "engine.device", "published": "cuda:0", "ours": "cpu"}
    ]
    text = format_report(report)
    assert "max |diff| 0.25" in text and 'engine.device: published "cuda:0", ours "cpu"' in text
    assert "top-1 agreement 100.00% over 5 positions" in text
    json.dumps(report.to_json())


def test_logits_mismatch_without_the_published_logits_says_so(release_dirs):
    published = actual(release_dirs)
    published["reference_logits"] = "2" * 64
    report = verify_dirs(published, **sources(release_dirs), results_dir=release_dirs["results"])
    assert report.logits_comparison["found"] is False
    assert "no reference_logits output" in report.logits_comparison["note"]
    assert "--against" in format_report(report)
    assert "a release directory" in report.logits_comparison["note"]


def test_against_compares_with_the_given_directory(release_dirs, make_keyed_dir, reference_writer):
    theirs_dir, _, _ = _published_logits(release_dirs, make_keyed_dir, reference_writer, -1.0)
    published = actual(release_dirs)
    published["reference_logits"] = "3" * 64  # the given logits are not the published ones: said so
    report = verify_dirs(published, **sources(release_dirs), against=theirs_dir)
    comparison = report.logits_comparison
    assert comparison["found"] and comparison["against_is_published"] is False
    assert comparison["max_abs_diff"] == pytest.approx(1.0, abs=1e-6)
    assert "NOT the published hash" in format_report(report)
    with pytest.raises(VerifyInputError, match="--against .*: no logits.safetensors there"):
        verify_dirs(published, **sources(release_dirs), against=release_dirs["checkpoint"])


# ------------------------------------------------------------- content vs numerical, the fingerprints

KINDS = {
    "prompt_token_ids": "content",
    "reference_logits": "numerical",
    "quant_config": "content",
    "safetensors_index": "content",
}


def _other_numerics(decisive):
    """The published fingerprint of another machine: AVX512 kernels and another torch."""
    return {**decisive, "cpu_capability": "AVX512", "libraries": {**decisive["libraries"], "torch": "2.12.0"}}


def _published(release_dirs, flipped=(), numerics=None):
    published = actual(release_dirs)
    for name in flipped:
        published[name] = "0" * 64
    return {**published, "numerics": numerics}


def test_every_hash_is_reported_as_content_or_numerical(release_dirs):
    published = _published(release_dirs, flipped=HASH_NAMES)
    report = verify_dirs(published, **sources(release_dirs))
    document = report.to_json()
    assert {name: row["kind"] for name, row in document["hashes"].items()} == KINDS
    assert document["mismatches"] == {
        "content": ["prompt_token_ids", "quant_config", "safetensors_index"],
        "numerical": ["reference_logits"],
    }
    text = format_report(report)
    table = {line.split()[0]: line.split()[1] for line in text.splitlines()[1:5]}
    assert table == KINDS and text.splitlines()[0].split()[:3] == ["hash", "kind", "status"]
    assert "reference_logits: mismatch (numerical hash)" in text
    assert "quant_config: mismatch (content hash)" in text
    records = release_hashes(
        release_dirs["prompt"], release_dirs["reference_logits"], release_dirs["checkpoint"]
    )
    assert {name: record.to_json()["kind"] for name, record in records.items()} == KINDS


def test_a_logits_mismatch_names_the_fingerprint_fields_that_differ(release_dirs, decisive):
    published = _published(release_dirs, ["reference_logits"], _other_numerics(decisive))
    report = verify_dirs(published, **sources(release_dirs))
    assert report.numerics.status == DIFFERENT and report.numerics.published_source == "published.numerics"
    assert report.numerics.ours == decisive  # reference.json's, without its host part
    assert report.numerics.differences == [
        "cpu_capability: 'AVX512' -> 'AVX2'",
        "libraries.torch: '2.12.0' -> '2.13.0+cpu'",
    ]
    document = report.to_json()
    assert document["numerics"]["differences"] == report.numerics.differences
    assert document["not_reproducible_bit_for_bit_here"] == ["reference_logits"]
    assert document["ok"] is False and document["passed"] is True
    text = format_report(report)
    lines = text.splitlines()
    assert (
        "reference logits numerics: numerics fingerprint differs from the published one in "
        "cpu_capability, libraries.torch"
    ) in lines
    assert "  differs   cpu_capability: 'AVX512' -> 'AVX2'" in lines
    assert (
        "  ours      device cpu, profile portable, threads 1, ATen CPU capability AVX2, MKL CBWR COMPATIBLE, "
        "oneDNN (mkldnn) off; mkl 2024.2, onednn 3.12.0, torch 2.13.0+cpu, transformers 5.24.0; Python 3.11.7"
    ) in lines
    assert text.splitlines()[-1] == (
        "passed: reference_logits not reproducible bit for bit here (numerics fingerprint differs from the "
        "published one in cpu_capability, libraries.torch); --strict fails on it"
    )
    strict = format_report(report, strict=True).splitlines()[-1]
    assert strict.startswith("FAILED: --strict: reference_logits not reproducible bit for bit here (")


def _no_recorded_numerics(release_dirs, reference_writer):
    reference_writer(release_dirs["reference_logits"], release_dirs["logits"], numerics=None)


# flipped hashes, published fingerprint (same / other / None: unknown), our fingerprint recorded,
# passes (workflow rule, plain `mixquant verify`), passes --strict, the failing hashes without --strict
POLICY = [
    ((), "same", True, True, True, []),
    ((), "other", True, True, True, []),
    (("quant_config",), "other", True, False, False, ["quant_config"]),
    (("prompt_token_ids",), None, True, False, False, ["prompt_token_ids"]),
    (("reference_logits",), "same", True, False, False, ["reference_logits"]),
    (("reference_logits",), None, True, False, False, ["reference_logits"]),
    (("reference_logits",), "other", False, False, False, ["reference_logits"]),
    (("reference_logits",), "other", True, True, False, []),
    (("reference_logits", "safetensors_index"), "other", True, False, False, ["safetensors_index"]),
]


@pytest.mark.parametrize(("flipped", "theirs", "recorded", "passes", "strict", "failing"), POLICY)
def test_policy_content_always_fails_numerical_only_under_an_equal_or_unknown_fingerprint(
    release_dirs, reference_writer, decisive, flipped, theirs, recorded, passes, strict, failing
):
    if not recorded:
        _no_recorded_numerics(release_dirs, reference_writer)
    numerics = {"same": decisive, "other": _other_numerics(decisive), None: None}[theirs]
    report = verify_dirs(_published(release_dirs, flipped, numerics), **sources(release_dirs))
    assert report.passed is passes and report.ok is (not flipped)
    assert (not report.failures(strict=True)) is strict
    assert [c.name for c in report.failures()] == failing
    assert [c.name for c in report.failures(strict=True)] == list(
        name for name in HASH_NAMES if name in flipped
    )
    expected_status = {"same": EQUAL, "other": DIFFERENT, None: UNKNOWN}[theirs] if recorded else UNKNOWN
    assert report.numerics.status == expected_status


def test_the_rule_fails_on_content_and_on_numerical_mismatches_under_an_equal_fingerprint(
    release_dirs, tmp_path, decisive
):
    from mixquant.keys.canonical import canonical_sha256

    def run(published):
        preimage = {"stage": "verify_hashes", "config": {"published": published}}
        out = tmp_path / "results" / "verify_hashes" / canonical_sha256(preimage)
        run_verify_hashes(out, **sources(release_dirs), settings={"published": published}, preimage=preimage)
        return out

    published = _published(release_dirs, ["reference_logits"], decisive)
    with pytest.raises(HashMismatchError) as error:
        run(published)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        f"published hash mismatch: reference_logits is {actual(release_dirs)['reference_logits']}"
    )
    assert "(numerical hash, reference_logits " in message
    assert "numerics fingerprint equal to the published one (published.numerics)" in message
    assert message.endswith("`mixquant verify --against PUBLISHED_LOGITS` says how close the logits are")

    published = _published(release_dirs, ["quant_config"], _other_numerics(decisive))
    with pytest.raises(
        HashMismatchError, match=r"^published hash mismatch: quant_config is .*\(content hash, "
    ) as error:
        run(published)
    assert "--against" not in str(error.value)  # a content mismatch has no logits to compare


def test_the_rule_passes_a_numerical_mismatch_under_another_fingerprint_and_says_so(
    release_dirs, tmp_path, decisive, capsys
):
    from mixquant.keys.canonical import canonical_sha256

    published = _published(release_dirs, ["reference_logits"], _other_numerics(decisive))
    preimage = {"stage": "verify_hashes", "config": {"published": published}}
    out = tmp_path / "results" / "verify_hashes" / canonical_sha256(preimage)
    run_verify_hashes(out, **sources(release_dirs), settings={"published": published}, preimage=preimage)
    document = json.loads((out / "verify.json").read_text())
    assert document["ok"] is False and document["passed"] is True
    assert document["not_reproducible_bit_for_bit_here"] == ["reference_logits"]
    assert document["numerics"]["status"] == DIFFERENT
    assert document["hashes"]["reference_logits"]["kind"] == "numerical"
    assert read_manifest(out)["summary"]["not_reproducible_bit_for_bit_here"] == ["reference_logits"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "mixquant: verify_hashes passed: reference_logits not reproducible bit for bit here"
    )
    assert "cpu_capability, libraries.torch" in line


# ------------------------------------------------------------------ how close, from the published logits

OURS_LOGITS = torch.tensor(
    [[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.5, 0.5, 4.0, 0.0], [1.0, -1.0, 0.0, 2.0]]
)
THEIRS_LOGITS = torch.tensor(
    [[0.0, 1.0, 3.5, 3.0], [3.0, 2.0, 1.0, 0.25], [0.5, 0.5, 4.0, 0.0], [2.5, -1.0, 0.0, 2.0]]
)


@pytest.fixture
def two_logits(release_dirs, make_keyed_dir, reference_writer):
    """Our reference logits (OURS_LOGITS) and the published ones (THEIRS_LOGITS) on a published dict."""
    reference_writer(release_dirs["reference_logits"], OURS_LOGITS)
    published = actual(release_dirs)
    theirs_sha = reference_writer(make_keyed_dir("reference_logits", "theirs"), THEIRS_LOGITS)
    published["reference_logits"] = theirs_sha
    return published


def _assert_closeness(comparison):
    assert comparison["found"] and comparison["against_is_published"] is True
    assert comparison["positions"] == 4
    assert comparison["max_abs_diff"] == pytest.approx(1.5)
    assert comparison["mean_kl"] == pytest.approx(_kl(THEIRS_LOGITS, OURS_LOGITS), rel=1e-6)
    assert comparison["top1_agreement"] == pytest.approx(0.5)  # rows 0 and 3 change their top token


def test_closeness_of_two_logits_files(release_dirs, two_logits, tmp_path):
    bare = tmp_path / "downloaded" / "published.safetensors"
    bare.parent.mkdir()
    save_file({"logits": THEIRS_LOGITS}, str(bare))
    report = verify_dirs(two_logits, **sources(release_dirs), against=bare)
    comparison = report.logits_comparison
    _assert_closeness(comparison)
    assert comparison["against_file"] == str(bare)
    assert comparison["engine_differences"] is None and comparison["against_numerics"] is None
    assert report.numerics.status == UNKNOWN  # nothing beside a bare file says how it was made
    text = format_report(report)
    assert "max |diff| 1.5, mean KL(published || ours) " in text
    assert "top-1 agreement 50.00% over 4 positions" in text
    assert "recorded engine settings: none beside the published logits" in text
    assert text.splitlines()[-1].startswith("FAILED: numerical mismatch: reference_logits (the published")


def test_closeness_from_the_published_reference_found_under_results(release_dirs, two_logits):
    report = verify_dirs(two_logits, **sources(release_dirs), results_dir=release_dirs["results"])
    _assert_closeness(report.logits_comparison)
    assert report.logits_comparison["engine_differences"] == []
    # published.numerics is null: the published logits' own record stands in (here the same fingerprint)
    assert report.numerics.status == EQUAL and "recorded beside the published logits" in (
        report.numerics.published_source
    )
    assert not report.passed


def test_a_release_directory_gives_the_published_logits_and_fingerprint(
    release_dirs, two_logits, tmp_path, reference_writer, decisive
):
    release = tmp_path / "release"
    (release / "reference").mkdir(parents=True)
    reference_writer(release / "reference", THEIRS_LOGITS, numerics=None)
    (release / "numerics.json").write_text(json.dumps(_other_numerics(decisive)))
    report = verify_dirs(two_logits, **sources(release_dirs), against=release)
    _assert_closeness(report.logits_comparison)
    assert report.logits_comparison["against_file"] == str(release / "reference" / "logits.safetensors")
    assert report.numerics.status == DIFFERENT and report.numerics.fields == [
        "cpu_capability",
        "libraries.torch",
    ]
    assert report.passed and not report.failures() and report.failures(strict=True)
    text = format_report(report)
    assert text.index("  differs   cpu_capability") < text.index("top-1 agreement 50.00%")
    assert text.splitlines()[-1].startswith("passed: reference_logits not reproducible bit for bit here")


def test_against_a_record_of_other_logits_is_refused(release_dirs, two_logits, tmp_path, reference_writer):
    directory = tmp_path / "mixed"
    directory.mkdir()
    reference_writer(directory, OURS_LOGITS)
    save_file({"logits": THEIRS_LOGITS}, str(directory / "logits.safetensors"))
    with pytest.raises(VerifyInputError, match="hashes to .* but .*reference.json records"):
        verify_dirs(two_logits, **sources(release_dirs), against=directory)


def test_cli_exit_codes_strict_and_not(release_dirs, two_logits, tmp_path, monkeypatch, capsys, decisive):
    import mixquant.cli as cli
    import mixquant.cli.verify as cli_verify

    def art(path):
        return SimpleNamespace(path=path, done=True)

    artifacts = {name: art(release_dirs[name]) for name in ("prompt", "reference_logits", "checkpoint")}
    published = {**two_logits, "numerics": _other_numerics(decisive)}
    monkeypatch.setattr(
        cli_verify, "load_config", lambda args: SimpleNamespace(published=published, results_dir="r")
    )
    monkeypatch.setattr(cli_verify, "planned_artifacts", lambda cfg, args: artifacts)
    monkeypatch.setattr(cli_verify, "made_from", lambda artifacts, cfg: None)  # no recipes pinned
    assert cli.main(["verify"]) == 0
    assert "not reproducible bit for bit here" in capsys.readouterr().out.splitlines()[-1]
    assert cli.main(["verify", "--strict"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAILED: --strict: reference_logits")
    assert cli.main(["verify", "--json", "--strict"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["strict"] is True and document["passed"] is True and document["ok"] is False
    published["numerics"] = decisive  # the same fingerprint: the bits should have reproduced
    assert cli.main(["verify"]) == 1
    assert "numerics fingerprint equal to the published one" in capsys.readouterr().out
    published["numerics"] = _other_numerics(decisive)
    published["quant_config"] = "0" * 64  # a content mismatch fails whatever the fingerprints
    assert cli.main(["verify"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAILED: content mismatch: quant_config"


def test_reference_logits_record_the_fingerprint_verify_compares(release_dirs, small_laguna_config, tmp_path):
    """The hf engine's fingerprint lands in reference.json, whose decisive part verify compares."""
    from mixquant.calibration.tokens import save_token_ids
    from mixquant.keys.canonical import canonical_sha256
    from mixquant.kld.run import run_reference_logits
    from mixquant.model import toy_layout
    from mixquant.numerics import fingerprint
    from transformers import LagunaForCausalLM

    torch.manual_seed(0)
    model = LagunaForCausalLM(small_laguna_config())
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    (tmp_path / "model").mkdir()
    toy_layout.save_upstream_checkpoint(model, tmp_path / "model", num_shards=1)
    engine = {"engine": "hf", "tensor_parallel_size": 1, "dtype": "bfloat16", "enforce_eager": True}
    engine |= {"seed": 0, "enable_prefix_caching": False, "max_model_len": None}
    preimage = {"stage": "reference_logits", "label": "fingerprint"}
    reference = tmp_path / "results" / "reference_logits" / canonical_sha256(preimage)
    settings = {"engine": engine, "kv_cache_dtype": "bfloat16", "threads": 1}
    model_dir, prompt = tmp_path / "model", tmp_path / "results" / "pin_prompt" / ("7" * 64)
    save_token_ids(prompt / "prompt.safetensors", torch.arange(4, 20), {})
    run_reference_logits(reference, model=model_dir, prompt=prompt, settings=settings, preimage=preimage)
    document = json.loads((reference / "reference.json").read_text())
    assert document["numerics"] == document["engine"]["numerics"]
    assert set(document["numerics"]) == {"decisive", "host"}
    assert document["numerics"]["decisive"] == fingerprint()["decisive"]
    dirs = {**sources(release_dirs), "prompt": prompt, "reference_logits": reference}
    published = {**actual(dirs), "numerics": fingerprint()["decisive"]}
    report = verify_dirs(published, **dirs)
    assert report.ok and report.numerics.status == EQUAL


def test_published_numerics_is_the_decisive_fingerprint(explicit_raw):
    from mixquant.config import ConfigError
    from mixquant.numerics import DECISIVE_FIELDS, fingerprint

    assert set(fingerprint()["decisive"]) <= set(DECISIVE_FIELDS)  # what numerics.json ships is accepted
    raw = copy.deepcopy(explicit_raw)
    raw.setdefault("published", {})["numerics"] = {"device": "cpu", "cpu_capabilty": "AVX2"}
    with pytest.raises(ConfigError, match=r"published.numerics.*unknown fingerprint field 'cpu_capabilty'"):
        validate_config(raw)
    raw["published"]["numerics"] = {"decisive": {"device": "cpu"}, "host": {}}
    with pytest.raises(ConfigError, match="decisive part"):
        validate_config(raw)
    raw["published"]["numerics"] = fingerprint()["decisive"]
    assert validate_config(raw).published.numerics == fingerprint()["decisive"]


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
    assert "verify" in downstream and len(base) - len(downstream) > 20
    pins = {name: "5" * 64 for name in HASH_NAMES} | {"numerics": {"device": "cpu", "profile": "native"}}
    for name, value in pins.items():
        changed = copy.deepcopy(explicit_raw)
        changed.setdefault("published", {})[name] = value
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
    assert set(verify.settings["planned"]) == {"prompt", "reference_logits", "checkpoint", "settings"}
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
    (tmp_path / "data").symlink_to(REPO / "data")  # the shipped toy and the corpus, as a workdir has them
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(explicit_raw))
    assert main(["verify", "--configfile", "config.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixquant: pin_prompt: results/pin_prompt/") and "run the workflow first" in err
    assert "\n" not in err


# ------------------------------------------------------------- what a published hash was made from


def _recipes(art):
    return {name: art[name].recipe for name in ("prompt", "reference_logits", "checkpoint")}


def test_a_recipe_is_what_an_artifact_is_made_from(explicit_raw):
    """A recipe follows the settings an artifact is made from, not its code, packages or neighbours."""
    base = resolve_artifacts(validate_config(explicit_raw))
    assert all(len(art.recipe) == 64 and art.recipe != art.key for art in base.values())
    changed = copy.deepcopy(explicit_raw)
    changed["calibration"]["num_samples"] = 32  # the rebuild's calibration: the checkpoint, not the prompt
    other = resolve_artifacts(validate_config(changed))
    assert other["checkpoint"].recipe != base["checkpoint"].recipe
    assert _recipes(other)["prompt"] == _recipes(base)["prompt"]
    assert other["reference_logits"].recipe == base["reference_logits"].recipe
    changed = copy.deepcopy(explicit_raw)
    changed["kld"]["candidates"].append({"name": "uniform-fp8", "source": "uniform", "format": "fp8"})
    assert _recipes(resolve_artifacts(validate_config(changed))) == _recipes(base)


def test_a_recipe_leaves_out_the_packages_and_code_the_key_holds(explicit_raw, monkeypatch):
    import mixquant.graph.artifact as artifacts_module

    base = resolve_artifacts(validate_config(explicit_raw))
    real = artifacts_module.stage_preimage

    def newer_torch(stage, config_slice, upstream, packages=None, env=None):
        preimage = real(stage, config_slice, upstream, packages, env)
        return {**preimage, "packages": {**preimage["packages"], "torch": "99.0"}}

    monkeypatch.setattr(artifacts_module, "stage_preimage", newer_torch)
    other = resolve_artifacts(validate_config(explicit_raw))
    assert other["checkpoint"].key != base["checkpoint"].key
    assert _recipes(other) == _recipes(base)


def _made_from_pins(release_dirs, **recipes):
    planned = {"prompt": "a" * 64, "reference_logits": "b" * 64, "checkpoint": "c" * 64}
    settings = {"placement": "1" * 16, "calibration": "2" * 16, "kld": "3" * 16}
    published = {**actual(release_dirs), "made_from": {**planned, **recipes, "settings": settings}}
    return published, {**planned, "settings": settings}


def test_hashes_of_an_artifact_made_otherwise_are_not_comparable_and_pass(release_dirs):
    published, planned = _made_from_pins(release_dirs, checkpoint="d" * 64)
    planned["settings"] = {**planned["settings"], "placement": "9" * 16}
    published["quant_config"] = "0" * 64  # differs by construction: not a mismatch
    report = verify_dirs(published, **sources(release_dirs), planned=planned)
    assert {c.name: c.status for c in report.checks} == {
        "prompt_token_ids": MATCH,
        "reference_logits": MATCH,
        "quant_config": NOT_COMPARABLE,
        "safetensors_index": NOT_COMPARABLE,
    }
    note = report.not_comparable[0].note
    assert "checkpoint (export_checkpoint) is made from other settings" in note
    assert "differs from the published config in placement" in note and "calibration" not in note
    assert report.passed and not report.ok and not report.failures() and report.failures(strict=True)
    text = format_report(report)
    assert "quant_config: not comparable: the checkpoint" in text
    assert text.splitlines()[-2] == "2 match, 0 mismatch, 0 not pinned, 2 not comparable"
    assert text.splitlines()[-1].startswith(
        "passed: quant_config, safetensors_index not comparable: the checkpoint (export_checkpoint)"
    )
    assert text.splitlines()[-1].endswith("; --strict fails on it")
    strict = format_report(report, strict=True).splitlines()[-1]
    assert strict.startswith("FAILED: --strict: quant_config, safetensors_index not comparable")
    document = report.to_json()
    assert document["counts"][NOT_COMPARABLE] == 2 and set(document["not_comparable"]) == {
        "quant_config",
        "safetensors_index",
    }


def test_the_published_recipe_is_compared_and_a_real_mismatch_still_fails(release_dirs):
    published, planned = _made_from_pins(release_dirs)
    published["quant_config"] = "0" * 64
    report = verify_dirs(published, **sources(release_dirs), planned=planned)
    assert [c.status for c in report.checks] == [MATCH, MATCH, MISMATCH, MATCH]
    assert not report.passed
    # without recipes on either side every pinned hash is compared, as before made_from existed
    del published["made_from"]
    assert [c.status for c in verify_dirs(published, **sources(release_dirs), planned=planned).checks] == [
        MATCH,
        MATCH,
        MISMATCH,
        MATCH,
    ]


def test_a_recipe_change_with_the_published_sections_says_so(release_dirs):
    published, planned = _made_from_pins(release_dirs, prompt="e" * 64)
    report = verify_dirs(published, **sources(release_dirs), planned=planned)
    (check,) = report.not_comparable
    assert check.name == "prompt_token_ids" and "config sections are the published ones" in check.note


def test_the_rule_passes_not_comparable_hashes_unless_strict(release_dirs, tmp_path, capsys):
    from mixquant.keys.canonical import canonical_sha256

    published, planned = _made_from_pins(release_dirs, checkpoint="d" * 64)
    planned["settings"] = {**planned["settings"], "placement": "9" * 16}

    def run(published):
        preimage = {"stage": "verify_hashes", "config": {"published": published}}
        out = tmp_path / "results" / "verify_hashes" / canonical_sha256(preimage)
        settings = {"published": published, "planned": planned}
        run_verify_hashes(out, **sources(release_dirs), settings=settings, preimage=preimage)
        return out

    out = run(published)
    document = json.loads((out / "verify.json").read_text())
    assert document["passed"] is True and document["counts"][NOT_COMPARABLE] == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("mixquant: verify_hashes passed: quant_config, safetensors_index not comparable")
    with pytest.raises(HashMismatchError, match=r"^published.strict: quant_config, safetensors_index not"):
        run({**published, "strict": True})


def test_planning_says_which_published_hashes_a_config_cannot_match():
    """`mixquant plan` / `snakemake -n`: the pinned hashes whose artifacts this config makes from other
    settings, with the sections that differ; the checkpoint before the solve judged by its upstream
    sections (another KLD candidate leaves it as published)."""
    from mixquant.release.published import planned_comparability

    settings = {"placement": "a" * 16, "kld": "b" * 16, "model": "c" * 16}
    made_from = {
        "prompt": "1" * 64,
        "reference_logits": "2" * 64,
        "checkpoint": "3" * 64,
        "settings": settings,
    }
    published = {name: "f" * 64 for name in HASH_NAMES} | {"made_from": made_from}
    assert planned_comparability(published, made_from) is None
    budget = {**made_from, "checkpoint": "4" * 64, "settings": {**settings, "placement": "d" * 16}}
    line = planned_comparability(published, budget)
    assert line.startswith("published hashes quant_config, safetensors_index cannot match this config (it ")
    assert "differs from the published one in placement)" in line and "--strict" in line
    before_solve = {key: value for key, value in budget.items() if key != "checkpoint"}
    assert planned_comparability(published, before_solve) == line
    candidate = {**before_solve, "settings": {**settings, "kld": "e" * 16}}
    assert planned_comparability(published, candidate) is None
    assert planned_comparability({**published, "made_from": None}, budget) is None
