"""The evaluation suite's tables in the KLD report: decomposed KLD and per-domain rows (torch-free: the model
card formats them too).

* :func:`decomposition` -- per (candidate, KV dtype): weights-only (the candidate with a BF16 KV cache),
  deployment (the candidate with that KV dtype) and KV-only (the BF16 weights with that KV dtype), side by
  side as the community publishes them. Each is the gated mean KLD: on the suite when the gate document has
  one, else on the pinned prompt.
* :func:`domain_rows` -- per (candidate, KV dtype, domain): the mean KLD with its window-level interval and
  the reduction vs the baseline with its interval.
* :func:`comparison_rows` -- the comparison table's rows of gate documents: the prompt's and the suite's.
* :func:`write_rows` -- a table as CSV (raw numbers, full precision) and Markdown, each written atomically.

A gate document is gate_kld's ``aggregate.json`` (:mod:`mixquant.kld.gate`).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mixquant.checkpoint.atomic import atomic_open

__all__ = [
    "BF16_KV",
    "DECOMPOSITION_COLUMNS",
    "DOMAIN_COLUMNS",
    "comparison_rows",
    "decomposition",
    "decomposition_markdown",
    "domain_rows",
    "domains_markdown",
    "gated_mean",
    "write_rows",
]

BF16_KV = "bfloat16"  # the KV-cache dtype of the weights-only measurement
DECOMPOSITION_COLUMNS = ("candidate", "kv_cache_dtype", "protocol", "weights_only", "deployment", "kv_only")
DOMAIN_COLUMNS = (
    "candidate",
    "kv_cache_dtype",
    "domain",
    "windows",
    "positions",
    "mean_kld",
    "ci_low",
    "ci_high",
    "reduction",
    "reduction_ci_low",
    "reduction_ci_high",
)

Documents = Mapping[tuple[str, str], Mapping[str, Any]]


def gated_mean(document: Mapping[str, Any] | None) -> float | None:
    """The mean KLD a gate document was judged on: the suite's when it has one, else the prompt's (None
    without a document). The value is passed through as recorded: an exact 0.0 stays 0.0."""
    if document is None:
        return None
    suite = document.get("suite")
    if suite is not None:
        return suite["mean"]["mean"]
    return document["aggregate"]["mean_kld"]


def decomposition(documents: Documents, bf16_candidate: str | None) -> list[dict[str, Any]]:
    """One row per (candidate, KV dtype) of ``documents`` (keyed ``(candidate, kv_cache_dtype)``), in their
    order: ``candidate``, ``kv_cache_dtype`` (the deployment KV dtype), ``protocol`` (suite or prompt),
    ``weights_only`` (the candidate with a BF16 KV cache), ``deployment`` (the candidate with that KV dtype)
    and ``kv_only`` (``bf16_candidate``, the BF16 weights, with that KV dtype; None without one). A missing
    document gives None."""
    rows = []
    for (candidate, kv), document in documents.items():
        rows.append(
            {
                "candidate": candidate,
                "kv_cache_dtype": kv,
                "protocol": "suite" if document.get("suite") is not None else "prompt",
                "weights_only": gated_mean(documents.get((candidate, BF16_KV))),
                "deployment": gated_mean(document),
                "kv_only": None
                if bf16_candidate is None
                else gated_mean(documents.get((bf16_candidate, kv))),
            }
        )
    return rows


def comparison_rows(gates: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows of :func:`mixquant.kld.report.comparison_table` from gate documents: per gate its prompt row and,
    with a suite, its suite row; the verdict sits on the row of the protocol that gated (none for a candidate
    with no check: not gated)."""
    rows = []
    for g in gates:
        verdict = g["verdict"] if g["verdict"]["checks"] else None
        suite = g.get("suite")
        rows.append(
            {
                "candidate": g["candidate"],
                "kv_cache_dtype": g["kv_cache_dtype"],
                "protocol": "prompt",
                "aggregate": g["aggregate"],
                "improvement": g["improvement"],
                "gates": verdict if suite is None else None,
            }
        )
        if suite is not None:
            rows.append(
                {
                    "candidate": g["candidate"],
                    "kv_cache_dtype": g["kv_cache_dtype"],
                    "protocol": "suite",
                    "aggregate": {**suite["aggregate"], "mean_kld": suite["mean"]["mean"]},
                    "improvement": suite["improvement"],
                    "gates": verdict,
                }
            )
    return rows


