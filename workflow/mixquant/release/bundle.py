"""Stage entry point for assemble_release: the release directory users download.

The keyed directory holds mixquant's bookkeeping (``manifest.json``, Snakemake's ``.snakemake_timestamp``)
beside ``repo/``, the directory to publish -- only what a model repository holds::

    results/assemble_release/<key>/manifest.json       bookkeeping (not published)
    results/assemble_release/<key>/repo/               e.g. huggingface-cli upload ORG/NAME .../repo

``repo/`` (a Hugging Face model repository)::

    model-0000k-of-0000N.safetensors, model.safetensors.index.json, config.json,
    hf_quant_config.json, tokenizer files, ...   the checkpoint (hardlinked from export_checkpoint)
    checkpoint_audit.json                         the export's audit (inspection vs prediction)
    placement_audit.json                          solve_placement's audit (with a search)
    refine_audit.json                             refine_placement's audit (with a refined search)
    quantization_recipe.yaml                      the resolved config + the placement: replays the build
    kld/<candidate>.<kv dtype>.json               gate_kld's aggregate per candidate x KV-cache dtype
    kld/report.json, kld/kl_cdf_domains_<kv>.png  kld_report's report (the suite, the decomposition, the
                                                  per-domain rows) and its per-domain KL CDF plots
    reference/logits.safetensors, reference.json  the BF16 reference logits and their record
    reference/prompt.safetensors                  the pinned prompt's token IDs the logits belong to
    numerics.json                                 the decisive numerics fingerprint they were made under
    README.md                                     the model card (mixquant.release.card)

Checkpoint files are hardlinked where the file system allows (the keyed directories are immutable, so
sharing inodes is safe and a 92 GB checkpoint is not copied), else copied.

The reference logits ship, with the prompt's token IDs they belong to, because their hash is a numerical
one (mixquant.release.hashes): on a machine whose numerics fingerprint differs they do not reproduce bit
for bit, and ``mixquant verify --against RELEASE`` then says how close they are. numerics.json holds
only the fingerprint's decisive part (what config ``published.numerics`` takes); its host part (CPU model,
...) goes to the log, so the release of a rerun elsewhere under the same fingerprint is the same.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from mixquant.export.files import AUDIT_FILE as CHECKPOINT_AUDIT
from mixquant.export.files import QUANT_CONFIG_FILE
from mixquant.jsonio import read_json
from mixquant.keys.hashing import require_sha256_hex
from mixquant.keys.manifest import MANIFEST, SNAKEMAKE_TIMESTAMP, publish_keyed_dir
from mixquant.kld.run import AGGREGATE_JSON, LOGITS_FILE, REFERENCE_JSON, REPORT_JSON, VERDICT_JSON
from mixquant.release.card_kld import DOMAIN_PLOT_PREFIX
from mixquant.release.recipe import RECIPE_FILE, recipe_yaml
from mixquant.search.refine import REFINE_AUDIT_FILE
from mixquant.search.run import AUDIT_FILE as PLACEMENT_AUDIT

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
REPO_DIR = "repo"  # the publishable directory inside the keyed one
KLD_DIR = "kld"
_SKIPPED = {MANIFEST, SNAKEMAKE_TIMESTAMP}


class ReleaseInputError(RuntimeError):
    """An upstream output the release needs is missing or inconsistent (one line naming it)."""


def _keyed_dir(path: str | Path, what: str) -> Path:
    directory = Path(path)
    require_sha256_hex(directory.name, f"{what} directory {directory}")
    if not (directory / MANIFEST).is_file():
        raise ReleaseInputError(f"{what} {directory}: not a finished mixquant output (no {MANIFEST})")
    return directory


def release_repo(release_dir: str | Path) -> Path:
    """The publishable directory of an assemble_release output (or ``release_dir`` if it is one)."""
    release_dir = Path(release_dir)
    return release_dir / REPO_DIR if (release_dir / REPO_DIR).is_dir() else release_dir


def link_or_copy(source: Path, target: Path) -> None:
    """Hardlink `source` to `target` (same file system), else copy it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The export's files, relative paths, without mixquant's manifest and Snakemake's timestamp."""
    return sorted(
        p.relative_to(checkpoint)
        for p in checkpoint.rglob("*")
        if p.is_file() and p.relative_to(checkpoint).as_posix() not in _SKIPPED
    )


def gate_file_name(candidate: str, kv: str) -> str:
    return f"{KLD_DIR}/{candidate}.{kv}.json"


