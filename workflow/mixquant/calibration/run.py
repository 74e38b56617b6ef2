"""Stage entry points for sample_calibration and pin_prompt (rule scripts and the CLI call these)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mixquant.calibration.dataset import load_dataset_conversations
from mixquant.calibration.prompt import build_prompt, check_prompt_pin
from mixquant.calibration.sample import sample_calibration
from mixquant.calibration.tokens import save_token_ids
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import resolve_model_dir

log = logging.getLogger(__name__)


def load_tokenizer(tokenizer_settings: dict[str, Any], model_artifact: str | Path | None):
    """The tokenizer named by settings: the model's own files, or a pinned hub revision."""
    from transformers import AutoTokenizer

    if tokenizer_settings["source"] == "hub":
        if tokenizer_settings.get("revision") is None:
            raise ValueError(f"tokenizer {tokenizer_settings['repo']}: refusing an unpinned revision")
        return AutoTokenizer.from_pretrained(
            tokenizer_settings["repo"], revision=tokenizer_settings["revision"], trust_remote_code=False
        )
    if model_artifact is None:
        raise ValueError("tokenizer source is 'model' but no model directory was given")
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(model_artifact)), trust_remote_code=False)


def member_counts(num_samples: int, members: int) -> list[int]:
    """Samples per dataset member: an even split, the first members taking the remainder."""
    counts = [num_samples // members] * members
    for index in range(num_samples % members):
        counts[index] += 1
    return counts


def run_sample_calibration(
    out_dir: str | Path, *, model: str | Path | None, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Sample N x T calibration token IDs into the keyed directory `out_dir`.

    With several hub members (a ModelOpt-style combo) the N samples are split evenly across
    members, the first members taking the remainder. With ``held_out_after`` M (the refinement's held-out
    draw), each member's draw continues after its share of M calibration samples: the sampler visits the
    conversations in one seeded order and stops at the count, so the first M are the calibration's and
    the rest use none of their conversations.
    """
    calibration = settings["calibration"]
    tokenizer = load_tokenizer(settings["tokenizer"], model)
    sources = load_dataset_conversations(settings["dataset"])
    counts = member_counts(calibration["num_samples"], len(sources))
    # a held-out draw (placement.search.refine) continues each member's calibration draw past its share
    skipped = member_counts(calibration.get("held_out_after", 0), len(sources))
    import torch

    parts = [
        sample_calibration(
            source,
            tokenizer,
            num_samples=skip + count,
            seq_len=calibration["seq_len"],
            seed=calibration["seed"],
            short_policy=calibration["short_policy"],
        )[skip:]
        for source, count, skip in zip(sources, counts, skipped, strict=True)
        if count
    ]
    ids = torch.cat(parts, dim=0)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        sha = save_token_ids(tmp / "calibration.safetensors", ids, {"encoding": "int32-le-row-major"})
        summary.update(sha256=sha, shape=list(ids.shape), tokens=int(ids.numel()))
    log.info("calibration %s: %s tokens, sha256 %s", list(ids.shape), ids.numel(), sha)
    return Path(out_dir)


def run_pin_prompt(
    out_dir: str | Path, *, model: str | Path | None, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Build the KLD prompt, check it against the pin and publish it with its SHA-256."""
    prompt = settings["prompt"]
    tokenizer = load_tokenizer(settings["tokenizer"], model)
    if prompt["source"] == "chat_sample":
        (source,) = load_dataset_conversations(settings["dataset"])[:1]
        ids = build_prompt(
            seq_len=prompt["seq_len"],
            conversations=source,
            tokenizer=tokenizer,
            sample_index=prompt["sample_index"],
        )
    else:
        ids = build_prompt(seq_len=prompt["seq_len"], token_ids_file=prompt["token_ids_file"])
    status = check_prompt_pin(ids, prompt["sha256"])
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_token_ids(tmp / "prompt.safetensors", ids, {"encoding": "int32-le-row-major"})
        summary.update(status, seq_len=int(ids.numel()), text_preview=tokenizer.decode(ids[:64].tolist()))
    log.info("prompt %d tokens, sha256 %s (%s)", ids.numel(), status["sha256"], status["pin_status"])
    return Path(out_dir)
