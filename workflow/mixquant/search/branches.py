"""Branch-parallel sensitivity scoring over a layer-streamed model: one pass over the weights per
macro-batch scores every (MoE layer, format).

The score of (layer ``L``, format ``f``) is KL(BF16 || model with only ``L``'s routed experts in ``f``)
(:mod:`mixquant.search.score`). Nothing before ``L``'s experts changes, so that model's hidden states
equal the reference's up to layer ``L``'s attention; from there on they differ. Here the reference and
every branch that has already diverged are carried through the decoder layers together, one layer
loaded at a time (:class:`mixquant.model.streaming.StreamedModel`):

* at layer ``i``: the reference runs layer ``i``; when ``i`` is scored, each format's branch runs layer
  ``i`` from the same input with the format's routed experts swapped in (``quantized_experts`` also
  fake-quantizes FP8 inputs) -- the model's own layer, so any family's router and shared experts behave
  exactly as in a full forward;
* every branch born before ``i`` runs layer ``i`` in full;
* after the last layer: the final norm and lm_head of the reference and of each branch, and the KL sum
  of each micro-batch (ModelOpt's ``kl_div`` accumulation, :func:`mixquant.search.score.kl_sum`).

Each layer is read from the shards once per pass, against once per scored layer for a per-layer scorer.
Exact mode (``stack=False``) runs every branch in micro-batches of ``batch_size`` sequences, so each
branch's operations are exactly those of the whole-model suffix scorer (:func:`sensitivity_scores`) on
the same batches: the per-micro-batch KL sums are bit-identical on the same device and threads (tests
check it). ``stack=True`` concatenates the live branches of a micro-batch into one batch per layer call
(fewer, larger GEMMs: the GPU mode); GEMM row blocking can then round differently, so its scores are not
promised bit for bit -- tests check that they rank the layers the same.

A pass can be killed and resumed: with ``state_dir``, the hidden states of the reference and the live
branches are saved after a layer (atomically; at most every ``checkpoint_interval_s`` seconds, 0: every
layer) and a rerun with the same ``state_key`` continues after the last saved layer, with identical
results (the states are the exact tensors, and per-layer arguments are recomputed identically). Under
:func:`mixquant.preemption.stop_at_checkpoints`, a SIGTERM (SLURM's time limit or preemption) makes the pass
save its states after the layer it is in and stop with :class:`mixquant.preemption.Preempted`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mixquant import faults
from mixquant.calibration.tokens import calibration_batches
from mixquant.checkpoint.atomic import atomic_path, write_text_atomic
from mixquant.checkpoint.writer import tensor_record, write_safetensors
from mixquant.facts import STACK_LIMIT
from mixquant.model.streaming import StreamedModel
from mixquant.preemption import Preempted, stop_requested
from mixquant.search.score import LayerQuant, kl_sum, quantized_experts

log = logging.getLogger(__name__)

__all__ = ["PROGRESS_FILE", "branch_parallel_scores"]

PROGRESS_FILE = "progress.json"

QuantFor = Callable[[int, str, torch.nn.Module], LayerQuant]


def _expand(value: Any, copies: int, batch: int) -> Any:
    """A layer argument for ``copies`` stacked micro-batches of ``batch`` sequences: tensors whose first
    dimension is the batch are repeated along it; everything else (broadcast shapes, flags) as is."""
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == batch and batch > 1:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, tuple):
        return tuple(_expand(v, copies, batch) for v in value)
    if isinstance(value, list):
        return [_expand(v, copies, batch) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, copies, batch) for k, v in value.items()}
    return value


def _run_branches(
    layer: torch.nn.Module,
    branches: dict[tuple[int, str], list[torch.Tensor]],
    kwargs: Sequence[dict[str, Any]],
    stack: bool,
) -> None:
    """Every live branch through ``layer`` (in place in ``branches``)."""
    keys = sorted(branches)
    if not keys:
        return
    micro = len(kwargs)
    if not stack:
        for key in keys:
            branches[key] = [layer(h, **kwargs[b]) for b, h in enumerate(branches[key])]
        return
    for b in range(micro):
        size = branches[keys[0]][b].shape[0]
        for start in range(0, len(keys), STACK_LIMIT):  # bounded: a call's activations grow with the stack
            chunk = keys[start : start + STACK_LIMIT]
            stacked = torch.cat([branches[key][b] for key in chunk], dim=0)
            out = layer(stacked, **_expand(kwargs[b], len(chunk), size))
            for key, part in zip(chunk, out.split(size, dim=0), strict=True):
                branches[key][b] = part


def _save_state(
    state_dir: Path,
    state_key: str,
    next_layer: int,
    ref: list[torch.Tensor],
    branches: Mapping[tuple[int, str], list[torch.Tensor]],
) -> None:
    """The pass's hidden states after a layer: one safetensors file per stream (the reference, each
    branch), so the host holds one stream's states at a time, then ``progress.json`` naming them -- the
    file that makes a state valid, written last and atomically (a kill mid-save leaves the previous one)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    streams = {"ref": ref, **{f"branch.{layer}.{fmt}": states for (layer, fmt), states in branches.items()}}
    files = {}
    for name, states in streams.items():
        file = f"{name}.layer{next_layer}.safetensors"
        with atomic_path(state_dir / file) as tmp:
            records = [tensor_record(str(b), h.contiguous().cpu()) for b, h in enumerate(states)]
            write_safetensors(tmp, records, metadata=None, fsync=False)
        files[name] = file
        faults.point("stream-state-saved", "score_sensitivity")  # a stream saved, progress.json not yet
    progress = {"state_key": state_key, "next_layer": next_layer, "micro_batches": len(ref), "files": files}
    write_text_atomic(state_dir / PROGRESS_FILE, json.dumps(progress, indent=1, sort_keys=True) + "\n")
    faults.point("progress-saved", "score_sensitivity")
    for stale in state_dir.glob("*.safetensors"):  # an earlier layer's states
        if stale.name not in files.values():
            stale.unlink(missing_ok=True)