def shipped_document(document: dict[str, Any]) -> dict[str, Any]:
    """A record (reference.json, a gate's aggregate) as the release ships it: every numerics fingerprint
    without its host part (informative only) and every checkpoint without the directory it was read from
    on the machine that made it (its hashes name it)."""
    shipped = copy.deepcopy(document)
    stack: list[Any] = [shipped]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for name, field in (("numerics", "host"), ("checkpoint", "directory")):
                if isinstance(node.get(name), dict):
                    node[name].pop(field, None)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return shipped


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def passed_inputs(checkpoint_dir: Path, verdict: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The KLD verdict and the checkpoint audit, once both say the release may ship (else one line why)."""
    verdict_doc = read_json(
        _keyed_dir(verdict, "check_kld_gates") / VERDICT_JSON, "KLD verdict", error=ReleaseInputError
    )
    if not verdict_doc.get("passed"):
        raise ReleaseInputError(f"check_kld_gates {Path(verdict).name}: the KLD gates did not pass")
    audit = read_json(checkpoint_dir / CHECKPOINT_AUDIT, "checkpoint audit", error=ReleaseInputError)
    if not all(audit["agreement"].values()):
        raise ReleaseInputError(
            f"export_checkpoint {checkpoint_dir.name}: audit disagrees {audit['agreement']}"
        )
    return verdict_doc, audit


def read_gate_documents(recipe: dict[str, Any], gates: dict[str, str | Path]) -> list[tuple[str, dict]]:
    """(role, aggregate) of every gate_kld input the recipe's candidates and KV dtypes call for, in order."""
    gate_docs = []
    for candidate in recipe["kld"]["candidates"]:
        for kv in recipe["kld"]["kv_cache_dtypes"]:
            role = f"gate_{candidate['name']}_{kv}"
            if role not in gates:
                raise ReleaseInputError(f"assemble_release: no gate_kld input for {candidate['name']} / {kv}")
            gate_docs.append(
                (
                    role,
                    read_json(
                        _keyed_dir(gates[role], "gate_kld") / AGGREGATE_JSON,
                        "KLD aggregate",
                        error=ReleaseInputError,
                    ),
                )
            )
    unknown = sorted(set(gates) - {role for role, _ in gate_docs})
    if unknown:
        raise ReleaseInputError(f"assemble_release: unexpected input {unknown[0]!r}")
    return gate_docs


def read_report(kld_report: str | Path | None) -> tuple[dict[str, Any] | None, list[Path]]:
    """kld_report's ``report.json`` and its per-domain KL CDF plots (None and none without the input)."""
    if kld_report is None:
        return None, []
    directory = _keyed_dir(kld_report, "kld_report")
    report = read_json(directory / REPORT_JSON, "KLD report", error=ReleaseInputError)
    plot_name = DOMAIN_PLOT_PREFIX.removeprefix(f"{KLD_DIR}/")
    return report, sorted(directory.glob(f"{plot_name}*.png"))


def write_repo(
    tmp: Path,
    *,
    checkpoint_dir: Path,
    recipe_text: str,
    placement: str | Path | None,
    gate_docs: list[dict[str, Any]],
    refined: Path | None = None,
    reference_dir: Path,
    prompt_dir: Path,
    reference_doc: dict[str, Any],
    numerics: dict[str, Any],
    card: str,
    report: dict[str, Any] | None = None,
    plots: list[Path] | None = None,
) -> None:
    """The release repository's files into ``tmp``: the checkpoint, the recipe, the placement audit, the
    gates' records, the KLD report and its per-domain plots, the reference logits with their prompt, the
    numerics fingerprint and the model card."""
    from mixquant.release.hashes import (
        NUMERICS_JSON,
        PROMPT_FILE,
        RELEASE_REFERENCE_DIR,
    )  # lazy: imports torch

    for relative in checkpoint_files(checkpoint_dir):
        link_or_copy(checkpoint_dir / relative, tmp / relative)
    (tmp / RECIPE_FILE).write_text(recipe_text, encoding="utf-8")
    if placement is not None:
        shutil.copyfile(Path(placement) / PLACEMENT_AUDIT, tmp / PLACEMENT_AUDIT)
    if refined is not None:
        shutil.copyfile(refined / REFINE_AUDIT_FILE, tmp / REFINE_AUDIT_FILE)
    for doc in gate_docs:
        target = tmp / gate_file_name(doc["candidate"], doc["kv_cache_dtype"])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_json_text(shipped_document(doc)), encoding="utf-8")
    if report is not None:
        (tmp / KLD_DIR).mkdir(exist_ok=True)
        (tmp / KLD_DIR / REPORT_JSON).write_text(_json_text(shipped_document(report)), encoding="utf-8")
    for plot in plots or []:
        link_or_copy(plot, tmp / KLD_DIR / plot.name)
    link_or_copy(reference_dir / LOGITS_FILE, tmp / RELEASE_REFERENCE_DIR / LOGITS_FILE)
    link_or_copy(prompt_dir / PROMPT_FILE, tmp / RELEASE_REFERENCE_DIR / PROMPT_FILE)
    (tmp / RELEASE_REFERENCE_DIR / REFERENCE_JSON).write_text(
        _json_text(shipped_document(reference_doc)), encoding="utf-8"
    )
    (tmp / NUMERICS_JSON).write_text(_json_text(numerics), encoding="utf-8")
    (tmp / CARD_FILE).write_text(card, encoding="utf-8")


