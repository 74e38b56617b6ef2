"""Benchmark: NVFP4 FP8-code-sweep scale fitting, mixquant vs ModelOpt's reference calibration (CPU).

Usage: .venv/bin/python benchmarks/bench_nvfp4_sweep.py [--rows R --cols C --dtype bf16 --threads T]

Both sides fit the per-block amax of the same weight (global amax = max |w|, i.e. weight_scale_2 fixed):

* ModelOpt: ``mtq.quantize`` of a one-``nn.Linear`` model with ModelOpt's ``W4A16_NVFP4_CFG`` (weights
  switched to static block scales) and ``algorithm={"method": "mse", "fp8_scale_sweep": True}``, i.e.
  ModelOpt's own reference sweep (``NVFP4MSECalibrator``), made runnable on CPU by
  ``mixquant.formats.cpu_fake_quant``. The timing covers the whole ``mtq.quantize`` call (max calibration
  + the sweep; the sweep dominates).
* mixquant: ``mixquant.formats.nvfp4.sweep_nvfp4_block_amax``.

Timing and memory come from separate passes, so the memory instrumentation cannot slow the timed runs.

Peak extra memory (pass 2) is tracemalloc-like tensor accounting: a ``TorchDispatchMode`` sees every aten op
the call runs; each CPU output whose storage is not one of the op's inputs (i.e. a fresh allocation, not a
view, in-place result or ``out=``) adds its storage's bytes to a live total, and a ``weakref.finalize`` on
the tensors referencing that storage subtracts them when the last one dies. The peak of the live total is
the call's peak extra tensor memory (storages that existed before the call, such as the weight, are not
counted; allocator-internal scratch buffers of single kernels are invisible to it). ``--rss`` adds a third
pass measuring the process high-water RSS delta instead (glibc mmap/trim thresholds at 64 KiB, malloc_trim,
``VmHWM`` reset via ``/proc/self/clear_refs``); it adds allocator, interpreter and code-page noise (about
+1.5 MiB for mixquant here) and kernel-internal scratch buffers. Keep ``--threads 1`` on a shared machine:
oversubscribed OpenMP threads slow both sides down erratically.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import io
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class TensorMemoryTracker(TorchDispatchMode):
    """Peak bytes of CPU tensor storages allocated (and still alive) while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [live tensors referencing it, nbytes]

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self._storages[key]
                self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            entry = self._storages.get(key)
            if entry is None and (nbytes == 0 or key in inputs):
                continue  # view / in-place / out= of a storage allocated before the call
            if entry is None:
                self._storages[key] = [1, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            else:
                entry[0] += 1
            weakref.finalize(t, self._release, key)
        return out


def measure_tensor_memory(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracker = TensorMemoryTracker()
    with tracker:
        fn()
    return tracker.peak


def measure_rss(fn: Callable[[], Any]) -> int:
    """High-water RSS above the RSS before the call (needs a writable /proc/self/clear_refs)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: big blocks are mmapped, unmapped on free
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    gc.collect()
    libc.malloc_trim(0)
    base = _proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    fn()
    return max(0, _proc_status_bytes("VmHWM") - base)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def make_weight(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A Gaussian weight with rare large outliers and a few all-zero blocks."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    outliers = torch.rand(rows, cols, generator=gen) < 1e-4
    w[outliers] *= 25.0
    w[:: max(1, rows // 8), :16] = 0.0
    return w.to(dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048, help="multiple of 16")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss", action="store_true", help="also measure process RSS high-water deltas")
    args = parser.parse_args(argv)
    if args.cols % 16:
        parser.error("--cols must be a multiple of 16")

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    import modelopt.torch.quantization as mtq
    from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant
    from mixquant.formats.nvfp4 import nvfp4_w4a16_static_config, sweep_nvfp4_block_amax

    weight = make_weight(args.rows, args.cols, _DTYPES[args.dtype], args.seed)
    weight_bytes = weight.numel() * weight.element_size()
    global_amax = weight.abs().amax().float()
    cfg = nvfp4_w4a16_static_config({"method": "mse", "fp8_scale_sweep": True})

    def make_model() -> torch.nn.Module:
        linear = torch.nn.Linear(args.cols, args.rows, bias=False, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        return torch.nn.Sequential(linear)

    def run_modelopt(model: torch.nn.Module) -> torch.Tensor:
        quiet = io.StringIO()  # ModelOpt prints "Inserted N quantizers" and a tqdm bar
        with cpu_nvfp4_fake_quant(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            mtq.quantize(model, cfg, None)
        quantizer = model[0].weight_quantizer
        assert torch.equal(quantizer.global_amax, global_amax), "ModelOpt used another global amax"
        return quantizer._amax.detach().clone()

    def run_mixquant() -> torch.Tensor:
        return sweep_nvfp4_block_amax(weight, global_amax)

    # Pass 1: timing (default allocator).
    model = make_model()
    ref_amax, ref_s = timed(functools.partial(run_modelopt, model))
    del model
    ours_amax, ours_s = timed(run_mixquant)
    identical = torch.equal(ref_amax, ours_amax)
    n_diff = int((ref_amax != ours_amax).sum())
    del ref_amax, ours_amax

    # Pass 2: peak extra tensor memory.
    ours_mem = measure_tensor_memory(run_mixquant)
    model = make_model()
    ref_mem = measure_tensor_memory(functools.partial(run_modelopt, model))
    del model
    rss = None
    if args.rss:  # Pass 3 (optional): process RSS high-water deltas.
        run_mixquant()
        rss = (measure_rss(functools.partial(run_modelopt, make_model())), measure_rss(run_mixquant))

    mib = 2.0**20
    print(
        f"weight: {args.rows} x {args.cols} {args.dtype} = {weight_bytes / mib:.2f} MiB "
        f"({weight.numel() // 16} NVFP4 blocks x 126 FP8 candidates), torch threads: {args.threads}"
    )
    print(
        f"identical scales: {'yes' if identical else 'no'} ({n_diff} of {weight.numel() // 16} blocks differ)"
    )
    results = (("ModelOpt reference", ref_s, ref_mem), ("mixquant", ours_s, ours_mem))
    for i, (name, sec, mem) in enumerate(results):
        line = (
            f"{name + ':':20s}{sec:8.2f} s   peak extra memory {mem / mib:8.1f} MiB"
            f" = {mem / weight_bytes:5.2f}x weight size"
        )
        if rss is not None:
            line += f"   (RSS high-water delta {rss[i] / mib:.1f} MiB)"
        print(line)
    print(f"speed ratio (ModelOpt time / mixquant time): {ref_s / ours_s:.1f}x")
    print("memory method: peak live bytes of the CPU tensor storages each call allocates (TorchDispatchMode)")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
