"""The embedded default model: a tiny Laguna (real transformers architecture) trained by the workflow.

It mirrors Laguna-S-2.1 at toy scale: dense layer 0 then sparse MoE layers (sigmoid router with
e_score_correction_bias, normalised top-k weights (LagunaTopKRouter always renormalises: there is no
norm_topk_prob field), one shared expert, routed scaling 2.5), hybrid attention
(layer l is full attention iff l % 4 == 0, partial RoPE 0.5 / theta 500000 there, sliding window with
default RoPE theta 10000 elsewhere), different head counts on full vs sliding layers, per-head softplus
output gate, q/k norms, untied lm_head. Every matrix input dimension is a multiple of 16 (NVFP4 blocks).

Everything is deterministic for a fixed seed and thread count: weight init (torch.manual_seed), data order
(a seeded torch.Generator), the router-bias balancing updates, the tokenizer (see tokenizer.py), and the
saved bytes (layout.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LagunaConfig, LagunaForCausalLM, PreTrainedTokenizerFast

from mixquant.model import layout
from mixquant.model.tokenizer import (
    SAVE_KWARGS,
    conversation_texts,
    render_conversation,
    special_token_ids,
    train_tokenizer,
)
from mixquant.model.toy_settings import ToyArchitecture, ToyOutliers, ToyTokenizer, ToyTraining

NVFP4_BLOCK = 16

# Defaults live in the typed settings (toy_settings.py, also the config schema); plain dicts here.
# Geometry of the toy model (LagunaConfig fields, some derived).
DEFAULT_TOY_ARCH: dict[str, Any] = ToyArchitecture().model_dump()

# Tokenizer training (tokenizer.py): byte-level BPE on the corpus text.
DEFAULT_TOY_TOKENIZER: dict[str, Any] = ToyTokenizer().model_dump()

# Training: AdamW, linear warmup then cosine decay, fp32 on CPU; packed next-token prediction.
DEFAULT_TOY_TRAINING: dict[str, Any] = ToyTraining().model_dump()

# Outlier channels applied after training (apply_outliers).
DEFAULT_TOY_OUTLIERS: dict[str, Any] = ToyOutliers().model_dump()


# ----------------------------------------------------------------------------------------- config


def with_defaults(defaults: dict[str, Any], given: dict[str, Any], what: str) -> dict[str, Any]:
    """`defaults` overridden by `given`; an unknown key (a typo) is an error, not silently ignored."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known: {sorted(defaults)}")
    return {**defaults, **given}


def _require_multiple(name: str, value: int, of: int = NVFP4_BLOCK) -> None:
    if value % of:
        raise ValueError(f"{name}={value} must be a multiple of {of} (NVFP4 blocks along the input dim)")


