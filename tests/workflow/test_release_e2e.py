"""The release bundle on the trained toy after the default run: its contents, a replay from its recipe
alone (same keys; the export rerun from the recipe writes the same files) and the Snakemake report."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from mixquant.cluster import parse_dry_run
from mixquant.keys.hashing import file_sha256
from mixquant.keys.manifest import read_manifest, verify_manifest
from mixquant.release.bundle import shipped_document
from mixquant.release.card import parse_front_matter
from mixquant.release.hashes import release_hashes
from mixquant.release.recipe import load_recipe
from model_card_checks import check_uploadable

pytestmark = pytest.mark.slow
RECIPE = "quantization_recipe.yaml"
# Stages of the search only: a replay from the recipe (placement.source: explicit) has none of them.
SEARCH_STAGES = {"score_sensitivity", "solve_placement"}


def _dir(wd, paths, name):
    return wd.root / paths[name]["path"]


def test_release_bundle(built_workdir):
    wd = built_workdir
    paths = wd.paths()
    keyed, checkpoint = _dir(wd, paths, "release"), _dir(wd, paths, "checkpoint")
    assert paths["release"]["done"] and verify_manifest(keyed) == []
    # what is published is repo/: a model repository's files, mixquant's bookkeeping beside it
    release = keyed / "repo"
    assert sorted(p.name for p in keyed.iterdir()) == [".snakemake_timestamp", "manifest.json", "repo"]
    # the checkpoint, byte for byte, and the bundle's own files
    shipped = read_manifest(checkpoint)["files"]
    bundle = {name.removeprefix("repo/"): row for name, row in read_manifest(keyed)["files"].items()}
    assert {name: bundle[name] for name in shipped} == shipped
    extra = sorted(set(bundle) - set(shipped))
    candidates = ("bf16", "searched", "uniform-nvfp4")
    gates = [f"kld/{c}.{kv}.json" for c in candidates for kv in ("bfloat16", "fp8")]
    # the evaluation suite's report (what the card's suite sections are made from) and its per-domain plots
    suite = ["kld/report.json", "kld/kl_cdf_domains_bfloat16.png", "kld/kl_cdf_domains_fp8.png"]
    reference = ["reference/logits.safetensors", "reference/prompt.safetensors", "reference/reference.json"]
    shipped_extra = ["README.md", RECIPE, "placement_audit.json", "numerics.json", *reference, *gates, *suite]
    assert extra == sorted(shipped_extra)
    # the reference logits ship byte for byte, their record without the (informative) host, and the
    # numerics fingerprint they were made under
    made = _dir(wd, paths, "reference_logits")
    assert (release / reference[0]).read_bytes() == (made / "logits.safetensors").read_bytes()
    prompt = _dir(wd, paths, "prompt") / "prompt.safetensors"
    assert (release / reference[1]).read_bytes() == prompt.read_bytes()  # the IDs the logits belong to
    shipped = json.loads((release / reference[2]).read_text())
    assert shipped == shipped_document(json.loads((made / "reference.json").read_text()))
    assert "host" not in json.dumps(shipped)
    fingerprint = json.loads((release / "numerics.json").read_text())
    assert fingerprint == wd.config()["published"]["numerics"]
    placement_audit = _dir(wd, paths, "placement") / "placement_audit.json"
    assert (release / "placement_audit.json").read_bytes() == placement_audit.read_bytes()
    for name in gates:
        candidate, kv = name.removeprefix("kld/").removesuffix(".json").split(".")
        aggregate = _dir(wd, paths, f"gate/{candidate}/{kv}") / "aggregate.json"
        assert json.loads((release / name).read_text()) == shipped_document(json.loads(aggregate.read_text()))
    # no record the release ships names a directory of the machine that made it, or its CPU
    for record in [*gates, reference[2]]:
        text = (release / record).read_text()
        assert '"directory"' not in text and '"host"' not in text and "results/" not in text, record

    card = (release / "README.md").read_text()
    meta = parse_front_matter(card)
    audit = json.loads((checkpoint / "checkpoint_audit.json").read_text())["inspection"]
    assert meta["quantization"]["routed_expert_layers"] == audit["placement_counts"]
    assert meta["quantization"]["routed_effective_bits"] == round(audit["routed_effective_bits"], 4)
    assert f"Routed-expert effective bits: {audit['routed_effective_bits']:.4f}" in card
    hashes = release_hashes(_dir(wd, paths, "prompt"), _dir(wd, paths, "reference_logits"), checkpoint)
    for record in hashes.values():
        assert f"`{record.sha256}`" in card
    searched = json.loads((release / "kld/searched.bfloat16.json").read_text())
    gated = searched["suite"]["improvement"]  # the gates judged the evaluation suite
    assert f"{100 * gated['reduction']:.2f}% below `uniform-nvfp4`" in card
    assert "### The evaluation suite" in card and "### Decomposed KLD" in card
    assert "--kv-cache-dtype bfloat16" in card and "--kv-cache-dtype fp8" in card
    # the card as the Hub reads it: front matter, only the repository's own files, the serve command's
    # repository (the default config leaves release.repo_id unset: the placeholder), each candidate's bits
    recipe = load_recipe(release / RECIPE).model_dump(mode="json")
    bits = {"searched": audit["routed_effective_bits"], "uniform-nvfp4": 4.5, "bf16": 16.0}
    check_uploadable(release, recipe, bits)
    print(card)


def test_replay_from_the_recipe_alone(built_workdir, workdir):
    """The recipe, copied into a workdir that shares nothing but the source files, plans the same keys;
    the export rerun from it there (its upstream results copied in, the checkpoint not) writes the same
    files."""
    wd, rebuild = built_workdir, workdir
    paths = wd.paths()
    keyed, checkpoint = _dir(wd, paths, "release"), _dir(wd, paths, "checkpoint")
    release = keyed / "repo"

    shutil.copyfile(release / RECIPE, rebuild.root / RECIPE)
    replayed = rebuild.paths(RECIPE)
    assert not any(row["done"] for row in replayed.values())  # nothing shared: no results at all
    built = {name: row for name, row in paths.items() if row["stage"] not in SEARCH_STAGES}
    placed = {name for name in replayed if name.startswith("layers/")}
    assert placed <= set(built)
    same = sorted(name for name in built if not name.startswith("layers/") and name != "release")
    assert {n: replayed[n]["key"] for n in same} == {n: built[n]["key"] for n in same}
    assert {n: replayed[n]["key"] for n in placed} == {n: built[n]["key"] for n in placed}
    assert {"checkpoint", "reference_logits", "kld_verdict", "verify"} <= set(same)

    by_key = {row["key"]: row["path"] for row in paths.values()}
    # one quantize window holds several layers: its key is upstream of the checkpoint once per layer
    for key in sorted(set(read_manifest(checkpoint)["preimage"]["upstream"].values())):
        shutil.copytree(wd.root / by_key[key], rebuild.root / by_key[key], symlinks=True)
    target = paths["checkpoint"]["path"]
    plan = parse_dry_run(rebuild.snakemake("-n", target, "--configfile", RECIPE).stdout)
    assert {rule: row["jobs"] for rule, row in plan.items()} == {"export_checkpoint": 1}
    rebuild.snakemake(target, "--configfile", RECIPE)
    again = rebuild.root / target
    assert verify_manifest(again) == []
    assert read_manifest(again)["files"] == read_manifest(checkpoint)["files"]  # every file, shards included
    # the published checkpoint hashes of the replay are the release's
    replay_hashes = release_hashes(_dir(wd, paths, "prompt"), _dir(wd, paths, "reference_logits"), again)
    released = read_manifest(keyed)["summary"]["hashes"]
    for name in ("quant_config", "safetensors_index"):
        assert (
            replay_hashes[name].sha256
            == released[name]
            == file_sha256(release / replay_hashes[name].artifact.file)
        )


def test_snakemake_report_has_the_plots(built_workdir, tmp_path):
    copy = tmp_path / "report-wd"
    shutil.copytree(built_workdir.root, copy, symlinks=True)
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--report", "report.html"],
        cwd=copy,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    html = (copy / "report.html").read_text(errors="replace")
    # each result is a report entry with its own file name (captions alone would not do)
    plots = [
        "scores_heatmap",
        "frontier",
        *(f"kl_{p}_{kv}" for p in ("cdf", "per_position") for kv in ("bfloat16", "fp8")),
    ]
    for plot in plots:
        assert f'"filename": "{plot}.png"' in html and f"filename={plot}.png;base64,iVBOR" in html, plot
    for table in ("frontier.csv", "kld_table.csv"):
        assert f'"filename": "{table}"' in html, table
