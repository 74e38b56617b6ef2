"""The KLD artifacts: reference logits, per (candidate, KV dtype) the runs and their gate, the report and
the verdict."""

from __future__ import annotations

from typing import Any

from mixquant.config import MixquantConfig
from mixquant.facts import explicit_placement, moe_layers
from mixquant.graph.artifact import GraphBuilder
from mixquant.graph.inputs import add_fetch
from mixquant.graph.rebuild import add_export, add_rebuild


def engine_settings(cfg: MixquantConfig) -> dict[str, Any]:
    """The engine settings that decide logits (everything but the KV-cache dtype, which varies)."""
    kld = cfg.kld
    return {
        "engine": kld.engine,
        "tensor_parallel_size": kld.tensor_parallel_size,
        "dtype": kld.dtype,
        "enforce_eager": kld.enforce_eager,
        "seed": kld.seed,
        "enable_prefix_caching": kld.enable_prefix_caching,
        "max_model_len": kld.max_model_len,
    }


def add_candidate(
    graph: GraphBuilder, candidate: Any, placed: bool, autoquantized: dict[int, str] | None = None
) -> str | None:
    """The artifact holding a KLD candidate's checkpoint (None until its placement is known)."""
    cfg = graph.cfg
    name = f"candidate/{candidate.name}"
    if candidate.source == "searched":
        return "checkpoint" if placed else None
    if candidate.source == "modelopt_autoquantize":
        if autoquantized is None:
            return None
        add_rebuild(graph, autoquantized)
        add_export(graph, autoquantized, name)
        return name
    if candidate.source == "bf16":
        return "model"
    if candidate.source in ("uniform", "explicit"):
        if candidate.source == "uniform":
            placement = dict.fromkeys(moe_layers(cfg), candidate.format)
        else:
            placement = explicit_placement(cfg, candidate.explicit)
        add_rebuild(graph, placement)
        add_export(graph, placement, name)
        return name
    hub = candidate.hub.model_dump(mode="json") if candidate.hub is not None else None
    add_fetch(graph, name, hub, candidate.local.path if candidate.local else None, False)
    return name


def add_autoquantize(graph: GraphBuilder) -> None:
    """autoquantize_placement: ModelOpt's own auto_quantize (kl_div) placement of the routed experts at the
    search's budget and cost model, on the calibration tokens (a ``modelopt_autoquantize`` candidate)."""
    cfg = graph.cfg
    settings = {
        "moe_layers": moe_layers(cfg),
        "formats": list(cfg.placement.formats),
        "target_effective_bits": cfg.placement.target_effective_bits,
        "cost_model": cfg.placement.cost_model,
        "method": "kl_div",
        "batch_size": cfg.placement.search.batch_size,
    }
    graph.add(
        "autoquantize",
        "autoquantize_placement",
        settings,
        settings,
        {"model": "model", "calibration": "calibration"},
    )