def domain_rows(documents: Documents) -> list[dict[str, Any]]:
    """One row per (candidate, KV dtype, domain) of the documents with a suite: ``windows``, ``positions``,
    ``mean_kld`` with its interval ``ci_low`` / ``ci_high`` (the suite's window-level means), and
    ``reduction`` with ``reduction_ci_low`` / ``reduction_ci_high`` vs the baseline (None when the
    document has no baseline comparison)."""
    rows = []
    for (candidate, kv), document in documents.items():
        suite = document.get("suite")
        if suite is None:
            continue
        improvement = (suite.get("improvement") or {}).get("domains") or {}
        for domain, mean in suite["mean"]["domains"].items():
            reduction = improvement.get(domain) or {}
            rows.append(
                {
                    "candidate": candidate,
                    "kv_cache_dtype": kv,
                    "domain": domain,
                    "windows": mean["windows"],
                    "positions": mean["positions"],
                    "mean_kld": mean["mean"],
                    "ci_low": mean["ci_low"],
                    "ci_high": mean["ci_high"],
                    "reduction": reduction.get("reduction"),
                    "reduction_ci_low": reduction.get("ci_low"),
                    "reduction_ci_high": reduction.get("ci_high"),
                }
            )
    return rows


# ------------------------------------------------------------------------------------------- Markdown


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _kld(x: Any) -> str:
    return "—" if _missing(x) else f"{float(x):.4g}"


def _pct(x: Any) -> str:
    return "—" if _missing(x) else f"{100.0 * float(x):.1f} %"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(
    columns: Sequence[tuple[str, str, Callable[[Mapping[str, Any]], str]]], rows: Sequence[Mapping]
) -> str:
    lines = [
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "|".join(":---" if align == "l" else "---:" for _, align, _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(fmt(row)) for _, _, fmt in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _mean_with_interval(row: Mapping[str, Any]) -> str:
    if _missing(row["mean_kld"]):
        return "—"
    return f"{_kld(row['mean_kld'])} [{_kld(row['ci_low'])}, {_kld(row['ci_high'])}]"


def _reduction_with_interval(row: Mapping[str, Any]) -> str:
    if _missing(row["reduction"]):
        return "—"
    return f"{_pct(row['reduction'])} [{_pct(row['reduction_ci_low'])}, {_pct(row['reduction_ci_high'])}]"


_DECOMPOSITION_MD = (
    ("candidate", "l", lambda r: str(r["candidate"])),
    ("KV cache", "l", lambda r: str(r["kv_cache_dtype"])),
    ("protocol", "l", lambda r: str(r["protocol"])),
    ("weights-only (BF16 KV)", "r", lambda r: _kld(r["weights_only"])),
    ("deployment", "r", lambda r: _kld(r["deployment"])),
    ("KV-only (BF16 weights)", "r", lambda r: _kld(r["kv_only"])),
)
_DOMAINS_MD = (
    ("candidate", "l", lambda r: str(r["candidate"])),
    ("KV cache", "l", lambda r: str(r["kv_cache_dtype"])),
    ("domain", "l", lambda r: str(r["domain"])),
    ("windows", "r", lambda r: str(r["windows"])),
    ("positions", "r", lambda r: f"{int(r['positions']):,}"),
    ("mean KLD [CI]", "r", _mean_with_interval),
    ("reduction vs baseline [CI]", "r", _reduction_with_interval),
)


def decomposition_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The decomposition (:func:`decomposition`) as a Markdown table: mean KLD weights-only, deployment and
    KV-only side by side (4 significant digits; an exact 0 shows as 0, a missing value as —)."""
    return _markdown(_DECOMPOSITION_MD, rows)


def domains_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-domain rows (:func:`domain_rows`) as a Markdown table: mean KLD and reduction with their
    intervals."""
    return _markdown(_DOMAINS_MD, rows)


# ------------------------------------------------------------------------------------------- files


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    return repr(float(value)) if isinstance(value, float) else value  # numpy floats too: no "np.float64(...)"


def _csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """CSV with a header; floats at full precision (``repr``: the shortest text that reads back equal), None
    as an empty cell."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_csv_cell(row.get(column)) for column in columns])
    return out.getvalue()


def write_rows(rows: Sequence[Mapping[str, Any]], stem: str | Path) -> tuple[Path, Path]:
    """Write ``stem.csv`` (raw numbers, full precision) and ``stem.md`` (formatted Markdown), each atomically:
    the decomposition's rows or the per-domain rows (told apart by their columns). Returns both paths."""
    if not rows:
        raise ValueError(f"{stem}: no rows to write")
    if "domain" in rows[0]:
        columns, markdown = DOMAIN_COLUMNS, domains_markdown(rows)
    elif "weights_only" in rows[0]:
        columns, markdown = DECOMPOSITION_COLUMNS, decomposition_markdown(rows)
    else:
        raise ValueError(
            f"{stem}: rows are neither the decomposition nor the per-domain rows: {sorted(rows[0])}"
        )
    stem = Path(stem)
    csv_path, md_path = stem.with_name(stem.name + ".csv"), stem.with_name(stem.name + ".md")
    for path, text in ((csv_path, _csv_text(rows, columns)), (md_path, markdown)):
        with atomic_open(path, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    return csv_path, md_path
