"""Building the embedded toy: tokenizer, training, outlier channels, the upstream-layout checkpoint, and
the check that from_pretrained reloads it bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import LagunaForCausalLM

from mixquant.model.layout import write_json
from mixquant.model.tokenizer import SAVE_KWARGS, conversation_texts, train_tokenizer
from mixquant.model.toy import (
    DEFAULT_TOY_ARCH,
    DEFAULT_TOY_TOKENIZER,
    DEFAULT_TOY_TRAINING,
    apply_outliers,
    parameter_counts,
    to_bfloat16,
    toy_laguna_config,
    with_defaults,
)
from mixquant.model.toy_layout import save_upstream_checkpoint
from mixquant.model.toy_training import split_conversations, token_stream, torch_threads, train_toy_model


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
    saved = save_upstream_checkpoint(model, out_dir, num_shards=num_shards)
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
    write_json(out_dir / "training_report.json", {k: v for k, v in report.items() if k != "timings_s"})
    return report
