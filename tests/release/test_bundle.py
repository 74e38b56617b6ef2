"""assemble_release on synthetic keyed outputs: layout, hardlinks, manifest, card and one-line refusals; the
card read as the Hub reads it (tests/model_card_checks.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from mixquant.config import validate_config
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.manifest import verify_manifest, write_manifest
from mixquant.kld.suite_tables import decomposition, domain_rows
from mixquant.release.bundle import ReleaseInputError, run_assemble_release
from mixquant.release.card import parse_front_matter
from mixquant.release.recipe import load_recipe, recipe_document
from model_card_checks import check_uploadable

REPO = Path(__file__).resolve().parents[2]
PLACEMENT = {layer: "nvfp4_w4a16" for layer in range(1, 5)} | {5: "fp8", 6: "fp8", 7: "bf16", 8: "bf16"}
CANDIDATES = ("searched", "modelopt-autoquantize", "uniform-nvfp4", "bf16")  # toy_config()'s
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
    _json(dirs["verdict"] / "verdict.json", {"passed": True, "verdicts": [{}] * 2 * len(CANDIDATES)})
    for candidate in CANDIDATES:
        for kv in KV:
            gate = make_keyed_dir("gate_kld", f"{candidate}/{kv}")
            _json(gate / "aggregate.json", _gate(candidate, kv))
            dirs[f"gate_{candidate}_{kv}"] = gate
    for directory in dirs.values():
        write_manifest(directory, {"label": directory.name})
    return dirs


def toy_config():
    """config/config.yaml with ModelOpt's own placement as a fourth candidate (the default leaves it out)."""
    modelopt = {"name": "modelopt-autoquantize", "source": "modelopt_autoquantize"}
    return _config(edit=lambda document: document["kld"]["candidates"].insert(1, modelopt))


def _release(upstream, tmp_path, cfg=None, **changes):
    recipe = recipe_document(cfg or toy_config(), PLACEMENT)
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
            "reference/prompt.safetensors",
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
    from mixquant.release.closeness import published_logits
    from mixquant.release.hashes import reference_logits_hash

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


def _config(name="config/config.yaml", edit=None):
    document = yaml.safe_load((REPO / name).read_text())
    if edit:
        edit(document)
    return validate_config(document, name)


def _add_gates(upstream, make_keyed_dir, candidate, engine=None):
    for kv in KV:
        gate = make_keyed_dir("gate_kld", f"{candidate}/{kv}")
        _json(gate / "aggregate.json", _gate(candidate, kv) | ({"engine": engine} if engine else {}))
        write_manifest(gate, {"label": gate.name})
        upstream[f"gate_{candidate}_{kv}"] = gate


@pytest.mark.parametrize("repo_id", [None, "someone/toy-laguna-mixquant"])
def test_the_card_uploads_as_is_with_the_bits_of_every_candidate(upstream, tmp_path, make_keyed_dir, repo_id):
    """The toy's card with ModelOpt's placement and two more candidates, a uniform FP8 (8 bits, its KLD lower
    than the searched checkpoint's 8.25 bits would suggest it wins) and an explicit map whose bits come from
    the layer formats the KLD engine recorded: the Hub's parser takes it, it names only files it ships, and
    each row states its candidate's bits."""

    def edit(config):
        config["release"]["repo_id"] = repo_id
        config["kld"]["candidates"] += [
            {"name": "modelopt-autoquantize", "source": "modelopt_autoquantize"},
            {"name": "uniform-fp8", "source": "uniform", "format": "fp8"},
            {
                "name": "fp8-half",
                "source": "explicit",
                "explicit": {"default_format": "bf16", "layers": [{"layers": "1-4", "format": "fp8"}]},
            },
        ]

    _add_gates(upstream, make_keyed_dir, "uniform-fp8")
    formats = {str(layer): "fp8" if layer <= 4 else "bf16" for layer in range(1, 9)}
    _add_gates(
        upstream, make_keyed_dir, "fp8-half", {"engine": "hf", "checkpoint": {"layer_formats": formats}}
    )
    cfg = _config(edit=edit)
    repo = _release(upstream, tmp_path, cfg) / "repo"
    recipe = recipe_document(cfg, PLACEMENT)
    bits = {"searched": 8.25, "uniform-nvfp4": 4.5, "bf16": 16.0, "uniform-fp8": 8.0, "fp8-half": 12.0}
    bits["modelopt-autoquantize"] = None  # its engine recorded no layer formats here
    card = check_uploadable(repo, recipe, bits)
    served = repo_id or "<your-org>/toy-laguna-MixQuant-4xNVFP4-2xFP8-2xBF16"
    assert f"vllm serve {served} \\\n" in card.text
    assert card.data.model_name == (repo_id or served).split("/")[-1]
    for text in ("data/", "results/", "pin_prompt", "export_checkpoint/", "build-toy", "manifest.json"):
        assert text not in card.content, text  # local paths and files that are not in the repository


