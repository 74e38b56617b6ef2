"""Keyed output directories: atomic publication and manifest.json.

Every stage writes into a fresh temporary directory beside its keyed directory and renames it
into place only after manifest.json (the key's full preimage plus SHA-256 and size of every file)
is written. A keyed directory is therefore complete or absent: a crash, a kill or an exception
leaves at most a ``.tmp-*`` directory, never a half-written keyed one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mixquant import faults
from mixquant.checkpoint.atomic import temporary_dir_beside
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.environments import installed_versions
from mixquant.keys.hashing import file_sha256, require_sha256_hex
from mixquant.keys.stages import RECORDED_PACKAGES
from mixquant.numerics import fingerprint, requested

MANIFEST = "manifest.json"
# Snakemake touches this file inside directory outputs to carry their mtime; it is not content.
SNAKEMAKE_TIMESTAMP = ".snakemake_timestamp"
_NOT_CONTENT = {MANIFEST, SNAKEMAKE_TIMESTAMP}

log = logging.getLogger(__name__)


class ManifestError(RuntimeError):
    """A keyed directory whose files do not match its manifest."""


def file_inventory(directory: Path) -> dict[str, dict[str, Any]]:
    """{relative posix path: {"sha256", "size"}} of every regular file under `directory`."""
    inventory = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(directory).as_posix()
        if relative in _NOT_CONTENT:
            continue
        inventory[relative] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    return inventory


# Summary entries that describe one run rather than the content (timings, rates): logged, never written,
# so that a keyed directory's bytes, manifest included, are the same on every machine and every run.
RUN_FACTS = frozenset(
    {
        "seconds",
        "engine_seconds",
        "stats_seconds",
        "timings_s",
        "write_rate_bytes_per_s",
        "created_utc",
        "layer_loads",  # layers a score job read: fewer when it resumed from saved states (the kill campaign)
    }
)


def environment_record() -> dict[str, Any]:
    """The software and numerics that produced an output: the same on every host of one kind.

    Host facts (CPU model, kernel, time) are not recorded here: they would make two machines' bytes
    differ; the numerics fingerprint's decisive part says what decides the bits.
    """
    record: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": installed_versions(RECORDED_PACKAGES),
    }
    profile, threads = requested()
    if "torch" in sys.modules:  # this process computed: its effective numerics
        record["numerics"] = fingerprint()["decisive"]
    else:
        record["numerics"] = {"profile": profile, "threads": threads, "torch_imported": False}
    return record


def split_run_facts(summary: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(content facts, run facts) of a stage summary (see RUN_FACTS), at any depth: a nested run fact
    is returned under its dotted path ("export.seconds")."""
    content: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    for name, value in (summary or {}).items():
        if name in RUN_FACTS:
            facts[name] = value
        elif isinstance(value, dict):
            content[name], inner = split_run_facts(value)
            facts.update({f"{name}.{where}": fact for where, fact in inner.items()})
        else:
            content[name] = value
    return content, dict(sorted(facts.items()))


def write_manifest(directory: Path, preimage: dict[str, Any], extra: dict[str, Any] | None = None) -> dict:
    key = canonical_sha256(preimage)
    content, facts = split_run_facts(extra)
    if facts:
        log.info("%s run facts: %s", directory.name, json.dumps(facts, sort_keys=True, default=str))
    manifest = {
        "key": key,
        "preimage": preimage,
        "files": file_inventory(directory),
        "environment": environment_record(),
    }
    if content:
        manifest["summary"] = content
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", "utf-8")
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (not a mixquant output directory)") from None
    except json.JSONDecodeError as error:
        raise ManifestError(f"{path}: unreadable manifest ({error})") from None


def verify_manifest(directory: str | Path) -> list[str]:
    """Problems found comparing a keyed directory with its manifest; empty when it matches."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems = []
    if canonical_sha256(manifest["preimage"]) != manifest["key"]:
        problems.append("manifest key is not the SHA-256 of its preimage")
    if directory.name != manifest["key"]:
        problems.append(f"directory name {directory.name} differs from manifest key {manifest['key']}")
    actual = file_inventory(directory)
    for name in sorted(set(manifest["files"]) | set(actual)):
        want, got = manifest["files"].get(name), actual.get(name)
        if want is None:
            problems.append(f"{name}: present but not in the manifest")
        elif got is None:
            problems.append(f"{name}: listed in the manifest but missing")
        elif want != got:
            problems.append(f"{name}: sha256/size {got['sha256'][:12]}/{got['size']} differ from manifest")
    return problems


@contextmanager
def publish_keyed_dir(
    final_dir: str | Path, preimage: dict[str, Any], summary: dict[str, Any] | None = None
) -> Iterator[Path]:
    """Yield an empty temporary directory; on success write manifest.json and rename it to `final_dir`.

    `final_dir`'s name must be the key, i.e. the SHA-256 of `preimage` (checked, so a caller
    cannot publish under a key that does not describe the content). An existing empty directory at
    `final_dir` (Snakemake may create one) is replaced; an existing non-empty one is an error: keyed
    directories are immutable. On any exception the temporary directory is removed. `summary`
    (a dict the caller may fill inside the block) goes into the manifest, not into a file: it may
    hold run-dependent facts such as timings, which must not change the directory's content.
    """
    final_dir = Path(final_dir)
    key = require_sha256_hex(final_dir.name, f"output directory {final_dir}")
    if canonical_sha256(preimage) != key:
        raise ValueError(f"{final_dir}: directory name is not the key of the given preimage")
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(final_dir.parent, key)
    temporary = temporary_dir_beside(final_dir, tag=key[:16])
    stage = final_dir.parent.name
    try:
        yield temporary
        faults.point("files-written", stage)
        write_manifest(temporary, preimage, summary)
        faults.point("manifest-written", stage)
        if final_dir.exists():
            leftovers = [p.name for p in final_dir.iterdir() if p.name != SNAKEMAKE_TIMESTAMP]
            if leftovers:
                raise FileExistsError(f"{final_dir}: keyed directory already exists and is not empty")
            shutil.rmtree(final_dir)
        os.rename(temporary, final_dir)
        log.info("published %s", final_dir)
        faults.point("published", stage)
    except BaseException as error:
        written = _tree_bytes(temporary)
        shutil.rmtree(temporary, ignore_errors=True)
        if faults.disk_full(error):  # one line naming the keyed directory (rulelog adds what the job needs)
            raise OSError(
                errno.ENOSPC,
                f"No space left on device (the stage had written {written / 1e6:.1f} MB; nothing published)",
                str(final_dir),
            ) from error
        raise


def _remove_stale_temporaries(stage_dir: Path, key: str) -> None:
    """Remove what a killed attempt at the same key left (``.tmp-<key>-<pid>-*`` of a process that is
    gone): one run computes a key at a time (mixquant.store), so nothing else is writing it."""
    for leftover in stage_dir.glob(f".tmp-{key[:16]}-*"):
        try:
            pid = int(leftover.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(leftover, ignore_errors=True)


def _tree_bytes(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
