"""Stage entry points for fetch_model, dequantize_source and build_toy_model (rule scripts and the CLI
call these): the BF16 source model every later stage reads."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mixquant.calibration.dataset import load_dataset_conversations
from mixquant.checkpoint.atomic import atomic_directory
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import (
    fetch_hub_model,
    fetch_local_model,
    identity_sha256,
    local_dir_identity,
    resolve_model_dir,
)

log = logging.getLogger(__name__)


def run_build_toy_model(out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any]) -> Path:
    """Train the embedded toy Laguna on the pinned corpus and publish it in the upstream layout."""
    (corpus,) = load_dataset_conversations(settings["corpus"])
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        summary.update(_build(tmp, settings["toy"], corpus))
    return Path(out_dir)


def _build(out_dir: Path, toy: dict[str, Any], conversations: list) -> dict[str, Any]:
    """build_toy_model with the `model.toy` settings (training, then the outlier layers)."""
    from mixquant.model.toy_build import build_toy_model  # lazy: imports torch (the CLI imports this module)

    return build_toy_model(
        out_dir,
        conversations=conversations,
        arch=toy["arch"],
        tokenizer_spec=toy["tokenizer"],
        training=toy["training"],
        seed=toy["seed"],
        outliers=toy["outliers"],
        threads=toy["threads"],
        num_shards=toy["num_shards"],
    )


def build_embedded_toy(out_dir: str | Path, *, toy: dict[str, Any], corpus: dict[str, Any]) -> str:
    """Regenerate the shipped toy checkpoint (data/toy-laguna) into a new directory; its content pin.

    The same training and outlier code as build_toy_model, written beside `out_dir` and renamed into place
    (a directory that exists is refused, never overwritten). CPU training is bit-exact only on the same
    machine and thread count: another host trains another toy, which is why the
    default config ships the checkpoint instead of training it.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists: give a new directory (the shipped toy is never overwritten)")
    (conversations,) = load_dataset_conversations(corpus)
    with atomic_directory(out_dir) as tmp:
        report = _build(tmp, toy, conversations)
    log.info(
        "toy built in %.0f s, held-out loss %.4f", report["timings_s"]["total"], report["loss"]["heldout"]
    )
    return identity_sha256(local_dir_identity(out_dir))


def run_fetch_model(out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any]) -> Path:
    """Pin a real model: download a hub revision, or record a local directory by content."""
    with publish_keyed_dir(out_dir, preimage) as tmp:
        if settings["source"] == "hub":
            fetch_hub_model(settings["repo"], settings["revision"], tmp)
        else:
            record = fetch_local_model(settings["path"], tmp)
            expected = preimage["config"]["files"]
            if record["files"] != expected:
                raise ValueError(f"{settings['path']}: content changed since planning; rerun to re-plan")
    return Path(out_dir)


def run_dequantize_source(
    out_dir: str | Path, *, source: str | Path, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """The BF16 source of a block-FP8 checkpoint: the publisher's dequantization, a shard at a time."""
    from mixquant.checkpoint.fp8_source import dequantize_checkpoint  # lazy: imports torch

    src = resolve_model_dir(source)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:  # the keyed directory is the checkpoint
        result = dequantize_checkpoint(src, tmp, progress=True)
        summary.update({k: v for k, v in result.items() if k in ("tensors_dequantized", "block_size")})
    return Path(out_dir)