def test_a_hub_release_names_its_base_model_and_the_vllm_the_gates_ran_with(
    upstream, tmp_path, make_keyed_dir
):
    """The reference release's config: base_model is the source repository; the vLLM version and the GPU
    are the ones the KLD runs recorded (not a constant: another record, another card)."""

    def edit(config):
        config["release"] = {
            "repo_id": "someone/Laguna-S-2.1-MixQuant",
            "license": "other",
            "license_name": "example",
            "license_link": "https://example.com/license",
        }
        config["kld"]["kv_cache_dtypes"] = list(KV)

    cfg = _config("config/laguna-s-2.1.yaml", edit)
    candidates = [c.name for c in cfg.kld.candidates]
    gates = {role: path for role, path in upstream.items() if not role.startswith("gate_")}

    def release(vllm, root):
        engine = {"engine": "vllm", "versions": {"vllm": vllm, "torch": "2.9.0+cu128"}}
        engine["numerics"] = {"decisive": {"gpu": "NVIDIA B200"}}
        for candidate in candidates:
            _add_gates(
                gates, lambda stage, label: make_keyed_dir(stage, f"{root}/{label}"), candidate, engine
            )
        return _release(gates, tmp_path / root, cfg) / "repo"

    repo = release("0.33.1", "a")
    recipe = recipe_document(cfg, PLACEMENT)
    card = check_uploadable(repo, recipe, {"searched": 8.25, "poolside-nvfp4": None})
    assert card.data.base_model == "poolside/Laguna-S-2.1"
    assert "ran with vLLM 0.33.1 on NVIDIA B200, tensor parallel 4." in card.text
    assert "ran with vLLM 0.34.0 on NVIDIA B200" in (release("0.34.0", "b") / "README.md").read_text()


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("library_name: Model Optimizer", "library_name: transformers", "library_name"),
        ("license_link: https://docs.python.org/3/license.html\n", "", "license: other needs name and link"),
        ("`reference/`", "`data/toy-laguna`", "names 'data/toy-laguna'"),
        ("| `reference/prompt.safetensors` |", "| pin_prompt/prompt.safetensors |", "pin_prompt/prompt"),
        ("vllm serve <your-org>/", "vllm serve ", "vllm serve toy-laguna"),
        ("| searched | bfloat16 | 8.25 |", "| searched | bfloat16 | 4.5 |", "searched"),
    ],
)
def test_the_upload_check_finds_what_a_hub_user_would(upstream, tmp_path, old, new, problem):
    """The check fails on each problem a card could have: the wrong library, a license without its link, a
    local path, a file that is not in the repository, a bare model name to serve, a candidate's wrong bits."""
    cfg = toy_config()
    repo = _release(upstream, tmp_path, cfg) / "repo"
    recipe = recipe_document(cfg, PLACEMENT)
    bits = {"searched": 8.25, "modelopt-autoquantize": None, "uniform-nvfp4": 4.5, "bf16": 16.0}
    check_uploadable(repo, recipe, bits)
    card = (repo / "README.md").read_text()
    assert old in card
    (repo / "README.md").write_text(card.replace(old, new))
    with pytest.raises(AssertionError, match=problem):
        check_uploadable(repo, recipe, bits)


def _suite(gate: dict, mean: float) -> dict:
    """``gate`` with an evaluation suite as gate_kld writes it: two domains of 4 windows x 64 tokens."""
    domains = {
        name: {"mean": mean, "ci_low": mean * 0.9, "ci_high": mean * 1.1, "windows": 4, "positions": 4 * 63}
        for name in ("docs", "code")
    }
    improvement = None
    if gate["improvement"] is not None:
        per_domain = {
            name: {"reduction": 0.3, "ci_low": 0.1, "ci_high": 0.5, "windows": 4} for name in domains
        }
        improvement = {"reduction": 0.3, "ci_low": 0.2, "ci_high": 0.4, "windows": 8, "domains": per_domain}
    suite = {
        "aggregate": {**gate["aggregate"], "mean_kld": mean},
        "mean": {"mean": mean, "ci_low": mean * 0.9, "ci_high": mean * 1.1, "windows": 8, "positions": 8 * 63,
                 "domains": domains},
        "improvement": improvement,
        "baseline_mean_kld": 0.02,
        "noise_floor": 0.0,
        "engine_floor": 0.0,
        "windows": 8,
        "window_tokens": 64,
        "positions": 8 * 63,
    }  # fmt: skip
    checks = [{"name": "min_improvement", "value": 0.3, "limit": 0.1, "word": "pass", "passed": True}]
    gated = gate["candidate"] == "searched"
    verdict = {"word": "pass", "passed": True, "checks": checks if gated else []}
    return gate | {"protocol": "suite", "suite": suite, "verdict": verdict}


