"""Where a real model's files come from: a local Hugging Face directory or a pinned Hub revision.

A model artifact directory is either a checkpoint itself (the toy build writes config.json straight into
it) or holds `model_source.json` describing where the checkpoint lives:

    {"kind": "local", "path": "data/toy-laguna", "files": {"config.json": {"sha256": ..., "size": ...}, ...}}
    {"kind": "hub", "repo": "org/name", "revision": "<40 hex>", "path": "model", "files": {...}}

A local path is recorded as the workdir names it (relative to the working directory, absolute only where
the directory lies outside it), a hub path relative to the artifact directory: the record's bytes do not
depend on where the workdir is, so two clones write the same directory.

`local_dir_identity` hashes every regular file of a directory for planning-time content keys; with a
cache directory it remembers digests keyed by (absolute path, size, mtime_ns) so multi-GB shards are not
rehashed on every plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from mixquant.checkpoint.atomic import atomic_open
from mixquant.checkpoint.headers import CONFIG_FILE
from mixquant.keys.hashing import bytes_sha256, file_sha256, require_sha256_hex

SOURCE_FILE = "model_source.json"
HASH_CACHE_FILE = "file_sha256_cache.json"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_SKIP_DIRS = frozenset({".git", ".cache"})  # VCS data; huggingface_hub's local_dir bookkeeping


def _regular_files(src_dir: Path) -> list[Path]:
    """All regular files under src_dir, sorted by relative path; .git/.cache directories are skipped.

    Symlinked directories are not followed; symlinked files (the Hub cache layout) are hashed through
    the link.
    """
    files = []
    for root, dirs, names in os.walk(src_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in names:
            path = Path(root) / name
            if path.is_file():
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(src_dir).as_posix())


def _load_cache(cache_path: Path | None) -> dict[str, dict[str, Any]]:
    if cache_path is None or not cache_path.is_file():
        return {}
    try:
        data = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(cache_path: Path, cache: dict[str, dict[str, Any]]) -> None:
    with atomic_open(cache_path, "w", encoding="utf-8") as handle:
        json.dump(cache, handle, indent=1, sort_keys=True)


def local_dir_identity(
    src_dir: str | Path, *, cache_dir: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """{relative posix path: {"sha256", "size"}} for every regular file under src_dir, sorted by path.

    `.git` and `.cache` directories are skipped. With `cache_dir`, digests are cached in
    cache_dir/file_sha256_cache.json keyed by "abs path|size|mtime_ns" (a changed file gets a new key).
    """
    src_dir = Path(src_dir).resolve()
    if not src_dir.is_dir():
        raise FileNotFoundError(f"model directory {src_dir} does not exist")
    cache_path = Path(cache_dir) / HASH_CACHE_FILE if cache_dir is not None else None
    cache = _load_cache(cache_path)
    dirty = False
    identity: dict[str, dict[str, Any]] = {}
    for path in _regular_files(src_dir):
        stat = path.stat()
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
        entry = cache.get(key)
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not (isinstance(digest, str) and len(digest) == 64):
            digest = require_sha256_hex(file_sha256(path), str(path))
            cache[key] = {"sha256": digest}
            dirty = True
        identity[path.relative_to(src_dir).as_posix()] = {"sha256": digest, "size": stat.st_size}
    if cache_path is not None and dirty:
        _save_cache(cache_path, cache)
    return identity


def identity_sha256(identity: dict[str, dict[str, Any]]) -> str:
    """One digest for a directory identity (canonical JSON of the sorted mapping)."""
    return bytes_sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _write_source(out_dir: Path, source: dict[str, Any]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return source


def fetch_local_model(
    src_dir: str | Path, out_dir: str | Path, *, cache_dir: str | Path | None = None
) -> dict:
    """Record a local HF model directory (every file's size and SHA-256) in out_dir/model_source.json.

    Nothing is copied: later stages read the files in place and can re-check them against the record.
    """
    src = Path(src_dir).resolve()
    if not (src / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{src} has no {CONFIG_FILE}; not a Hugging Face model directory")
    files = local_dir_identity(src, cache_dir=cache_dir)
    return _write_source(Path(out_dir), {"kind": "local", "path": workdir_path(src_dir), "files": files})


def workdir_path(path: str | Path) -> str:
    """``path`` as a record names it: relative to the working directory where it lies inside it (as
    given, normalised, symlinks kept), else absolute."""
    given = Path(path)
    if not given.is_absolute():
        return Path(os.path.normpath(given)).as_posix()
    here = Path(os.path.abspath("."))
    normal = Path(os.path.normpath(given))
    return normal.relative_to(here).as_posix() if normal.is_relative_to(here) else normal.as_posix()


def require_pinned_revision(revision: object) -> str:
    """A Hub revision must be a full 40-hex commit id: branches and tags move, so they cannot key a cache."""
    if not (isinstance(revision, str) and _COMMIT_RE.match(revision)):
        raise ValueError(f"hub revision must be a 40-hex commit id (branches/tags move), got {revision!r}")
    return revision


def fetch_hub_model(repo: str, revision: str, out_dir: str | Path) -> dict:
    """Download `repo` at the pinned commit `revision` into out_dir/model and record it.

    Refuses (ValueError) any revision that is not a 40-hex commit id before touching the network.
    """
    revision = require_pinned_revision(revision)
    from huggingface_hub import snapshot_download  # lazy: only real-model runs need the Hub client
    from huggingface_hub.errors import LocalEntryNotFoundError

    out_dir = Path(out_dir)
    local = out_dir / "model"
    try:
        snapshot_download(repo, revision=revision, local_dir=str(local))
    except LocalEntryNotFoundError as error:  # no Hub (offline, no network) and nothing in local_dir
        # a download into local_dir never looks in the Hugging Face cache: take the revision from there
        try:
            cached = snapshot_download(repo, revision=revision, local_files_only=True)
        except OSError:
            raise OSError(hub_unreachable_line(repo, revision, error)) from error
        shutil.copytree(cached, local, dirs_exist_ok=True)  # the cache's symlinks copied as files
    files = local_dir_identity(local)
    # relative to the artifact directory: out_dir is renamed into place after this returns
    source = {"kind": "hub", "repo": repo, "revision": revision, "path": local.name, "files": files}
    return _write_source(out_dir, source)


def hub_unreachable_line(repo: str, revision: str, error: BaseException) -> str:
    """One line for a Hub download that found neither the Hub nor the revision in the local cache: the repo,
    the revision, why (the client's first line), and both ways out."""
    from huggingface_hub import constants

    reason = (str(error).splitlines() or [type(error).__name__])[0].removeprefix("Got: ")
    return (
        f"model.hub: cannot download {repo} at revision {revision} from {constants.ENDPOINT} ({reason}): "
        "run where the Hub is reachable, or offline with HF_HUB_OFFLINE=1 and that revision in the "
        f"Hugging Face cache at {constants.HF_HUB_CACHE} (`hf download {repo} --revision {revision}` "
        "on a machine with network, with the same HF_HOME)"
    )


def resolve_model_dir(artifact_dir: str | Path) -> Path:
    """The directory holding the checkpoint's config.json for a model artifact directory.

    The artifact itself when it has config.json (the toy build), else the `path` in its model_source.json.
    """
    artifact_dir = Path(artifact_dir)
    if (artifact_dir / CONFIG_FILE).is_file():
        return artifact_dir
    source_path = artifact_dir / SOURCE_FILE
    if not source_path.is_file():
        raise FileNotFoundError(f"{artifact_dir} has neither {CONFIG_FILE} nor {SOURCE_FILE}")
    source = json.loads(source_path.read_text(encoding="utf-8"))
    model_dir = Path(source["path"])
    if not model_dir.is_absolute():
        # a local directory as the workdir names it; a hub download inside the artifact directory
        model_dir = model_dir if source.get("kind") == "local" else artifact_dir / model_dir
    if not (model_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{SOURCE_FILE} points at {model_dir}, which has no {CONFIG_FILE}")
    return model_dir
