"""What an engine scores and what is kept of it: evaluation windows, the reference as stored, and one pass of
a fresh engine over every window.

Windows (:func:`load_windows`): the pinned prompt is one window (domain ``prompt``); the evaluation suite
(``sample_eval``) is W windows of T tokens, each with its domain. Positions are numbered window by window:
window w holds positions ``w*(T-1) .. (w+1)*(T-1)-1``, the predictions of its tokens 1..T-1.

The reference, as stored (``reference_logits``):

* ``full`` -- ``logits.safetensors``: float32 ``[positions, V]`` (``logits``), the exact reference; its
  SHA-256 is the canonical encoding's (:func:`logits_sha256`), the published hash for the prompt.
* ``topk`` -- ``reference_topk.safetensors``: per position the top-k log-probabilities, the tail mass and
  its entropy term (:mod:`mixquant.kld.topk`): KL with a stated per-position bound, for real scale.

A pass (:func:`score_pass`) opens one fresh engine and, for each task, runs every window through it and
either records the reference (no reference given) or scores the candidate against one: per-position
statistics (:func:`mixquant.kld.stats.kld_statistics`, or its top-k form) written as
``per_position.safetensors`` + ``kld.json``. The statistics are computed where the engine leaves the logits:
the CPU for hf (its numerics profile), the engine's first GPU for vLLM under CUDA (the reference rows are
moved there a window at a time). A window's logits never outlive its own scoring, so memory is
one window's ``[T-1, V]`` plus what is stored.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from mixquant.calibration.eval_suite import EVAL_JSON, WINDOWS_FILE
from mixquant.calibration.tokens import load_token_ids
from mixquant.checkpoint.writer import save_file_sorted
from mixquant.kld.engines import open_engine
from mixquant.kld.settings import EngineSettings
from mixquant.kld.stats import kld_statistics, summarize
from mixquant.kld.topk import kld_statistics_topk, reduce_reference
from mixquant.model.layer_reader import check_checkpoint_shards

LOGITS_FILE = "logits.safetensors"
TOPK_FILE = "reference_topk.safetensors"
PER_POSITION_FILE = "per_position.safetensors"
RUN_JSON = "kld.json"
PROMPT_FILE = "prompt.safetensors"
PROMPT_DOMAIN = "prompt"
ENCODING = "float32 little-endian IEEE-754, row-major [T-1, V], no header"
PER_POSITION_KEYS = ("kl", "p_ref", "p_cand", "ref_nll", "cand_nll")


@dataclass(frozen=True)
class Windows:
    """Token windows ``ids`` (int64 [W, T]) and each window's domain."""

    ids: torch.Tensor
    domains: tuple[str, ...]

    @property
    def positions_per_window(self) -> int:
        return int(self.ids.shape[1]) - 1

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0]) * self.positions_per_window

    def window_of_position(self) -> np.ndarray:
        return np.repeat(np.arange(self.ids.shape[0]), self.positions_per_window)

    def rows(self, window: int) -> slice:
        return slice(window * self.positions_per_window, (window + 1) * self.positions_per_window)


def load_windows(directory: str | Path) -> Windows:
    """The windows of an evaluation-suite (``sample_eval``) or prompt (``pin_prompt``) output."""
    directory = Path(directory)
    if (directory / WINDOWS_FILE).is_file():
        ids = load_token_ids(directory / WINDOWS_FILE).long()
        document = json.loads((directory / EVAL_JSON).read_text(encoding="utf-8"))
        domains = tuple(w["domain"] for w in document["windows"])
        if len(domains) != ids.shape[0]:
            raise ValueError(f"{directory}: {ids.shape[0]} windows but {len(domains)} listed in {EVAL_JSON}")
        return Windows(ids, domains)
    ids = load_token_ids(directory / PROMPT_FILE).reshape(1, -1).long()
    return Windows(ids, (PROMPT_DOMAIN,))


def logits_sha256(logits: torch.Tensor) -> str:
    """SHA-256 of the canonical encoding of float32 logits (see the module docstring)."""
    return _LogitsHash().update(logits).hexdigest()


class _LogitsHash:
    """The canonical-encoding hash of logits fed a window at a time (row-major concatenation)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, logits: torch.Tensor) -> _LogitsHash:
        array = np.ascontiguousarray(logits.detach().to("cpu").float().numpy(), dtype="<f4")
        self._hash.update(array.tobytes())
        return self

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class Reference:
    """A stored reference (full logits or top-k form), read one window's rows at a time."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        self.form = "topk" if (directory / TOPK_FILE).is_file() else "full"
        self._path = directory / (TOPK_FILE if self.form == "topk" else LOGITS_FILE)

    def statistics(self, rows: slice, cand: torch.Tensor, next_tokens: torch.Tensor) -> dict[str, Any]:
        with safe_open(str(self._path), framework="pt") as handle:
            if self.form == "full":
                ref = handle.get_slice("logits")[rows.start : rows.stop]
                if ref.shape != cand.shape:
                    raise ValueError(f"candidate logits {tuple(cand.shape)} vs reference {tuple(ref.shape)}")
                return kld_statistics(ref.to(cand.device), cand, next_tokens.to(cand.device))
            reduced = {name: handle.get_slice(name)[rows.start : rows.stop] for name in handle.keys()}
        reduced = {name: value.to(cand.device) for name, value in reduced.items()}
        return kld_statistics_topk(reduced, cand, next_tokens.to(cand.device))


