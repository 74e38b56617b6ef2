"""Compare the release's four re-derived hashes with the published ones (``mixquant verify``, verify_hashes).

Per hash the status is ``match``, ``mismatch`` (expected, got, the artifact file and its encoding),
``not pinned`` (no published value) or ``not comparable``, and the kind is ``content`` or ``numerical``
(:data:`mixquant.release.hashes.HASH_KINDS`).

A published hash belongs to what was published: config ``published.made_from`` pins, beside the hashes,
the recipe of each artifact they were read from (:attr:`mixquant.keys.artifacts.Artifact.recipe`: the
key without code and package versions) and a short hash of each config section. When the planned
artifact's recipe is another one (an experiment: another budget, more calibration samples), its hashes
differ by construction: they are ``not comparable``, reported with the config sections that differ from
the published ones, and pass; ``mixquant verify --strict`` (or ``published.strict``) fails on them.
``mixquant verify --made-from`` prints the block to pin for the config's own artifacts.

The policy (:meth:`VerifyReport.failures`). A content mismatch always fails: the same code on the same
inputs writes the same token IDs and JSON bytes on every machine. A numerical mismatch (the reference
logits) is judged by the decisive numerics fingerprints (:func:`mixquant.numerics.fingerprint`): ours,
which reference.json records, and the published one (config ``published.numerics``, a release's
numerics.json). Under equal fingerprints -- or an unknown one -- the bits should have reproduced, so it
fails; under different ones the logits are "not reproducible bit for bit here": reported with the
differing fields and passed. ``mixquant verify --strict`` fails on any mismatch.

On a reference-logits mismatch :func:`compare_reference_logits` says how close the numbers are: it takes
the published logits given (``--against``: a reference_logits output, a release directory or a
logits.safetensors file) or looks for a reference_logits output whose logits hash to the published value,
and reports the largest absolute logit difference, the mean KL(published || ours) over positions, the
top-1 agreement and the recorded engine settings that differ.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.jsonio import diff_values
from mixquant.keys.hashing import is_sha256_hex
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.numerics import fingerprint_differences
from mixquant.release.hashes import (
    CONTENT,
    HASH_KINDS,
    HASH_NAMES,
    HASHERS,
    LOGITS_FILE,
    NUMERICAL,
    NUMERICS_JSON,
    RELEASE_REFERENCE_DIR,
    HashRecord,
    HashSourceError,
    numerics_text,
    recorded_numerics,
    reference_document,
)
from mixquant.release.published import (
    SOURCE_ARTIFACTS,
    comparability,
    published_made_from,
    published_strict,
    published_values,
)

log = logging.getLogger(__name__)

VERIFY_JSON = "verify.json"
MATCH, MISMATCH, NOT_PINNED, NOT_COMPARABLE = "match", "mismatch", "not pinned", "not comparable"
EQUAL, DIFFERENT, UNKNOWN = "equal", "different", "unknown"  # our numerics fingerprint vs the published one
NOT_REPRODUCIBLE = "not reproducible bit for bit here"
# The artifact each hash is read from, as `mixquant.keys.artifacts` names it.


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

    @property
    def kind(self) -> str:
        """``content`` or ``numerical`` (:data:`mixquant.release.hashes.HASH_KINDS`)."""
        return HASH_KINDS[self.name]

    def to_json(self) -> dict[str, Any]:
        record = {"artifact": None, "encoding": None} if self.record is None else self.record.to_json()
        record.pop("name", None)
        record.pop("sha256", None)
        return {
            "status": self.status,
            "kind": self.kind,
            "expected": self.expected,
            "got": self.got,
            "note": self.note,
            **record,
        }


@dataclass(frozen=True)
class NumericsCheck:
    """Our decisive numerics fingerprint (reference.json) vs the published one: equal, different, unknown."""

    ours: dict[str, Any] | None
    published: dict[str, Any] | None
    published_source: str | None = None  # "published.numerics", or the record beside the published logits

    @property
    def differences(self) -> list[str]:
        """The decisive fields that differ, as 'field: published -> ours' (empty unless both are known)."""
        if self.ours is None or self.published is None:
            return []
        return fingerprint_differences({"decisive": self.ours}, {"decisive": self.published})

    @property
    def status(self) -> str:
        if self.ours is None or self.published is None:
            return UNKNOWN
        return DIFFERENT if self.differences else EQUAL

    @property
    def fields(self) -> list[str]:
        """The names of the differing fields ('cpu_capability', 'libraries.torch', ...)."""
        return [difference.split(":", 1)[0] for difference in self.differences]

    @property
    def note(self) -> str:
        """What the comparison says about a numerical mismatch, in a few words (one line)."""
        if self.ours is None:
            return "our reference.json records no numerics fingerprint"
        if self.published is None:
            return "the published numerics fingerprint is unknown (published.numerics is null)"
        if self.differences:
            return f"numerics fingerprint differs from the published one in {', '.join(self.fields)}"
        return f"numerics fingerprint equal to the published one ({self.published_source})"

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "ours": self.ours,
            "published": self.published,
            "published_source": self.published_source,
            "differences": self.differences,
        }


@dataclass
class VerifyReport:
    checks: list[HashCheck]
    numerics: NumericsCheck = field(default_factory=lambda: NumericsCheck(None, None))
    logits_comparison: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def mismatches(self) -> list[HashCheck]:
        return [check for check in self.checks if check.status == MISMATCH]

    @property
    def not_reproducible(self) -> list[HashCheck]:
        """Numerical mismatches under a different numerics fingerprint: not reproducible bit for bit here."""
        if self.numerics.status != DIFFERENT:
            return []
        return [check for check in self.mismatches if check.kind == NUMERICAL]

    @property
    def not_comparable(self) -> list[HashCheck]:
        """Hashes of an artifact made from other settings than the published one (they cannot match)."""
        return [check for check in self.checks if check.status == NOT_COMPARABLE]

    def failures(self, strict: bool = False) -> list[HashCheck]:
        """What fails: with `strict` every mismatch and every not comparable hash, else the mismatches
        but :attr:`not_reproducible`."""
        if strict:
            return self.mismatches + self.not_comparable
        excused = [check.name for check in self.not_reproducible]
        return [check for check in self.mismatches if check.name not in excused]

    @property
    def ok(self) -> bool:
        """Every pinned hash compared and reproduced bit for bit (what ``--strict`` asks)."""
        return not self.mismatches and not self.not_comparable

    @property
    def passed(self) -> bool:
        """No failure under the policy (the workflow's verify_hashes and a plain ``mixquant verify``)."""
        return not self.failures()

    def to_json(self) -> dict[str, Any]:
        counts = {
            status: sum(c.status == status for c in self.checks) for status in (MATCH, MISMATCH, NOT_PINNED)
        }
        if self.not_comparable:  # present when any: the published release's own artifacts have none
            counts[NOT_COMPARABLE] = len(self.not_comparable)
        return {
            "ok": self.ok,
            "passed": self.passed,
            "counts": counts,
            "not_comparable": {check.name: check.note for check in self.not_comparable},
            "mismatches": {
                kind: [c.name for c in self.mismatches if c.kind == kind] for kind in (CONTENT, NUMERICAL)
            },
            "not_reproducible_bit_for_bit_here": [c.name for c in self.not_reproducible],
            "numerics": self.numerics.to_json(),
            "hashes": {check.name: check.to_json() for check in self.checks},
            "reference_logits_comparison": self.logits_comparison,
        }


def published_numerics(published: Mapping[str, Any] | Any) -> dict[str, Any] | None:
    """Config ``published.numerics``: the decisive fingerprint of the published logits, or None (unknown)."""
    if not isinstance(published, Mapping):
        published = published.model_dump(mode="json")
    value = published.get("numerics")
    if value is None:
        return None
    if not isinstance(value, Mapping) or "decisive" in value:
        raise ValueError(
            "published.numerics: expected the decisive numerics fingerprint as a mapping (a release's "
            f"{NUMERICS_JSON}), got {json.dumps(value)[:80]}"
        )
    return dict(value)


def check_hashes(
    published: Mapping[str, Any] | Any,
    *,
    prompt: str | Path,
    reference_logits: str | Path,
    checkpoint: str | Path,
    planned: Mapping[str, Any] | None = None,
) -> list[HashCheck]:
    """One :class:`HashCheck` per hash, in :data:`HASH_NAMES` order.

    `planned` is :func:`made_from` of the artifacts given: a pinned hash whose artifact is made from
    another recipe than ``published.made_from`` names is ``not comparable`` (:func:`comparability`).
    A missing source file is an error (:class:`HashSourceError`) for a pinned, comparable hash; otherwise
    the hash is reported with a note (an all-BF16 export writes no hf_quant_config.json).
    """
    expected = published_values(published)
    pinned = published_made_from(published)
    dirs = {"prompt": prompt, "reference_logits": reference_logits, "checkpoint": checkpoint}
    checks = []
    for name in HASH_NAMES:
        want = expected[name]
        function, source = HASHERS[name]
        reason = None if want is None else comparability(pinned, planned, source)
        try:
            record = function(dirs[source])
        except HashSourceError as error:
            if want is not None and reason is None:
                raise
            status = NOT_PINNED if want is None else NOT_COMPARABLE
            checks.append(HashCheck(name, status, want, None, note=reason or str(error)))
            continue
        if reason is not None:
            checks.append(HashCheck(name, NOT_COMPARABLE, want, record, note=reason))
            continue
        status = NOT_PINNED if want is None else MATCH if record.sha256 == want else MISMATCH
        checks.append(HashCheck(name, status, want, record))
    return checks


def mismatch_line(report: VerifyReport, checks: list[HashCheck] | None = None) -> str:
    """One line naming every mismatched hash (or those of `checks`) with its kind, expected and got."""
    parts = []
    for check in report.mismatches if checks is None else checks:
        art = check.record.artifact
        why = f" -- {report.numerics.note}" if check.kind == NUMERICAL else ""
        parts.append(
            f"{check.name} is {check.got}, published {check.expected} "
            f"({check.kind} hash, {art.stage} {art.key[:12]} {art.file}{why})"
        )
    return "published hash mismatch: " + "; ".join(parts)


def verdict_line(report: VerifyReport, strict: bool = False) -> str:
    """'passed', 'passed: ... not reproducible bit for bit here (...)' or 'FAILED: <reasons>' (one line)."""
    failures = report.failures(strict)
    if not failures:
        notes = []
        if report.not_reproducible:
            names = ", ".join(c.name for c in report.not_reproducible)
            notes.append(f"{names} {NOT_REPRODUCIBLE} ({report.numerics.note})")
        if report.not_comparable:
            notes.append(_not_comparable_text(report.not_comparable))
        if not notes:
            return "passed"
        return f"passed: {'; '.join(notes)}; --strict fails on it"
    reasons = []
    if strict and report.not_comparable:
        reasons.append(f"--strict: {_not_comparable_text(report.not_comparable)}")
    content = [c.name for c in failures if c.kind == CONTENT and c.status == MISMATCH]
    numerical = [c.name for c in failures if c.kind == NUMERICAL and c.status == MISMATCH]
    if content:
        reasons.append(f"content mismatch: {', '.join(content)}")
    if numerical and strict and report.numerics.status == DIFFERENT:
        reasons.append(f"--strict: {', '.join(numerical)} {NOT_REPRODUCIBLE} ({report.numerics.note})")
    elif numerical:
        reasons.append(f"numerical mismatch: {', '.join(numerical)} ({report.numerics.note})")
    return "FAILED: " + "; ".join(reasons)


def _not_comparable_text(checks: list[HashCheck]) -> str:
    """'quant_config, safetensors_index not comparable: <reason>' (one reason per artifact, in order)."""
    by_reason: dict[str, list[str]] = {}
    for check in checks:
        by_reason.setdefault(check.note or "", []).append(check.name)
    return "; ".join(f"{', '.join(names)} {NOT_COMPARABLE}: {reason}" for reason, names in by_reason.items())


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


def published_logits(against: str | Path) -> tuple[Path, Path, dict[str, Any] | None]:
    """(the logits file, the directory of its record, the decisive fingerprint recorded) of `--against`.

    Accepted: a reference_logits output (logits.safetensors + reference.json), a release directory
    (reference/logits.safetensors + reference/reference.json, numerics.json) or a logits file (its
    record, if any, beside it). The fingerprint is the record's, else the release's numerics.json.
    """
    from mixquant.release.bundle import release_repo

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
    import torch

    from mixquant.kld.stats import kld_statistics

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
    from safetensors.torch import load_file

    from mixquant.kld.run import logits_sha256

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


# ----------------------------------------------------------------------------------- entry points


def verify_dirs(
    published: Mapping[str, Any] | Any,
    *,
    prompt: str | Path,
    reference_logits: str | Path,
    checkpoint: str | Path,
    results_dir: str | Path | None = None,
    against: str | Path | None = None,
    planned: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Re-derive the four hashes from the given keyed directories and compare them with `published`.

    `planned`: :func:`made_from` of the artifacts the directories hold (None: every pinned hash is
    compared, as without ``published.made_from``).

    Our numerics fingerprint (reference.json's) is compared with ``published.numerics``. With
    `results_dir` (or `against`), a reference-logits mismatch also gets :func:`compare_reference_logits`;
    when ``published.numerics`` is null, the fingerprint recorded beside the published logits found there
    (their hash is the published one) stands in for it.
    """
    dirs = {"prompt": prompt, "reference_logits": reference_logits, "checkpoint": checkpoint}
    report = VerifyReport(check_hashes(published, **dirs, planned=planned))
    ours = recorded_numerics(reference_document(reference_logits))
    theirs = published_numerics(published)
    report.numerics = NumericsCheck(ours, theirs, "published.numerics" if theirs is not None else None)
    logits = next(c for c in report.checks if c.name == "reference_logits")
    if logits.status == MISMATCH and (results_dir is not None or against is not None):
        comparison = compare_reference_logits(
            reference_logits, logits.expected, results_dir=results_dir or ".", against=against
        )
        report.logits_comparison = comparison
        if theirs is None and comparison.get("against_is_published") and comparison["against_numerics"]:
            source = f"recorded beside the published logits, {comparison['against']}"
            report.numerics = NumericsCheck(ours, comparison["against_numerics"], source)
    return report


def verify_artifacts(
    artifacts: Mapping[str, Any],
    published: Mapping[str, Any] | Any,
    *,
    results_dir: str | Path,
    against: str | Path | None = None,
    planned: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """:func:`verify_dirs` on the planned artifacts of a config (``mixquant.keys.artifacts``); `planned`
    is their :func:`mixquant.keys.artifacts.made_from`, compared with ``published.made_from``.

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
    return verify_dirs(published, **dirs, results_dir=results_dir, against=against, planned=planned)


def _numerics_lines(report: VerifyReport) -> list[str]:
    numerics = report.numerics
    lines = [f"reference logits numerics: {numerics.note}"]
    for who, decisive in (("ours", numerics.ours), ("published", numerics.published)):
        if decisive is not None:
            lines.append(f"  {who.ljust(9)} {numerics_text(decisive)}")
    lines += [f"  differs   {difference}" for difference in numerics.differences]
    return lines


def _comparison_lines(comparison: Mapping[str, Any]) -> list[str]:
    if not comparison["found"]:
        return [f"reference logits: {comparison['note']}"]
    published = "published" if comparison["against_is_published"] else "NOT the published hash"
    lines = [f"reference logits vs {comparison['against']} ({published}):"]
    if "max_abs_diff" in comparison:
        lines.append(
            f"  max |diff| {comparison['max_abs_diff']:.6g}, mean KL(published || ours) "
            f"{comparison['mean_kl']:.6g}, top-1 agreement {100.0 * comparison['top1_agreement']:.2f}% "
            f"over {comparison['positions']} positions"
        )
    else:
        lines.append(f"  {comparison['note']}")
    diffs = comparison["engine_differences"]
    if diffs is None:
        lines.append("  recorded engine settings: none beside the published logits")
    elif not diffs:
        lines.append("  recorded engine settings: identical")
    for diff in diffs or []:
        theirs, ours = json.dumps(diff["published"]), json.dumps(diff["ours"])
        lines.append(f"  {diff['field']}: published {theirs}, ours {ours}")
    return lines


def format_report(report: VerifyReport, strict: bool = False) -> str:
    """A compact table (one row per hash, with its kind), then the details.

    The details of every mismatch, the numerics fingerprints on a numerical one, the logits comparison,
    the counts and, last, the verdict under the policy (:func:`verdict_line`).
    """
    rows = [("hash", "kind", "status", "published", "ours", "artifact")]
    for check in report.checks:
        art = None if check.record is None else check.record.artifact
        where = f"{art.stage}/{art.key[:12]}/{art.file}" if art is not None else check.note or "-"
        rows.append(
            (
                check.name,
                check.kind,
                check.status,
                (check.expected or "-")[:12],
                (check.got or "-")[:12],
                where,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines += [f"{check.name}: {NOT_COMPARABLE}: {check.note}" for check in report.not_comparable]
    for check in report.mismatches:
        lines += [
            f"{check.name}: mismatch ({check.kind} hash)",
            f"  published {check.expected}",
            f"  ours      {check.got}",
            f"  artifact  {check.record.artifact.path}",
            f"  encoding  {check.record.encoding}",
        ]
    if any(check.kind == NUMERICAL for check in report.mismatches):
        lines += _numerics_lines(report)
    if report.logits_comparison is not None:
        lines += _comparison_lines(report.logits_comparison)
    counts = report.to_json()["counts"]
    line = f"{counts[MATCH]} match, {counts[MISMATCH]} mismatch, {counts[NOT_PINNED]} not pinned"
    if report.not_comparable:
        line += f", {len(report.not_comparable)} {NOT_COMPARABLE}"
    lines.append(line)
    lines.append(verdict_line(report, strict))
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
    """Stage verify_hashes: verify.json when the policy passes, else one line naming the hash, no output.

    A numerical mismatch under a different numerics fingerprint passes, and so do the hashes of an
    artifact made from other settings than the published one (not comparable; ``published.strict``
    fails on both); either is logged, said on stderr in one line and recorded in verify.json.
    """
    published = settings["published"]
    strict = published_strict(published)
    report = verify_dirs(
        published,
        prompt=prompt,
        reference_logits=reference_logits,
        checkpoint=checkpoint,
        planned=settings.get("planned"),
    )
    for check in report.checks:
        where = check.record.artifact.path if check.record is not None else check.note
        log.info("%s (%s hash): %s (%s, %s)", check.name, check.kind, check.status, check.got, where)
    for line in _numerics_lines(report):
        log.info("%s", line)
    host = (reference_document(reference_logits).get("numerics") or {}).get("host")
    if host:  # informative: under the portable profile another CPU model gives the same bits
        log.info("reference logits host: %s", json.dumps(host, sort_keys=True))
    failures = report.failures(strict)
    mismatched = [check for check in failures if check.status == MISMATCH]
    if mismatched:
        hint = ""
        if any(check.kind == NUMERICAL for check in mismatched):
            hint = "; `mixquant verify --against PUBLISHED_LOGITS` says how close the logits are"
        raise HashMismatchError(mismatch_line(report, mismatched) + hint)
    if failures:  # published.strict: not comparable fails too
        raise HashMismatchError(
            f"published.strict: {_not_comparable_text(report.not_comparable)}; unset published.strict or "
            "pin the hashes of what this config makes"
        )
    if report.not_reproducible or report.not_comparable:
        line = verdict_line(report)
        log.warning("%s", line)
        print(f"mixquant: verify_hashes {line}", file=sys.stderr)
    document = report.to_json()
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / VERIFY_JSON).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", "utf-8")
        summary.update(
            counts=document["counts"],
            not_reproducible_bit_for_bit_here=document["not_reproducible_bit_for_bit_here"],
        )
    return Path(out_dir)
