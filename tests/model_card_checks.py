"""What makes a release's model card uploadable as is, checked the way the Hub reads it.

The card is parsed by huggingface_hub (``ModelCard.load``: the Hub's own YAML block and ``ModelCardData``
with metadata errors raised, not ignored), and its text is read as a user of the uploaded repository
reads it: every path it names (in backticks, code blocks or links) is a file of the repository, a URL or
a Hub repository id; the ``vllm serve`` commands name the repository id (or the placeholder); the KLD
table states each candidate's bits; the prompt token IDs ship beside the reference logits with the hash
the card states. Shared by tests/release (a synthetic bundle) and tests/workflow (the toy's real release).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from mixquant.calibration.tokens import load_token_ids, token_ids_sha256
from mixquant.keys.hashing import file_sha256
from mixquant.kld.run import logits_sha256
from safetensors import safe_open

LIBRARY_NAME = "Model Optimizer"  # NVIDIA's ModelOpt checkpoints on the Hub declare this library
PLACEHOLDER_ORG = "<your-org>"
PROMPT_FILE = "reference/prompt.safetensors"
LOGITS_FILE = "reference/logits.safetensors"

_FENCED = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FILE_NAME = re.compile(r"[\w./-]+\.(?:json|jsonl|yaml|yml|safetensors|md|txt|py|csv|png|bin|pt)\b")
_URL = re.compile(r"https?://\S+")


def _path_like(token: str) -> bool:
    return "/" in token or bool(_FILE_NAME.fullmatch(token))


def named_paths(body: str) -> list[str]:
    """Every path-like word in the card's code (fenced and inline) and link targets, and every file name
    in its plain text."""
    code = _FENCED.findall(body)
    plain = _FENCED.sub(" ", body)
    code += _INLINE.findall(plain)
    words = [word.strip(",.;:()'\"\\") for span in code for word in span.split()]
    words += _LINK.findall(plain)
    names = [word for word in words if word and _path_like(word)]
    names += _FILE_NAME.findall(_URL.sub(" ", _INLINE.sub(" ", plain)))
    return names


def hub_repo_ids(recipe: Mapping[str, Any]) -> set[str]:
    """The Hub repositories a recipe names (source model, tokenizer, datasets, release)."""
    ids = {(recipe[section].get("hub") or {}).get("repo") for section in ("model", "tokenizer")}
    if recipe["dataset"]["source"] == "hub":
        ids |= {member["repo"] for member in recipe["dataset"]["hub"]}
    ids |= {(c.get("hub") or {}).get("repo") for c in recipe["kld"]["candidates"]}
    ids.add(recipe["release"].get("repo_id"))
    return {repo for repo in ids if repo}


def kld_table_bits(body: str) -> dict[tuple[str, str], str]:
    """(candidate, KV-cache dtype) -> the bits cell of the card's KLD table."""
    # the comparison table: the decomposition and per-domain tables of a suite start alike, without bits
    lines = [line for line in body.splitlines() if line.startswith("| candidate | KV cache | bits |")]
    assert len(lines) == 1, "the card has one KLD table with the candidates' bits"
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert "bits" in header, f"the KLD table has no bits column: {header}"
    rows = body.split(lines[0], 1)[1].splitlines()[2:]
    table = {}
    for row in rows:
        if not row.startswith("|"):
            break
        cells = dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
        table[(cells["candidate"], cells["KV cache"])] = cells["bits"]
    return table


def stated_hashes(body: str) -> dict[str, tuple[str, str]]:
    """what -> (SHA-256, file) of the card's hash table."""
    header = "| what | kind | SHA-256 | file | encoding |"
    assert header in body, "the card has no hash table"
    rows = {}
    for row in body.split(header, 1)[1].splitlines()[2:]:
        if not row.startswith("|"):
            break
        what, _, sha, file, _ = (cell.strip() for cell in row.strip("|").split("|"))
        rows[what] = (re.search(r"`([0-9a-f]{64})`", sha).group(1), file.strip("`"))
    return rows


_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "bytes": 1}


