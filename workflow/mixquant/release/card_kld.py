"""The model card's KLD text for the evaluation suite: what was measured, the decomposed KLD, the floors, the
per-domain rows, the interval widths and the limitation line.

Plain data in, Markdown lines out: the gate documents (gate_kld's ``aggregate.json``), the kld_report's
``report.json`` (suite facts, decomposition, per-domain rows, interval widths; optional: without it the
tables are derived from the gate documents with the same functions) and the recipe. What was measured is
read from the gate documents, never assumed from the config: a gate without a suite judged the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mixquant.kld.suite_tables import (
    decomposition,
    decomposition_markdown,
    domain_rows,
    domains_markdown,
)

DOMAIN_PLOT_PREFIX = "kld/kl_cdf_domains_"  # the per-domain KL CDF plots the release ships, one per KV dtype


def suite_gates(gates: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The gate documents that measured the evaluation suite."""
    return [g for g in gates if g.get("suite") is not None]


def _pct(value: Any) -> str:
    return "—" if value is None or math.isnan(float(value)) else f"{100.0 * float(value):.2f}%"


def _nats(value: Any) -> str:
    return "—" if value is None else f"{float(value):.4g}"


def _reference_text(suite_config: Mapping[str, Any] | None) -> str:
    if suite_config is not None and suite_config.get("reference") == "topk":
        return (
            f"against the BF16 reference's top {suite_config['top_k']:,} log-probabilities and its tail mass "
            "per position (exact on the top tokens, the tail's share bounded per position)"
        )
    return "over the full vocabulary against the BF16 reference logits of every position (exact)"


def intro_text(recipe: Mapping[str, Any], gates: Sequence[Mapping[str, Any]]) -> str:
    """What the gates judged, in one paragraph, when they judged the suite (else empty)."""
    measured = suite_gates(gates)
    if not measured:
        return ""
    suite = measured[0]["suite"]
    kld = recipe["kld"]
    names = list(suite["mean"]["domains"])
    return (
        f"The gates judge an evaluation suite: KL(BF16 ‖ candidate) {_reference_text(kld.get('eval'))} "
        f"at each of {suite['positions']:,} positions of {suite['windows']} windows of "
        f"{suite['window_tokens']} tokens over {len(names)} domains ({', '.join(names)}), held out from "
        f"calibration. Intervals are paired bootstraps over windows, stratified by domain "
        f"({kld['gates']['confidence']:.0%}, {kld['gates']['bootstrap_samples']:,} resamples). Verdict per "
        "candidate × KV cache: pass when every check clears its limit, fail when one misses it, "
        "repeat-required when an interval straddles a limit (more windows would decide). The pinned prompt "
        "stays as the published-hash protocol: its rows below are reported, not gated."
    )


def _domain_source(name: str, recipe: Mapping[str, Any]) -> str:
    """How the card names a domain's source: a Hub dataset as a link at its revision, a local file by its
    SHA-256 (its path is the builder's, not the release's)."""
    domains = ((recipe["kld"].get("eval") or {}).get("domains")) or []
    domain = next((d for d in domains if d["name"] == name), None)
    if domain is None:
        return "—"
    if domain.get("hub"):
        hub = domain["hub"]
        revision = f" at revision `{hub['revision'][:12]}`" if hub.get("revision") else " (unpinned)"
        subset = f", {hub['name']}" if hub.get("name") else ""
        link = f"[{hub['repo']}](https://huggingface.co/datasets/{hub['repo']})"
        return f"{link}{revision}{subset}, {hub['split']}"
    return f"a local JSONL file, SHA-256 `{domain['local']['sha256'][:16]}…`"


def _facts_lines(facts: Mapping[str, Any], recipe: Mapping[str, Any]) -> list[str]:
    lines = ["### The evaluation suite", ""]
    lines += ["| domain | source | documents | windows | tokens |", "|:---|:---|---:|---:|---:|"]
    for domain in facts["domains"]:
        source = _domain_source(domain["name"], recipe)
        lines.append(
            f"| {domain['name']} | {source} | {domain.get('documents', '—')} | {domain['windows']} | "
            f"{int(domain['tokens']):,} |"
        )
    disjoint = facts.get("disjoint_from_calibration") or {}
    lines += [
        "",
        f"{facts['windows']} windows of {facts['window_tokens']} tokens ({int(facts['tokens']):,} tokens, "
        f"{int(facts['positions']):,} scored positions); token IDs SHA-256 `{facts['token_ids_sha256']}`.",
    ]
    if disjoint:
        lines.append(
            f"Held out from calibration, checked by content: {int(disjoint['eval_units']):,} evaluation text "
            f"units against {int(disjoint['calibration_units']):,} of the calibration dataset, "
            f"{int(disjoint['shared'])} shared (a unit is a document's text or a chat message, whitespace-"
            "normalised, of 32 characters or more; none equals one of the calibration dataset's or another "
            "domain's)."
        )
    return lines


