"""Benchmark: streaming checkpoint export (mixquant.export.checkpoint.export_checkpoint) on a multi-GB model.

Usage: .venv/bin/python benchmarks/bench_export.py [--gb 3] [--dir DIR] [--shard-gb 1] [--no-cold] [--keep]

Builds, in a temporary directory under ``--dir`` (default: the system temp dir; everything -- source,
layer results, dd file, exports -- on that one disk):

* a synthetic upstream Laguna checkpoint of about ``--gb`` GB (bf16; real tensor names and shapes of a
  ``LagunaConfig`` with 2048 hidden, 64 experts of 2048 x 512, as many MoE layers as the size asks), in
  shards of about ``--shard-gb`` GB, plus config.json, generation_config.json and a tokenizer file;
* fake layer results for every MoE layer, cycling NVFP4 / FP8 / BF16 (right names, dtypes and shapes;
  the bytes are arbitrary -- the export copies bytes and never decodes them);
* FP8 KV-cache amaxes for every layer.

Every tensor's bytes are copied from one 160 MiB random pattern file with the module's own streaming writer,
so building never holds more than a header in memory either.

Then, in one run:

1. ``export_checkpoint`` (``fsync=True``: every shard is fdatasync'ed, as dd's conv=fdatasync) with the
   source and layer results in the page cache ("warm": what follows a quantization run); its write rate
   (bytes written / wall time of the whole call, configs included) as a ratio of dd's (goal >= 0.7);
2. the same with the source shards and layer results evicted from the page cache first
   (``posix_fadvise(DONTNEED)``, no root needed; "cold": reads and writes share the disk), unless
   ``--no-cold``;
3. ``dd if=/dev/zero of=DIR/dd.bin bs=1M count=N conv=fdatasync``, N = the export's size in MiB, before
   and after each export (an unmeasured export runs first to size it and let the build's writes settle):
   the sequential write rate of that disk (wall time of the dd process). This VM disk's rate drifts
   (host-side caching), so each export is compared with the mean of the two dd runs around it.

Peak RSS during each export is sampled every 5 ms from ``/proc/self/statm`` in a thread (goal: flat,
<= 2 GB); the baseline is the RSS just before the call, after torch / transformers / ModelOpt are imported
and warmed up (the export builds a meta-device model and applies ModelOpt's quantize mode to it to
compute the quantization config).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from mixquant.checkpoint.writer import TensorRecord, write_safetensors  # noqa: E402
from mixquant.export.checkpoint import export_checkpoint  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.model.families import mlp_layer_types  # noqa: E402
from mixquant.producer import default_producer  # noqa: E402
from mixquant.quantize.layer import LAYER_FILE  # noqa: E402
from mixquant.quantize.reference import BF16, FP8, NVFP4  # noqa: E402

PATTERN_BYTES = 160 << 20  # >= the largest tensor (embedding / lm_head: 128 MiB)
ST_DTYPE = {torch.bfloat16: "BF16"}
CYCLE = (NVFP4, FP8, BF16)
PAGE = os.sysconf("SC_PAGE_SIZE")


def laguna_config(num_layers: int):
    from transformers import LagunaConfig

    return LagunaConfig(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    )


def upstream_shapes(config) -> dict[str, tuple[int, ...]]:
    from transformers import LagunaForCausalLM

    with torch.device("meta"):
        model = LagunaForCausalLM(config)
    tensors = toy_layout.hf_to_upstream_state_dict(model.state_dict())
    return {name: tuple(t.shape) for name, t in tensors.items()}


def nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape:
        n *= d
    return n


def pattern_record(name: str, dtype: str, shape: tuple[int, ...], itemsize: int, pattern: Path, k: int):
    size = nbytes(shape, itemsize)
    if size > PATTERN_BYTES:
        raise ValueError(f"{name}: {size} bytes > pattern")
    offset = (k * 4096) % (PATTERN_BYTES - size + 1)  # vary the source range a little
    return TensorRecord(name, dtype, shape, size, path=pattern, offset=offset)


def build(root: Path, gb: float, shard_gb: float) -> dict:
    pattern = root / "pattern.bin"
    with open(pattern, "wb") as f:
        f.write(os.urandom(PATTERN_BYTES))
    per_moe = 64 * 3 * 2048 * 512 * 2
    layers = max(3, round(gb * 1e9 / per_moe))  # the rest (attention, embeddings) adds ~10%
    config = laguna_config(layers)
    shapes = upstream_shapes(config)
    src = root / "source"
    src.mkdir()
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in shapes.items()}
    total = sum(nbytes(s, 2) for s in shapes.values())
    shards = layout.assign_shards(meta, min(layers + 2, max(1, round(total / (shard_gb * 1e9)))))
    weight_map = {}
    for k, names in enumerate(shards):
        file = layout.shard_file_name(k, len(shards))
        records = [pattern_record(n, "BF16", shapes[n], 2, pattern, i) for i, n in enumerate(names)]
        write_safetensors(src / file, records, fsync=True)
        weight_map.update(dict.fromkeys(names, file))
    layout.write_json(src / layout.INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    layout.write_json(src / layout.CONFIG_FILE, toy_layout.checkpoint_config_dict(config))
    layout.write_json(src / layout.GENERATION_CONFIG_FILE, {})
    (src / "tokenizer.json").write_text("{}")

    moe = [i for i, t in enumerate(mlp_layer_types(config.to_dict())) if t == "sparse"]
    layer_dirs, result_bytes = {}, 0
    for j, layer in enumerate(moe):
        fmt = CYCLE[j % len(CYCLE)]
        records = []
        for i, name in enumerate(n for n in shapes if f"layers.{layer}.mlp.experts." in n and "_proj" in n):
            base, (rows, cols) = name.removesuffix(".weight"), shapes[name]
            if fmt == NVFP4:
                records += [
                    pattern_record(name, "U8", (rows, cols // 2), 1, pattern, i),
                    pattern_record(f"{base}.weight_scale", "F8_E4M3", (rows, cols // 16), 1, pattern, i + 1),
                    pattern_record(f"{base}.weight_scale_2", "F32", (), 4, pattern, i + 2),
                ]
            elif fmt == FP8:
                records += [
                    pattern_record(name, "F8_E4M3", (rows, cols), 1, pattern, i),
                    pattern_record(f"{base}.weight_scale", "F32", (), 4, pattern, i + 1),
                    pattern_record(f"{base}.input_scale", "F32", (), 4, pattern, i + 2),
                ]
            else:
                records.append(pattern_record(name, "BF16", (rows, cols), 2, pattern, i))
        out = root / "layers" / f"L{layer}"
        out.mkdir(parents=True)
        write_safetensors(out / LAYER_FILE, records, fsync=True)
        result_bytes += (out / LAYER_FILE).stat().st_size
        layer_dirs[layer] = (fmt, out)
    kv = {f"{k}_amax": dict.fromkeys(range(layers), 2.5) for k in "kv"}
    return {
        "source": src,
        "layer_dirs": layer_dirs,
        "kv_amax": kv,
        "layers": layers,
        "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
        "source_shards": len(shards),
        "result_bytes": result_bytes,
        "formats": {f: sum(1 for v in layer_dirs.values() if v[0] == f) for f in CYCLE},
    }


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:  # the files were fdatasync'ed when built: their cached pages are clean and can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class RssSampler(threading.Thread):
    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval, self.peak, self.samples = interval, rss_bytes(), 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())


def dd_rate(root: Path, size: int) -> tuple[float, str]:
    count = max(1, size >> 20)
    target = root / "dd.bin"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fdatasync"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    target.unlink()
    return (count << 20) / seconds, proc.stderr.strip().splitlines()[-1]


def run_export(data: dict, out: Path) -> dict:
    baseline = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    start = time.perf_counter()
    try:
        summary = export_checkpoint(
            data["source"],
            data["layer_dirs"],
            out,
            tokenizer_dir=data["source"],
            max_shard_bytes=int(1e9),
            kv_cache="fp8",
            kv_amax=data["kv_amax"],
            producer=default_producer(),
        )
    finally:
        seconds = time.perf_counter() - start
        sampler.stop()
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    return {
        "seconds": seconds,
        "bytes": out_bytes,
        "rate": out_bytes / seconds,
        "baseline": baseline,
        "peak": sampler.peak,
        "samples": sampler.samples,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.0, help="approximate source checkpoint size (GB)")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="approximate source shard size (GB)")
    parser.add_argument("--dir", type=Path, default=None, help="where to create the temporary directory")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache export")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_export_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        data = build(root, args.gb, args.shard_gb)
        print(
            f"source: {data['source_bytes'] / 1e9:.2f} GB in {data['source_shards']} shards "
            f"({data['layers']} layers, 64 experts of 2048x512 bf16); layer results: "
            f"{data['result_bytes'] / 1e9:.2f} GB {data['formats']}; "
            f"built in {time.perf_counter() - t0:.1f} s"
        )
        print(f"directory: {root} ({os.statvfs(root).f_bsize}-byte blocks)")

        # dd and exports interleaved (dd, warm, dd, cold, dd), dd writing as many MiB as an export: this
        # disk's rate drifts (host-side caching), so each export is compared with the dd runs around it
        # an unmeasured export first: it gives the size, lets the build's writes settle and warms up
        # the imports and ModelOpt's config path (so the RSS baselines include them)
        primer = run_export(data, root / "export_primer")
        size = primer["bytes"]
        shutil.rmtree(root / "export_primer")
        os.sync()
        time.sleep(2.0)
        dd = [dd_rate(root, size)]
        results = {}
        for label in ("warm", "cold")[: 1 if args.no_cold else 2]:
            if label == "cold":
                evict(
                    [
                        *data["source"].glob("*.safetensors"),
                        *(d / LAYER_FILE for _, d in data["layer_dirs"].values()),
                    ]
                )
            out = root / f"export_{label}"
            results[label] = run_export(data, out)
            shutil.rmtree(out)
            os.sync()
            dd.append(dd_rate(root, size))
        for k, (rate, line) in enumerate(dd):
            print(f"dd #{k + 1} bs=1M count={size >> 20} conv=fdatasync: {rate / 1e6:.0f} MB/s ({line})")
        for k, (label, result) in enumerate(results.items()):
            s = result["summary"]
            ref = (dd[k][0] + dd[k + 1][0]) / 2
            print(
                f"[{label} source cache] export: {result['bytes'] / 1e9:.2f} GB ({s['num_shards']} shards, "
                f"{s['num_tensors']} tensors, {s['quant_algo']}, kv {s['kv_cache_quant_algo']}) in "
                f"{result['seconds']:.2f} s = {result['rate'] / 1e6:.0f} MB/s -> "
                f"{result['rate'] / ref:.2f} x dd (mean of dd #{k + 1}, #{k + 2}: {ref / 1e6:.0f} MB/s; "
                f"goal >= 0.7) [{s['copy_method']}]"
            )
            print(
                f"[{label} source cache] peak RSS during export: {result['peak'] / 2**20:.0f} MiB (baseline "
                f"{result['baseline'] / 2**20:.0f} MiB, "
                f"+{(result['peak'] - result['baseline']) / 2**20:.0f} MiB; "
                f"{result['samples']} samples every 5 ms) (goal flat, <= 2 GB)"
            )
        assert all(r["bytes"] == size for r in results.values()), (
            size,
            [r["bytes"] for r in results.values()],
        )
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
