"""How close our reference logits are to the published ones, on a reference-logits mismatch: the published
logits given (``--against``: a reference_logits output, a release directory or a logits.safetensors file) or
a reference_logits output whose logits hash to the published value; the largest absolute logit difference,
the mean KL(published || ours) over positions, the top-1 agreement and the recorded engine settings that
differ."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mixquant.jsonio import diff_values
from mixquant.keys.hashing import is_sha256_hex
from mixquant.kld.run import logits_sha256
from mixquant.kld.stats import kld_statistics
from mixquant.release.bundle import release_repo
from mixquant.release.hashes import (
    LOGITS_FILE,
    NUMERICS_JSON,
    RELEASE_REFERENCE_DIR,
    recorded_numerics,
    reference_document,
)
from mixquant.release.report import VerifyInputError


def find_published_reference(
    results_dir: str | Path, published_sha256: str, exclude: Path | None = None
) -> Path | None:
    """A reference_logits output under `results_dir` whose recorded logits hash is the published one."""
    root = Path(results_dir) / "reference_logits"
    if not root.is_dir():
        return None
    for directory in sorted(root.iterdir()):
        if not is_sha256_hex(directory.name) or not (directory / LOGITS_FILE).is_file():
            continue
        if exclude is not None and directory.resolve() == exclude.resolve():
            continue
        if reference_document(directory).get("sha256") == published_sha256:
            return directory
    return None


def published_logits(against: str | Path) -> tuple[Path, Path, dict[str, Any] | None]:
    """(the logits file, the directory of its record, the decisive fingerprint recorded) of `--against`.

    Accepted: a reference_logits output (logits.safetensors + reference.json), a release directory
    (reference/logits.safetensors + reference/reference.json, numerics.json) or a logits file (its
    record, if any, beside it). The fingerprint is the record's, else the release's numerics.json.
    """
    path = Path(against)
    if path.is_dir():
        path = release_repo(path)  # an assemble_release output: its repo/
    if path.is_file():
        logits, record = path, path.parent
    elif (path / LOGITS_FILE).is_file():
        logits, record = path / LOGITS_FILE, path
    elif (path / RELEASE_REFERENCE_DIR / LOGITS_FILE).is_file():
        logits, record = path / RELEASE_REFERENCE_DIR / LOGITS_FILE, path / RELEASE_REFERENCE_DIR
    else:
        raise VerifyInputError(
            f"--against {path}: no {LOGITS_FILE} there (give a reference_logits output, a release directory "
            f"or a {LOGITS_FILE} file)"
        )
    numerics = recorded_numerics(reference_document(record))
    release_numerics = path / NUMERICS_JSON
    if numerics is None and record != path and release_numerics.is_file():
        numerics = json.loads(release_numerics.read_text("utf-8"))
    return logits, record, numerics


def _engine_record(document: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings and info a reference.json records, without the fingerprint (compared apart)."""
    engine = document.get("engine")
    if isinstance(engine, Mapping):
        engine = {name: value for name, value in engine.items() if name != "numerics"}
    return {"engine_settings": document.get("engine_settings"), "engine": engine}


def logits_closeness(published, ours) -> dict[str, Any]:
    """max |published - ours|, mean KL(published || ours) and top-1 agreement over the positions."""
    difference = (published.to(torch.float64) - ours.to(torch.float64)).abs()
    # KL needs no next tokens; kld_statistics wants some for its next-token statistics.
    stats = kld_statistics(published, ours, torch.zeros(published.shape[0], dtype=torch.long))
    per_position = stats["per_position"]
    return {
        "positions": int(published.shape[0]),
        "max_abs_diff": float(difference.max()),
        "mean_kl": float(per_position["kl"].mean()),
        "top1_agreement": float(per_position["top1_same"].to(torch.float64).mean()),
    }


def compare_reference_logits(
    ours_dir: str | Path,
    published_sha256: str,
    *,
    results_dir: str | Path,
    against: str | Path | None = None,
) -> dict[str, Any]:
    """How close our reference logits are to the published ones (see the module docstring).

    `against` names the published logits (:func:`published_logits`); without it a reference_logits output
    with the published hash is searched for under ``results_dir/reference_logits/``. ``found`` is False
    (with a ``note``) when none is known.
    """
    ours_dir = Path(ours_dir)
    if against is None:
        against = find_published_reference(results_dir, published_sha256, exclude=ours_dir)
        if against is None:
            return {
                "found": False,
                "note": f"no reference_logits output under {Path(results_dir) / 'reference_logits'} has the "
                f"published logits hash {published_sha256[:12]}; give the published logits with --against "
                f"(a reference_logits output, a release directory or a {LOGITS_FILE} file) to compare",
            }
    logits_file, record, their_numerics = published_logits(against)
    tensors = load_file(str(logits_file))
    if "logits" not in tensors:
        raise VerifyInputError(f"--against {against}: {logits_file} has no 'logits' tensor")
    ref = tensors["logits"]
    their_sha = logits_sha256(ref)
    their = reference_document(record)
    if their.get("sha256") not in (None, their_sha):
        raise VerifyInputError(
            f"--against {against}: {logits_file} hashes to {their_sha} but {record}/reference.json records "
            f"{their['sha256']} (not the record of these logits)"
        )
    cand = load_file(str(ours_dir / LOGITS_FILE))["logits"]
    result: dict[str, Any] = {
        "found": True,
        "against": str(against),
        "against_file": str(logits_file),
        "against_sha256": their_sha,
        "against_is_published": their_sha == published_sha256,
        "against_numerics": their_numerics,
        "shape_published": list(ref.shape),
        "shape_ours": list(cand.shape),
    }
    if ref.shape != cand.shape:
        result["note"] = "the logits have different shapes: no per-position comparison"
    else:
        result.update(logits_closeness(ref, cand))
    if not their:
        result["engine_differences"] = None  # no record beside the published logits: nothing to compare
    else:
        result["engine_differences"] = [
            {"field": where, "published": left, "ours": right}
            for where, left, right in diff_values(
                _engine_record(their), _engine_record(reference_document(ours_dir))
            )
        ]
    return result
