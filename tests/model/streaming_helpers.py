"""Checkpoints and scoring inputs for the layer-streaming tests (imported by tests/model/test_streaming.py
and run as a child process by its memory and kill tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def laguna_config(**overrides):
    """A Laguna-shaped config: dense layer 0, MoE layers after it, hybrid full/sliding attention."""
    from transformers import LagunaConfig

    layers = overrides.pop("num_hidden_layers", 4)
    settings = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "tie_word_embeddings": False,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "layer_types": ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(layers)],
        **overrides,
    }
    return LagunaConfig(**settings)


def write_random_checkpoint(config, out: Path, *, seed: int = 0, scale: float = 0.05) -> Path:
    """A random bf16 checkpoint in the upstream layout, written one decoder layer at a time (one shard per
    layer, so even a large one never sits in memory), with an index; routers spread over the experts and
    a sharp lm_head so that KL scores are well above rounding noise. The float32 draws are scaled in
    place and dropped once rounded: a layer of the real Laguna size (5 GB in bf16) peaks near 11 GB."""
    from mixquant.model.layout import CONFIG_FILE, INDEX_FILE, layer_of, write_json
    from mixquant.model.toy_layout import checkpoint_config_dict, hf_to_upstream_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    groups: dict[int | None, list[str]] = {}
    for name in shapes:
        groups.setdefault(layer_of(name), []).append(name)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))  # layers, then the rest
    for index, (_, names) in enumerate(ordered):
        tensors = {}
        for name in names:
            tensor = torch.randn(shapes[name], generator=generator).mul_(scale)
            if name.endswith("norm.weight"):
                tensor.add_(1)
            elif name.endswith("gate.weight"):
                tensor.mul_(20)  # spread the routing over many experts
            elif name.startswith("lm_head"):
                tensor.mul_(8)
            tensors[name] = tensor.to(torch.bfloat16)
            del tensor
        upstream = {n: t.contiguous() for n, t in hf_to_upstream_state_dict(tensors).items()}
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(upstream, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(upstream, file))
    write_json(out / INDEX_FILE, {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})
    write_json(out / CONFIG_FILE, checkpoint_config_dict(config))
    return out


def routed_copy(loaded_layer: torch.nn.Module, layer: int, fmt: str):
    """A LayerQuant holding a perturbed copy of the loaded layer's routed experts: a stand-in for a
    quantized layer with the memory of a real one (one dequantized copy of the routed experts)."""
    from mixquant.search.score import LayerQuant

    experts = loaded_layer.mlp.experts
    return LayerQuant(layer, fmt, experts.gate_up_proj.data * 1.0625, experts.down_proj.data * 0.9375)


def _rss_child(model_dir: str, sequences: int, seq_len: int, mode: str) -> None:
    """Peak resident memory of a streamed pass above the resident memory just before it (VmHWM after a
    clear_refs reset, VmRSS), printed as JSON."""
    from mixquant.numerics import enter

    enter("portable", 1)
    from mixquant.model.streaming import StreamedModel
    from mixquant.search.branches import branch_parallel_scores

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    stream = StreamedModel(model_dir, prefetch=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, stream.config.vocab_size, (sequences, seq_len), generator=generator)
    moe = [i for i, kind in enumerate(stream.config.mlp_layer_types) if kind == "sparse"]

    def run() -> None:
        if mode == "forward":
            stream.forward([ids[:1], ids[1:]])
        else:
            branch_parallel_scores(
                stream,
                ids,
                {layer: ["nvfp4_w4a16"] for layer in moe},
                lambda layer, fmt, loaded: routed_copy(loaded, layer, fmt),
                batch_size=1,
            )

    run()  # a first pass: lazy imports and one-time initialisation are not the pass's memory
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current
    run()
    layer = max(stream.reader.nbytes(stream.reader.layer_names(i)) for i in range(stream.num_layers))
    states = (1 + len(moe)) * sequences * seq_len * stream.config.hidden_size * 2
    print(
        json.dumps(
            {
                "base": base,
                "peak": status("VmHWM"),
                "layer_bytes": layer,
                "state_bytes": states,
                "model_bytes": stream.reader.nbytes(stream.reader.names),
                "loads": dict(stream.reader.reads),
            }
        )
    )


def _kill_child(model_dir: str, state_dir: str, delay_s: float) -> None:
    """A scoring pass that saves its states after every layer and takes ``delay_s`` per layer load (the
    parent kills it mid-pass)."""
    import time

    from mixquant.numerics import enter

    enter("portable", 1)
    from mixquant.model.streaming import StreamedModel

    stream = StreamedModel(model_dir)
    original = stream.load_layer

    def slow_load(layer: int):
        time.sleep(delay_s)
        return original(layer)

    stream.load_layer = slow_load
    score(stream, state_dir=state_dir, checkpoint_interval_s=0)


def score(stream, **kwargs):
    """Every MoE layer of ``stream`` in two formats (routed-copy stand-ins), 4 sequences of 16 tokens."""
    from mixquant.search.branches import branch_parallel_scores

    moe = [i for i, kind in enumerate(stream.config.mlp_layer_types) if kind == "sparse"]
    ids = torch.randint(0, stream.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    return branch_parallel_scores(
        stream,
        ids,
        {layer: ["nvfp4_w4a16", "fp8_copy"] for layer in moe},
        lambda layer, fmt, loaded: routed_copy(
            loaded, layer, "nvfp4_w4a16" if fmt == "nvfp4_w4a16" else "bf16"
        ),
        batch_size=2,
        state_key="kill-test",
        **kwargs,
    )


if __name__ == "__main__":
    if sys.argv[1] == "rss":
        _rss_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "kill":
        _kill_child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
