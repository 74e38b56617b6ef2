"""What a finished run made, read from its outputs: the placement and its routed effective bits, each KLD
gate's verdict word and KL reduction (on the evaluation suite, with its interval, where the gate judged one),
verify's counts. Printed at the end of a successful run (the Snakefile's
onsuccess, mixquant.planning.report_run_end), before where the release and the checkpoint are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from mixquant.jsonio import read_json
from mixquant.kld.run import AGGREGATE_JSON
from mixquant.release.verify import VERIFY_JSON
from mixquant.search.run import PLACEMENT_FILE


class Artifact(Protocol):
    """What the summary reads of a planned artifact (:class:`mixquant.graph.Artifact`)."""

    path: Path

    @property
    def done(self) -> bool: ...


def _bits(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "?"


def placement_line(art: Artifact) -> str:
    """The placement: how it was chosen, its routed effective bits (and the target), layers per format."""
    placement = read_json(art.path / PLACEMENT_FILE, "placement")
    meta = placement.get("metadata") or {}
    counts: dict[str, int] = {}
    for fmt in (placement.get("layers") or {}).values():
        counts[str(fmt)] = counts.get(str(fmt), 0) + 1
    how = meta.get("source", "?") + (f" ({meta['method']})" if meta.get("method") else "")
    target = meta.get("target_effective_bits")
    line = f"placement: {how}, routed effective bits {_bits(meta.get('effective_bits'))}"
    line += f" (target {_bits(target)})" if target is not None else ""
    layers = ", ".join(f"{fmt} {count}" for fmt, count in sorted(counts.items()))
    return line + (f"; layers: {layers}" if layers else "")


def rounding_line(artifacts: Mapping[str, Artifact]) -> str:
    """How the NVFP4 layers were rounded (the rebuild's setting): rtn (ModelOpt's export) or gptq."""
    roundings = sorted(
        {
            str(art.settings["params"].get("rounding", "rtn"))
            for art in artifacts.values()
            if art.stage == "quantize_layer" and art.settings.get("format") == "nvfp4_w4a16"
        }
    )
    words = {
        "rtn": "rtn (round to nearest: ModelOpt's export)",
        "gptq": "gptq (error-compensating, same scales)",
    }
    return "NVFP4 rounding: " + (", ".join(words.get(r, r) for r in roundings) or "none (no NVFP4 layer)")


def verdict_word(verdict: Mapping[str, Any]) -> str:
    """A gate's verdict as the summary says it: its word (pass, FAIL, REPEAT-REQUIRED; "not gated" with no
    check), or passed / FAILED for a verdict recorded without a word."""
    word = verdict.get("word")
    if word is None:
        return "passed" if verdict.get("passed") else "FAILED"
    if not verdict.get("checks"):
        return "not gated"
    return word if word == "pass" else str(word).upper()


def _number(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "?"


def _interval(estimate: Mapping[str, Any], spec: str) -> str:
    return f"[{_number(estimate.get('ci_low'), spec)}, {_number(estimate.get('ci_high'), spec)}]"


def gate_line(art: Artifact) -> str:
    """One KLD gate: candidate and KV-cache dtype, verdict, mean KL and the reduction vs the baseline; on the
    evaluation suite with their window-level intervals when the gate judged one, else on the prompt."""
    gate = read_json(art.path / AGGREGATE_JSON, "KLD gate")
    verdict = verdict_word(gate.get("verdict") or {})
    suite = gate.get("suite")
    if suite:
        mean = suite.get("mean") or {}
        shown = f"mean KL {_number(mean.get('mean'), '.3g')} on the suite {_interval(mean, '.3g')}"
        improvement = suite.get("improvement") or {}
    else:
        mean_kld = (gate.get("aggregate") or {}).get("mean_kld")
        shown = f"mean KL {_number(mean_kld, '.3g')}"
        improvement = gate.get("improvement") or {}
    reduction = improvement.get("reduction")
    if isinstance(reduction, (int, float)) and gate.get("baseline"):  # 1 - mean(candidate) / mean(baseline)
        interval = f" {_interval(improvement, '.1%')}" if suite else ""
        than = "lower" if reduction >= 0 else "higher"
        shown += f" ({abs(reduction):.1%} {than} than {gate['baseline']}{interval})"
    return f"gate {gate.get('candidate', '?')} kv {gate.get('kv_cache_dtype', '?')}: {verdict}, {shown}"


def verify_line(art: Artifact) -> str:
    """verify_hashes' counts per status (match, mismatch, ...)."""
    counts = read_json(art.path / VERIFY_JSON, "verify report").get("counts") or {}
    return "verify: " + ", ".join(f"{count} {status}" for status, count in counts.items())


def run_summary(artifacts: Mapping[str, Artifact]) -> list[str]:
    """What a finished run made, from its outputs (those built): the placement and its bits, the NVFP4
    rounding, each KLD
    gate's verdict and reduction, verify's counts (where the release is: mixquant.planning.run_end_lines)."""
    lines = []
    placement = "refined" if "refined" in artifacts else "placement"
    sources: list[tuple[str, Callable[[Artifact], str]]] = [(placement, placement_line)]
    if "checkpoint" in artifacts:
        sources.append(("checkpoint", lambda art: rounding_line(artifacts)))
    sources += [(name, gate_line) for name in sorted(artifacts) if name.startswith("gate/")]
    sources += [("verify", verify_line)]
    for name, line in sources:
        art = artifacts.get(name)
        if art is None or not art.done:
            continue
        try:
            lines.append(line(art))
        except (OSError, ValueError) as error:  # a summary never fails a run that succeeded
            lines.append(f"{name}: cannot read ({error})")
    return lines