class _ReferenceWriter:
    """Collects the reference a window at a time: full logits (and their hash) or the top-k form."""

    def __init__(self, form: str, top_k: int | None):
        self.form, self.top_k = form, top_k
        self.parts: list[Any] = []
        self.hash = _LogitsHash()
        self.shape = [0, 0]

    def add(self, logits: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.hash.update(logits)
        self.shape = [self.shape[0] + int(logits.shape[0]), int(logits.shape[1])]
        if self.form == "full":
            self.parts.append(logits.detach().to("cpu", torch.float32))
        else:
            self.parts.append(reduce_reference(logits, next_tokens.to(logits.device), int(self.top_k)))

    def save(self, directory: Path) -> dict[str, Any]:
        sha = self.hash.hexdigest()
        if self.form == "full":
            save_file_sorted(
                {"logits": torch.cat(self.parts).contiguous()}, directory / LOGITS_FILE, {"sha256": sha}
            )
        else:
            tensors = {name: torch.cat([p[name] for p in self.parts]).contiguous() for name in self.parts[0]}
            save_file_sorted(
                tensors, directory / TOPK_FILE, {"full_logits_sha256": sha, "top_k": str(self.top_k)}
            )
        return {"sha256": sha, "shape": self.shape, "form": self.form, "top_k": self.top_k}


@dataclass
class Task:
    """One thing a pass does with every window: record the reference into ``out`` (``reference`` None) or
    score against ``reference`` into ``out``."""

    windows: Windows
    out: Path
    reference: Reference | None = None
    form: str = "full"
    top_k: int | None = None


def score_pass(model_dir: str | Path, settings: EngineSettings, tasks: Sequence[Task]) -> dict[str, Any]:
    """One fresh engine over every task's windows; returns ``{"engine": info, "seconds", "results": [...]}``
    where each result is the reference's record or the scored run's summary."""
    check_checkpoint_shards(model_dir)  # a broken shard stops here with one line naming it
    started = time.perf_counter()
    engine = open_engine(model_dir, settings)
    results = []
    try:
        for task in tasks:
            task.out.mkdir(parents=True, exist_ok=True)
            if task.reference is None:
                results.append(_record(engine, task))
            else:
                results.append(_score(engine, task))
        info = engine.info()
    finally:
        engine.close()
    return {"engine": info, "seconds": time.perf_counter() - started, "results": results}


def _window_logits(engine: Any, windows: Windows) -> Iterator[tuple[int, torch.Tensor]]:
    """(window, its [T-1, V] logits) in order: the engine's own pass over every window where it has one
    (the layer-streamed hf engine reads each layer once for all windows), else a window at a time."""
    if hasattr(engine, "windows_logits"):
        yield from enumerate(engine.windows_logits(windows.ids))
        return
    logits_of = getattr(engine, "device_logits", engine.prompt_logits)  # vLLM: left on its GPU
    for w in range(windows.ids.shape[0]):
        yield w, logits_of(windows.ids[w])


def _record(engine: Any, task: Task) -> dict[str, Any]:
    writer = _ReferenceWriter(task.form, task.top_k)
    for w, logits in _window_logits(engine, task.windows):
        writer.add(logits, task.windows.ids[w][1:])
    return writer.save(task.out)


def _score(engine: Any, task: Task) -> dict[str, Any]:
    windows = task.windows
    parts: dict[str, list[torch.Tensor]] = {}
    logits_hash = _LogitsHash()
    for w, logits in _window_logits(engine, windows):
        logits_hash.update(logits)
        per = task.reference.statistics(windows.rows(w), logits, windows.ids[w][1:])["per_position"]
        for name, value in per.items():
            parts.setdefault(name, []).append(value)
    per_position = {name: torch.cat(values) for name, values in parts.items()}
    summary = summarize(per_position)
    for bound in ("kl_low", "kl_high"):  # a top-k reference: the stated bounds of the mean
        if bound in per_position:
            summary[f"mean_{bound.replace('kl', 'kld')}"] = float(per_position[bound].double().mean())
    tensors = {
        name: value.to(torch.float64).contiguous()
        for name, value in per_position.items()
        if name != "top1_same"
    }
    tensors["top1_same"] = per_position["top1_same"].to(torch.uint8).contiguous()
    save_file_sorted(tensors, task.out / PER_POSITION_FILE, None)
    return {"summary": summary, "candidate_logits_sha256": logits_hash.hexdigest()}
