"""Compare the release's four re-derived hashes with the published ones (``mixquant verify``, verify_hashes).

Per hash the status is ``match``, ``mismatch`` (expected, got, the artifact file and its encoding) or
``not pinned`` (no published value). On a reference-logits mismatch :func:`compare_reference_logits` says
how close the numbers are: it looks for a reference_logits output whose logits hash to the published
value (or takes the one given) and reports the largest absolute logit difference, the mean
KL(published || ours) over positions and the recorded engine settings that differ.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.jsonio import diff_values
from mixquant.keys.hashing import is_sha256_hex, require_sha256_hex
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.release.hashes import (
    HASH_NAMES,
    HASHERS,
    LOGITS_FILE,
    HashRecord,
    HashSourceError,
    reference_document,
    reference_logits_hash,
)

log = logging.getLogger(__name__)

VERIFY_JSON = "verify.json"
MATCH, MISMATCH, NOT_PINNED = "match", "mismatch", "not pinned"
# The artifact each hash is read from, as `mixquant.keys.artifacts` names it.
SOURCE_ARTIFACTS = {
    "prompt": "pin_prompt",
    "reference_logits": "reference_logits",
    "checkpoint": "export_checkpoint",
}


class VerifyInputError(ValueError):
    """An artifact verify needs is not built (one line naming the stage)."""


class HashMismatchError(RuntimeError):
    """A re-derived hash differs from the published one (one line naming the hash)."""


@dataclass(frozen=True)
class HashCheck:
    """One hash compared: `record` is None only for an unpinned hash whose file does not exist (`note`)."""

    name: str
    status: str
    expected: str | None
    record: HashRecord | None
    note: str | None = None

    @property
    def got(self) -> str | None:
        return None if self.record is None else self.record.sha256

    def to_json(self) -> dict[str, Any]:
        record = {"artifact": None, "encoding": None} if self.record is None else self.record.to_json()
        record.pop("name", None)
        record.pop("sha256", None)
        return {
            "status": self.status,
            "expected": self.expected,
            "got": self.got,
            "note": self.note,
            **record,
        }


@dataclass
class VerifyReport:
    checks: list[HashCheck]
    logits_comparison: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def mismatches(self) -> list[HashCheck]:
        return [check for check in self.checks if check.status == MISMATCH]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "counts": {
                status: sum(c.status == status for c in self.checks)
                for status in (MATCH, MISMATCH, NOT_PINNED)
            },
            "hashes": {check.name: check.to_json() for check in self.checks},
            "reference_logits_comparison": self.logits_comparison,
        }


def published_values(published: Mapping[str, Any] | Any) -> dict[str, str | None]:
    """{hash name: published SHA-256 or None} from config ``published`` (a model or a dict)."""
    if not isinstance(published, Mapping):
        published = published.model_dump(mode="json")
    unknown = sorted(set(published) - set(HASH_NAMES))
    if unknown:
        raise ValueError(f"published: unknown hash {unknown[0]!r} (known: {', '.join(HASH_NAMES)})")
    values = {}
    for name in HASH_NAMES:
        value = published.get(name)
        values[name] = None if value in (None, "") else require_sha256_hex(value, f"published.{name}")
    return values


def check_hashes(
    published: Mapping[str, Any] | Any,
    *,
    prompt: str | Path,
    reference_logits: str | Path,
    checkpoint: str | Path,
) -> list[HashCheck]:
    """One :class:`HashCheck` per hash, in :data:`HASH_NAMES` order.

    A missing source file is an error (:class:`HashSourceError`) for a pinned hash; an unpinned one is
    reported ``not pinned`` with a note (an all-BF16 export writes no hf_quant_config.json).
    """
    expected = published_values(published)
    dirs = {"prompt": prompt, "reference_logits": reference_logits, "checkpoint": checkpoint}
    checks = []
    for name in HASH_NAMES:
        want = expected[name]
        function, source = HASHERS[name]
        try:
            record = function(dirs[source])
        except HashSourceError as error:
            if want is not None:
                raise
            checks.append(HashCheck(name, NOT_PINNED, None, None, note=str(error)))
            continue
        status = NOT_PINNED if want is None else MATCH if record.sha256 == want else MISMATCH
        checks.append(HashCheck(name, status, want, record))
    return checks


def mismatch_line(report: VerifyReport) -> str:
    """One line naming every mismatched hash with expected and got."""
    parts = []
    for check in report.mismatches:
        art = check.record.artifact
        parts.append(
            f"{check.name} is {check.got}, published {check.expected} ({art.stage} {art.key[:12]} {art.file})"
        )
    return "published hash mismatch: " + "; ".join(parts)


# -------------------------------------------------------------------------- how close are the logits


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


def compare_reference_logits(
    ours_dir: str | Path,
    published_sha256: str,
    *,
    results_dir: str | Path,
    against: str | Path | None = None,
) -> dict[str, Any]:
    """How close our reference logits are to the published ones (see the module docstring).

    `against` names the published logits' reference_logits directory; without it one is searched for
    under ``results_dir/reference_logits/``. ``found`` is False (with a ``note``) when none is known.
    """
    import torch
    from safetensors.torch import load_file

    from mixquant.kld.stats import kld_statistics

    ours_dir = Path(ours_dir)
    if against is None:
        theirs = find_published_reference(results_dir, published_sha256, exclude=ours_dir)
        if theirs is None:
            return {
                "found": False,
                "note": f"no reference_logits output under {Path(results_dir) / 'reference_logits'} has the "
                f"published logits hash {published_sha256[:12]}; give one with --against DIR to compare",
            }
    else:
        theirs = Path(against)
        if not (theirs / LOGITS_FILE).is_file():
            raise VerifyInputError(
                f"--against {theirs}: no {LOGITS_FILE} there (give a reference_logits output)"
            )
    their_sha = reference_logits_hash(theirs).sha256
    ref = load_file(str(theirs / LOGITS_FILE))["logits"]
    cand = load_file(str(ours_dir / LOGITS_FILE))["logits"]
    result: dict[str, Any] = {
        "found": True,
        "against": str(theirs),
        "against_sha256": their_sha,
        "against_is_published": their_sha == published_sha256,
        "shape_published": list(ref.shape),
        "shape_ours": list(cand.shape),
    }
    if ref.shape != cand.shape:
        result["note"] = "the logits have different shapes: no per-position comparison"
    else:
        difference = (ref.to(torch.float64) - cand.to(torch.float64)).abs()
        # KL needs no next tokens; kld_statistics wants some for its next-token statistics.
        stats = kld_statistics(ref, cand, torch.zeros(ref.shape[0], dtype=torch.long))
        result.update(
            positions=int(ref.shape[0]),
            max_abs_diff=float(difference.max()),
            mean_kl=float(stats["per_position"]["kl"].mean()),
        )
    recorded = ("engine_settings", "engine")
    mine, their = reference_document(ours_dir), reference_document(theirs)
    result["engine_differences"] = [
        {"field": where, "published": left, "ours": right}
        for where, left, right in diff_values(
            {k: their.get(k) for k in recorded}, {k: mine.get(k) for k in recorded}
        )
    ]
    return result


# ----------------------------------------------------------------------------------- entry points


def verify_dirs(
    published: Mapping[str, Any] | Any,
    *,
    prompt: str | Path,
    reference_logits: str | Path,
    checkpoint: str | Path,
    results_dir: str | Path | None = None,
    against: str | Path | None = None,
) -> VerifyReport:
    """Re-derive the four hashes from the given keyed directories and compare them with `published`.

    With `results_dir` (or `against`), a reference-logits mismatch also gets :func:`compare_reference_logits`.
    """
    dirs = {"prompt": prompt, "reference_logits": reference_logits, "checkpoint": checkpoint}
    report = VerifyReport(check_hashes(published, **dirs))
    logits = next(c for c in report.checks if c.name == "reference_logits")
    if logits.status == MISMATCH and (results_dir is not None or against is not None):
        report.logits_comparison = compare_reference_logits(
            reference_logits, logits.expected, results_dir=results_dir or ".", against=against
        )
    return report


def verify_artifacts(
    artifacts: Mapping[str, Any],
    published: Mapping[str, Any] | Any,
    *,
    results_dir: str | Path,
    against: str | Path | None = None,
) -> VerifyReport:
    """:func:`verify_dirs` on the planned artifacts of a config (``mixquant.keys.artifacts``).

    A source that is not built raises :class:`VerifyInputError` naming its stage.
    """
    dirs = {}
    for name, stage in SOURCE_ARTIFACTS.items():
        art = artifacts.get(name)
        if art is None:  # a placement search: the checkpoint is known once solve_placement ran
            placement = artifacts.get("placement")
            where = f" ({placement.path} is not built)" if placement is not None else ""
            raise VerifyInputError(
                f"{stage}: the checkpoint is not planned yet{where}; run the workflow first (snakemake)"
            )
        if not art.done:
            raise VerifyInputError(f"{stage}: {art.path} is not built; run the workflow first (snakemake)")
        dirs[name] = art.path
    return verify_dirs(published, **dirs, results_dir=results_dir, against=against)


def format_report(report: VerifyReport) -> str:
    """A compact table: one row per hash, then the details of every mismatch and the logits comparison."""
    rows = [("hash", "status", "published", "ours", "artifact")]
    for check in report.checks:
        art = None if check.record is None else check.record.artifact
        where = f"{art.stage}/{art.key[:12]}/{art.file}" if art is not None else check.note or "-"
        rows.append((check.name, check.status, (check.expected or "-")[:12], (check.got or "-")[:12], where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    for check in report.mismatches:
        lines += [
            f"{check.name}: mismatch",
            f"  published {check.expected}",
            f"  ours      {check.got}",
            f"  artifact  {check.record.artifact.path}",
            f"  encoding  {check.record.encoding}",
        ]
    comparison = report.logits_comparison
    if comparison is not None:
        if not comparison["found"]:
            lines.append(f"reference logits: {comparison['note']}")
        else:
            published = "published" if comparison["against_is_published"] else "NOT the published hash"
            lines.append(f"reference logits vs {comparison['against']} ({published}):")
            if "max_abs_diff" in comparison:
                lines.append(
                    f"  max |diff| {comparison['max_abs_diff']:.6g}, mean KL(published || ours) "
                    f"{comparison['mean_kl']:.6g} over {comparison['positions']} positions"
                )
            else:
                lines.append(f"  {comparison['note']}")
            diffs = comparison["engine_differences"]
            if not diffs:
                lines.append("  recorded engine settings: identical")
            for diff in diffs:
                theirs, ours = json.dumps(diff["published"]), json.dumps(diff["ours"])
                lines.append(f"  {diff['field']}: published {theirs}, ours {ours}")
    counts = report.to_json()["counts"]
    lines.append(f"{counts[MATCH]} match, {counts[MISMATCH]} mismatch, {counts[NOT_PINNED]} not pinned")
    return "\n".join(lines)


def run_verify_hashes(
    out_dir: str | Path,
    *,
    prompt: str | Path,
    reference_logits: str | Path,
    checkpoint: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """Stage verify_hashes: verify.json when nothing mismatches, else one line naming the hash, no output."""
    report = verify_dirs(
        settings["published"], prompt=prompt, reference_logits=reference_logits, checkpoint=checkpoint
    )
    for check in report.checks:
        where = check.record.artifact.path if check.record is not None else check.note
        log.info("%s: %s (%s, %s)", check.name, check.status, check.got, where)
    if not report.ok:
        raise HashMismatchError(mismatch_line(report) + "; `mixquant verify` says how close the logits are")
    document = report.to_json()
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / VERIFY_JSON).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", "utf-8")
        summary.update(counts=document["counts"])
    return Path(out_dir)