def run_assemble_release(
    out_dir: str | Path,
    *,
    model: str | Path,
    checkpoint: str | Path,
    prompt: str | Path,
    reference: str | Path,
    verdict: str | Path,
    placement: str | Path | None = None,
    refined: str | Path | None = None,
    kld_report: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    **gates: str | Path,
) -> Path:
    """Assemble the release directory from the keyed outputs (``gates``: gate_<candidate>_<kv> -> dir)."""
    from mixquant.release.card import CardInputs, model_card  # lazy: imports torch
    from mixquant.release.hashes import (  # lazy: imports torch
        NUMERICS_JSON,
        PROMPT_FILE,
        RELEASE_REFERENCE_DIR,
        recorded_numerics,
        reference_document,
        release_hashes,
    )

    recipe = settings["recipe"]
    checkpoint_dir = _keyed_dir(checkpoint, "export_checkpoint")
    verdict_doc, audit = passed_inputs(checkpoint_dir, verdict)
    placement_audit = None
    if placement is not None:
        placement_audit = read_json(
            _keyed_dir(placement, "solve_placement") / PLACEMENT_AUDIT,
            "placement audit",
            error=ReleaseInputError,
        )
    refine_audit = None
    if refined is not None:
        refine_audit = read_json(
            _keyed_dir(refined, "refine_placement") / REFINE_AUDIT_FILE,
            "refine audit",
            error=ReleaseInputError,
        )
    gate_docs = read_gate_documents(recipe, gates)
    report, plots = read_report(kld_report)
    reference_dir = _keyed_dir(reference, "reference_logits")
    prompt_dir = _keyed_dir(prompt, "pin_prompt")
    hashes = release_hashes(prompt_dir, reference_dir, checkpoint_dir)
    reference_doc = reference_document(reference_dir)
    numerics = recorded_numerics(reference_doc)
    if numerics is None:
        raise ReleaseInputError(
            f"reference_logits {reference_dir.name}: {REFERENCE_JSON} records no numerics fingerprint "
            "(made before mixquant recorded it); rebuild reference_logits"
        )
    host = (reference_doc.get("numerics") or {}).get("host")
    log.info("reference logits numerics host (informative, not shipped): %s", json.dumps(host))
    hf_quant_config = read_json(
        checkpoint_dir / QUANT_CONFIG_FILE, QUANT_CONFIG_FILE, error=ReleaseInputError
    )
    model_config = read_json(checkpoint_dir / "config.json", "config.json", error=ReleaseInputError)
    upstream_keys = preimage["upstream"]

    files = [p.as_posix() for p in checkpoint_files(checkpoint_dir)]
    extra = [RECIPE_FILE] + ([PLACEMENT_AUDIT] if placement_audit is not None else [])
    extra += [REFINE_AUDIT_FILE] if refine_audit is not None else []
    extra += [gate_file_name(doc["candidate"], doc["kv_cache_dtype"]) for _, doc in gate_docs]
    extra += [f"{KLD_DIR}/{REPORT_JSON}"] if report is not None else []
    extra += [f"{KLD_DIR}/{plot.name}" for plot in plots]
    shipped_reference = [
        f"{RELEASE_REFERENCE_DIR}/{LOGITS_FILE}",
        f"{RELEASE_REFERENCE_DIR}/{PROMPT_FILE}",
        f"{RELEASE_REFERENCE_DIR}/{REFERENCE_JSON}",
    ]
    extra += [NUMERICS_JSON, *shipped_reference]
    inputs = CardInputs(
        recipe=recipe,
        inspection=audit["inspection"],
        hf_quant_config=hf_quant_config,
        gates=[doc for _, doc in gate_docs],
        hashes={name: record.to_json() for name, record in hashes.items()},
        keys=upstream_keys,
        producer=audit["producer"],
        verdict=verdict_doc,
        placement_audit=placement_audit,
        refine_audit=refine_audit,
        model_type=model_config.get("model_type"),
        files=sorted(files + extra),
        numerics=numerics,
        weight_bytes=sum(
            (checkpoint_dir / name).stat().st_size for name in files if name.endswith(".safetensors")
        ),
        report=report,
    )
    card = model_card(inputs)
    header = [
        "mixquant quantization recipe: the resolved settings of this release, with the placement the",
        "search chose written down (placement.source: explicit). Rebuild the checkpoint from it alone:",
        "  snakemake --cores all --configfile quantization_recipe.yaml",
        f"Checkpoint key: {upstream_keys['checkpoint']}",
    ]
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as keyed:
        tmp = keyed / REPO_DIR
        tmp.mkdir()
        write_repo(
            tmp,
            checkpoint_dir=checkpoint_dir,
            recipe_text=recipe_yaml(recipe, header),
            placement=placement if placement_audit is not None else None,
            refined=None if refine_audit is None else _keyed_dir(refined, "refine_placement"),
            gate_docs=[doc for _, doc in gate_docs],
            reference_dir=reference_dir,
            prompt_dir=prompt_dir,
            reference_doc=reference_doc,
            numerics=numerics,
            card=card,
            report=report,
            plots=plots,
        )
        summary.update(
            hashes={name: record.sha256 for name, record in hashes.items()},
            numerics=numerics,
            placement_counts=audit["inspection"]["placement_counts"],
            routed_effective_bits=audit["inspection"]["routed_effective_bits"],
        )
    log.info("release assembled: %s", out_dir)
    return Path(out_dir)
