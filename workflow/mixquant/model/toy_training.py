"""Training the embedded toy: the corpus as packed next-token sequences, then AdamW with a seeded data
order and aux-loss-free router balancing, fp32 on the CPU.

Deterministic for a fixed seed and thread count: the held-out split, the data order (a seeded
torch.Generator), the router-bias updates.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LagunaConfig, LagunaForCausalLM, PreTrainedTokenizerFast

from mixquant.model.families import moe_experts
from mixquant.model.tokenizer import render_conversation
from mixquant.model.toy import DEFAULT_TOY_ARCH, DEFAULT_TOY_TRAINING, init_toy_model, routers, with_defaults

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
    """Forward pre-hooks on every MoE layer's routed-experts module counting how often each expert is
    selected (per MoE layer, in layer order), from the ``top_k_index`` the block hands its experts: the
    same count in every family (Laguna's and DeepSeek's routers return it, MiniMax's block computes it)."""

    def __init__(self, model: torch.nn.Module):
        self.experts = [experts for _, experts in sorted(moe_experts(model).items())]
        self.counts = [torch.zeros(int(e.num_experts)) for e in self.experts]
        self.handles = [
            e.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, e in enumerate(self.experts)
        ]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            selected = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self.counts[i] += torch.bincount(selected.reshape(-1), minlength=self.counts[i].numel()).float()[
                : self.counts[i].numel()
            ]

        return hook

    def reset(self) -> None:
        for c in self.counts:
            c.zero_()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _update_router_bias(biased: list[torch.nn.Module], counts: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3 style): push under-used experts' bias up, over-used down."""
    with torch.no_grad():
        for holder, count in zip(biased, counts, strict=True):
            bias = holder.e_score_correction_bias
            bias.add_(torch.sign(count.mean() - count).to(bias.dtype) * rate)


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
    """Train a fresh seeded toy Laguna on the rendered conversations (:func:`train_moe_model`); returns
    (fp32 model in eval mode, report)."""
    with torch_threads(threads):
        model = init_toy_model(config, seed=seed, router_bias_init_std=router_bias_init_std)
    return train_moe_model(
        model, conversations, tokenizer, training=training, seed=seed, threads=threads, progress=progress
    )


def train_moe_model(
    model: torch.nn.Module,
    conversations: list[list[dict]],
    tokenizer: PreTrainedTokenizerFast,
    *,
    training: dict[str, Any],
    seed: int,
    threads: int,
    aux_loss_coef: float = 0.0,
    progress: bool = True,
    desc: str = "train toy laguna",
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the initialised fp32 MoE ``model`` (any family of :mod:`mixquant.model.families`) on the
    rendered conversations; returns (the model in eval mode, report).

    Conversation i is held out iff i % heldout_every == 0; the rest are packed into seq_len sequences and
    visited in seeded shuffled epochs. Routers with an ``e_score_correction_bias`` are balanced without an
    auxiliary loss (the bias update, DeepSeek-V3's recipe); with ``aux_loss_coef`` > 0 the model's own
    load-balancing loss (``output_router_logits``, Switch / Mixtral / Qwen3-MoE) is added to the next-token
    loss, the way those families are trained.
    """
    training = with_defaults(DEFAULT_TOY_TRAINING, training, "toy training")
    seq_len, batch_size, steps = int(training["seq_len"]), int(training["batch_size"]), int(training["steps"])
    config = model.config
    with torch_threads(threads):
        t0 = time.perf_counter()
        train_convs, heldout_convs = split_conversations(conversations, int(training["heldout_every"]))
        train_x, train_y = pack(token_stream(tokenizer, train_convs), seq_len)
        heldout_x, heldout_y = pack(token_stream(tokenizer, heldout_convs), seq_len)
        if train_x.shape[0] < batch_size:
            raise ValueError(f"{train_x.shape[0]} training sequences are fewer than batch_size {batch_size}")
        tokenize_s = time.perf_counter() - t0

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
        biased = routers(model)
        if biased and len(biased) != len(counter.experts):
            raise RuntimeError(f"{len(biased)} routing biases for {len(counter.experts)} MoE layers")
        batches = _batches(train_x.shape[0], batch_size, torch.Generator().manual_seed(seed))
        losses: list[float] = []
        t1 = time.perf_counter()
        model.train()
        bar = tqdm(range(steps), desc=desc, file=sys.stderr, disable=not progress, mininterval=1.0)
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, training)
            idx = next(batches)
            counter.reset()
            if aux_loss_coef > 0:
                out = model(input_ids=train_x[idx], output_router_logits=True)
            else:
                out = model(input_ids=train_x[idx])
            logits = out.logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), train_y[idx].reshape(-1))
            total = loss + aux_loss_coef * out.aux_loss if aux_loss_coef > 0 else loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(training["grad_clip"]), foreach=False)
            optimizer.step()
            if biased:
                _update_router_bias(biased, counter.counts, float(training["router_bias_update_rate"]))
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
    biases = (
        torch.cat([r.e_score_correction_bias.detach().float().flatten() for r in biased]) if biased else None
    )
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
            "min": float(biases.min()) if biases is not None else None,
            "max": float(biases.max()) if biases is not None else None,
            "nonzero": int((biases != 0).sum()) if biases is not None else 0,
            "last_step_max_load": max(float(x.max()) for x in loads) if loads else None,
            "last_step_min_load": min(float(x.min()) for x in loads) if loads else None,
        },
        "loss_curve": [round(x, 4) for x in losses[:: max(1, steps // 50)]],
        "timings_s": {"tokenize": tokenize_s, "train": train_s, "eval": eval_s},
    }
    model.eval()
    return model, report
