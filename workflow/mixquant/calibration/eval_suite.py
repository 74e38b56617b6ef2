"""The evaluation suite's windows: per domain, the first T tokens of documents drawn in a seeded order.

Window rule, per domain (``kld.eval.domains``): the documents are visited in the order
``numpy.random.Generator(numpy.random.PCG64([seed, domain index])).permutation(n)``; a document tokenized to
at least T tokens yields one window, its first T tokens (a plain-text document through the tokenizer with
its special tokens, a chat document through the chat template as calibration renders it); shorter ones are
skipped; the domain stops at its ``windows``. One window per document, so a window is a unit of text: the
window-level bootstrap of the gate resamples documents. Fewer long-enough documents than asked is a
one-line error.

Output of ``sample_eval``: ``windows.safetensors`` (``input_ids`` int32 [W, T]) and ``eval.json``: per
window its domain, document index and document SHA-256; per domain its source; the disjointness check's
counts (:mod:`mixquant.calibration.disjoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixquant.calibration.dataset import load_dataset_conversations
from mixquant.calibration.disjoint import check_disjoint, document_sha256, read_jsonl
from mixquant.calibration.run import load_tokenizer
from mixquant.calibration.sample import render_chat
from mixquant.calibration.tokens import save_token_ids
from mixquant.jsonio import write_json_atomic
from mixquant.keys.manifest import publish_keyed_dir

log = logging.getLogger(__name__)

WINDOWS_FILE = "windows.safetensors"
EVAL_JSON = "eval.json"


class EvalSuiteError(ValueError):
    """The suite cannot be drawn as configured (one line naming the domain)."""


def domain_rows(domain: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The documents of one configured domain: a pinned local JSONL, or a hub split at a pinned revision."""
    if domain.get("local") is not None:
        return read_jsonl(domain["local"]["path"], domain["local"]["sha256"])
    hub = domain["hub"]
    if hub.get("revision") is None:
        raise EvalSuiteError(
            f"kld.eval domain {domain['name']!r}: refusing the unpinned hub dataset {hub['repo']}"
        )
    import datasets  # lazy: imports pyarrow; only hub domains need it

    split = datasets.load_dataset(hub["repo"], hub.get("name"), revision=hub["revision"], split=hub["split"])
    return [dict(row) for row in split]


def domain_source(domain: Mapping[str, Any]) -> str:
    if domain.get("local") is not None:
        return f"{domain['local']['path']} (sha256 {domain['local']['sha256'][:12]})"
    hub = domain["hub"]
    return f"{hub['repo']}@{hub.get('revision')} {hub.get('name') or ''}/{hub['split']}".replace(" /", "/")


def _tokens(tokenizer: Any, row: Mapping[str, Any], domain: Mapping[str, Any]) -> list[int]:
    if domain.get("text_field"):
        return list(tokenizer(row[domain["text_field"]], add_special_tokens=True)["input_ids"])
    return render_chat(tokenizer, row[domain["messages_field"]])


def draw_domain(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    domain: Mapping[str, Any],
    index: int,
    *,
    window_tokens: int,
    seed: int,
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The windows of one domain (see the module docstring) and, per window, its document."""
    order = np.random.Generator(np.random.PCG64([int(seed), int(index)])).permutation(len(rows))
    windows: list[list[int]] = []
    documents: list[dict[str, Any]] = []
    for doc in order.tolist():
        ids = _tokens(tokenizer, rows[doc], domain)
        if len(ids) < window_tokens:
            continue
        windows.append(ids[:window_tokens])
        documents.append(
            {
                "domain": domain["name"],
                "document": int(doc),
                "document_sha256": document_sha256(
                    rows[doc], domain.get("text_field"), domain.get("messages_field")
                ),
            }
        )
        if len(windows) == domain["windows"]:
            return windows, documents
    raise EvalSuiteError(
        f"kld.eval domain {domain['name']!r}: only {len(windows)} of its {len(rows)} documents have "
        f"{window_tokens} tokens, {domain['windows']} windows asked: lower `windows` or `window_tokens`"
    )


def run_sample_eval(
    out_dir: str | Path, *, model: str | Path | None, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Draw the suite's windows, check them against the calibration dataset by content, publish them."""
    suite = settings["eval"]
    tokenizer = load_tokenizer(settings["tokenizer"], model)
    rows = {d["name"]: domain_rows(d) for d in suite["domains"]}
    calibration_rows = [
        {settings["dataset"]["messages_field"]: conversation}
        for source in load_dataset_conversations(settings["dataset"])
        for conversation in source
    ]
    disjoint = check_disjoint(
        {
            d["name"]: (rows[d["name"]], d.get("text_field"), d.get("messages_field"))
            for d in suite["domains"]
        },
        (calibration_rows, settings["dataset"]["messages_field"]),
        where={d["name"]: domain_source(d) for d in suite["domains"]},
    )
    windows: list[list[int]] = []
    documents: list[dict[str, Any]] = []
    domains = []
    for index, domain in enumerate(suite["domains"]):
        ids, docs = draw_domain(
            tokenizer,
            rows[domain["name"]],
            domain,
            index,
            window_tokens=suite["window_tokens"],
            seed=suite["seed"],
        )
        windows += ids
        documents += docs
        domains.append(
            {
                "name": domain["name"],
                "source": domain_source(domain),
                "documents": len(rows[domain["name"]]),
                "windows": len(ids),
                "tokens": len(ids) * suite["window_tokens"],
            }
        )
    tensor = torch.tensor(windows, dtype=torch.int32)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        sha = save_token_ids(tmp / WINDOWS_FILE, tensor, {"encoding": "int32-le-row-major"})
        document = {
            "window_tokens": suite["window_tokens"],
            "token_ids_sha256": sha,
            "domains": domains,
            "windows": documents,
            "disjoint_from_calibration": disjoint,
        }
        write_json_atomic(tmp / EVAL_JSON, document)
        summary.update(
            windows=len(windows), tokens=int(tensor.numel()), sha256=sha, domains=[d["name"] for d in domains]
        )
    log.info(
        "eval suite: %d windows x %d tokens over %s",
        len(windows),
        suite["window_tokens"],
        [d["name"] for d in domains],
    )
    return Path(out_dir)
