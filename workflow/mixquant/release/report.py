"""The verify report: each published hash checked (match, mismatch, not pinned, not comparable; content or
numerical), our numerics fingerprint against the published one, the policy that decides what fails
(:meth:`VerifyReport.failures`) and the report's text (:func:`format_report`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.numerics import fingerprint_differences
from mixquant.release.hashes import (
    CONTENT,
    HASH_KINDS,
    HASH_NAMES,
    HASHERS,
    NUMERICAL,
    NUMERICS_JSON,
    HashRecord,
    HashSourceError,
    numerics_text,
)
from mixquant.release.published import comparability, published_made_from, published_values

MATCH, MISMATCH, NOT_PINNED, NOT_COMPARABLE = "match", "mismatch", "not pinned", "not comparable"
EQUAL, DIFFERENT, UNKNOWN = "equal", "different", "unknown"  # our numerics fingerprint vs the published one
NOT_REPRODUCIBLE = "not reproducible bit for bit here"


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
            notes.append(not_comparable_text(report.not_comparable))
        if not notes:
            return "passed"
        return f"passed: {'; '.join(notes)}; --strict fails on it"
    reasons = []
    if strict and report.not_comparable:
        reasons.append(f"--strict: {not_comparable_text(report.not_comparable)}")
    content = [c.name for c in failures if c.kind == CONTENT and c.status == MISMATCH]
    numerical = [c.name for c in failures if c.kind == NUMERICAL and c.status == MISMATCH]
    if content:
        reasons.append(f"content mismatch: {', '.join(content)}")
    if numerical and strict and report.numerics.status == DIFFERENT:
        reasons.append(f"--strict: {', '.join(numerical)} {NOT_REPRODUCIBLE} ({report.numerics.note})")
    elif numerical:
        reasons.append(f"numerical mismatch: {', '.join(numerical)} ({report.numerics.note})")
    return "FAILED: " + "; ".join(reasons)


def not_comparable_text(checks: list[HashCheck]) -> str:
    """'quant_config, safetensors_index not comparable: <reason>' (one reason per artifact, in order)."""
    by_reason: dict[str, list[str]] = {}
    for check in checks:
        by_reason.setdefault(check.note or "", []).append(check.name)
    return "; ".join(f"{', '.join(names)} {NOT_COMPARABLE}: {reason}" for reason, names in by_reason.items())


def numerics_lines(report: VerifyReport) -> list[str]:
    numerics = report.numerics
    lines = [f"reference logits numerics: {numerics.note}"]
    for who, decisive in (("ours", numerics.ours), ("published", numerics.published)):
        if decisive is not None:
            lines.append(f"  {who.ljust(9)} {numerics_text(decisive)}")
    lines += [f"  differs   {difference}" for difference in numerics.differences]
    return lines


def comparison_lines(comparison: Mapping[str, Any]) -> list[str]:
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
        lines += numerics_lines(report)
    if report.logits_comparison is not None:
        lines += comparison_lines(report.logits_comparison)
    counts = report.to_json()["counts"]
    line = f"{counts[MATCH]} match, {counts[MISMATCH]} mismatch, {counts[NOT_PINNED]} not pinned"
    if report.not_comparable:
        line += f", {len(report.not_comparable)} {NOT_COMPARABLE}"
    lines.append(line)
    lines.append(verdict_line(report, strict))
    return "\n".join(lines)
