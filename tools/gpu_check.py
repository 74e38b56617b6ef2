#!/usr/bin/env python3
"""Prepared GPU check of mixquant's hot paths: one run, one JSON file of measurements.

Run on a GPU machine through ``tools/gpu-check.sh`` (which installs the pinned transformers / ModelOpt
wheels first); ``--device cpu --small`` is a CPU smoke mode with tiny shapes (tests/test_gpu_check.py).

Sections, each independent -- a failure is recorded as ``{"error": ...}`` and the next section still
runs, and a section that would start too close to ``--budget-s`` is ``{"skipped": "time budget"}``:

* ``h2d``: host-to-device copy bandwidth, pinned and pageable (CUDA events; best and median GB/s);
* ``laguna_layer``: one Laguna-S-2.1 MoE decoder layer (transformers' ``LagunaDecoderLayer``, eager
  experts, sdpa, random bf16 weights made on the device) at several batch sizes: tokens/s, TFLOP/s
  and peak memory;
* ``stacked_branches``: that layer on 1..N stacked copies of one micro-batch, as
  ``mixquant.search.branches`` stacks live branches (``stack=True``): time per branch-sequence;
* ``lm_head_kl``: lm_head + float32 log_softmax + KL sum per token chunk (``mixquant.search.score.kl_sum``);
* ``toy_gpu_vs_cpu``: the shipped toy checkpoint through the library on the device vs the CPU --
  activation statistics, branch-parallel KL scores and the NVFP4 (round-to-nearest and GPTQ) / FP8
  exported bytes;
* ``gptq``: GPTQ rounding of 1..32 Laguna-shaped experts as one batch: seconds per expert, peak memory.

The numerics profile is entered first (``mixquant.numerics.enter``, as a workflow stage does), so the
CUDA side runs with ``torch.use_deterministic_algorithms(True)``; an op refused under it is listed in
``deterministic_errors``. The JSON is rewritten after every section, so a run killed at its time limit
still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "workflow"))  # the library from this checkout, whatever is installed

TOY_DIR = REPO / "data" / "toy-laguna"
LAGUNA_CONFIG = REPO / "data" / "models" / "laguna-s-2.1" / "config.json"
SCHEMA = "mixquant-gpu-check/1"
GIB = 1 << 30
MIB = 1 << 20
NVFP4 = "nvfp4_w4a16"
FP8 = "fp8"
# Recorded in the header: what decides the numbers, and what tools/gpu-check.sh may have installed.
DISTRIBUTIONS = (
    "torch",
    "transformers",
    "nvidia-modelopt",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "regex",
    "numpy",
    "pydantic",
    "omegaconf",
    "PuLP",
)


@dataclass(frozen=True)
class Sizes:
    """Every shape a run uses: the device run's, or the CPU smoke test's (``--small``)."""

    h2d_bytes: tuple[int, ...]
    layer_sequences: tuple[int, ...]
    seq_len: int
    branches: tuple[int, ...]
    branch_sequences: int
    lm_chunks: tuple[int, ...]
    layer_overrides: dict[str, Any] = field(default_factory=dict)
    repeats: int = 3
    toy_sequences: int = 16
    toy_seq_len: int = 256
    toy_batch: int = 8
    # GPTQ rounding: experts of gate/up [2I, H] rounded as one batch, each with its own Hessian
    gptq_shape: tuple[int, int] = (3072, 1024)  # Laguna-S-2.1's (H, I)
    gptq_experts: tuple[int, ...] = (1, 8, 32)


FULL = Sizes(
    h2d_bytes=(GIB, 256 * MIB),
    layer_sequences=(8, 32, 128),
    seq_len=512,
    branches=(1, 16, 64),
    branch_sequences=2,  # 64 branches x 8 sequences x 512 tokens would be 262k tokens per layer call
    lm_chunks=(1024, 4096),
)
# A Laguna-shaped layer small enough for a CPU test: same structure (sliding-window attention with
# per-head gating, routed + shared experts), 8 experts, hidden 256.
SMALL = Sizes(
    h2d_bytes=(),
    layer_sequences=(1, 2),
    seq_len=64,
    branches=(1, 2, 4),
    branch_sequences=2,
    lm_chunks=(64, 256),
    layer_overrides={
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_attention_heads": 4,
        "num_attention_heads_per_layer": [4, 8],
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 64,
        "vocab_size": 4096,
    },
    repeats=2,
    toy_sequences=8,
    toy_seq_len=64,
    toy_batch=4,
    gptq_shape=(64, 32),
    gptq_experts=(1, 2),
)
# Seconds a section needs at least on the device; it is skipped when less of the budget is left.
RESERVE_S = {
    "h2d": 15,
    "laguna_layer": 45,
    "stacked_branches": 45,
    "lm_head_kl": 15,
    "toy_gpu_vs_cpu": 60,
    "gptq": 30,
}


# ----------------------------------------------------------------------------------------- the run


class TimeLimit(BaseException):
    """SIGTERM (tools/gpu-check.sh's time limit): stop where we are, keep what was measured."""


def on_sigterm(signum, frame) -> None:
    raise TimeLimit()


class Run:
    """One check: arguments, clock, the report being built and its file."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sizes = SMALL if args.small else FULL
        self.started = time.monotonic()
        self.out = Path(args.out)
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "header": {
                "argv": sys.argv[1:],
                "device": str(args.device),
                "small": args.small,
                "budget_s": args.budget_s,
                "setup": {"status": args.setup_status, "log_tail": log_tail(args.setup_log)},
            },
            "sections": {},
            "deterministic_errors": [],
        }
        self.device = None  # a torch.device once torch is imported
        self.current = "header"
        self.partial: dict[str, Any] = {}  # what the running section measured so far (kept if killed)
        self._layer = None  # (layer, config): built once, shared by two sections

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float:
        return self.args.budget_s - self.elapsed()

    def guarded(self, where: str, fn: Callable[[], dict]) -> dict:
        """``fn()``, or ``{"error": ...}`` when it raises."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- a failure is a measurement here
            return self.failure(where, exc)

    def failure(self, where: str, exc: Exception) -> dict:
        """The error entry of ``exc`` (an op refused by deterministic mode is also listed at the top)."""
        message = f"{type(exc).__name__}: {exc}".strip()[:2000]
        if "deterministic" in message:
            self.report["deterministic_errors"].append({"where": where, "error": message})
        free_device_memory(self.device)
        return {"error": message, "traceback": traceback.format_exc().splitlines()[-8:]}

    def release_layer(self) -> None:
        """The Laguna layer's memory back (its sections are done)."""
        self._layer = None
        free_device_memory(self.device)

    def section(self, name: str, fn: Callable[[Run], dict]) -> None:
        self.current, self.partial = name, {}
        if self.args.sections and name not in self.args.sections:
            result: dict = {"skipped": "not selected"}
        elif self.remaining() < RESERVE_S[name]:
            result = {"skipped": "time budget"}
        else:
            start = time.monotonic()
            result = self.guarded(name, lambda: fn(self))
            result["wall_s"] = round(time.monotonic() - start, 3)
        self.report["sections"][name] = result
        progress(f"{name}: {one_line(result)}")
        self.write()

    def write(self) -> None:
        """The report as it stands, replacing the file atomically."""
        self.report["wall_s"] = round(self.elapsed(), 3)
        self.report["header"]["section_wall_s"] = {
            name: result.get("wall_s") for name, result in self.report["sections"].items()
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(finite(self.report), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.out)


def progress(line: str) -> None:
    print(f"[gpu-check] {line}", file=sys.stderr, flush=True)


def one_line(result: dict) -> str:
    for key in ("summary", "error", "skipped"):
        if key in result:
            return f"{key}: {str(result[key]).splitlines()[0][:200]} ({result.get('wall_s', 0)} s)"
    return f"done ({result.get('wall_s', 0)} s)"


def finite(value: Any) -> Any:
    """JSON-safe copy: NaN / inf as strings (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------- helpers


def free_device_memory(device) -> None:
    import gc

    gc.collect()
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events on the GPU, the wall clock on the CPU), after warm-ups."""
    import torch

    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return times


def time_stats(times: list[float]) -> dict[str, float]:
    return {"best_s": min(times), "median_s": statistics.median(times), "repeats": len(times)}


def reset_peak(device) -> int:
    """Start a peak-memory window; the bytes allocated now (0 on the CPU)."""
    import torch

    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gib(device, base: int) -> dict[str, float | None]:
    """Peak allocated since :func:`reset_peak`, in all and above what was allocated then (None on CPU)."""
    import torch

    if device.type != "cuda":
        return {"peak_memory_gib": None, "peak_above_start_gib": None}
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_memory_gib": peak / GIB, "peak_above_start_gib": (peak - base) / GIB}


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def within_budget(run: Run, seconds: float) -> bool:
    return run.remaining() > seconds


# ----------------------------------------------------------------------------------------- header


def enter_numerics(run: Run) -> None:
    """The workflow's numerics profile for this device (before torch is imported by anything else)."""
    header = run.report["header"]
    try:
        from mixquant.numerics import enter

        header["numerics"] = enter("portable", run.args.threads, run.args.device)
    except Exception as exc:  # noqa: BLE001 -- recorded; the measurements still run
        header["numerics"] = {"error": f"{type(exc).__name__}: {exc}"}
    import torch

    header["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()


def versions() -> dict[str, str | None]:
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def library_imports() -> dict[str, Any]:
    """Whether the modules the sections need import here (the first error of each, else 'ok')."""
    import importlib

    status = {}
    for module in (
        "transformers.models.laguna.modeling_laguna",
        "modelopt.torch.quantization",
        "mixquant.model.streaming",
        "mixquant.quantize.activations",
        "mixquant.quantize.layer",
        "mixquant.search.branches",
        "mixquant.search.score",
    ):
        try:
            loaded = importlib.import_module(module)
            status[module] = f"ok ({Path(loaded.__file__).parent})" if module.startswith("trans") else "ok"
        except Exception as exc:  # noqa: BLE001
            status[module] = f"{type(exc).__name__}: {exc}"[:500]
    return status


def fill_header(run: Run) -> None:
    import torch

    header = run.report["header"]
    header.update(
        python=platform.python_version(),
        host=platform.node(),
        cpu_count=os.cpu_count(),
        versions=versions(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
    )
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        header.update(
            gpu_name=torch.cuda.get_device_name(run.device),
            gpu_total_memory_gib=props.total_memory / GIB,
            gpu_multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
        )
    header["imports"] = library_imports()
    header["transformers"] = header["versions"].get("transformers")
    header["modelopt"] = header["versions"].get("nvidia-modelopt")


def log_tail(path: str | None, chars: int = 3000) -> str | None:
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError as exc:
        return f"unreadable: {exc}"


# ----------------------------------------------------------------------------------------- h2d


def copy_bandwidth(src, dst, device) -> dict:
    """Host-to-device copies of ``src`` into ``dst`` (asynchronous from pinned memory, as a loader does)."""
    times = timed(lambda: dst.copy_(src, non_blocking=src.is_pinned()), device, repeats=5)
    nbytes = src.numel() * src.element_size()
    return {
        "bytes": nbytes,
        "best_gb_s": nbytes / min(times) / 1e9,
        "median_gb_s": nbytes / statistics.median(times) / 1e9,
        **time_stats(times),
    }


def section_h2d(run: Run) -> dict:
    import torch

    if run.device.type != "cuda":
        return {"skipped": "no cuda"}
    cases = {}
    for nbytes in run.sizes.h2d_bytes:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
        for kind in ("pinned", "pageable"):
            # ones, not empty: every host page is touched before the clock starts
            src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
            cases[f"{kind}_{nbytes // MIB}MiB"] = copy_bandwidth(src, dst, run.device)
    free_device_memory(run.device)
    summary = ", ".join(f"{name} {case['best_gb_s']:.1f}" for name, case in cases.items())
    return {"unit": "GB/s = 1e9 bytes/s", "cases": cases, "summary": f"best GB/s: {summary}"}


# ----------------------------------------------------------------------------------------- the layer


def laguna_config(sizes: Sizes):
    """Laguna-S-2.1's config (the repo's copy) cut to two layers -- 0 dense, 1 sparse, as in the model --
    with eager experts and sdpa attention; ``sizes.layer_overrides`` shrink it for the smoke test."""
    from transformers import LagunaConfig

    raw = json.loads(LAGUNA_CONFIG.read_text(encoding="utf-8"))
    raw.update(sizes.layer_overrides)
    for key in ("layer_types", "mlp_layer_types", "num_attention_heads_per_layer"):
        raw[key] = raw[key][:2]
    raw["num_hidden_layers"] = 2
    if raw["mlp_layer_types"] != ["dense", "sparse"]:
        raise ValueError(f"expected layers 0 dense and 1 sparse, the config has {raw['mlp_layer_types']}")
    config = LagunaConfig.from_dict(raw)
    config._experts_implementation = "eager"
    config._attn_implementation = "sdpa"
    return config


def random_layer(config, device):
    """Decoder layer 1 (sparse) with random bf16 weights made directly on ``device`` (no host copy)."""
    import torch
    from transformers.models.laguna.modeling_laguna import LagunaDecoderLayer

    with torch.device("meta"):
        layer = LagunaDecoderLayer(config, layer_idx=1)
    layer = layer.to(dtype=torch.bfloat16).to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    if config._experts_implementation != "eager":
        raise RuntimeError(f"experts implementation {config._experts_implementation!r}, need 'eager'")
    return layer


def shared_layer(run: Run):
    """(layer, config), built on first use and kept for the stacked-branches section."""
    if run._layer is None:
        config = laguna_config(run.sizes)
        run._layer = (random_layer(config, run.device), config)
    return run._layer


def layer_kwargs(config, hidden) -> dict[str, Any]:
    """The keyword arguments ``LagunaModel.forward`` passes to layer 1 for ``hidden`` ([B, T, H]).

    The model is a skeleton on the meta device whose decoder layers are replaced by recorders (the
    trick of ``StreamedModel.layer_inputs``); only the rotary module and the final norm get storage on
    the device, so the masks and rotary embeddings are the model's own, computed there.
    """
    import torch
    from transformers.models.laguna.modeling_laguna import LagunaModel, LagunaRotaryEmbedding

    with torch.device("meta"):
        model = LagunaModel(config)
    model.rotary_emb = LagunaRotaryEmbedding(config, device=hidden.device)
    model.norm.to_empty(device=hidden.device)  # runs after the recorded layers; its output is unused
    records: list[dict[str, Any]] = []

    def recorder(hidden_states, *args, **kwargs):
        if args:
            raise RuntimeError("decoder layers are called with positional arguments beyond the input")
        records.append(kwargs)
        return hidden_states

    for layer in model.layers:
        layer.forward = recorder
    with torch.no_grad():
        model(inputs_embeds=hidden, use_cache=False)
    if len(records) != 2:
        raise RuntimeError(f"the skeleton called {len(records)} of its 2 decoder layers")
    return records[1]


def describe(value: Any) -> Any:
    """Shapes and types of layer arguments, for the report (which masks the model built, and how)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, tuple | list):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    return repr(value)[:100]


def active_matmul_params(layer, config) -> int:
    """Weights a token multiplies by: every matrix of the layer, the routed experts' scaled by top-k / E."""
    experts = layer.mlp.experts
    routed = experts.gate_up_proj.numel() + experts.down_proj.numel()
    matrices = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    return matrices - routed + routed * config.num_experts_per_tok // config.num_experts


def attention_flops(layer, config, sequences: int, seq_len: int) -> int:
    """Q K^T and P V of causal (sliding-window) attention: 2 matmuls x 2 FLOP x heads x head_dim per
    (query, attended key) pair."""
    attn = layer.self_attn
    window = attn.sliding_window or seq_len
    pairs = sum(min(t + 1, window) for t in range(seq_len))
    return 4 * attn.num_heads * attn.head_dim * pairs * sequences


def forward_case(run: Run, layer, config, hidden, kwargs) -> dict:
    """Timed forwards of ``layer`` on ``hidden``: tokens/s, TFLOP/s, peak memory."""
    import torch

    sequences, seq_len = hidden.shape[0], hidden.shape[1]
    base = reset_peak(run.device)
    with torch.no_grad():
        times = timed(lambda: layer(hidden, **kwargs), run.device, repeats=run.sizes.repeats)
    tokens = sequences * seq_len
    flops = 2 * active_matmul_params(layer, config) * tokens + attention_flops(
        layer, config, sequences, seq_len
    )
    best = min(times)
    return {
        "sequences": sequences,
        "seq_len": seq_len,
        "tokens": tokens,
        **time_stats(times),
        "tokens_per_s": tokens / best,
        "tflop_s": flops / best / 1e12,
        "flop_per_forward": flops,
        **peak_gib(run.device, base),
    }


def guarded_case(run: Run, where: str, fn: Callable[[], dict]) -> dict:
    """One case; an OOM is that case's error, the memory is freed and the next case runs."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        if is_oom(exc):
            free_device_memory(run.device)
            return {"error": f"OOM: {str(exc).splitlines()[0][:300]}"}
        return run.failure(where, exc)


def random_hidden(config, sequences: int, seq_len: int, device, seed: int):
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (sequences, seq_len, config.hidden_size)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)


def section_laguna_layer(run: Run) -> dict:
    layer, config = shared_layer(run)
    cases, arguments = run.partial.setdefault("cases", {}), {}
    for sequences in run.sizes.layer_sequences:
        if not within_budget(run, 20):
            cases[str(sequences)] = {"skipped": "time budget"}
            continue

        def case(sequences=sequences):
            hidden = random_hidden(config, sequences, run.sizes.seq_len, run.device, seed=sequences)
            kwargs = layer_kwargs(config, hidden)
            arguments[str(sequences)] = describe(kwargs)
            return forward_case(run, layer, config, hidden, kwargs)

        cases[str(sequences)] = guarded_case(run, f"laguna_layer/{sequences}", case)
    return {
        "geometry": layer_geometry(layer, config),
        "flop_model": "2 x active matmul params x tokens + 4 x heads x head_dim x causal (query, key) pairs",
        "layer_kwargs": arguments,
        "cases": cases,
        "summary": ", ".join(
            f"{n} seq: {c['tokens_per_s']:.0f} tok/s {c['tflop_s']:.1f} TFLOP/s"
            if "tokens_per_s" in c
            else f"{n} seq: {next(iter(c))}"
            for n, c in cases.items()
        ),
    }


def layer_geometry(layer, config) -> dict:
    return {
        "hidden_size": config.hidden_size,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "attention_heads": layer.self_attn.num_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": layer.self_attn.head_dim,
        "sliding_window": layer.self_attn.sliding_window,
        "layer_type": config.layer_types[1],
        "params": sum(p.numel() for p in layer.parameters()),
        "active_matmul_params_per_token": active_matmul_params(layer, config),
        "experts_implementation": config._experts_implementation,
        "attn_implementation": config._attn_implementation,
        "dtype": "bfloat16",
    }


# ----------------------------------------------------------------------------------------- stacking


def expand_kwargs():
    """``mixquant.search.branches._expand`` (the stacking the scorer does), or a copy of its rule when
    that private helper is gone: tensors whose first dim is the micro-batch are repeated along it."""
    try:
        from mixquant.search.branches import _expand

        return _expand, "mixquant.search.branches._expand"
    except ImportError:

        def expand(value, copies, batch):
            import torch

            if isinstance(value, torch.Tensor):
                if value.dim() and value.shape[0] == batch and batch > 1:
                    return value.repeat(copies, *([1] * (value.dim() - 1)))
                return value
            if isinstance(value, tuple | list):
                return type(value)(expand(v, copies, batch) for v in value)
            if isinstance(value, dict):
                return {k: expand(v, copies, batch) for k, v in value.items()}
            return value

        return expand, "local copy of the _expand rule"


def section_stacked_branches(run: Run) -> dict:
    layer, config = shared_layer(run)
    expand, expand_source = expand_kwargs()
    micro, seq_len = run.sizes.branch_sequences, run.sizes.seq_len
    hidden = random_hidden(config, micro, seq_len, run.device, seed=7)
    kwargs = layer_kwargs(config, hidden)
    cases: dict[str, dict] = run.partial.setdefault("cases", {})
    for branches in run.sizes.branches:
        if not within_budget(run, 20):
            cases[str(branches)] = {"skipped": "time budget"}
            continue

        def case(branches=branches):
            # branches differ a little, as quantized branches do; the routing stays realistic
            noise = random_hidden(config, branches * micro, seq_len, run.device, seed=100 + branches)
            stacked = hidden.repeat(branches, 1, 1) + noise * 0.01
            result = forward_case(run, layer, config, stacked, expand(kwargs, branches, micro))
            result["branches"] = branches
            result["per_branch_sequence_s"] = result["best_s"] / (branches * micro)
            return result

        cases[str(branches)] = guarded_case(run, f"stacked_branches/{branches}", case)
    one = cases.get("1", {}).get("per_branch_sequence_s")
    for result in cases.values():
        if one and "per_branch_sequence_s" in result:
            result["speedup_vs_1_branch"] = one / result["per_branch_sequence_s"]
    run._layer = None  # the last user of the layer: its memory goes back before lm_head_kl
    return {
        "shape": {
            "per_branch": f"{micro} sequences x {seq_len} tokens",
            "stacked_input": "[branches x sequences, tokens, hidden]",
            "hidden_size": config.hidden_size,
        },
        "kwargs_expanded_by": expand_source,
        "layer_kwargs": describe(kwargs),
        "cases": cases,
        "summary": ", ".join(
            f"{n} br: {c['per_branch_sequence_s'] * 1e3:.2f} ms/branch-seq "
            f"x{c.get('speedup_vs_1_branch', 0):.1f}"
            if "per_branch_sequence_s" in c
            else f"{n} br: {next(iter(c))}"
            for n, c in cases.items()
        ),
    }


# ----------------------------------------------------------------------------------------- lm_head + KL


def kl_function():
    try:
        from mixquant.search.score import kl_sum

        return kl_sum, "mixquant.search.score.kl_sum"
    except ImportError:
        import torch

        def kl_sum(log_p_ref, logits_quant, p_ref):
            log_q = torch.log_softmax(logits_quant.float(), dim=-1)
            return torch.sub(log_p_ref, log_q, out=log_q).mul_(p_ref).sum()

        return kl_sum, "local copy of kl_sum"


def section_lm_head_kl(run: Run) -> dict:
    import torch
    import torch.nn.functional as F

    run.release_layer()
    raw = json.loads(LAGUNA_CONFIG.read_text(encoding="utf-8"))
    raw.update(run.sizes.layer_overrides)
    vocab, hidden_size = raw["vocab_size"], raw["hidden_size"]
    kl_sum, kl_source = kl_function()
    generator = torch.Generator(device=run.device).manual_seed(3)
    weight = torch.randn(vocab, hidden_size, generator=generator, device=run.device, dtype=torch.bfloat16)
    weight.mul_(0.02)
    cases = run.partial.setdefault("cases", {})
    for chunk in run.sizes.lm_chunks:
        if not within_budget(run, 10):
            cases[str(chunk)] = {"skipped": "time budget"}
            continue

        def case(chunk=chunk):
            ref_hidden, quant_hidden = (
                torch.randn(chunk, hidden_size, generator=generator, device=run.device, dtype=torch.bfloat16)
                for _ in range(2)
            )

            def reference():  # once per micro-batch in the scorer
                log_p = torch.log_softmax(F.linear(ref_hidden, weight), dim=-1, dtype=torch.float32)
                return log_p, log_p.exp()

            log_p, p = reference()
            base = reset_peak(run.device)
            branch = timed(
                lambda: kl_sum(log_p, F.linear(quant_hidden, weight), p), run.device, run.sizes.repeats
            )
            memory = peak_gib(run.device, base)
            ref = timed(reference, run.device, run.sizes.repeats)
            return {
                "tokens": chunk,
                "branch": {**time_stats(branch), "tokens_per_s": chunk / min(branch)},
                "reference": {**time_stats(ref), "tokens_per_s": chunk / min(ref)},
                "branch_tflop_s": 2 * vocab * hidden_size * chunk / min(branch) / 1e12,
                **memory,
            }

        cases[str(chunk)] = guarded_case(run, f"lm_head_kl/{chunk}", case)
    return {
        "vocab": vocab,
        "hidden_size": hidden_size,
        "what": "branch: lm_head (bf16) + log_softmax (fp32) + KL(ref||q) sum; "
        "reference: lm_head + log_softmax + exp (once per micro-batch)",
        "kl_sum": kl_source,
        "cases": cases,
        "summary": ", ".join(
            f"{n} tok: {c['branch']['tokens_per_s']:.0f} tok/s"
            if "branch" in c
            else f"{n} tok: {next(iter(c))}"
            for n, c in cases.items()
        ),
    }


# ----------------------------------------------------------------------------------------- toy: device vs CPU


def toy_config() -> dict:
    return json.loads((TOY_DIR / "config.json").read_text(encoding="utf-8"))


def toy_moe_layers() -> list[int]:
    return [i for i, kind in enumerate(toy_config()["mlp_layer_types"]) if kind == "sparse"]


def toy_ids(sizes: Sizes):
    import torch

    generator = torch.Generator().manual_seed(0)
    shape = (sizes.toy_sequences, sizes.toy_seq_len)
    return torch.randint(toy_config()["vocab_size"], shape, generator=generator)


def relative_difference(a, b) -> float:
    """max |a - b| / max |a| in float64 (0 when both are zero)."""

    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    scale = a.abs().max().item() if a.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def same_bytes(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


def compare_activation_stats(run: Run, ids) -> dict:
    from mixquant.quantize.activations import STATS, collect_activation_stats

    def collect(device):
        start = time.monotonic()
        stats = collect_activation_stats(
            TOY_DIR, ids, batch_size=run.sizes.toy_batch, device=device, progress=False
        )
        return stats, time.monotonic() - start

    reference, ref_s = collect("cpu")
    other, other_s = collect(run.args.device)
    per_stat = {}
    for stat in STATS:
        layers = sorted(reference[stat])
        differing = [
            layer
            for layer in layers
            if not same_bytes(reference[stat][layer].cpu(), other[stat][layer].cpu())
        ]
        per_stat[stat] = {
            "bit_equal": not differing and set(layers) == set(other[stat]),
            "layers_differing": differing,
            "max_relative_difference": max(
                relative_difference(reference[stat][layer], other[stat][layer]) for layer in layers
            ),
        }
    return {
        "bit_equal": all(entry["bit_equal"] for entry in per_stat.values()),
        "stats": per_stat,
        "cpu_s": ref_s,
        "device_s": other_s,
    }


GPTQ_SETTINGS = {"damping": 0.01, "block_size": 128, "order": "natural", "min_tokens": 8}


def quantize_toy(layer: int, fmt: str, device: str, expert_inputs: Path | None = None) -> tuple[dict, float]:
    """One toy layer in ``fmt`` (NVFP4 rounded with GPTQ when ``expert_inputs`` is given)."""
    import torch
    from mixquant.quantize.expert_inputs import expert_inputs_file
    from mixquant.quantize.layer import quantize_layer

    params = {"calibration": "fp8_sweep"} if fmt == NVFP4 else {"weight_calibration": "mse"}
    inputs = None
    if expert_inputs is not None:
        params = {**params, "rounding": "gptq", "gptq": GPTQ_SETTINGS}
        inputs = expert_inputs_file(expert_inputs, layer)
    amax = {"gate_up": torch.tensor(1.0), "down": torch.tensor(1.0)} if fmt == FP8 else None
    start = time.monotonic()
    tensors, _audit = quantize_layer(
        TOY_DIR, layer, fmt, params, activation_amax=amax, expert_inputs=inputs, device=device
    )
    return tensors, time.monotonic() - start


def compare_codes(reference: dict[int, dict], other: dict[int, dict]) -> dict:
    """Exported tensors of every layer compared byte for byte (float8 / uint8 as bytes)."""
    import torch

    differing, tensors, scale_elements, scale_differing = [], 0, 0, 0
    for layer in sorted(reference):
        ref, oth = reference[layer], other[layer]
        for name in sorted(set(ref) | set(oth)):
            tensors += 1
            if name not in ref or name not in oth or not same_bytes(ref[name], oth[name]):
                differing.append(name)
            if (
                name.endswith(".weight_scale")
                and name in ref
                and name in oth
                and ref[name].dtype != torch.float32
            ):
                scale_elements += ref[name].numel()
                if ref[name].shape == oth[name].shape:
                    a, b = (t.contiguous().view(torch.uint8) for t in (ref[name], oth[name]))
                    scale_differing += int((a != b).sum())
    return {
        "tensors": tensors,
        "differing_tensors": len(differing),
        "differing_names": differing[:10],
        "block_scale_elements": scale_elements,
        "differing_block_scale_elements": scale_differing,
    }


def codes_section(
    run: Run, fmt: str, cpu_tensors: dict[int, dict] | None, expert_inputs: Path | None = None
) -> dict:
    layers = toy_moe_layers()
    cpu_s = None
    if cpu_tensors is None:
        runs = {layer: quantize_toy(layer, fmt, "cpu", expert_inputs) for layer in layers}
        cpu_tensors = {layer: tensors for layer, (tensors, _s) in runs.items()}
        cpu_s = sum(seconds for _t, seconds in runs.values())
    other = {layer: quantize_toy(layer, fmt, run.args.device, expert_inputs) for layer in layers}
    result = compare_codes(cpu_tensors, {layer: tensors for layer, (tensors, _s) in other.items()})
    return {
        "format": fmt,
        "layers": layers,
        "bit_equal": result["differing_tensors"] == 0,
        **result,
        "cpu_s": cpu_s,
        "device_s": sum(seconds for _t, seconds in other.values()),
    }


def toy_scores(
    device: str, ids, quants: dict, batch_size: int, stack: bool
) -> tuple[dict[int, list[float]], float]:
    from mixquant.model.streaming import StreamedModel
    from mixquant.search.branches import branch_parallel_scores

    start = time.monotonic()
    with StreamedModel(TOY_DIR, device=device) as stream:
        sums = branch_parallel_scores(
            stream,
            ids,
            {layer: [NVFP4] for layer in quants},
            lambda layer, fmt, loaded_layer: quants[layer],
            batch_size=batch_size,
            stack=stack,
        )
    return {int(layer): values for layer, values in sums[NVFP4].items()}, time.monotonic() - start


def summed(values: list[float]) -> float:
    total = 0.0  # left to right from 0.0, as mixquant.search.score.scores_table adds micro-batches
    for value in values:
        total += float(value)
    return total


def ranking(scores: dict[int, float]) -> list[int]:
    return sorted(scores, key=lambda layer: (scores[layer], layer))


def compare_scores(run: Run, ids, cpu_nvfp4: dict[int, dict]) -> dict:
    from mixquant.search.score import layer_quant_from_tensors

    quants = {layer: layer_quant_from_tensors(tensors, layer, NVFP4) for layer, tensors in cpu_nvfp4.items()}
    batch = run.sizes.toy_batch
    reference, ref_s = toy_scores("cpu", ids, quants, batch, stack=False)
    other, other_s = toy_scores(run.args.device, ids, quants, batch, stack=False)
    ref_sums = {layer: summed(values) for layer, values in reference.items()}
    other_sums = {layer: summed(values) for layer, values in other.items()}
    result = {
        "format": NVFP4,
        "micro_batches": len(next(iter(reference.values()))),
        "kl_sum_cpu": ref_sums,
        "kl_sum_device": other_sums,
        "relative_difference": {
            layer: abs(other_sums[layer] - value) / abs(value) if value else math.inf
            for layer, value in ref_sums.items()
        },
        "bit_equal": reference == other,
        "ranking_cpu": ranking(ref_sums),
        "ranking_device": ranking(other_sums),
        "same_ranking": ranking(ref_sums) == ranking(other_sums),
        "cpu_s": ref_s,
        "device_s": other_s,
    }
    if run.device.type == "cuda" and within_budget(run, 20):
        stacked, stacked_s = toy_scores(run.args.device, ids, quants, batch, stack=True)
        stacked_sums = {layer: summed(values) for layer, values in stacked.items()}
        result["device_stack_true"] = {
            "same_ranking_as_cpu": ranking(stacked_sums) == ranking(ref_sums),
            "max_relative_difference_vs_device_exact": max(
                abs(stacked_sums[layer] - value) / abs(value) if value else math.inf
                for layer, value in other_sums.items()
            ),
            "device_s": stacked_s,
        }
    return result


def section_toy_gpu_vs_cpu(run: Run) -> dict:
    run.release_layer()
    ids = toy_ids(run.sizes)
    out = run.partial
    out.update(
        {
            "checkpoint": str(TOY_DIR.relative_to(REPO)),
            "calibration": f"{ids.shape[0]} sequences x {ids.shape[1]} tokens, seeded random ids",
            "batch_size": run.sizes.toy_batch,
            "compared": f"cpu vs {run.args.device}",
        }
    )
    out["activation_stats"] = run.guarded("toy/activation_stats", lambda: compare_activation_stats(run, ids))
    cpu_nvfp4: dict[int, dict] = {}
    cpu_nvfp4_s = 0.0

    def quantize_cpu_nvfp4() -> dict:
        nonlocal cpu_nvfp4_s
        for layer in toy_moe_layers():
            cpu_nvfp4[layer], seconds = quantize_toy(layer, NVFP4, "cpu")
            cpu_nvfp4_s += seconds
        return {"ok": True}

    prepared = run.guarded("toy/quantize_cpu", quantize_cpu_nvfp4)
    if "error" in prepared:
        out["scores"] = out["nvfp4_codes"] = {"error": f"CPU NVFP4 quantization failed: {prepared['error']}"}
    else:
        out["scores"] = budgeted(run, 20, "toy/scores", lambda: compare_scores(run, ids, cpu_nvfp4))

        def nvfp4_codes() -> dict:
            return {**codes_section(run, NVFP4, cpu_nvfp4), "cpu_s": cpu_nvfp4_s}

        out["nvfp4_codes"] = budgeted(run, 20, "toy/nvfp4_codes", nvfp4_codes)
    out["fp8_codes"] = budgeted(run, 20, "toy/fp8_codes", lambda: codes_section(run, FP8, None))

    def gptq_codes() -> dict:
        import tempfile

        from mixquant.quantize.expert_inputs import collect_expert_inputs

        with tempfile.TemporaryDirectory() as scratch:
            collect_expert_inputs(TOY_DIR, ids, scratch, batch_size=run.sizes.toy_batch, progress=False)
            return codes_section(run, NVFP4, None, Path(scratch))

    out["nvfp4_gptq_codes"] = budgeted(run, 30, "toy/nvfp4_gptq_codes", gptq_codes)
    parts = ("activation_stats", "scores", "nvfp4_codes", "fp8_codes", "nvfp4_gptq_codes")
    out["summary"] = ", ".join(f"{part} {verdict(out[part])}" for part in parts)
    return out


def budgeted(run: Run, seconds: float, where: str, fn: Callable[[], dict]) -> dict:
    return run.guarded(where, fn) if within_budget(run, seconds) else {"skipped": "time budget"}


def verdict(part: dict) -> str:
    if "error" in part or "skipped" in part:
        return "error" if "error" in part else "skipped"
    if part.get("bit_equal"):
        return "bit-equal"
    if "same_ranking" in part:
        return f"differs (same ranking: {part['same_ranking']})"
    return f"differs ({part.get('differing_tensors', '?')} tensors)"


# ----------------------------------------------------------------------------------------- main


def section_gptq(run: Run) -> dict:
    """GPTQ rounding of a layer's experts at the Laguna-S-2.1 shape, a batch of them at a time (one column
    step for all, as quantize_layer rounds them): seconds per expert and per 256-expert layer, peak memory;
    the cost model's estimate beside it (mixquant.costs.rebuild.gptq_layer_cost's GPU terms)."""
    import torch
    from mixquant.formats.nvfp4_gptq import gptq_nvfp4

    hidden, inter = run.sizes.gptq_shape
    device = run.device
    cases = {}
    for experts in run.sizes.gptq_experts:
        if not within_budget(run, 30):
            cases[str(experts)] = {"skipped": "time budget"}
            continue

        def case(experts: int = experts) -> dict:
            generator = torch.Generator(device="cpu").manual_seed(experts)
            weight = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.02).to(
                device, torch.bfloat16
            )
            x = torch.randn(experts, 4 * hidden, hidden, generator=generator, dtype=torch.float64).to(device)
            hessian = x.transpose(-1, -2) @ x
            del x
            scale = torch.full((experts, 2 * inter, hidden), 0.004, device=device)
            base = reset_peak(device)
            times = timed(lambda: gptq_nvfp4(weight, hessian, scale), device, repeats=1, warmup=0)
            per_expert = min(times) / experts
            return {
                "experts": experts,
                "shape": [2 * inter, hidden],
                "s": min(times),
                "s_per_expert": per_expert,
                "s_per_256_expert_layer_gate_up": per_expert * 256,
                **peak_gib(device, base),
            }

        cases[str(experts)] = run.guarded(f"gptq/{experts}", case)
    return {"cases": cases, "note": "gate/up only; the down projection is (I/H)^2 of it per column step"}


SECTIONS: dict[str, Callable[[Run], dict]] = {
    "h2d": section_h2d,
    "laguna_layer": section_laguna_layer,
    "stacked_branches": section_stacked_branches,
    "lm_head_kl": section_lm_head_kl,
    "toy_gpu_vs_cpu": section_toy_gpu_vs_cpu,
    "gptq": section_gptq,
}


def default_out() -> str:
    return str(Path(os.environ["OUT"]) / "gpu-check.json") if os.environ.get("OUT") else "gpu-check.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out(), help="the JSON file (default $OUT/gpu-check.json)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes: the CPU smoke test")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip sections past this (seconds)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the numerics profile")
    parser.add_argument(
        "--sections", type=lambda s: s.split(","), default=None, help="comma list (default all)"
    )
    parser.add_argument("--setup-log", default=None, help="tools/gpu-check.sh's install log (tail recorded)")
    parser.add_argument("--setup-status", default=None, help="tools/gpu-check.sh's install outcome")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sections or ()) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    progress(f"writing {run.out} (budget {args.budget_s:.0f} s, device {args.device}, small {args.small})")
    signal.signal(signal.SIGTERM, on_sigterm)
    run.report["finished"] = False
    try:
        enter_numerics(run)
        run_sections(run)
        run.report["finished"] = True
    except TimeLimit:
        killed = {"error": "killed at the time limit (SIGTERM)", "partial": run.partial}
        run.report["sections"][run.current] = killed
        progress(f"{run.current}: killed at the time limit")
    except Exception as exc:  # noqa: BLE001 -- even a run that cannot start leaves its JSON
        run.report["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"{run.current}: {run.report['error']}")
    run.write()
    progress(f"done in {run.elapsed():.1f} s: {run.out}")
    return 0


def run_sections(run: Run) -> None:
    import torch

    torch.manual_seed(0)
    header = run.guarded("header", lambda: device_and_header(run))
    if "error" in header:
        run.report["header"]["error"] = header["error"]
    run.write()
    progress(f"header: {header_line(run.report['header'])}")
    for name, fn in SECTIONS.items():
        if run.device is None:
            run.report["sections"][name] = {"error": "no device: see header.error"}
            continue
        run.section(name, fn)


def device_and_header(run: Run) -> dict:
    import torch

    device = torch.device(run.args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {run.args.device!r}: no CUDA GPU is visible to this process")
    run.device = device
    fill_header(run)
    return {}


def header_line(header: dict) -> str:
    return (
        f"torch {header.get('torch')} cuda {header.get('cuda')} gpu {header.get('gpu_name', '-')} "
        f"transformers {header.get('transformers')} modelopt {header.get('modelopt')} "
        f"deterministic {header.get('deterministic_algorithms')}"
    )


if __name__ == "__main__":
    sys.exit(main())
