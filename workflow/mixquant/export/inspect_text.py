"""The checkpoint audit (:func:`mixquant.export.inspect.inspect_checkpoint`) as text, for a reader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["format_inspection"]


def format_inspection(report: Mapping[str, Any]) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s report."""
    t, b, disk = report["tensors"], report["bytes"], report["disk_bytes"]
    producer = report.get("producer") or {}
    bits = report["routed_effective_bits"]
    lines = [
        f"checkpoint: {report['directory']} ({report['layout']}, {len(report['shards'])} shard(s))",
        f"producer: {producer.get('name', '?')} {producer.get('version', '?')}"
        if producer
        else "producer: unknown",
        "placement: " + ", ".join(f"{fmt}={n}" for fmt, n in report["placement_counts"].items()),
        f"routed effective bits: {bits:.4f}" if bits is not None else "routed effective bits: n/a",
        f"{'category':<22}{'tensors':>12}{'bytes':>20}",
    ]
    for fmt, n in t["routed"].items():
        lines.append(f"{'routed ' + fmt:<22}{n:>12,}{b['routed'][fmt]:>20,}")
    lines += [
        f"{'non-expert':<22}{t['non_expert']:>12,}{b['non_expert']:>20,}",
        f"{'KV-cache scales':<22}{t['kv_scales']:>12,}{b['kv_scales']:>20,}",
        f"{'total (payload)':<22}{t['total']:>12,}{b['total']:>20,}",
        "on disk:",
    ]
    for key in (
        "payload",
        "shard_headers",
        "shard_slack",
        "index",
        "configs",
        "tokenizer",
        "unreferenced_shards",
    ):
        lines.append(f"  {key:<20}{disk[key]:>20,}")
    lines.append(f"  {'other':<20}{disk['other']:>20,}")
    lines.append(f"  {'total':<20}{disk['total']:>20,}")
    for f in report["files"]:
        if f["category"] == "other":
            lines.append(f"    other file {f['path']}: {f['bytes']:,}")
    for name, digest in report["sha256"].items():
        lines.append(f"sha256 {name}: {digest or 'absent'}")
    if report["layer_formats"]:
        lines.append("layers: " + " ".join(f"{k}:{v}" for k, v in report["layer_formats"].items()))
    lines.append(f"quantized modules: {report['quantized_module_count']}")
    for category, formats in report["quantized_modules"].items():
        lines.append(f"  {category:<20}" + ", ".join(f"{fmt}={n}" for fmt, n in formats.items()))
    qc, ic = report["quant_config_check"], report["index_check"]
    lines.append(f"hf_quant_config vs tensors: {'ok' if qc['ok'] else 'DISAGREE'}")
    lines += [f"  - {d}" for d in qc["disagreements"]]
    if ic["present"]:
        lines.append(f"index vs shard headers: {'ok' if ic['ok'] else 'DISAGREE'}")
        lines += [f"  - {p}" for p in ic["problems"]]
    lines += [f"problem: {p}" for p in report["problems"]]
    lines.append(f"overall: {'ok' if report['ok'] else 'PROBLEMS'}")
    return "\n".join(lines)