def check_requirements(repo: Path, recipe: Mapping[str, Any], body: str) -> None:
    """The serving requirements: GPU architecture, the vLLM version the KLD runs recorded (the gate
    aggregates shipped in kld/), the weight memory per GPU from the shipped safetensors' sizes."""
    assert "- GPU: NVIDIA, compute capability 8.0 or newer." in body, "the card names no GPU architecture"
    engines = [
        json.loads(path.read_text()).get("engine") or {} for path in sorted((repo / "kld").glob("*.json"))
    ]
    versions = sorted({e["versions"]["vllm"] for e in engines if e.get("engine") == "vllm"})
    if versions:
        assert f"- vLLM: the KLD gates above ran with vLLM {', '.join(versions)}" in body, "vLLM version"
    else:
        assert "- vLLM: no vLLM run was gated for this release" in body, "no vLLM run"
    tp = recipe["kld"]["tensor_parallel_size"]
    total = sum(path.stat().st_size for path in repo.glob("*.safetensors"))
    match = re.search(
        rf"- GPU memory: ([0-9.,]+) (GiB|MiB|KiB|bytes) of weights per GPU at tensor parallel {tp} \(the "
        rf"safetensors files hold {total:,} bytes{f', split {tp} ways' if tp > 1 else ''}\)",
        body,
    )
    assert match, "the card states no weight memory per GPU from the shipped safetensors"
    scale = _UNITS[match.group(2)]
    rounding = 0.5 if scale == 1 else 0.005 * scale  # whole bytes, else two decimals
    assert abs(float(match.group(1).replace(",", "")) * scale - total / tp) <= rounding, match.group(0)


def check_uploadable(repo: Path, recipe: Mapping[str, Any], bits: Mapping[str, float | None]) -> ModelCard:
    """Assert that ``repo``'s README.md is a card the Hub takes as is; ``bits``: candidate -> expected bits
    (None: not known, an external checkpoint)."""
    card = ModelCard.load(repo / "README.md", ignore_metadata_errors=False)
    assert isinstance(card.data, ModelCardData)
    meta = card.data.to_dict()
    ModelCardData(**meta, ignore_metadata_errors=False)  # what the Hub validates the metadata into
    assert meta["library_name"] == LIBRARY_NAME, f"library_name {meta['library_name']!r}"
    assert meta["pipeline_tag"] == "text-generation", f"pipeline_tag {meta['pipeline_tag']!r}"
    release = recipe["release"]
    assert meta["license"] == release["license"], f"license {meta['license']!r}"
    if meta["license"] == "other":
        assert meta.get("license_name") and meta.get("license_link"), "license: other needs name and link"
        link = meta["license_link"]
        assert link.startswith("https://") or (repo / link).is_file(), link
    model = recipe["model"]
    if model["source"] == "hub":
        assert meta["base_model"] == model["hub"]["repo"], f"base_model {meta.get('base_model')!r}"
        assert meta["base_model_relation"] == "quantized", "base_model_relation"
    else:
        assert "base_model" not in meta, "base_model of a model that is on no Hub"
    name = meta["model_name"]
    served = release.get("repo_id") or f"{PLACEHOLDER_ORG}/{name}"
    # besides Hub repositories: the name of the ModelOpt recipe the placement settings mirror (ModelOpt's)
    allowed = hub_repo_ids(recipe) | {served, recipe["placement"].get("recipe")}

    body = card.text
    for path in named_paths(body):
        if path.startswith(("http://", "https://")) or path in allowed:
            continue
        assert (repo / path.rstrip("/")).exists(), f"the card names {path!r}, which is not in the repository"

    commands = [block for block in _FENCED.findall(body) if block.startswith("vllm serve ")]
    assert commands, "the card has no vllm serve command"
    for command in commands:
        assert command.split()[2] == served, command
    assert (PLACEHOLDER_ORG in body) == (not release.get("repo_id")), (
        "the placeholder, and only without repo_id"
    )

    table = kld_table_bits(body)
    candidates = [c["name"] for c in recipe["kld"]["candidates"]]
    assert sorted({candidate for candidate, _ in table}) == sorted(candidates), "the KLD table's candidates"
    for (candidate, _), cell in table.items():
        expected = bits[candidate]
        assert (cell == "—") if expected is None else (float(cell) == round(expected, 4)), (candidate, cell)
    check_requirements(repo, recipe, body)

    hashes = stated_hashes(body)
    prompt_sha, prompt_file = hashes["prompt token IDs"]
    assert prompt_file == PROMPT_FILE, f"the prompt token IDs' hash names {prompt_file!r}"
    assert token_ids_sha256(load_token_ids(repo / PROMPT_FILE)) == prompt_sha, "the prompt token IDs' hash"
    logits_sha, logits_file = hashes["BF16 reference logits"]
    assert logits_file == LOGITS_FILE, f"the reference logits' hash names {logits_file!r}"
    with safe_open(str(repo / LOGITS_FILE), framework="pt") as handle:
        assert logits_sha256(handle.get_tensor("logits")) == logits_sha, "the reference logits' hash"
    for what, (sha, file) in hashes.items():
        assert (repo / file).is_file(), f"the hash table names {file!r}, which is not in the repository"
        if what not in ("prompt token IDs", "BF16 reference logits"):  # of the file's bytes
            assert file_sha256(repo / file) == sha, f"the hash of {file}"
    return card
