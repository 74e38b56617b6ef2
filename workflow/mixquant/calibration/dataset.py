"""Load a pinned chat dataset (local JSONL or Hugging Face Hub) through the `datasets` library.

Both sources go through ``datasets.load_dataset`` so that a local file and a Hub dataset are parsed by the
same code:

* local: ``load_dataset("json", data_files=path, split="train")`` -- if `sha256` is given the file's bytes
  must hash to it (:class:`DatasetPinError` otherwise);
* Hub: ``load_dataset(hub_repo, name, revision=revision, split=split)`` -- `revision` must be a full 40-hex
  commit SHA; branch or tag names are refused because they move.

Cache: when `cache_dir` is None a fresh temporary directory (removed at interpreter exit) is used, so no
global Hugging Face cache (``~/.cache/huggingface``) is needed or written by the Arrow conversion. Pass a
`cache_dir` to reuse the Arrow files across runs.

Each row's `messages_field` must be a list of ``{"role": str, "content": str}`` dicts (post-training chat
format); the first rows are checked on load.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixquant.keys.hashing import file_sha256, require_sha256_hex

if TYPE_CHECKING:
    import datasets

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
VALIDATE_ROWS = 16


class DatasetPinError(ValueError):
    """The dataset is not the pinned one (file hash mismatch) or is not pinned at all (Hub revision)."""


def _temporary_cache_dir() -> str:
    path = tempfile.mkdtemp(prefix="mixquant-datasets-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def load_chat_dataset(
    *,
    path: str | Path | None = None,
    sha256: str | None = None,
    hub_repo: str | None = None,
    revision: str | None = None,
    name: str | None = None,
    split: str = "train",
    messages_field: str = "messages",
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Load a chat dataset from exactly one of a local JSONL `path` or a Hub `hub_repo` pinned to `revision`.

    `sha256` pins a local file's bytes. `name` (config) and `split` apply to the Hub only; a local JSONL file
    is always the single ``train`` split. With `cache_dir` None a temporary directory is used (see the module
    docstring). Raises :class:`DatasetPinError` for a hash mismatch or an unpinned revision and ``ValueError``
    for malformed rows.
    """
    if (path is None) == (hub_repo is None):
        raise ValueError(
            "load_chat_dataset: give exactly one of path= (local JSONL) or hub_repo= (Hub dataset)"
        )
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: chat dataset file not found")
        if sha256 is not None:
            pin = require_sha256_hex(sha256, f"sha256 pin for {path}")
            got = file_sha256(path)
            if got != pin:
                raise DatasetPinError(f"{path}: SHA-256 {got} does not match the pinned {pin}")
        import datasets

        cache = str(cache_dir) if cache_dir is not None else _temporary_cache_dir()
        dataset = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache)
        source = str(path)
    else:
        if sha256 is not None:
            raise ValueError("load_chat_dataset: sha256= pins a local file; pin a Hub dataset with revision=")
        if not isinstance(revision, str) or not COMMIT_SHA.match(revision):
            raise DatasetPinError(
                f"refusing unpinned revision {revision!r} for Hub dataset {hub_repo}: "
                "give the full 40-hex commit SHA, not a branch or tag"
            )
        import datasets

        cache = str(cache_dir) if cache_dir is not None else _temporary_cache_dir()
        dataset = datasets.load_dataset(hub_repo, name, revision=revision, split=split, cache_dir=cache)
        source = f"{hub_repo}@{revision}"
    validate_chat_rows(dataset, messages_field, source=source)
    return dataset


def validate_chat_rows(dataset: Any, messages_field: str = "messages", *, source: str = "dataset") -> None:
    """Check that `messages_field` exists and the first rows are lists of {role: str, content: str} dicts."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if messages_field not in columns:
        raise ValueError(f"{source}: no '{messages_field}' column (columns: {columns})")
    if len(dataset) == 0:
        raise ValueError(f"{source}: the dataset has no rows")
    head = dataset.select(range(min(VALIDATE_ROWS, len(dataset))))[messages_field]
    for row, messages in enumerate(head):
        _check_messages(messages, f"{source}: row {row} field '{messages_field}'")


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {messages!r:.80}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {i} is {type(message).__name__}, expected a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"{where}: message {i} has no string '{key}' (got {message.get(key)!r:.60})")


def clean_messages(messages: Sequence[dict]) -> list[dict]:
    """Drop keys whose value is None: Arrow fills fields missing from some rows with None."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def conversations(dataset: Any, messages_field: str = "messages") -> list[list[dict]]:
    """All conversations of `dataset` as plain lists of message dicts (materialises the whole column)."""
    return [clean_messages(m) for m in dataset[messages_field]]


class ConversationView(Sequence):
    """A lazy, read-only sequence of the conversations of a (possibly huge) Dataset, fetched row by row."""

    def __init__(self, dataset: Any, messages_field: str = "messages") -> None:
        self._dataset = dataset
        self._field = messages_field

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return clean_messages(self._dataset[int(index)][self._field])


def load_dataset_conversations(dataset_settings: dict[str, Any], limit_per_member: int | None = None):
    """Conversations of the configured dataset: one list, or one lazy view per hub member split.

    A hub split stays in its memory-mapped Arrow files and rows are decoded as they are visited
    (:class:`ConversationView`), so a job holds the conversations it samples, not every split's column;
    the local JSONL (the toy's corpus, a few MB) is materialised."""
    field = dataset_settings["messages_field"]
    if dataset_settings["source"] == "local":
        dataset = load_chat_dataset(
            path=dataset_settings["path"], sha256=dataset_settings["sha256"], messages_field=field
        )
        return [conversations(dataset, field)]
    members = []
    for member in dataset_settings["members"]:
        for split in member["splits"]:
            dataset = load_chat_dataset(
                hub_repo=member["repo"],
                revision=member["revision"],
                name=member["name"],
                split=split,
                messages_field=field,
            )
            members.append(ConversationView(dataset, field))
    return members
