"""The graph's root inputs and the stages that read them: the source model (fetched, dequantized or the
toy built), the calibration tokens and the pinned prompt.

Root inputs are identified by what pins them: a hub revision, a file's pinned SHA-256, or the content
hashes of a local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixquant.checkpoint.headers import check_links_inside
from mixquant.config import MixquantConfig
from mixquant.facts import source_fp8_block
from mixquant.graph.artifact import GraphBuilder
from mixquant.keys.hashing import file_sha256
from mixquant.model.fetch import identity_sha256, local_dir_identity


def dataset_identity(cfg: MixquantConfig) -> tuple[dict, dict]:
    """(key slice, settings) of the chat dataset: pinned hash or hub revisions, never a path."""
    dataset = cfg.dataset
    if dataset.source == "local":
        assert dataset.local is not None
        identity = {"source": "local", "sha256": dataset.local.sha256}
        settings = {"source": "local", "path": dataset.local.path, "sha256": dataset.local.sha256}
    else:
        members = [member.model_dump(mode="json") for member in dataset.hub or []]
        identity = {"source": "hub", "members": members}
        settings = {"source": "hub", "members": members}
    identity["messages_field"] = settings["messages_field"] = dataset.messages_field
    return identity, settings


def dataset_settings(cfg: MixquantConfig) -> dict:
    """What the stages that read the chat dataset need to load it (paths included)."""
    return dataset_identity(cfg)[1]


def tokenizer_identity(cfg: MixquantConfig) -> tuple[dict, dict]:
    """(slice, settings) naming the tokenizer; 'model' tokenizers are covered by the model key."""
    if cfg.tokenizer.source == "hub":
        assert cfg.tokenizer.hub is not None
        pin = cfg.tokenizer.hub.model_dump(mode="json")
        return {"source": "hub", **pin}, {"source": "hub", **pin}
    return {"source": "model"}, {"source": "model"}


def add_model(graph: GraphBuilder) -> None:
    model = graph.cfg.model
    if model.source == "toy":
        identity, dataset_settings = dataset_identity(graph.cfg)
        toy = model.toy.model_dump(mode="json")
        graph.add(
            "model",
            "build_toy_model",
            {"toy": toy, "corpus": identity},
            {"toy": toy, "corpus": dataset_settings},
            {},
        )
    elif model.source == "hub":
        assert model.hub is not None
        add_fetch(graph, "model", model.hub.model_dump(mode="json"), None, model.trust_remote_code)
    else:
        assert model.local is not None
        add_fetch(graph, "model", None, model.local.path, False, pin=model.local.sha256)
    if model.source != "toy" and (block := source_fp8_block(graph.cfg)) is not None:
        # the checkpoint the publisher ships is block-FP8: the BF16 source is its dequantization
        graph.artifacts["source_model"] = graph.artifacts.pop("model")
        settings = {"block_size": list(block)}
        graph.add("model", "dequantize_source", settings, settings, {"source": "source_model"})


def add_fetch(
    graph: GraphBuilder,
    name: str,
    hub: dict | None,
    local: str | None,
    remote_code: bool,
    pin: str | None = None,
) -> None:
    """A checkpoint pinned by hub revision or by the content of a local directory (fetch_model)."""
    if hub is not None:
        pin = {"source": "hub", **hub, "trust_remote_code": remote_code}
        graph.add(name, "fetch_model", pin, pin, {})
        return
    check_links_inside(local)  # no link out of the model directory is hashed, or read by a stage
    files = local_dir_identity(local, cache_dir=graph.hash_cache_dir)
    if pin is not None and identity_sha256(files) != pin:
        raise ValueError(
            f"model.local.sha256: {local} has content {identity_sha256(files)[:12]}..., pinned "
            f"{pin[:12]}... (a file changed, or the pin is stale: `mixquant pin-model {local}` prints it)"
        )
    graph.add(
        name, "fetch_model", {"source": "local", "files": files}, {"source": "local", "path": local}, {}
    )


def add_calibration(graph: GraphBuilder) -> None:
    """sample_calibration: the calibration token sequences, from the chat dataset and the tokenizer."""
    cfg = graph.cfg
    tokenizer_slice, tokenizer_settings = tokenizer_identity(cfg)
    dataset_slice, dataset_settings = dataset_identity(cfg)
    calibration = cfg.calibration.model_dump(mode="json")
    graph.add(
        "calibration",
        "sample_calibration",
        {"calibration": calibration, "dataset": dataset_slice, "tokenizer": tokenizer_slice},
        {"calibration": calibration, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )


def add_holdout(graph: GraphBuilder) -> None:
    """sample_calibration's held-out draw: ``placement.search.refine.holdout_samples`` sequences continuing
    the calibration's own draw (same dataset, tokenizer, seed and length) after its ``num_samples``, so no
    conversation of the scored sequences is in it (``mixquant.calibration.run.run_sample_calibration``)."""
    cfg = graph.cfg
    tokenizer_slice, tokenizer_settings = tokenizer_identity(cfg)
    dataset_slice, dataset_settings = dataset_identity(cfg)
    calibration = {
        **cfg.calibration.model_dump(mode="json"),
        "num_samples": cfg.placement.search.refine.holdout_samples,
        "held_out_after": cfg.calibration.num_samples,
    }
    graph.add(
        "holdout",
        "sample_calibration",
        {"calibration": calibration, "dataset": dataset_slice, "tokenizer": tokenizer_slice},
        {"calibration": calibration, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )


def add_prompt(graph: GraphBuilder) -> None:
    """pin_prompt: the KLD prompt's token IDs (a chat sample, or a token-ID file)."""
    cfg = graph.cfg
    tokenizer_slice, tokenizer_settings = tokenizer_identity(cfg)
    dataset_slice, dataset_settings = dataset_identity(cfg)
    prompt = cfg.prompt.model_dump(mode="json")
    prompt_slice: dict[str, Any] = {
        "seq_len": prompt["seq_len"],
        "source": prompt["source"],
        "sha256": prompt["sha256"],
        "tokenizer": tokenizer_slice,
    }
    if prompt["source"] == "chat_sample":
        prompt_slice.update(sample_index=prompt["sample_index"], dataset=dataset_slice)
    else:
        # A token-ID file is identified by the pin when there is one (the run checks the file
        # against it), else by its content at planning time.
        token_file = Path(prompt["token_ids_file"])
        content = file_sha256(token_file) if token_file.is_file() else None
        prompt_slice["token_ids_file_sha256"] = None if prompt["sha256"] else content
    graph.add(
        "prompt",
        "pin_prompt",
        prompt_slice,
        {"prompt": prompt, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )


def add_eval(graph: GraphBuilder) -> None:
    """sample_eval: the evaluation suite's windows (``kld.eval``), checked disjoint from the calibration data.

    Each domain enters the key by what pins it (a file's SHA-256, a hub revision), with its field, its window
    count, the window length and the seed; the chat dataset by its identity (the disjointness check reads it).
    """
    cfg = graph.cfg
    suite = cfg.kld.eval
    assert suite is not None
    tokenizer_slice, tokenizer_settings = tokenizer_identity(cfg)
    dataset_slice, dataset_settings = dataset_identity(cfg)
    domains = [domain.model_dump(mode="json") for domain in suite.domains]
    identities = [
        {**domain, "local": {"sha256": domain["local"]["sha256"]} if domain["local"] else None}
        for domain in domains
    ]
    draw = {"window_tokens": suite.window_tokens, "seed": suite.seed}
    graph.add(
        "eval",
        "sample_eval",
        {"eval": {**draw, "domains": identities}, "dataset": dataset_slice, "tokenizer": tokenizer_slice},
        {"eval": {**draw, "domains": domains}, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )
