"""Layer streaming: forward passes that never hold the whole model, on CPU or CUDA.

A :class:`StreamedModel` is the checkpoint's transformers model built on the meta device (a skeleton:
modules, no storage) with only what every position needs materialized on the compute device -- the
token embedding, the final norm, the lm_head and the rotary tables (non-persistent buffers, recomputed by
the model's own rotary module). Decoder layers are read from the shards one at a time
(:class:`mixquant.checkpoint.shards.ShardReader`: validated headers, ``pread`` into owned tensors),
converted to the in-memory layout and attached by transformers' own loading code
(``convert_and_load_state_dict_in_model`` with the model's conversion mapping: per-expert tensors fused,
renames applied -- exactly what ``from_pretrained`` does), run, and released back to the meta device.
While one layer computes, a background thread reads the next one's tensors (into pinned memory on
CUDA), so host and device hold about two decoder layers plus the activations.

Fused reads: the routed experts are most of a layer's bytes, and transformers builds their fused parameters
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) by stacking the per-expert tensors and then
concatenating gate and up -- two more copies of the experts into freshly faulted memory, which cost more
than the read itself. Where the conversion mapping fuses a parameter in just that way (a
``MergeModulelist(dim=0)``, then for several source patterns a ``Concatenate(dim=1)``),
:class:`_FusedParameter` places each checkpoint tensor where those operations would put it, found with
transformers' own key renaming and source order, and the reader reads it straight into that slice of a
buffer of the parameter's shape (a dequantized export copies into it once). The buffer is handed to
transformers' loader under the parameter's name, which attaches it as it does any tensor (dtype cast,
device, bookkeeping); everything else, and every converter of another kind, takes transformers' own
conversion. Stacking and concatenating are copies, so the parameters are the same bits (tests compare every
parameter of every family with ``fused_reads=False``, transformers' conversion alone).

Passes are layer-major: every sequence of a pass goes through layer ``i`` before layer ``i + 1`` is
loaded, so each layer is read once per pass whatever the number of batches. The per-layer keyword
arguments (masks, rotary embeddings, positions) are the model's own: :meth:`StreamedModel.layer_inputs`
runs the model's forward with every decoder layer replaced by a recorder, which captures the embedding
output and each layer's arguments without computing any layer. Calling the layers in order on those
inputs and then :meth:`StreamedModel.head` is the model's forward, operation for operation, so the
results are bit-identical to the whole-model forward on the same device (tests check it).

An exported (ModelOpt) checkpoint streams through the same path with ``dequantize=True``: each layer's
quantized weights are dequantized with ModelOpt's export numerics
(:func:`mixquant.model.dequant.dequantized_group`) before they are attached, their scale tensors and
KV-cache scales dropped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixquant.checkpoint.shards import CheckpointError, ShardReader, glibc
from mixquant.model.dequant import dequantized_group

__all__ = ["LayerInputs", "StreamedModel", "resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a config names (``cpu``, ``cuda``, ``cuda:N``); one line when it is not there."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r}: not a torch device ({exc})") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: mixquant computes on cpu or cuda")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is visible to this process")
        index = resolved.index if resolved.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
        resolved = torch.device("cuda", index)
    return resolved


@dataclass
class LayerInputs:
    """One batch's input to the decoder stack: the embedding output and each layer's keyword arguments."""

    hidden: torch.Tensor
    kwargs: list[dict[str, Any]]


class _ReadTensor:
    """A tensor already read, handed to transformers' loader as the lazy slice it expects: ``t[...]``
    returns it once and drops this reference, so the loader's conversions (stacking experts, concatenating
    gate and up) free each source as they consume it instead of holding the whole raw layer."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is not Ellipsis:
            raise TypeError("a read tensor is materialised whole ([...])")
        tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise RuntimeError("tensor materialised twice")
        return tensor


@dataclass(frozen=True)
class _FusedParameter:
    """One fused parameter and where each of its checkpoint tensors goes in it.

    ``slots[source] = (position, first row, end row)``: transformers' ``MergeModulelist(dim=0)`` stacks a
    source pattern's tensors in its key order (position ``j`` is the ``j``-th), then ``Concatenate(dim=1)``
    joins the patterns in the converter's order, so pattern ``p``'s tensor ``j`` is rows
    ``[offset_p, offset_p + rows_p)`` of ``parameter[j]`` -- one contiguous slice.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    slots: dict[str, tuple[int, int, int]]

    def allocate(self, *, pin_memory: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """An uninitialised buffer of the parameter's shape and each source's slice of it."""
        buffer = torch.empty(self.shape, dtype=self.dtype, pin_memory=pin_memory)
        return buffer, {source: buffer[j, begin:end] for source, (j, begin, end) in self.slots.items()}


def _fuses_by_stacking(converter: Any) -> bool:
    """Whether a conversion-mapping entry is exactly a stack of experts (``MergeModulelist(dim=0)``),
    then, for several source patterns, a concatenation of their stacks (``Concatenate(dim=1)``)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    if type(converter) is not WeightConverter:
        return False
    if converter.quantization_operation is not None or converter.distributed_operation is not None:
        return False
    ops = converter.operations
    stacks = len(ops) >= 1 and type(ops[0]) is MergeModulelist and ops[0].dim == 0
    if len(converter.source_patterns) == 1:
        return stacks and len(ops) == 1
    return stacks and len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1


@contextlib.contextmanager
def _layer_loading() -> Iterator[None]:
    """transformers' loader as a layer at a time needs it: its per-call 'Loading weights' progress bar off
    (the stage's own bar says how far the pass is) and synchronous materialisation, so sources are
    consumed one converter at a time (its thread pool would materialise every source up front)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    hf_logging.disable_progress_bar()
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
        if previous is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _map_large_allocations() -> None:
    """Serve every allocation of 128 KiB or more with its own mapping, returned to the system on free.

    A streamed layer arrives as many mid-sized tensors (one per expert and projection). glibc raises its
    mmap threshold after freeing a mapped chunk (up to 32 MiB), so later such tensors come from the heap,
    where freed chunks stay resident: a pass's resident memory would grow with every layer it loads. A
    fixed threshold turns that off (process-wide; a few more mmap calls)."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


