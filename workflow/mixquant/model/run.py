"""Stage entry points for build_toy_model and fetch_model (rule scripts and the CLI call these)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mixquant.keys.manifest import publish_keyed_dir

log = logging.getLogger(__name__)


def run_build_toy_model(out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any]) -> Path:
    """Train the embedded toy Laguna on the pinned corpus and publish it in the upstream layout."""
    from mixquant.calibration.run import load_dataset_conversations
    from mixquant.model.toy import build_toy_model

    toy = settings["toy"]
    (corpus,) = load_dataset_conversations(settings["corpus"])
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        report = build_toy_model(
            tmp,
            conversations=corpus,
            arch=toy["arch"],
            tokenizer_spec=toy["tokenizer"],
            training=toy["training"],
            seed=toy["seed"],
            threads=toy["threads"],
            num_shards=toy["num_shards"],
        )
        summary.update(report)
    return Path(out_dir)


def run_fetch_model(out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any]) -> Path:
    """Pin a real model: download a hub revision, or record a local directory by content."""
    from mixquant.model.fetch import fetch_hub_model, fetch_local_model

    with publish_keyed_dir(out_dir, preimage) as tmp:
        if settings["source"] == "hub":
            fetch_hub_model(settings["repo"], settings["revision"], tmp)
        else:
            record = fetch_local_model(settings["path"], tmp)
            expected = preimage["config"]["files"]
            if record["files"] != expected:
                raise ValueError(f"{settings['path']}: content changed since planning; rerun to re-plan")
    return Path(out_dir)
