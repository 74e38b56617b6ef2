"""Compare the release's four re-derived hashes with the published ones (``mixquant verify``, verify_hashes).

Per hash the status is ``match``, ``mismatch`` (expected, got, the artifact file and its encoding),
``not pinned`` (no published value) or ``not comparable``, and the kind is ``content`` or ``numerical``
(:data:`mixquant.release.hashes.HASH_KINDS`).

A published hash belongs to what was published: config ``published.made_from`` pins, beside the hashes,
the recipe of each artifact they were read from (:attr:`mixquant.graph.Artifact.recipe`: the
key without code and package versions) and a short hash of each config section. When the planned
artifact's recipe is another one (an experiment: another budget, more calibration samples), its hashes
differ by construction: they are ``not comparable``, reported with the config sections that differ from
the published ones, and pass; ``mixquant verify --strict`` (or ``published.strict``) fails on them.
``mixquant verify --made-from`` prints the block to pin for the config's own artifacts.

The policy (:meth:`mixquant.release.report.VerifyReport.failures`). A content mismatch always fails: the
same code on the same inputs writes the same token IDs and JSON bytes on every machine. A numerical
mismatch (the reference logits) is judged by the decisive numerics fingerprints
(:func:`mixquant.numerics.fingerprint`): ours, which reference.json records, and the published one (config
``published.numerics``, a release's numerics.json). Under equal fingerprints -- or an unknown one -- the bits
should have reproduced, so it fails; under different ones the logits are "not reproducible bit for bit
here": reported with the differing fields and passed. ``mixquant verify --strict`` fails on any mismatch.

On a reference-logits mismatch :func:`mixquant.release.closeness.compare_reference_logits` says how close
the numbers are: it takes the published logits given (``--against``: a reference_logits output, a release
directory or a logits.safetensors file) or looks for a reference_logits output whose logits hash to the
published value, and reports the largest absolute logit difference, the mean KL(published || ours) over
positions, the top-1 agreement and the recorded engine settings that differ.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixquant.keys.manifest import publish_keyed_dir
from mixquant.release.closeness import compare_reference_logits
from mixquant.release.hashes import recorded_numerics, reference_document
from mixquant.release.published import SOURCE_ARTIFACTS, published_strict
from mixquant.release.report import (
    MISMATCH,
    NUMERICAL,
    HashMismatchError,
    NumericsCheck,
    VerifyInputError,
    VerifyReport,
    check_hashes,
    mismatch_line,
    not_comparable_text,
    numerics_lines,
    published_numerics,
    verdict_line,
)

log = logging.getLogger(__name__)


VERIFY_JSON = "verify.json"


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
    """:func:`verify_dirs` on the planned artifacts of a config (``mixquant.graph``); `planned`
    is their :func:`mixquant.graph.made_from`, compared with ``published.made_from``.

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
    for line in numerics_lines(report):
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
            f"published.strict: {not_comparable_text(report.not_comparable)}; unset published.strict or "
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
