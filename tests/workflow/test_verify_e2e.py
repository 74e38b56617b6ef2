"""`mixquant verify` and verify_hashes on the built default DAG: the pinned toy hashes are reproduced, and a
changed pin fails naming the hash. Reuses the session's built workdir (no build of its own)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

HASH_NAMES = ("prompt_token_ids", "reference_logits", "quant_config", "safetensors_index")


def _flipped(sha256: str) -> str:
    """The same hash with its last hex digit changed."""
    return sha256[:-1] + ("0" if sha256[-1] != "0" else "1")


def test_a_fresh_build_reproduces_the_published_hashes(built_workdir):
    wd = built_workdir
    published = wd.config()["published"]
    assert all(len(published[name]) == 64 for name in HASH_NAMES), "config/config.yaml pins all four"
    paths = wd.paths()
    assert paths["verify"]["done"]  # rule all ran verify_hashes
    verified = json.loads((wd.root / paths["verify"]["path"] / "verify.json").read_text())
    assert verified["counts"] == {"match": 4, "mismatch": 0, "not pinned": 0}

    document = json.loads(wd.mixquant("verify", "--json").stdout)
    assert document["ok"] is True
    assert document["counts"] == {"match": 4, "mismatch": 0, "not pinned": 0}
    for name in HASH_NAMES:
        row = document["hashes"][name]
        assert row["status"] == "match" and row["got"] == row["expected"] == published[name]
    assert (
        document["hashes"]["prompt_token_ids"]["artifact"]["path"]
        == f"{paths['prompt']['path']}/prompt.safetensors"
    )
    assert document["hashes"]["quant_config"]["artifact"]["key"] == paths["checkpoint"]["key"]
    # the prompt hash is the one pin_prompt recorded, the logits hash the one reference_logits recorded
    prompt = json.loads((wd.root / paths["prompt"]["path"] / "manifest.json").read_text())
    assert prompt["summary"]["sha256"] == published["prompt_token_ids"]
    reference = json.loads((wd.root / paths["reference_logits"]["path"] / "reference.json").read_text())
    assert reference["sha256"] == published["reference_logits"]

    text = wd.mixquant("verify").stdout
    assert text.splitlines()[-2:] == ["4 match, 0 mismatch, 0 not pinned", "passed"]


@pytest.mark.parametrize("changed", HASH_NAMES)
def test_a_changed_published_hash_fails_verify_naming_it(built_workdir, changed):
    wd = built_workdir
    config = wd.config()
    config["published"][changed] = _flipped(config["published"][changed])
    name = wd.write_config(f"config/published-{changed}.yaml", config)

    result = wd.mixquant("verify", "--configfile", name, check=False)
    assert result.returncode == 1, result.stderr
    assert (
        f"{changed}: mismatch" in result.stdout
        and f"published {config['published'][changed]}" in result.stdout
    )
    assert result.stdout.splitlines()[-2] == "3 match, 1 mismatch, 0 not pinned"
    assert result.stdout.splitlines()[-1].startswith("FAILED: ")  # same (or unknown) published numerics

    result = wd.mixquant("verify", "--json", "--configfile", name, check=False)
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert {n: row["status"] for n, row in document["hashes"].items()} == {
        n: "mismatch" if n == changed else "match" for n in HASH_NAMES
    }
    comparison = document["reference_logits_comparison"]
    if changed == "reference_logits":
        # no reference_logits output here has the (made-up) published hash: said so
        assert comparison["found"] is False and "--against" in comparison["note"]
    else:
        assert comparison is None


def test_reference_logits_mismatch_compares_with_a_given_output(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["published"]["reference_logits"] = _flipped(config["published"]["reference_logits"])
    name = wd.write_config("config/published-logits-against.yaml", config)
    ours = wd.paths(name)["reference_logits"]["path"]
    result = wd.mixquant("verify", "--json", "--configfile", name, "--against", ours, check=False)
    assert result.returncode == 1
    comparison = json.loads(result.stdout)["reference_logits_comparison"]
    assert comparison["found"] and comparison["against_is_published"] is False
    assert comparison["max_abs_diff"] == 0.0 and comparison["mean_kl"] == 0.0
    assert comparison["top1_agreement"] == 1.0
    assert comparison["positions"] == config["prompt"]["seq_len"] - 1
    assert comparison["engine_differences"] == []


def test_verify_hashes_fails_the_workflow_with_one_line_naming_the_hash(built_workdir):
    wd = built_workdir
    config = wd.config()
    config["published"]["quant_config"] = _flipped(config["published"]["quant_config"])
    name = wd.write_config("config/published-quant-config.yaml", config)
    paths = wd.paths(name)
    # `published` moves no upstream key: only the verify stage and the release bundle (which quotes the
    # pins) follow it (keys, not a dry run: earlier tests leave the shared workdir's mtimes behind)
    default = wd.paths()
    assert sorted(n for n in paths if paths[n]["key"] != default[n]["key"]) == ["release", "verify"]
    result = wd.snakemake(paths["verify"]["path"], "--configfile", name, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]
    assert len(lines) == 1 and "published hash mismatch: quant_config is " in lines[0], result.stderr
    assert config["published"]["quant_config"] in lines[0]
    assert not (wd.root / paths["verify"]["path"]).exists()
    assert not list((wd.root / "results").glob("*/.tmp-*"))