def _floors_lines(
    facts: Mapping[str, Any] | None, gates: Sequence[Mapping[str, Any]], recipe: Mapping[str, Any]
) -> list[str]:
    """The noise and engine floors: the report's suite facts, else the gate documents'."""
    measured = [g["suite"] for g in suite_gates(gates)]
    noise = facts.get("noise_floor") if facts else measured[0].get("noise_floor")
    engines = [s["engine_floor"] for s in measured if s.get("engine_floor") is not None]
    engine = facts.get("engine_floor") if facts else (engines[0] if engines else None)
    kld = recipe["kld"]
    captures = (kld.get("eval") or {}).get("reference_captures")
    limit = kld["gates"].get("max_engine_floor")
    lines = ["### Floors", ""]
    lines.append(
        f"- Runtime noise floor (mean KL between {captures or 'repeated'} fresh reference captures on the "
        f"`{kld['engine']}` engine): {_nats(noise)} nats"
        + (". A reduction must exceed it to count." if noise is not None else " (not measured).")
    )
    lines.append(
        f"- Engine floor (the BF16 model through the `{kld['engine']}` engine with a BF16 KV cache, against "
        f"the reference path): {_nats(engine)} nats"
        + (
            f"; gated at {limit:g}, never subtracted."
            if limit is not None
            else "; reported, never subtracted."
        )
    )
    return lines


def _widths_lines(widths: Mapping[str, Any] | None, domains: Sequence[Mapping[str, Any]]) -> list[str]:
    if not widths:
        return []
    prompt, suite = widths["prompt"], widths["suite"]
    name, kv = widths["candidate"], widths["kv_cache_dtype"]
    lines = ["### Interval width: one prompt against the suite", ""]
    lines.append(
        f"`{name}` against `{widths['baseline']}` ({kv} KV cache): on the pinned prompt, resampling its "
        f"positions, {_pct(prompt['reduction'])} [{_pct(prompt['ci_low'])}, {_pct(prompt['ci_high'])}]; "
        f"on the suite, resampling windows, {_pct(suite['reduction'])} [{_pct(suite['ci_low'])}, "
        f"{_pct(suite['ci_high'])}], {widths['ratio']:.2f}× the prompt's width."
    )
    positions = widths.get("suite_positions")
    if positions:
        lines[-1] += (
            f" Resampling the suite's positions instead of its windows would claim "
            f"[{_pct(positions['ci_low'])}, {_pct(positions['ci_high'])}]: the window-level interval is "
            f"{widths['ratio_to_positions']:.2f}× "
            "that width. An interval over positions says how stable the mean is over the text at hand; one "
            "over windows, stratified by domain, carries the variation between texts."
        )
    own = [
        r
        for r in domains
        if r["candidate"] == name and r["kv_cache_dtype"] == kv and r["reduction"] is not None
    ]
    if len(own) > 1:
        low = min(own, key=lambda r: r["reduction"])
        high = max(own, key=lambda r: r["reduction"])
        lines.append(
            f"Between domains its reduction moves from {_pct(low['reduction'])} ({low['domain']}) to "
            f"{_pct(high['reduction'])} ({high['domain']})."
        )
    return lines