def _load_state(
    state_dir: Path, state_key: str, micro: int, device: torch.device
) -> tuple[int, list[torch.Tensor], dict[tuple[int, str], list[torch.Tensor]]] | None:
    """(next layer, reference states, branch states) of a saved pass with this key, else None."""
    from safetensors.torch import load_file

    path = state_dir / PROGRESS_FILE
    try:
        progress = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if progress.get("state_key") != state_key or progress.get("micro_batches") != micro:
        log.info("ignoring %s: saved by another pass", path)
        return None
    streams = {}
    for name, file in progress["files"].items():
        tensors = load_file(str(state_dir / file), device=str(device))
        streams[name] = [tensors[str(b)] for b in range(micro)]
    branches = {}
    for name, states in streams.items():
        if name.startswith("branch."):
            _, layer, fmt = name.split(".")
            branches[(int(layer), fmt)] = states
    return int(progress["next_layer"]), streams["ref"], branches


def branch_parallel_scores(
    stream: StreamedModel,
    calibration_ids: torch.Tensor,
    scored: Mapping[int, Sequence[str]],
    quant_for: QuantFor,
    *,
    batch_size: int,
    stack: bool = False,
    state_dir: str | Path | None = None,
    state_key: str = "",
    checkpoint_interval_s: float = 600.0,
    progress: bool = False,
) -> dict[str, dict[int, list[float]]]:
    """``{format: {layer: [KL sum of each micro-batch]}}`` for every (layer, format) in ``scored``.

    ``calibration_ids``: this pass's sequences [M, T]; micro-batches of ``batch_size`` in order.
    ``quant_for(layer, fmt, loaded_layer)``: the :class:`LayerQuant` to swap in (read when the layer is
    scored, so only one format of one layer is held at a time). KL sums are float32 values as Python
    floats, one per micro-batch: summing them in order over every pass gives the whole-calibration score.
    """
    from tqdm import tqdm

    micro_ids = calibration_batches(calibration_ids, batch_size)
    scored = {int(layer): list(formats) for layer, formats in scored.items() if formats}
    inputs = [stream.layer_inputs(mb) for mb in micro_ids]
    kwargs_of = [[item.kwargs[i] for item in inputs] for i in range(stream.num_layers)]
    ref = [item.hidden for item in inputs]
    branches: dict[tuple[int, str], list[torch.Tensor]] = {}
    start = 0
    state_path = Path(state_dir) if state_dir is not None else None
    if state_path is not None:
        saved = _load_state(state_path, state_key, len(micro_ids), stream.device)
        if saved is not None:
            start, ref, branches = saved
            log.info("resuming the pass at layer %d (%d branches live)", start, len(branches))
    last_save = time.monotonic()
    bar = tqdm(
        total=stream.num_layers,
        initial=start,
        desc="score layers",
        unit="layer",
        file=sys.stderr,
        disable=not progress,
    )
    # no_grad, not inference_mode: layers are loaded inside, and quantized_experts swaps their .data
    with torch.no_grad(), bar:
        for i in range(start, stream.num_layers):
            layer = stream.load_layer(i)
            kwargs = kwargs_of[i]
            if i in scored:
                ref_in = ref
                ref = [layer(h, **kwargs[b]) for b, h in enumerate(ref_in)]
                for fmt in scored[i]:  # each branch: this layer in full, its routed experts swapped
                    quant = quant_for(i, fmt, layer)
                    with quantized_experts(stream.model, quant):
                        branches[(i, fmt)] = [layer(h, **kwargs[b]) for b, h in enumerate(ref_in)]
                    del quant
                del ref_in
                stream.prefetch_layer(i + 1)  # only now: the quantized copy is freed (2 layers at most)
                older = {k: v for k, v in branches.items() if k[0] < i}
                _run_branches(layer, older, kwargs, stack)
                branches.update(older)
            else:
                stream.prefetch_layer(i + 1)
                ref = [layer(h, **kwargs[b]) for b, h in enumerate(ref)]
                _run_branches(layer, branches, kwargs, stack)
            stream.release_layer(i)
            bar.update()
            stopping = stop_requested() and i + 1 < stream.num_layers
            if state_path is not None and (stopping or time.monotonic() - last_save >= checkpoint_interval_s):
                _save_state(state_path, state_key, i + 1, ref, branches)
                last_save = time.monotonic()
            if stopping:
                saved = f"state saved: the retry resumes at layer {i + 1}" if state_path else "no state"
                raise Preempted(f"stopped by SIGTERM after layer {i} of {stream.num_layers} ({saved})")
        sums: dict[str, dict[int, list[float]]] = {}
        for b, hidden in enumerate(ref):
            log_p = torch.log_softmax(stream.head(hidden), dim=-1, dtype=torch.float32)
            p = log_p.exp()
            for (layer, fmt), states in sorted(branches.items()):
                value = float(kl_sum(log_p, stream.head(states[b]), p))
                sums.setdefault(fmt, {}).setdefault(layer, []).append(value)
            del log_p, p
    missing = [
        (layer, fmt) for layer, formats in scored.items() for fmt in formats if (layer, fmt) not in branches
    ]
    if missing:
        raise RuntimeError(f"layers never reached while scoring: {missing[:4]}")
    return sums