def toy_laguna_config(arch: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> LagunaConfig:
    """LagunaConfig for `arch` (keys as DEFAULT_TOY_ARCH), vocab and special ids from `tokenizer`.

    The vocabulary is len(tokenizer) rounded up to a multiple of 16.
    """
    arch = with_defaults(DEFAULT_TOY_ARCH, arch, "toy arch")
    layers = int(arch["num_hidden_layers"])
    dense = int(arch["num_dense_layers"])
    period = int(arch["full_attention_period"])
    if not 0 < dense < layers:
        raise ValueError(f"need 0 < num_dense_layers ({dense}) < num_hidden_layers ({layers})")
    vocab = -(-len(tokenizer) // NVFP4_BLOCK) * NVFP4_BLOCK
    head_dim = int(arch["head_dim"])
    heads_full = int(arch["num_attention_heads_full"])
    heads_sliding = int(arch["num_attention_heads_sliding"])
    kv_heads = int(arch["num_key_value_heads"])
    layer_types = ["full_attention" if i % period == 0 else "sliding_attention" for i in range(layers)]
    heads = [heads_full if t == "full_attention" else heads_sliding for t in layer_types]
    for h in sorted(set(heads)):
        if h % kv_heads:
            raise ValueError(f"{h} query heads are not a multiple of {kv_heads} KV heads")
        _require_multiple(f"o_proj input ({h} heads x head_dim {head_dim})", h * head_dim)
    for key in (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        _require_multiple(key, int(arch[key]))
    _require_multiple("num_experts (router rows)", int(arch["num_experts"]))
    return LagunaConfig(
        vocab_size=vocab,
        hidden_size=int(arch["hidden_size"]),
        intermediate_size=int(arch["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads_full,
        num_attention_heads_per_layer=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(arch["max_position_embeddings"]),
        initializer_range=float(arch["initializer_range"]),
        rms_norm_eps=float(arch["rms_norm_eps"]),
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(arch["full_rope_theta"]),
                "partial_rotary_factor": float(arch["full_partial_rotary_factor"]),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(arch["sliding_rope_theta"]),
                "partial_rotary_factor": 1.0,
            },
        },
        sliding_window=int(arch["sliding_window"]),
        layer_types=layer_types,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        num_experts=int(arch["num_experts"]),
        num_experts_per_tok=int(arch["num_experts_per_tok"]),
        moe_intermediate_size=int(arch["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(arch["shared_expert_intermediate_size"]),
        moe_routed_scaling_factor=float(arch["moe_routed_scaling_factor"]),
        gating=True,
        attention_bias=False,
        **special_token_ids(tokenizer),
    )


def init_toy_model(
    config: LagunaConfig, *, seed: int, router_bias_init_std: float = 0.02
) -> LagunaForCausalLM:
    """Seeded fp32 model with a small nonzero e_score_correction_bias (HF initialises it to zeros)."""
    torch.manual_seed(seed)
    model = LagunaForCausalLM(config)
    model.to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for router in _routers(model):
            bias = (
                torch.randn(router.e_score_correction_bias.shape, generator=generator) * router_bias_init_std
            )
            router.e_score_correction_bias.copy_(bias)
    return model


def to_bfloat16(model: LagunaForCausalLM) -> LagunaForCausalLM:
    """Cast parameters (router bias included) to bf16 in place, as from_pretrained(dtype=bf16) loads them.

    Unlike model.to(bf16) this leaves the non-persistent RoPE inv_freq buffers in fp32, which is what a
    reloaded checkpoint has (they are recomputed at load time); casting them would change the logits.
    """
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts by role, in the upstream layout's terms."""
    counts = {
        "total": 0,
        "routed_experts": 0,
        "shared_experts": 0,
        "router": 0,
        "attention": 0,
        "embedding": 0,
    }
    counts.update({"lm_head": 0, "dense_mlp": 0, "norms": 0})
    for name, tensor in model.state_dict().items():
        n = tensor.numel()
        counts["total"] += n
        if ".mlp.experts." in name:
            counts["routed_experts"] += n
        elif ".mlp.shared_experts." in name:
            counts["shared_experts"] += n
        elif ".mlp.gate." in name:
            counts["router"] += n
        elif ".self_attn." in name and name.endswith("_proj.weight"):
            counts["attention"] += n
        elif "embed_tokens" in name:
            counts["embedding"] += n
        elif name.startswith("lm_head"):
            counts["lm_head"] += n
        elif ".mlp." in name:
            counts["dense_mlp"] += n
        else:
            counts["norms"] += n
    config = model.config
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    sparse = sum(t == "sparse" for t in config.mlp_layer_types)
    counts["active_per_token"] = (
        counts["total"] - counts["routed_experts"] + (sparse * config.num_experts_per_tok * per_expert)
    )
    return counts


# ----------------------------------------------------------------------------------------- data


def split_conversations(
    conversations: list[list[dict]], heldout_every: int
) -> tuple[list[list[dict]], list[list[dict]]]:
    """Deterministic split: conversation i is held out iff i % heldout_every == 0."""
    train = [c for i, c in enumerate(conversations) if i % heldout_every]
    heldout = [c for i, c in enumerate(conversations) if i % heldout_every == 0]
    return train, heldout


def token_stream(tokenizer: PreTrainedTokenizerFast, conversations: list[list[dict]]) -> torch.Tensor:
    """All conversations rendered through the chat template and concatenated (each starts with bos)."""
    texts = [render_conversation(tokenizer, messages) for messages in conversations]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for ids in encoded for t in ids], dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a token stream into [N, seq_len] inputs and next-token targets (the stream shifted by one)."""
    n = (stream.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"{stream.numel()} tokens do not fill one sequence of {seq_len}")
    inputs = stream[: n * seq_len].view(n, seq_len)
    targets = stream[1 : n * seq_len + 1].view(n, seq_len)
    return inputs, targets


def _batches(num_sequences: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless seeded epochs of shuffled sequence indices, `batch_size` at a time (last partial dropped)."""
    while True:
        order = torch.randperm(num_sequences, generator=generator)
        for start in range(0, num_sequences - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def _evenly_spaced(count: int, available: int) -> torch.Tensor:
    if count >= available:
        return torch.arange(available)
    return torch.linspace(0, available - 1, count).round().long()


# ----------------------------------------------------------------------------------------- training


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def lr_at(step: int, training: dict[str, Any]) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step."""
    peak, steps, warmup = float(training["lr"]), int(training["steps"]), int(training["warmup_steps"])
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    floor = float(training["min_lr_ratio"])
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class _RoutingCounter:
    """Forward hooks on the routers counting how often each expert is selected (per layer)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = _routers(model)
        self.counts = [torch.zeros(r.e_score_correction_bias.numel()) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module, args, output):
            selected = output[2]
            self.counts[i] += torch.bincount(selected.reshape(-1), minlength=self.counts[i].numel()).float()

        return hook

    def reset(self) -> None:
        for c in self.counts:
            c.zero_()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _update_router_bias(counter: _RoutingCounter, rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3 style): push under-used experts' bias up, over-used down."""
    with torch.no_grad():
        for router, counts in zip(counter.routers, counter.counts, strict=True):
            bias = router.e_score_correction_bias
            bias.add_(torch.sign(counts.mean() - counts).to(bias.dtype) * rate)


@torch.no_grad()
def evaluate(model: LagunaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> dict:
    """Mean next-token loss (nats), perplexity, mean max-probability and top-1 accuracy."""
    model.eval()
    total_loss, total_maxp, total_correct, total = 0.0, 0.0, 0, 0
    for start in range(0, inputs.shape[0], batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        logits = model(input_ids=x).logits.float()
        logp = F.log_softmax(logits, dim=-1)
        total_loss += -logp.gather(-1, y.unsqueeze(-1)).sum().item()
        maxp, argmax = logp.max(dim=-1)
        total_maxp += maxp.exp().sum().item()
        total_correct += int((argmax == y).sum())
        total += y.numel()
    loss = total_loss / total
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "mean_max_prob": total_maxp / total,
        "top1_accuracy": total_correct / total,
        "tokens": total,
    }


def train_toy_model(
    config: LagunaConfig,
    conversations: list[list[dict]],
    tokenizer: PreTrainedTokenizerFast,
    *,
    training: dict[str, Any],
    seed: int,
    threads: int,
    router_bias_init_std: float = DEFAULT_TOY_ARCH["router_bias_init_std"],
    progress: bool = True,
) -> tuple[LagunaForCausalLM, dict[str, Any]]:
    """Train a fresh seeded model on the rendered conversations; returns (fp32 model in eval mode, report).

    Conversation i is held out iff i % heldout_every == 0; the rest are packed into seq_len sequences and
    visited in seeded shuffled epochs.
    """
    training = with_defaults(DEFAULT_TOY_TRAINING, training, "toy training")
    seq_len, batch_size, steps = int(training["seq_len"]), int(training["batch_size"]), int(training["steps"])
    with torch_threads(threads):
        t0 = time.perf_counter()
        train_convs, heldout_convs = split_conversations(conversations, int(training["heldout_every"]))
        train_x, train_y = pack(token_stream(tokenizer, train_convs), seq_len)
        heldout_x, heldout_y = pack(token_stream(tokenizer, heldout_convs), seq_len)
        if train_x.shape[0] < batch_size:
            raise ValueError(f"{train_x.shape[0]} training sequences are fewer than batch_size {batch_size}")
        tokenize_s = time.perf_counter() - t0

        model = init_toy_model(config, seed=seed, router_bias_init_std=router_bias_init_std)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": float(training["weight_decay"])},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=float(training["lr"]),
            betas=(float(training["beta1"]), float(training["beta2"])),
            eps=1e-8,
            foreach=False,
        )
        counter = _RoutingCounter(model)
        batches = _batches(train_x.shape[0], batch_size, torch.Generator().manual_seed(seed))
        losses: list[float] = []
        t1 = time.perf_counter()
        model.train()
        bar = tqdm(
            range(steps), desc="train toy laguna", file=sys.stderr, disable=not progress, mininterval=1.0
        )
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, training)
            idx = next(batches)
            counter.reset()
            logits = model(input_ids=train_x[idx]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), train_y[idx].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(training["grad_clip"]), foreach=False)
            optimizer.step()
            _update_router_bias(counter, float(training["router_bias_update_rate"]))
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.close()
        # expert load in the last step relative to a perfectly balanced router (1.0 = E/k share)
        loads = [c * c.numel() / c.sum() for c in counter.counts]
        counter.remove()
        train_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        n_eval = int(training["eval_sequences"])
        train_eval = evaluate(
            model, *(t[_evenly_spaced(n_eval, train_x.shape[0])] for t in (train_x, train_y)), batch_size
        )
        heldout_eval = evaluate(
            model,
            *(t[_evenly_spaced(n_eval, heldout_x.shape[0])] for t in (heldout_x, heldout_y)),
            batch_size,
        )
        eval_s = time.perf_counter() - t2

    uniform = math.log(config.vocab_size)
    tail = losses[-max(1, steps // 10) :]
    biases = torch.cat([r.e_score_correction_bias.detach().flatten() for r in _routers(model)])
    report = {
        "seed": seed,
        "threads": threads,
        "training": training,
        "data": {
            "conversations_train": len(train_convs),
            "conversations_heldout": len(heldout_convs),
            "tokens_train": int(train_x.numel()),
            "tokens_heldout": int(heldout_x.numel()),
            "sequences_train": int(train_x.shape[0]),
            "tokens_seen": steps * batch_size * seq_len,
            "epochs": steps * batch_size / train_x.shape[0],
        },
        "loss": {
            "first_step": losses[0],
            "last_steps_mean": sum(tail) / len(tail),
            "train": train_eval["loss"],
            "heldout": heldout_eval["loss"],
            "uniform": uniform,
            "heldout_over_uniform": heldout_eval["loss"] / uniform,
        },
        "train_eval": train_eval,
        "heldout_eval": heldout_eval,
        "uniform_baseline": {
            "loss": uniform,
            "perplexity": float(config.vocab_size),
            "max_prob": 1 / config.vocab_size,
        },
        "router_bias": {
            "min": float(biases.min()),
            "max": float(biases.max()),
            "nonzero": int((biases != 0).sum()),
            "last_step_max_load": max(float(x.max()) for x in loads) if loads else None,
            "last_step_min_load": min(float(x.min()) for x in loads) if loads else None,
        },
        "loss_curve": [round(x, 4) for x in losses[:: max(1, steps // 50)]],
        "timings_s": {"tokenize": tokenize_s, "train": train_s, "eval": eval_s},
    }
    model.eval()
    return model, report


# ----------------------------------------------------------------------------------------- outliers


@torch.no_grad()
def apply_outliers(model: LagunaForCausalLM, outliers: dict[str, Any]) -> list[dict[str, Any]]:
    """Give some MoE layers' routed experts massive intermediate activations, keeping the BF16 function.

    Real MoE models carry a few channels with activations orders of magnitude above the rest and the
    matching tiny down-projection weights ("super weights", Yu et al. 2024, arXiv:2411.07191); they are
    what makes some layers far more sensitive to 4-bit weights than others. Per listed layer and per expert,
    ``channels`` intermediate channels (a seeded permutation) get their up_proj row multiplied by
    2**log2_scale and their down_proj column divided by it. Powers of two scale bf16 values exactly and
    the expert computes silu(gate) * up before down_proj, so the model's logits stay bit-identical (checked
    by the caller), while NVFP4's 16-element blocks along down_proj's input round the tiny column to zero
    and FP8's per-tensor scales keep it. Returns what was changed (for the training report).
    """
    outliers = with_defaults(DEFAULT_TOY_OUTLIERS, outliers, "toy outliers")
    layers = model.model.layers
    changed = []
    for entry in outliers["layers"]:
        layer, channels, log2_scale = int(entry["layer"]), int(entry["channels"]), int(entry["log2_scale"])
        if not 0 <= layer < len(layers) or not hasattr(layers[layer].mlp, "experts"):
            raise ValueError(f"toy outliers: layer {layer} is not a MoE layer")
        experts = layers[layer].mlp.experts
        intermediate = experts.down_proj.shape[-1]
        if channels > intermediate:
            raise ValueError(f"toy outliers: layer {layer} has {intermediate} channels, asked for {channels}")
        generator = torch.Generator().manual_seed(int(outliers["seed"]) * 1000 + layer)
        scale = float(2**log2_scale)
        picked = []
        for expert in range(experts.down_proj.shape[0]):
            chosen = torch.randperm(intermediate, generator=generator)[:channels]
            experts.gate_up_proj.data[expert, intermediate + chosen, :] *= scale  # the "up" half
            experts.down_proj.data[expert][:, chosen] /= scale
            picked.append(sorted(int(c) for c in chosen))
        changed.append({"layer": layer, "log2_scale": log2_scale, "channels_per_expert": picked})
    return changed


# ----------------------------------------------------------------------------------------- build


def _texts_for_tokenizer(conversations: list[list[dict]], heldout_every: int) -> list[str]:
    train, _ = split_conversations(conversations, heldout_every)
    return list(conversation_texts(train))


def build_toy_model(
    out_dir: Path,
    *,
    conversations: list[list[dict]],
    arch: dict[str, Any],
    tokenizer_spec: dict[str, Any],
    training: dict[str, Any],
    seed: int,
    outliers: dict[str, Any] | None = None,
    threads: int = 2,
    num_shards: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Train tokenizer + toy Laguna and write the upstream-layout checkpoint into the empty `out_dir`.

    Also verifies that LagunaForCausalLM.from_pretrained(out_dir) reproduces the saved bf16 model's logits
    bit for bit on a held-out batch. Returns the report also written to out_dir/training_report.json.
    """
    out_dir = Path(out_dir)
    if any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty")
    arch = with_defaults(DEFAULT_TOY_ARCH, arch, "toy arch")
    tokenizer_spec = with_defaults(DEFAULT_TOY_TOKENIZER, tokenizer_spec, "toy tokenizer")
    training = with_defaults(DEFAULT_TOY_TRAINING, training, "toy training")
    start = time.perf_counter()

    tokenizer = train_tokenizer(
        _texts_for_tokenizer(conversations, int(training["heldout_every"])),
        vocab_size=int(tokenizer_spec["vocab_size"]),
        min_frequency=int(tokenizer_spec["min_frequency"]),
    )
    tokenizer_s = time.perf_counter() - start

    config = toy_laguna_config(arch, tokenizer)
    model, report = train_toy_model(
        config,
        conversations,
        tokenizer,
        training=training,
        seed=seed,
        threads=threads,
        router_bias_init_std=float(arch["router_bias_init_std"]),
        progress=progress,
    )

    t_save = time.perf_counter()
    to_bfloat16(model)
    with torch_threads(threads), torch.no_grad():
        probe = token_stream(tokenizer, conversations[:8])[: int(training["seq_len"])].unsqueeze(0)
        before = model(input_ids=probe).logits
        outlier_report = apply_outliers(model, outliers or {"layers": []})
        if not torch.equal(before, model(input_ids=probe).logits):
            raise RuntimeError("toy outliers changed the bf16 model's logits (they must be exact rescalings)")
    saved = layout.save_upstream_checkpoint(model, out_dir, num_shards=num_shards)
    tokenizer.save_pretrained(out_dir, **SAVE_KWARGS)
    save_s = time.perf_counter() - t_save

    t_verify = time.perf_counter()
    with torch_threads(threads):
        # a held-out sequence longer than the sliding window, so both mask kinds are exercised
        probe = token_stream(tokenizer, conversations[:8])[: int(training["seq_len"])].unsqueeze(0)
        with torch.no_grad():
            expected = model(input_ids=probe).logits
            reloaded = LagunaForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
            reloaded.eval()
            actual = reloaded(input_ids=probe).logits
    logits_identical = bool(torch.equal(expected, actual))
    if not logits_identical:
        raise RuntimeError("from_pretrained logits differ from the saved bf16 model's logits")
    verify_s = time.perf_counter() - t_verify

    counts = parameter_counts(model)
    report = {
        "model": {
            "model_type": "laguna",
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "head_dim": config.head_dim,
            "num_attention_heads_per_layer": list(config.num_attention_heads_per_layer),
            "num_key_value_heads": config.num_key_value_heads,
            "layer_types": list(config.layer_types),
            "mlp_layer_types": list(config.mlp_layer_types),
            "sliding_window": config.sliding_window,
            "intermediate_size": config.intermediate_size,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "vocab_size": config.vocab_size,
            "tokenizer_size": len(tokenizer),
            "parameters": counts,
        },
        "arch": arch,
        "tokenizer": tokenizer_spec,
        **report,
        "checkpoint": {**saved, "logits_bit_identical_after_reload": logits_identical},
        "outliers": outlier_report,
    }
    report["timings_s"].update(
        {"tokenizer": tokenizer_s, "save": save_s, "verify": verify_s, "total": time.perf_counter() - start}
    )
    # Timings vary run to run; they go to the caller (the manifest), not into the checkpoint, so
    # every file of the build is bit-identical for a fixed seed.
    layout.write_json(out_dir / "training_report.json", {k: v for k, v in report.items() if k != "timings_s"})
    return report
