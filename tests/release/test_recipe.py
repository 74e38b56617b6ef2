"""quantization_recipe.yaml: the resolved config with the placement written down reproduces the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixquant.config import ConfigError, load_config_file
from mixquant.graph import resolve_artifacts
from mixquant.release.recipe import (
    explicit_placement,
    layer_ranges,
    load_recipe,
    recipe_document,
    recipe_yaml,
)

REPO = Path(__file__).resolve().parents[2]
# A placement the search could choose on the toy's 8 MoE layers: not contiguous per format.
TOY_PLACEMENT = {1: "nvfp4_w4a16", 2: "fp8", 3: "nvfp4_w4a16", 4: "nvfp4_w4a16", 5: "bf16", 6: "fp8",
                 7: "nvfp4_w4a16", 8: "bf16"}  # fmt: skip
LAGUNA_PLACEMENT = (
    {layer: "nvfp4_w4a16" for layer in range(1, 48)}
    | {7: "fp8", 20: "fp8", 33: "fp8"}
    | {layer: "bf16" for layer in (1, 2, 45, 46, 47)}
)


def test_layer_ranges_compress_and_round_trip():
    from mixquant.config import parse_layer_ranges

    assert layer_ranges([1, 2, 3, 5, 7, 8]) == "1-3,5,7-8"
    assert layer_ranges([4]) == "4"
    for layers in ([1, 3, 4, 7], list(range(1, 48)), [2, 9, 10, 11, 40]):
        assert parse_layer_ranges(layer_ranges(layers)) == layers


def test_explicit_placement_names_every_layer_once():
    explicit = explicit_placement(TOY_PLACEMENT)
    assert explicit == {
        "default_format": "bf16",
        "layers": [
            {"layers": "1,3-4,7", "format": "nvfp4_w4a16"},
            {"layers": "2,6", "format": "fp8"},
            {"layers": "5,8", "format": "bf16"},
        ],
    }
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        explicit_placement({1: "int4"})


def _checkpoint_keys(artifacts) -> dict[str, str]:
    """Every key but the release's (which names the placement artifact when the search ran)."""
    return {name: art.key for name, art in artifacts.items() if art.stage != "assemble_release"}


@pytest.mark.parametrize(
    ("config", "placement"),
    [("config/config.yaml", TOY_PLACEMENT), ("config/laguna-s-2.1.yaml", LAGUNA_PLACEMENT)],
)
def test_recipe_round_trips_to_the_same_keys(tmp_path, monkeypatch, config, placement):
    monkeypatch.chdir(REPO)  # relative paths in the configs (corpus, prompt file, geometry)
    cfg = load_config_file(config)
    assert cfg.placement.source == "search"
    # a ModelOpt AutoQuantize candidate (the toy's) waits for its own placement: handed here as well
    searched = resolve_artifacts(cfg, placement=placement, autoquantized=placement)
    path = tmp_path / "quantization_recipe.yaml"
    path.write_text(recipe_yaml(recipe_document(cfg, placement), ["a header", ""]), "utf-8")
    assert path.read_text("utf-8").startswith("# a header\n#\n")

    replay_cfg = load_recipe(path)  # the project's config loader, as the Snakefile validates it
    assert replay_cfg.placement.source == "explicit"
    replayed = resolve_artifacts(
        replay_cfg, autoquantized=placement
    )  # the recipe alone decides the placement
    # the search's own stages are gone; everything the checkpoint and its KLD are made of is the same
    searched_keys, replayed_keys = _checkpoint_keys(searched), _checkpoint_keys(replayed)
    search_only = {n for n, a in searched.items() if a.stage in ("score_sensitivity", "solve_placement")}
    assert search_only and not search_only & set(replayed_keys)
    # layer x format results the search scored but the placement does not use are search-only too
    placed = {name for name in searched_keys if not name.startswith("layers/")} - search_only
    assert {n: searched_keys[n] for n in placed} == {n: replayed_keys[n] for n in placed}
    shared = [n for n in replayed_keys if n.startswith("layers/") and n in searched_keys]
    assert shared and all(replayed_keys[n] == searched_keys[n] for n in shared)
    assert replayed["checkpoint"].settings["placement"] == {str(k): v for k, v in sorted(placement.items())}
    # the recipe of the recipe is the recipe: a replay's release ships the same file
    assert recipe_document(replay_cfg, placement) == recipe_document(cfg, placement)
    assert replayed["release"].settings == searched["release"].settings
    assert set(searched["release"].upstream) - set(replayed["release"].upstream) == {"placement"}


def test_recipe_leaves_out_the_results_dir_and_is_validated(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config_file("config/config.yaml")
    document = recipe_document(cfg, TOY_PLACEMENT)
    assert "results_dir" not in document and document["placement"]["source"] == "explicit"
    with pytest.raises(ValueError, match="not a MoE layer"):
        resolve_artifacts(_with_placement(document, {9: "fp8"}))


def _with_placement(document, placement):
    from mixquant.config import validate_config

    bad = dict(document)
    bad["placement"] = dict(document["placement"], explicit=explicit_placement(placement))
    return validate_config(bad)


def test_a_broken_recipe_fails_with_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    document = recipe_document(load_config_file("config/config.yaml"), TOY_PLACEMENT)
    document["placement"]["sorce"] = document["placement"].pop("source")
    path = tmp_path / "quantization_recipe.yaml"
    path.write_text(recipe_yaml(document, []), "utf-8")
    with pytest.raises(ConfigError, match=r"unknown config key 'placement.sorce'; did you mean"):
        load_recipe(path)


def test_the_recipe_replays_gptq_rounding_and_the_refined_placement(tmp_path, monkeypatch):
    """A release rounded with GPTQ and refined by measured KL: its recipe writes the kept placement down
    and keeps the rounding, so the replay plans the same expert inputs, GPTQ windows and checkpoint."""
    import yaml

    monkeypatch.chdir(REPO)
    raw = yaml.safe_load((REPO / "config/config.yaml").read_text())
    raw["quantize"]["nvfp4_w4a16"].update(rounding="gptq", gptq={"damping": 0.02})
    raw["placement"]["search"]["refine"] = {"candidates": 4, "holdout_samples": 8}
    config = tmp_path / "gptq.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config_file(config)
    searched = resolve_artifacts(cfg, placement=TOY_PLACEMENT, autoquantized=TOY_PLACEMENT)
    assert {"expert_inputs", "holdout", "refined"} <= set(searched)
    path = tmp_path / "quantization_recipe.yaml"
    path.write_text(recipe_yaml(recipe_document(cfg, TOY_PLACEMENT), ["header"]), "utf-8")
    replay_cfg = load_recipe(path)
    assert replay_cfg.quantize.nvfp4_w4a16.rounding == "gptq"
    assert replay_cfg.quantize.nvfp4_w4a16.gptq.damping == 0.02
    replayed = resolve_artifacts(replay_cfg, autoquantized=TOY_PLACEMENT)
    assert not {"holdout", "refined", "placement"} & set(replayed)  # the placement is written down
    for name in ("expert_inputs", "checkpoint", "layers/nvfp4_w4a16/1-8"):
        assert replayed[name].key == searched[name].key, name
    assert set(searched["release"].upstream) - set(replayed["release"].upstream) == {"placement", "refined"}
