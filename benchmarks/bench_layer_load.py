"""Benchmark: streaming decoder layers of the real Laguna size from disk, cold, step by step, on CPU.

Usage: .venv/bin/python benchmarks/bench_layer_load.py [--rounds 2] [--moe-layers 3] [--vocab 4096]
       [--seq-len 128] [--no-score] [--dir DIR] [--checkpoint DIR] [--before DIR]

Builds a random BF16 checkpoint of the real Laguna geometry (data/models/laguna-s-2.1/config.json: hidden
3072, 256 routed experts of 1024, a shared expert of 1024, 48/72 attention heads) truncated to the dense
layer 0 and ``--moe-layers`` MoE layers, one shard per layer (4.98 GB per MoE layer), with the vocabulary
cut to ``--vocab`` (the embedding and lm_head are not what is measured; at the real 100352 they would add
1.2 GB). It is built in a temporary directory under ``--dir`` and deleted at the end, or in ``--checkpoint``,
kept and reused by later runs (building takes about a minute per MoE layer and peaks near 11 GB).

Each round then runs, in fresh child processes, with the page cache of a shard dropped before each cold
measurement (``posix_fadvise(POSIX_FADV_DONTNEED)``; the disk row's warm read shows whether it worked):

* disk: a plain sequential read of each MoE shard (16 MiB reads into one reused buffer, like ``dd``),
  cold, then warm;
* reader: :meth:`ShardReader.read` of each MoE layer's tensors, cold;
* load: :meth:`StreamedModel.load_layer` of each MoE layer (read, conversion, attach), without prefetch,
  cold, then warm (the host-side cost alone);
* each cold reader and load measurement between two cold disk reads of the same shard, its share of the
  disk's speed taken against their mean (the disk's speed drifts on shared machines);
* forward: :meth:`StreamedModel.forward` of 1 x ``--seq-len`` tokens, cold, prefetching (the compute of
  each MoE layer also timed on its own);
* score: :func:`branch_parallel_scores` of every MoE layer in one format (routed copies of the loaded
  experts: tests/model/streaming_helpers.py ``routed_copy``) on the same tokens.

load, forward and score run in variants: ``fused`` (this code: experts read straight into their fused
parameters), ``transformers`` (``fused_reads=False``: transformers' conversion stacks the experts) and, with
``--before DIR``, ``before``: the ``mixquant`` package found in DIR (for instance the workflow/ directory of
an older checkout made with ``git worktree add``), with its own defaults.

Each child starts with the checkpoint out of the page cache and reports wall times and its peak resident
memory above what it held before the measured work (VmHWM after a clear_refs reset), in layers (one MoE
layer's bytes). The parent prints, per variant, the median over MoE layers and rounds of seconds per layer
and GB/s, and of the reads' and loads' shares of the disk's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAGUNA = REPO / "data" / "models" / "laguna-s-2.1" / "config.json"
HELPERS = REPO / "tests" / "model"

CHILD = """
import json, os, sys, time
from pathlib import Path
from mixquant.numerics import enter
enter("portable", 2)
import torch

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def drop(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

def start():
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")

def sequential_read(path):
    buffer = bytearray(16 << 20)
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - began

def cold_disk_read(path):  # and the page cache left as it was found: without the file
    drop([path])
    seconds = sequential_read(path)
    drop([path])
    return seconds

mode, variant, model_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
moe, seq_len = json.loads(sys.argv[4]), int(sys.argv[5])
index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
shard = {layer: model_dir / index[f"model.layers.{layer}.input_layernorm.weight"] for layer in moe}
shards = sorted(model_dir.glob("*.safetensors"))
drop(shards)  # what an earlier child left in the page cache would have to be reclaimed by this one's reads
kwargs = {} if variant in ("before", "-") else {"fused_reads": variant == "fused"}
out = {"layers": {}}

if mode == "disk":
    for layer in moe:
        cold = cold_disk_read(shard[layer])
        sequential_read(shard[layer])
        warm = sequential_read(shard[layer])
        drop([shard[layer]])
        out["layers"][layer] = {"cold": cold, "warm": warm, "bytes": shard[layer].stat().st_size}
elif mode == "reader":
    from mixquant.checkpoint.shards import ShardReader
    reader = ShardReader(model_dir)
    base = start()
    for layer in moe:
        names = reader.layer_names(layer)
        disk = cold_disk_read(shard[layer])
        began = time.perf_counter()
        tensors = reader.read(names)
        seconds = time.perf_counter() - began
        del tensors
        disk = (disk + cold_disk_read(shard[layer])) / 2
        out["layers"][layer] = {"cold": seconds, "disk": disk, "bytes": reader.nbytes(names)}
    out["peak"] = status("VmHWM") - base
elif mode == "load":
    from mixquant.model.streaming import StreamedModel
    stream = StreamedModel(model_dir, prefetch=False, **kwargs)
    base = start()
    for layer in moe:
        disk = cold_disk_read(shard[layer])
        times = []
        for _ in ("cold", "warm"):
            began = time.perf_counter()
            stream.load_layer(layer)
            times.append(time.perf_counter() - began)
            stream.release_layer(layer)
        disk = (disk + cold_disk_read(shard[layer])) / 2
        names = stream.reader.layer_names(layer)
        out["layers"][layer] = {
            "cold": times[0], "warm": times[1], "disk": disk, "bytes": stream.reader.nbytes(names)
        }
    out["peak"] = status("VmHWM") - base
else:
    sys.path.insert(0, sys.argv[6])
    from mixquant.model.streaming import StreamedModel
    from mixquant.search.branches import branch_parallel_scores
    from streaming_helpers import routed_copy
    stream = StreamedModel(model_dir, **kwargs)
    ids = torch.randint(0, stream.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    compute = dict.fromkeys(range(stream.num_layers), 0.0)
    position = {id(module): i for i, module in enumerate(stream.layers)}
    began_call = {}

    def before_call(module, args):
        began_call[id(module)] = time.perf_counter()

    def after_call(module, args, output):
        compute[position[id(module)]] += time.perf_counter() - began_call.pop(id(module))

    for module in stream.layers:
        module.register_forward_pre_hook(before_call)
        module.register_forward_hook(after_call)
    drop(shards)
    base = start()
    began = time.perf_counter()
    with torch.no_grad():
        if mode == "forward":
            stream.forward([ids])
        else:
            branch_parallel_scores(
                stream, ids, {layer: ["nvfp4_w4a16"] for layer in moe},
                lambda layer, fmt, loaded: routed_copy(loaded, layer, fmt), batch_size=1,
            )
    out["seconds"] = time.perf_counter() - began
    out["peak"] = status("VmHWM") - base
    out["num_layers"] = stream.num_layers
    for layer in moe:
        names = stream.reader.layer_names(layer)
        out["layers"][layer] = {"compute": compute[layer], "bytes": stream.reader.nbytes(names)}
    stream.close()
print(json.dumps(out))
"""


def laguna_geometry(moe_layers: int, vocab: int):
    """The real Laguna config, truncated to the dense layer 0 and ``moe_layers`` MoE layers."""
    from transformers import LagunaConfig

    settings = json.loads(LAGUNA.read_text())
    layers = 1 + moe_layers
    for key in ("layer_types", "mlp_layer_types", "num_attention_heads_per_layer"):
        settings[key] = settings[key][:layers]
    for key in ("architectures", "model_type", "dtype"):
        settings.pop(key)
    return LagunaConfig(**{**settings, "num_hidden_layers": layers, "vocab_size": vocab})


def build(model_dir: Path, moe_layers: int, vocab: int) -> None:
    """The checkpoint (tests/model/streaming_helpers.py ``write_random_checkpoint``), unless it is there."""
    if (model_dir / "config.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
        if config["num_hidden_layers"] != 1 + moe_layers or config["vocab_size"] != vocab:
            raise SystemExit(f"{model_dir}: holds another checkpoint ({config['num_hidden_layers']} layers)")
        return
    sys.path.insert(0, str(HELPERS))
    from streaming_helpers import write_random_checkpoint

    started = time.perf_counter()
    write_random_checkpoint(laguna_geometry(moe_layers, vocab), model_dir)
    os.sync()  # written pages are dirty until then, and a dirty page is not dropped from the cache
    print(f"built {model_dir} in {time.perf_counter() - started:.0f} s", flush=True)


def run_child(mode: str, variant: str, model_dir: Path, moe: list[int], seq_len: int, before: str = ""):
    """One measurement in a fresh process (``before``: the directory of the variant ``before``'s package)."""
    env = dict(os.environ)
    if variant == "before":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [before, env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", CHILD, mode, variant, str(model_dir), json.dumps(moe), str(seq_len)]
    out = subprocess.run([*command, str(HELPERS)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{mode} {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--moe-layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-score", action="store_true", help="skip the scoring pass (about 3 layers)")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint goes")
    parser.add_argument("--checkpoint", default=None, help="build the checkpoint here and keep it")
    parser.add_argument("--before", default=None, help="a directory holding an older mixquant package")
    parser.add_argument("--results", default=None, help="write every child's measurements here (JSON)")
    args = parser.parse_args()
    variants = [*(["before"] if args.before else []), "transformers", "fused"]
    modes = ["load", "forward", *([] if args.no_score else ["score"])]
    moe = list(range(1, 1 + args.moe_layers))
    with tempfile.TemporaryDirectory(prefix="mixquant-layer-load-", dir=args.dir) as tmp:
        model_dir = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "model"
        build(model_dir, args.moe_layers, args.vocab)
        rows: dict[tuple[str, str], list] = {}
        for round_ in range(args.rounds):
            for mode in ("disk", "reader"):
                rows.setdefault((mode, "-"), []).append(run_child(mode, "-", model_dir, moe, args.seq_len))
            order = variants if round_ % 2 == 0 else variants[::-1]
            for mode in modes:
                for variant in order:
                    got = run_child(mode, variant, model_dir, moe, args.seq_len, args.before)
                    rows.setdefault((mode, variant), []).append(got)
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        if args.results:
            raw = [{"mode": mode, "variant": variant, "runs": runs} for (mode, variant), runs in rows.items()]
            Path(args.results).write_text(json.dumps(raw, indent=1))
        report(rows, variants, moe)


def report(rows: dict[tuple[str, str], list], variants: list[str], moe: list[int]) -> None:
    """Medians over MoE layers and rounds: seconds and GB/s per layer, peak resident memory in layers."""
    layer_bytes = rows[("disk", "-")][0]["layers"][str(moe[0])]["bytes"]

    def per_layer(runs, key):
        return [run["layers"][str(layer)][key] for run in runs for layer in moe]

    def share_of_disk(runs):  # each against cold disk reads of the same shard just before and after it
        return [
            run["layers"][str(layer)]["disk"] / run["layers"][str(layer)]["cold"]
            for run in runs
            for layer in moe
        ]

    def line(what, seconds, gbps="", share="", peak=""):
        print(f"| {what} | {seconds} | {gbps} | {share} | {peak} |")

    def fmt_peak(runs):
        return f"{median([run['peak'] for run in runs]) / layer_bytes:.2f}"

    print(f"\none MoE layer: {layer_bytes / 1e9:.2f} GB; medians over MoE layers and rounds")
    print("| what | s / layer | GB/s | of cold disk | peak RSS above base, layers |")
    print("|---|---|---|---|---|")
    disk = rows[("disk", "-")]
    cold, warm = median(per_layer(disk, "cold")), median(per_layer(disk, "warm"))
    line("disk read, cold", f"{cold:.2f}", f"{layer_bytes / cold / 1e9:.2f}", "1.00")
    line("disk read, warm (page cache)", f"{warm:.2f}", f"{layer_bytes / warm / 1e9:.2f}")
    reader = rows[("reader", "-")]
    seconds = median(per_layer(reader, "cold"))
    line(
        "ShardReader.read, cold",
        f"{seconds:.2f}",
        f"{layer_bytes / seconds / 1e9:.2f}",
        f"{median(share_of_disk(reader)):.2f}",
        fmt_peak(reader),
    )
    for variant in variants:
        runs = rows.get(("load", variant), [])
        for key in ("cold", "warm"):
            seconds = median(per_layer(runs, key))
            share = f"{median(share_of_disk(runs)):.2f}" if key == "cold" else ""
            peak = fmt_peak(runs) if key == "cold" else ""
            line(
                f"load_layer, {key} [{variant}]",
                f"{seconds:.2f}",
                f"{layer_bytes / seconds / 1e9:.2f}",
                share,
                peak,
            )
    for mode in ("forward", "score"):
        for variant in variants:
            runs = rows.get((mode, variant))
            if not runs:
                continue
            wall = median([run["seconds"] / len(moe) for run in runs])  # the dense layer 0 and head: 0.3 GB
            compute = median(per_layer(runs, "compute"))
            gbps = f"{layer_bytes / wall / 1e9:.2f}"
            line(
                f"{mode} pass, cold, wall per MoE layer [{variant}]", f"{wall:.2f}", gbps, "", fmt_peak(runs)
            )
            line(f"{mode}: compute of one MoE layer [{variant}]", f"{compute:.2f}")
    print(f"\ncold disk read / warm read: {cold / warm:.1f} (the page-cache drop worked if well above 1)")
    loads = {variant: median(per_layer(rows[("load", variant)], "cold")) for variant in variants}
    for variant in variants:
        if variant != "fused":
            print(f"load_layer cold, {variant} / fused: {loads[variant] / loads['fused']:.2f}")


if __name__ == "__main__":
    main()
