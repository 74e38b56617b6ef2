"""What each routed expert received in calibration: every MoE layer's expert input and routing, recorded by
one layer-streamed BF16 forward (``collect_expert_inputs``), read by the GPTQ rebuild.

GPTQ rounds an expert's weights against the inputs that expert actually sees: the tokens its router sent
it. The forward is the activation statistics' (:mod:`mixquant.quantize.activations`: the unquantized model,
bf16, eager experts, ``batch_size`` calibration sequences per call, no mask, no cache), streamed layer-major
(:class:`mixquant.model.streaming.StreamedModel`: each decoder layer read once, every batch through it before
the next). At each MoE layer's routed-experts module it records the two arguments the family's block hands
it -- ``hidden_states`` ``[tokens, hidden]`` (after the layer's post-attention norm, in the model dtype) and
the router's ``top_k_index`` ``[tokens, top_k]`` -- and writes them, batches in order, to
``layer_<L>.safetensors`` as soon as the layer is done, so the host holds one layer's inputs at a time.

What a layer file costs: ``tokens x hidden x 2`` bytes (Laguna-S-2.1 at 512 x 512 calibration tokens:
1.6 GB per MoE layer, 75 GB in all) -- a fraction of the per-expert Hessians it yields (10.7 GB per layer in
fp32), which the rebuild job of each layer computes from it (:mod:`mixquant.quantize.gptq`). The down
projection's input (``act(gate) * up`` of each expert) is recomputed there from these inputs and the BF16
weights, exactly as the expert computes it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from mixquant.calibration.tokens import calibration_batches, load_token_ids
from mixquant.checkpoint.shards import ShardReader
from mixquant.checkpoint.writer import save_file_sorted
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.experts import ExpertIntercept, intercept_expert_linears
from mixquant.model.families import moe_experts
from mixquant.model.fetch import resolve_model_dir
from mixquant.model.streaming import StreamedModel, resolve_device

log = logging.getLogger(__name__)

__all__ = ["HIDDEN", "ROUTING", "collect_expert_inputs", "expert_inputs_file", "run_collect_expert_inputs"]

HIDDEN = "hidden_states"
ROUTING = "top_k_index"


def expert_inputs_file(directory: str | Path, layer: int) -> Path:
    """The file of MoE layer ``layer``'s expert inputs in a ``collect_expert_inputs`` output."""
    return Path(directory) / f"layer_{int(layer)}.safetensors"


class _InputRecorder(ExpertIntercept):
    """The experts module's positional arguments of every call: its input states and the routing."""

    def __init__(self) -> None:
        self.hidden: list[torch.Tensor] = []
        self.routing: list[torch.Tensor] = []

    def enter(self, args: tuple) -> None:
        hidden_states, top_k_index = args[0], args[1]
        if hidden_states.dim() != 2 or top_k_index.dim() != 2:
            raise RuntimeError("expected [tokens, hidden] expert inputs and [tokens, top_k] routing")
        self.hidden.append(hidden_states.detach().cpu())
        self.routing.append(top_k_index.detach().to(torch.int32).cpu())


@torch.no_grad()
def collect_expert_inputs(
    model_dir: str | Path,
    calibration_ids: torch.Tensor,
    out_dir: str | Path,
    *,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    reader: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``layer_<L>.safetensors`` (``hidden_states``, ``top_k_index``) for every MoE layer into
    ``out_dir``; returns a summary (tokens per layer, the routed count of each expert per layer)."""
    import sys

    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = calibration_batches(calibration_ids, batch_size)
    stream = StreamedModel(model_dir, device=resolve_device(device), reader=reader)
    routed: dict[str, list[int]] = {}
    try:
        model = stream.model
        if model.config._experts_implementation != "eager":
            raise RuntimeError(
                f"experts implementation is {model.config._experts_implementation!r}, need 'eager'"
            )
        experts = moe_experts(model)
        inputs = [stream.layer_inputs(ids) for ids in batches]
        hidden = [item.hidden for item in inputs]
        bar = tqdm(
            total=stream.num_layers, desc="expert inputs", unit="layer", file=sys.stderr, disable=not progress
        )
        with bar:
            for i, layer in stream.stream():
                recorder = _InputRecorder()
                intercepts = {experts[i]: recorder} if i in experts else {}
                with intercept_expert_linears(intercepts):
                    hidden = [layer(h, **item.kwargs[i]) for h, item in zip(hidden, inputs, strict=True)]
                if i in experts:
                    states, routing = torch.cat(recorder.hidden), torch.cat(recorder.routing)
                    save_file_sorted(
                        {HIDDEN: states.contiguous(), ROUTING: routing.contiguous()},
                        expert_inputs_file(out_dir, i),
                        {"format": "pt"},
                    )
                    counts = torch.bincount(routing.reshape(-1).long(), minlength=int(experts[i].num_experts))
                    routed[str(i)] = [int(c) for c in counts[: int(experts[i].num_experts)]]
                    del states, routing, recorder
                bar.update()
    finally:
        stream.close()
    tokens = int(calibration_ids.numel())
    return {
        "tokens": tokens,
        "batch_size": batch_size,
        "moe_layers": sorted(map(int, routed)),
        "routed": routed,
    }


def run_collect_expert_inputs(
    out_dir: str | Path,
    *,
    model: str | Path,
    calibration: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """Stage entry point: the expert inputs of every MoE layer over the calibration tokens."""
    ids = load_token_ids(Path(calibration) / "calibration.safetensors")
    reader = ShardReader(resolve_model_dir(model))
    reader.check_all()  # a broken shard stops here with one line naming it
    device = settings.get("numerics", {}).get("device", "cpu")
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        recorded = collect_expert_inputs(
            reader.model_dir, ids, tmp, batch_size=settings["batch_size"], device=device, reader=reader
        )
        (Path(tmp) / "expert_inputs.json").write_text(json.dumps(recorded, indent=1) + "\n", encoding="utf-8")
        summary.update(tokens=recorded["tokens"], moe_layers=recorded["moe_layers"])
    log.info("expert inputs of %d MoE layers (%d tokens)", len(recorded["moe_layers"]), recorded["tokens"])
    return Path(out_dir)