def _release_freed_memory() -> None:
    """Return freed heap pages to the system (the small tensors of a released layer); a no-op elsewhere."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


class StreamedModel:
    """A causal LM whose decoder layers are loaded one at a time (see the module docstring).

    ``model_dir``: a checkpoint in its upstream layout (BF16) or, with ``dequantize=True``, a ModelOpt
    export. ``reader``: a :class:`ShardReader` to read through (a counting one in tests). ``prefetch``:
    read layer ``i + 1`` in a background thread while layer ``i`` computes. ``fused_reads``: read the
    experts straight into their fused parameters (the module docstring); False leaves the fusing to
    transformers' conversion, the reference the tests and the benchmark compare with.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        dequantize: bool = False,
        reader: ShardReader | None = None,
        prefetch: bool = True,
        fused_reads: bool = True,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = dtype
        self.dequantize = dequantize
        self.reader = reader or ShardReader(self.model_dir)
        self.prefetch = prefetch
        self.fused_reads = fused_reads
        _map_large_allocations()
        config = AutoConfig.from_pretrained(self.model_dir)  # trust_remote_code stays off
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights arrive dequantized
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, experts_implementation="eager", attn_implementation="sdpa"
            )
        self.model = model.eval()
        self.config = model.config
        if self.config._experts_implementation != "eager":
            raise RuntimeError(
                f"experts implementation is {self.config._experts_implementation!r}, need 'eager'"
            )
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self._mapping = get_model_conversion_mapping(model)
        self._shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixquant-prefetch")
        self._pending: dict[int, Future] = {}
        self._attach(self.reader.non_layer_names(), what="embeddings, final norm, lm_head")
        rotary = getattr(model.model, "rotary_emb", None)
        if rotary is not None:  # non-persistent buffers: computed by the model's own module (on the CPU,
            # as from_pretrained does), then moved
            model.model.rotary_emb = type(rotary)(config=self.config).to(self.device)
        stray = [
            name
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.device.type == "meta" and not name.startswith("model.layers.")
        ]
        if stray:
            raise CheckpointError(f"{self.model_dir}: not in the checkpoint: {', '.join(stray[:4])}")

    # ------------------------------------------------------------------------------------ loading

    def _fusion_plan(
        self, stored: Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]]
    ) -> list[_FusedParameter]:
        """The fused parameters that tensors ``{name: (dtype, shape)}`` make, as transformers' conversion
        would build them (:class:`_FusedParameter`): keys renamed by its own ``rename_source_key``, each
        pattern's tensors in its own order (``dot_natural_key``). A parameter is left to transformers when
        its converter is of another kind or its tensors would not stack into exactly the model's shape
        (transformers then reports what is wrong)."""
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        renamings = [entry for entry in self._mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in self._mapping if isinstance(entry, WeightConverter)]
        converter_of = {pattern: entry for entry in converters for pattern in entry.source_patterns}
        prefix = self.model.base_model_prefix
        sources: dict[str, dict[str, list[str]]] = {}
        for name in sorted(stored, key=dot_natural_key):
            target, pattern = rename_source_key(name, renamings, converters, prefix, self._shapes)
            if pattern is None or target not in self._shapes or not _fuses_by_stacking(converter_of[pattern]):
                continue  # renamed or unknown: transformers' business (a name of the model stays as it is)
            sources.setdefault(target, {}).setdefault(pattern, []).append(name)
        plan = []
        for target, by_pattern in sources.items():
            converter = converter_of[next(iter(by_pattern))]  # as transformers picks it: the first key's
            if not set(by_pattern) <= set(converter.source_patterns):
                continue
            groups = [by_pattern.get(pattern, []) for pattern in converter.source_patterns]
            specs = {stored[name] for group in groups for name in group}
            if len(specs) != 1 or len({len(group) for group in groups}) != 1:
                continue  # missing, or tensors of different shapes or dtypes
            dtype, shape = specs.pop()
            if dtype is None or not shape:
                continue
            fused_shape = (len(groups[0]), len(groups) * shape[0], *shape[1:])
            if fused_shape != self._shapes[target]:
                continue
            slots = {
                name: (position, index * shape[0], (index + 1) * shape[0])
                for index, group in enumerate(groups)
                for position, name in enumerate(group)
            }
            plan.append(_FusedParameter(target, fused_shape, dtype, slots))
        return plan

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``names`` read from the checkpoint; with fused reads the experts land in their fused parameters,
        which replace them in the result (an export's are fused after dequantization instead)."""
        pin_memory = self.device.type == "cuda"
        plan = []
        if self.fused_reads and not self.dequantize:
            plan = self._fusion_plan({name: self.reader.stored(name) for name in names})
        buffers, into = {}, {}
        for fused in plan:
            buffers[fused.name], slots = fused.allocate(pin_memory=pin_memory)
            into.update(slots)
        tensors = self.reader.read(names, pin_memory=pin_memory, into=into)
        for fused in plan:
            for source in fused.slots:
                del tensors[source]
            tensors[fused.name] = buffers[fused.name]
        return tensors

    def _fused_copies(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (consumed) with the experts copied into their fused parameters, each source freed as
        it is copied: one copy instead of transformers' stack and concatenation."""
        plan = self._fusion_plan({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
        for fused in plan:
            buffer, slots = fused.allocate(pin_memory=False)
            for source, slot in slots.items():
                slot.copy_(tensors.pop(source))
            tensors[fused.name] = buffer
        return tensors

    def _attach(self, names: list[str], *, what: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Convert ``names`` (read now unless given; the dict is consumed) to the in-memory layout and
        load them on the device."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        if tensors is None:
            tensors = self._read(names)
        if self.dequantize:
            tensors = dequantized_group(tensors, self.dtype)
            if self.fused_reads:
                tensors = self._fused_copies(tensors)
        sources = {name: _ReadTensor(tensors.pop(name)) for name in list(tensors)}
        load = LoadStateDictConfig(
            dtype=self.dtype, weight_mapping=self._mapping, device_map={"": str(self.device)}
        )
        with _layer_loading():
            info, _ = convert_and_load_state_dict_in_model(self.model, sources, load)
        problems = (
            sorted(info.unexpected_keys) + sorted(info.mismatched_keys) + sorted(info.conversion_errors)
        )
        if problems:
            raise CheckpointError(f"{self.model_dir}: {what}: cannot load {problems[0]}")

    def prefetch_layer(self, layer: int) -> None:
        """Start reading layer ``layer``'s tensors in the background (a no-op out of range)."""
        if self.prefetch and 0 <= layer < self.num_layers and layer not in self._pending:
            self._pending[layer] = self._pool.submit(self._read, self.reader.layer_names(layer))

    def load_layer(self, layer: int) -> torch.nn.Module:
        """Decoder layer ``layer`` on the device (prefetched tensors when there are any)."""
        names = self.reader.layer_names(layer)
        if not names:
            raise CheckpointError(f"{self.reader.where}: no tensors of layer {layer}")
        pending = self._pending.pop(layer, None)
        tensors = pending.result() if pending is not None else None
        del pending  # the future would keep the raw tensors alive through the conversion
        self._attach(names, what=f"layer {layer}", tensors=tensors)
        module = self.layers[layer]
        left = [
            n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"
        ]
        if left:
            raise CheckpointError(f"{self.model_dir}: layer {layer}: not in the checkpoint: {left[0]}")
        return module

    def release_layer(self, layer: int) -> None:
        """Back to the meta device: the layer's storage is freed (and returned to the system)."""
        self.layers[layer].to("meta")
        if self.device.type == "cpu":
            _release_freed_memory()

    def stream(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, torch.nn.Module]]:
        """``(i, layer)`` for ``start <= i < stop``: loaded on entry, released when the caller moves on;
        the next layer is read in the background meanwhile."""
        stop = self.num_layers if stop is None else stop
        for layer in range(start, stop):
            module = self.load_layer(layer)
            self.prefetch_layer(layer + 1 if layer + 1 < stop else -1)
            try:
                yield layer, module
            finally:
                self.release_layer(layer)

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ computing

    def layer_inputs(self, input_ids: torch.Tensor) -> LayerInputs:
        """The decoder stack's input for ``input_ids`` ([B, T]) as the model's own forward builds it.

        Runs the model's forward with each decoder layer replaced by a recorder (no layer computes): the
        embedding output and every layer's keyword arguments (masks, rotary embeddings, positions).
        """
        records: list[dict[str, Any]] = []
        first: list[torch.Tensor] = []

        def recorder(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args:
                raise RuntimeError("decoder layers are called with positional arguments beyond the input")
            if not first:
                first.append(hidden_states)
            records.append(kwargs)
            return hidden_states

        for layer in self.layers:
            layer.forward = recorder
        try:
            with torch.no_grad():
                self.model.model(input_ids=input_ids.to(self.device), use_cache=False)
        finally:
            for layer in self.layers:
                del layer.forward
        if len(records) != self.num_layers:
            raise RuntimeError(f"the model called {len(records)} of its {self.num_layers} decoder layers")
        return LayerInputs(first[0], records)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the final hidden states: the final norm, then the lm_head (the model's own order)."""
        return self.model.lm_head(self.model.model.norm(hidden))

    def forward(
        self, batches: list[torch.Tensor], *, logits: bool = True, progress: str | None = None
    ) -> list:
        """The whole forward of every batch, layer-major (each layer read once): logits per batch, or the
        final hidden states before the norm with ``logits=False``."""
        import sys

        from tqdm import tqdm

        inputs = [self.layer_inputs(ids) for ids in batches]
        hidden = [item.hidden for item in inputs]
        bar = tqdm(
            total=self.num_layers,
            desc=progress or "layers",
            unit="layer",
            file=sys.stderr,
            disable=progress is None,
        )
        with torch.no_grad(), bar:
            for i, layer in self.stream():
                hidden = [layer(h, **item.kwargs[i]) for h, item in zip(hidden, inputs, strict=True)]
                bar.update()
            return [self.head(h) for h in hidden] if logits else hidden
