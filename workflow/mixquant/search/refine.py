"""A placement refined by measured KL: the K best ILP placements within the budget, each measured end to
end on calibration sequences held out from scoring, the best kept (``refine_placement``).

The search predicts a placement's KL as the sum of its layers' scores, each measured with that layer alone
quantized; the placement itself is never measured with its layers quantized together, where their errors
interact (they compound through the residual stream, or cancel). Refinement measures them together: the
candidates are the ILP's K lowest predicted placements within the same budget
(:func:`mixquant.search.ilp.k_best_ilp`, plus the solve's own placement when ``placement.search.method`` is
another solver's), and each one's KL(BF16 || placement) per token is measured on ``holdout_samples``
calibration sequences drawn after the scored ones (same dataset, seed and length; no conversation of the
scored sequences: ``sample_calibration`` visits the conversations in one seeded order and the held-out draw
continues it). Never on the evaluation suite, which judges the result. The weights are the rebuild's own
(the ``quantize_layer`` results, so the rounding the checkpoint ships, GPTQ included), FP8 inputs
fake-quantized at their static scales, as the scores are.

One layer-streamed pass carries the reference and every candidate (:func:`measured_kl`): at layer ``i`` each
candidate runs the layer with its format's routed experts swapped in (a candidate still equal to the
reference shares its states), the final norm and lm_head close every stream, and KL sums per sequence are
taken like the scores' (float32 log-softmax, full vocabulary, every position). The audit shows predicted
against measured for every candidate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mixquant.formats.facts import BF16, FORMATS
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.families import architecture
from mixquant.model.fetch import resolve_model_dir
from mixquant.search.groups import PlacementInfeasible, effective_bits
from mixquant.search.run import (
    AUDIT_FILE,
    PLACEMENT_FILE,
    PlacementSearchError,
    _layer_of,
    _read_scores,
    search_groups,
)

log = logging.getLogger(__name__)

__all__ = ["REFINE_AUDIT_FILE", "REFINE_PNG", "candidate_placements", "measured_kl", "run_refine_placement"]

REFINE_AUDIT_FILE = "refine_audit.json"
REFINE_PNG = "refine.png"

Placement = dict[int, str]


def candidate_placements(groups: Sequence[Any], target: float, k: int, solved: Placement) -> list[dict]:
    """The K best ILP placements (best predicted first) and, when the solve chose another, the solve's
    own first: ``[{"placement", "predicted", "effective_bits", "source"}]``."""
    from mixquant.search.ilp import k_best_ilp  # lazy: imports pulp (planning imports this module)

    by_layer = {_layer_of(g.name): g for g in groups}
    names = {layer: g.name for layer, g in by_layer.items()}
    best = [_placement(s.choice) for s in k_best_ilp(groups, target, k)]
    listed = [("ilp", choice) for choice in best]
    if solved not in best:  # another method's placement (minimax) is measured too, first
        listed = [("solve", solved), *listed[: max(k - 1, 1)]]
    out = []
    for source, choice in listed:
        predicted = sum(by_layer[layer].scores[fmt] for layer, fmt in choice.items())
        bits = effective_bits(groups, {names[layer]: fmt for layer, fmt in choice.items()})
        out.append({"placement": choice, "predicted": predicted, "effective_bits": bits, "source": source})
    return out


def _placement(choice: Mapping[str, str]) -> Placement:
    return {_layer_of(name): fmt for name, fmt in choice.items()}


def measured_kl(
    stream: Any,
    ids: Any,
    candidates: Sequence[Placement],
    quant_for: Callable[[int, str], Any],
    *,
    batch_size: int,
    progress: bool = False,
) -> list[list[float]]:
    """KL(BF16 || candidate) summed per sequence of ``ids`` ``[N, T]``, for each candidate (every placed
    layer quantized at once), in one layer-streamed pass (:class:`mixquant.model.streaming.StreamedModel`)."""
    import sys

    import torch
    from tqdm import tqdm

    # lazy: these import torch (planning imports this module: the release's file names)
    from mixquant.calibration.tokens import calibration_batches
    from mixquant.search.score import kl_sum, quantized_experts

    with torch.no_grad():
        micro = calibration_batches(ids, batch_size)
        inputs = [stream.layer_inputs(mb) for mb in micro]
        ref = [item.hidden for item in inputs]
        states: list[list[torch.Tensor] | None] = [None] * len(candidates)  # None: equal to the reference
        bar = tqdm(
            total=stream.num_layers, desc="refine", unit="layer", file=sys.stderr, disable=not progress
        )
        with bar:
            for i in range(stream.num_layers):
                layer = stream.load_layer(i)
                stream.prefetch_layer(i + 1)
                kwargs = [item.kwargs[i] for item in inputs]
                ref_in = ref
                ref = [layer(h, **kwargs[b]) for b, h in enumerate(ref_in)]
                plain = [c for c, placement in enumerate(candidates) if placement.get(i, BF16) == BF16]
                for c in plain:
                    if states[c] is not None:
                        states[c] = [layer(h, **kwargs[b]) for b, h in enumerate(states[c])]
                for fmt in sorted({p.get(i, BF16) for p in candidates} - {BF16}):
                    quant = quant_for(i, fmt)
                    with quantized_experts(stream.model, quant):
                        for c, placement in enumerate(candidates):
                            if placement.get(i, BF16) == fmt:
                                own = ref_in if states[c] is None else states[c]
                                states[c] = [layer(h, **kwargs[b]) for b, h in enumerate(own)]
                    del quant
                del ref_in
                stream.release_layer(i)
                bar.update()
        sums: list[list[float]] = [[] for _ in candidates]
        for b, hidden in enumerate(ref):
            log_p = torch.log_softmax(stream.head(hidden), dim=-1, dtype=torch.float32)
            p = log_p.exp()
            for c in range(len(candidates)):
                if states[c] is None:
                    sums[c].extend([0.0] * hidden.shape[0])
                else:
                    logits = stream.head(states[c][b])
                    sums[c].extend(float(kl_sum(log_p[s], logits[s], p[s])) for s in range(hidden.shape[0]))
            del log_p, p
        return sums


def run_refine_placement(
    out_dir: str | Path,
    *,
    model: str | Path,
    holdout: str | Path,
    placement: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    **inputs: str | Path,
) -> Path:
    """Measure the candidates on the held-out sequences and publish the best as ``placement.json``, with
    ``refine_audit.json`` (predicted vs measured for each) and ``refine.png``."""
    from safetensors.torch import load_file

    # lazy: these import torch and matplotlib (planning imports this module)
    from mixquant.calibration.tokens import load_token_ids
    from mixquant.checkpoint.shards import ShardReader
    from mixquant.export.placement import load_placement
    from mixquant.model.streaming import StreamedModel
    from mixquant.quantize.layer import LAYER_FILE
    from mixquant.quantize.run import layer_result_dir
    from mixquant.search.plots import plot_refinement
    from mixquant.search.score import layer_quant_from_tensors, scores_table

    scores = {role: Path(path) for role, path in inputs.items() if role.startswith("scores_")}
    windows = {
        (int(role.rsplit("_layer_", 1)[1]), role.rsplit("_layer_", 1)[0]): Path(path)
        for role, path in inputs.items()
        if "_layer_" in role
    }
    model_dir = resolve_model_dir(model)
    model_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    groups = search_groups(settings, scores_table(_read_scores(scores)), model_config)
    target, refine = float(settings["target_effective_bits"]), settings["refine"]
    solved = load_placement(Path(placement) / PLACEMENT_FILE)
    try:
        candidates = candidate_placements(groups, target, int(refine["candidates"]), solved)
    except PlacementInfeasible as exc:
        raise PlacementSearchError(f"placement.target_effective_bits: {exc}") from exc
    needed = {(layer, fmt) for c in candidates for layer, fmt in c["placement"].items() if fmt != BF16}
    missing = sorted(needed - set(windows))
    if missing:
        raise PlacementSearchError(f"refine_placement: no quantize_layer result for {missing[:3]}")
    ids = load_token_ids(Path(holdout) / "calibration.safetensors")
    reader = ShardReader(model_dir)
    reader.check_all()
    arch = architecture(model_dir)

    def quant_for(layer: int, fmt: str):
        tensors = load_file(str(layer_result_dir(windows[(layer, fmt)], layer) / LAYER_FILE))
        return layer_quant_from_tensors(tensors, layer, fmt, arch=arch)

    device = settings.get("numerics", {}).get("device", "cpu")
    with StreamedModel(model_dir, device=device, reader=reader) as stream:
        per_sequence = measured_kl(
            stream,
            ids,
            [c["placement"] for c in candidates],
            quant_for,
            batch_size=int(settings["batch_size"]),
            progress=True,
        )
    tokens = int(ids.numel())
    for candidate, sums in zip(candidates, per_sequence, strict=True):
        candidate["measured"] = sum(sums) / tokens  # the scores' normalisation: per token, every position
        candidate["measured_per_sequence"] = [s / ids.shape[1] for s in sums]
    ranked = sorted(range(len(candidates)), key=lambda c: (candidates[c]["measured"], c))
    chosen = candidates[ranked[0]]
    optimum = next(c for c in candidates if c["source"] == "ilp")
    audit = {
        "what": "the K best ILP placements within the budget (predicted: summed per-layer scores on the "
        "scored calibration sequences), each measured with all its layers quantized on held-out "
        "calibration sequences (measured: KL(BF16 || placement) per token); the lowest measured is kept",
        "settings": {**refine, "target_effective_bits": target, "batch_size": int(settings["batch_size"])},
        "holdout": {"sequences": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "tokens": tokens},
        "candidates": [
            {
                **{k: v for k, v in c.items() if k != "placement"},
                "placement": {str(layer): fmt for layer, fmt in sorted(c["placement"].items())},
                "predicted_rank": index + 1,
                "measured_rank": ranked.index(index) + 1,
            }
            for index, c in enumerate(candidates)
        ],
        "chosen": ranked[0] + 1,
        "ilp_optimum": candidates.index(optimum) + 1,
        "measured_reduction_vs_ilp_optimum": (
            1 - chosen["measured"] / optimum["measured"] if optimum["measured"] > 0 else 0.0
        ),
    }
    counts = {fmt: sum(1 for f in chosen["placement"].values() if f == fmt) for fmt in FORMATS}
    document = {
        "layers": {str(layer): fmt for layer, fmt in sorted(chosen["placement"].items())},
        "metadata": {
            "source": "search",
            "method": f"{settings['method']} + refine (k-best ILP, measured)",
            "target_effective_bits": target,
            "effective_bits": chosen["effective_bits"],
            "objective": chosen["predicted"],
            "measured": chosen["measured"],
            "counts": counts,
        },
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        (tmp / PLACEMENT_FILE).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        (tmp / REFINE_AUDIT_FILE).write_text(json.dumps(audit, indent=2) + "\n", encoding="utf-8")
        solve_audit = Path(placement) / AUDIT_FILE
        (tmp / AUDIT_FILE).write_text(solve_audit.read_text(encoding="utf-8"), encoding="utf-8")
        plot_refinement(audit["candidates"], tmp / REFINE_PNG, chosen=audit["chosen"])
        summary.update(candidates=len(candidates), chosen=audit["chosen"])
    log.info(
        "refined placement: candidate %d of %d (predicted rank %d), measured %.6g vs the ILP optimum's %.6g",
        audit["chosen"],
        len(candidates),
        audit["candidates"][ranked[0]]["predicted_rank"],
        chosen["measured"],
        optimum["measured"],
    )
    return Path(out_dir)