def suite_lines(
    recipe: Mapping[str, Any],
    gates: Sequence[Mapping[str, Any]],
    report: Mapping[str, Any] | None,
    files: Sequence[str],
) -> list[str]:
    """The suite's subsections of the KLD section (empty when no gate measured a suite): the suite, the
    decomposed KLD, the floors, the per-domain rows with the per-domain CDF plots, the interval widths."""
    measured = suite_gates(gates)
    if not measured:
        return []
    documents = {(g["candidate"], g["kv_cache_dtype"]): g for g in gates}
    facts = (report or {}).get("suite")
    bf16 = next((c["name"] for c in recipe["kld"]["candidates"] if c["source"] == "bf16"), None)
    rows = (report or {}).get("decomposition") or decomposition(documents, bf16)
    domains = (report or {}).get("domains") or domain_rows(documents)
    lines: list[str] = []
    if facts:
        lines += ["", *_facts_lines(facts, recipe)]
    lines += [
        "",
        "### Decomposed KLD",
        "",
        "Mean KLD per candidate: weights-only (the candidate with a BF16 KV cache), deployment (with the KV "
        "cache dtype of the row) and KV-only (the BF16 weights with that KV cache dtype)"
        + ("" if bf16 else "; KV-only needs a bf16 candidate")
        + ".",
        "",
        decomposition_markdown(rows).rstrip("\n"),
        "",
        *_floors_lines(facts, gates, recipe),
        "",
        "### Per domain",
        "",
        domains_markdown(domains).rstrip("\n"),
    ]
    for path in sorted(f for f in files if f.startswith(DOMAIN_PLOT_PREFIX) and f.endswith(".png")):
        kv = path.removeprefix(DOMAIN_PLOT_PREFIX).removesuffix(".png")
        lines += ["", f"![KL(BF16 ‖ candidate) CDF per domain, {kv} KV cache]({path})"]
    pairwise = _pairwise_lines((report or {}).get("pairwise") or [], recipe)
    if pairwise:
        lines += ["", *pairwise]
    widths = _widths_lines((report or {}).get("interval_widths"), domains)
    if widths:
        lines += ["", *widths]
    return lines


def _pairwise_lines(rows: Sequence[Mapping[str, Any]], recipe: Mapping[str, Any]) -> list[str]:
    """The searched placement against every other quantized candidate on the suite (ModelOpt's own
    AutoQuantize placement among them): the reduction with its window-level interval."""
    if not rows:
        return []
    sources = {c["name"]: c["source"] for c in recipe["kld"]["candidates"]}
    lines = [
        "### The searched placement against the other candidates",
        "",
        "| candidate | against | KV cache | mean KLD | against's mean KLD | reduction [CI over windows] |",
        "|:---|:---|:---|---:|---:|---:|",
    ]
    for r in rows:
        against = r["against"] + (
            " (ModelOpt AutoQuantize)" if sources.get(r["against"]) == "modelopt_autoquantize" else ""
        )
        same = " (the same checkpoint)" if r.get("identical") else ""
        lines.append(
            f"| {r['candidate']} | {against} | {r['kv_cache_dtype']} | {_nats(r['mean_kld'])} | "
            f"{_nats(r['against_mean_kld'])} | {_pct(r['reduction'])} [{_pct(r['ci_low'])}, "
            f"{_pct(r['ci_high'])}]{same} |"
        )
    if any(r.get("identical") and sources.get(r["against"]) == "modelopt_autoquantize" for r in rows):
        lines += [
            "",
            "ModelOpt's `auto_quantize` (kl_div, at the same routed effective-bits target and cost model) "
            "chose the same per-layer formats as the search on this model: the two checkpoints are one, and "
            "every position's KL is identical.",
        ]
    return lines


def verdict_words(gates: Sequence[Mapping[str, Any]]) -> str:
    """The gates' words counted (`` on the evaluation suite: 2 pass, 4 not gated``); empty without a suite."""
    if not suite_gates(gates):
        return ""
    words = [
        g["verdict"].get("word", "pass" if g["verdict"]["passed"] else "fail")
        for g in gates
        if g["verdict"]["checks"]
    ]
    counts = {word: words.count(word) for word in ("pass", "repeat-required", "fail") if word in words}
    ungated = len(gates) - len(words)
    parts = [f"{n} {word}" for word, n in counts.items()] + ([f"{ungated} not gated"] if ungated else [])
    return " on the evaluation suite: " + ", ".join(parts)


def limitation_line(recipe: Mapping[str, Any], gates: Sequence[Mapping[str, Any]]) -> str:
    """The card's limitation line on what the KLD measured: the pinned prompt alone, or the suite too."""
    measured = suite_gates(gates)
    positions = recipe["prompt"]["seq_len"] - 1
    if not measured:
        return (
            f"- The KLD protocol is one pinned prompt ({positions:,} positions of one text); it is not a "
            "task benchmark, and it says nothing about other text."
        )
    suite = measured[0]["suite"]
    names = list(suite["mean"]["domains"])
    return (
        f"- KLD is gated on {suite['windows']} held-out windows ({suite['positions']:,} positions) over "
        f"{len(names)} domains ({', '.join(names)}) and reported on the pinned prompt; it is not a task "
        "benchmark, and text unlike these domains may fare differently."
    )