def add_kld(graph: GraphBuilder, placed: bool, autoquantized: dict[int, str] | None = None) -> None:
    """Reference logits; per (candidate, KV dtype) a run_kld job doing all ``kld.runs`` runs and a gate;
    then the report and the verdict once every candidate is known.

    A run_kld key holds the engine settings, the KV dtype, the number of runs and the keys of the
    reference, the prompt and the candidate's checkpoint -- not the candidate's name, so a renamed
    candidate keeps its runs. Each run is a fresh engine (a fresh process with vLLM) and keeps its own
    results under ``runs/<i>/`` (:mod:`mixquant.kld.run`). Gates hold the gate settings and the keys of
    their runs (and the baseline's runs).
    """
    cfg = graph.cfg
    kld = cfg.kld
    engine = engine_settings(cfg)
    graph.add(
        "reference_logits",
        "reference_logits",
        {"engine": engine, "kv_cache_dtype": "bfloat16"},
        {"engine": engine, "kv_cache_dtype": "bfloat16"},
        {"model": "model", "prompt": "prompt"},
    )
    suite = kld.eval
    if suite is not None:
        reference = {
            "engine": engine,
            "kv_cache_dtype": "bfloat16",
            "reference_form": suite.reference,
            "top_k": suite.top_k if suite.reference == "topk" else None,
            "captures": suite.reference_captures,
        }
        graph.add(
            "suite_reference", "reference_logits", reference, reference, {"model": "model", "prompt": "eval"}
        )
    sources = {c.name: add_candidate(graph, c, placed, autoquantized) for c in kld.candidates}
    for candidate in kld.candidates:
        if sources[candidate.name] is None:
            continue
        for kv in kld.kv_cache_dtypes:
            runs_slice = {"engine": engine, "kv_cache_dtype": kv, "runs": kld.runs}
            upstream = {
                "reference": "reference_logits",
                "prompt": "prompt",
                "candidate": sources[candidate.name],
            }
            if suite is not None:
                upstream.update(suite_reference="suite_reference", suite="eval")
            graph.add(f"kld/{candidate.name}/{kv}", "run_kld", runs_slice, runs_slice, upstream)
    gated = kld.gates.gated or [c.name for c in kld.candidates if c.name != kld.baseline]
    bf16 = next((c.name for c in kld.candidates if c.source == "bf16"), None)
    for candidate in kld.candidates:
        baseline = kld.baseline if kld.baseline not in (None, candidate.name) else None
        if sources[candidate.name] is None or (baseline is not None and sources[baseline] is None):
            continue
        for kv in kld.kv_cache_dtypes:
            upstream = {"runs": f"kld/{candidate.name}/{kv}"}
            if baseline is not None:
                upstream["baseline_runs"] = f"kld/{baseline}/{kv}"
            if suite is not None:
                upstream.update(suite="eval", suite_reference="suite_reference")
                floor = bf16 is not None and sources[bf16] is not None and "bfloat16" in kld.kv_cache_dtypes
                if floor and candidate.name != bf16:
                    upstream["floor_runs"] = f"kld/{bf16}/bfloat16"  # the engine floor
            gates = kld.gates.model_dump(mode="json")
            gates.pop("gated")
            gate_slice = {
                "candidate": candidate.name,
                "source": candidate.source,
                "kv_cache_dtype": kv,
                "baseline": baseline,
                # the BF16 self-check has its own gates: exactly 0 with BF16 KV (require_exact_zero); with
                # FP8 KV it measures the KV cache's own effect, which is no improvement over any baseline
                "gated": candidate.name in gated and candidate.source != "bf16",
                "gates": gates,
                # the BF16 self-check must be exactly 0 where the engine is exact (hf, BF16 KV)
                "require_exact_zero": candidate.source == "bf16" and kv == "bfloat16" and kld.engine == "hf",
                # hf is deterministic: its runs must be bit-identical
                "require_identical_runs": kld.engine == "hf",
            }
            graph.add(f"gate/{candidate.name}/{kv}", "gate_kld", gate_slice, gate_slice, upstream)
    if all(source is not None for source in sources.values()):
        gates_up = {
            f"gate_{c.name}_{kv}": f"gate/{c.name}/{kv}" for c in kld.candidates for kv in kld.kv_cache_dtypes
        }
        report_slice = {
            "candidates": [c.name for c in kld.candidates],
            "kv_cache_dtypes": list(kld.kv_cache_dtypes),
            "baseline": kld.baseline,
            "bf16_candidate": bf16,
            "sources": {c.name: c.source for c in kld.candidates},
            "gates": {"bootstrap_samples": kld.gates.bootstrap_samples, "confidence": kld.gates.confidence},
        }
        if suite is not None:
            gates_up["suite"] = "eval"
        graph.add("kld_report", "kld_report", report_slice, report_slice, gates_up)
        graph.add("kld_verdict", "check_kld_gates", report_slice, report_slice, {"report": "kld_report"})