def test_a_suite_release_ships_the_report_and_the_per_domain_plots_its_card_shows(
    upstream, tmp_path, make_keyed_dir
):
    """With kld_report as an input: its report.json and per-domain KL CDF plots ship in kld/, and the card
    that embeds them and shows the suite, the decomposition and the verdict words uploads as is."""
    documents = {}
    for candidate in CANDIDATES:
        for kv in KV:
            gate = _suite(_gate(candidate, kv), 0.0 if candidate == "bf16" and kv == "bfloat16" else 0.01)
            _json(Path(upstream[f"gate_{candidate}_{kv}"]) / "aggregate.json", gate)
            documents[(candidate, kv)] = gate
    report_dir = make_keyed_dir("kld_report", "report")
    domains = [{"name": n, "source": f"data/eval/{n}.jsonl", "documents": 9, "windows": 4, "tokens": 256}
               for n in ("docs", "code")]  # fmt: skip
    disjoint = {"calibration_units": 40, "eval_units": 18, "shared": 0}
    facts = {"domains": domains, "window_tokens": 64, "windows": 8, "tokens": 512, "positions": 504,
             "token_ids_sha256": "d" * 64, "noise_floor": 0.0, "engine_floor": 0.0,
             "disjoint_from_calibration": disjoint}  # fmt: skip
    report = {
        "baseline": "uniform-nvfp4",
        "protocol": "suite",
        "verdicts": [],
        "suite": facts,
        "decomposition": decomposition(documents, "bf16"),
        "domains": domain_rows(documents),
        "interval_widths": None,
    }
    _json(report_dir / "report.json", report)
    plots = {kv: f"PNG of the {kv} KV cache".encode() for kv in KV}
    for kv, data in plots.items():
        (report_dir / f"kl_cdf_domains_{kv}.png").write_bytes(data)
    (report_dir / "kl_per_position_fp8.png").write_bytes(b"not shipped")
    write_manifest(report_dir, {"label": report_dir.name})
    cfg = toy_config()
    repo = _release(upstream | {"kld_report": report_dir}, tmp_path, cfg) / "repo"
    assert sorted(
        p.name for p in (repo / "kld").iterdir() if not p.name.endswith(f".{KV[0]}.json")
    ) == sorted(
        [
            *(f"{c}.{KV[1]}.json" for c in CANDIDATES),
            "report.json",
            *(f"kl_cdf_domains_{kv}.png" for kv in KV),
        ]
    )
    assert all((repo / "kld" / f"kl_cdf_domains_{kv}.png").read_bytes() == data for kv, data in plots.items())
    assert json.loads((repo / "kld" / "report.json").read_text())["suite"] == facts
    bits = {"searched": 8.25, "modelopt-autoquantize": None, "uniform-nvfp4": 4.5, "bf16": 16.0}
    card = check_uploadable(repo, recipe_document(cfg, PLACEMENT), bits)  # the plots it names are shipped
    assert "![KL(BF16 ‖ candidate) CDF per domain, fp8 KV cache](kld/kl_cdf_domains_fp8.png)" in card.text
    assert "| docs | a local JSONL file, SHA-256 `2b007856d26ffa66…` | 9 | 4 | 256 |" in card.text
    assert "| bf16 | bfloat16 | suite | 0 | 0 | 0 |" in card.text
    assert "| searched | fp8 | 8.25 | suite |" in card.text and "| PASS |" in card.text
    assert "on the evaluation suite: 2 pass, 6 not gated" in card.text


def test_shipped_records_name_no_local_directory_or_host():
    """A gate's aggregate as the release ships it: no checkpoint directory of the machine that made it and
    no host CPU, wherever they sit in the record; everything else as recorded."""
    from mixquant.release.bundle import shipped_document

    engine = {
        "checkpoint": {"directory": "results/export_checkpoint/ab", "quant_config_sha256": "c" * 64},
        "numerics": {"host": {"model": "Intel(R) Xeon(R)"}, "decisive": {"threads": 1}},
    }
    recorded = {"candidate": "searched", "engine": engine, "runs": [{"engine": engine, "mean_kld": 0.1}]}
    shipped = shipped_document(recorded)
    clean = {"checkpoint": {"quant_config_sha256": "c" * 64}, "numerics": {"decisive": {"threads": 1}}}
    assert shipped == {"candidate": "searched", "engine": clean, "runs": [{"engine": clean, "mean_kld": 0.1}]}
    assert recorded["engine"]["checkpoint"]["directory"]  # the record itself is left as it was
