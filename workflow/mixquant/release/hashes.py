"""The release's four SHA-256 values, re-derived from the workflow's keyed artifacts.

Each value comes from one file of one keyed output directory and one encoding, both recorded:

* ``prompt_token_ids`` -- ``pin_prompt``'s ``prompt.safetensors``: the token IDs through
  :func:`mixquant.calibration.tokens.token_ids_sha256` (the function pin_prompt pins with).
* ``reference_logits`` -- ``reference_logits``' ``logits.safetensors``: the float32 logits through
  :func:`mixquant.kld.run.logits_sha256` (the function the stage recorded its hash with).
* ``quant_config`` -- ``export_checkpoint``'s ``hf_quant_config.json``: the file's bytes.
* ``safetensors_index`` -- ``export_checkpoint``'s ``model.safetensors.index.json``: the file's bytes.

The two tensor hashes are recomputed from the tensors, never copied from the stage's own record; a
record that disagrees with its file is an error (the artifact changed after it was written).

Each hash has a kind (:data:`HASH_KINDS`). A *content* hash is of integers or of bytes the workflow
writes (token IDs, JSON files): any machine that runs the same code on the same inputs must reproduce
it. A *numerical* hash is of floating-point results (the BF16 reference logits): its bits depend on the
numerics the process computed under -- device, CPU code path, library versions, recorded as the
fingerprint of :func:`mixquant.numerics.fingerprint` -- so it reproduces bit for bit only under an equal
fingerprint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from mixquant.calibration.tokens import load_token_ids, token_ids_sha256
from mixquant.export.files import QUANT_CONFIG_FILE
from mixquant.keys.hashing import file_sha256, require_sha256_hex
from mixquant.kld.run import LOGITS_FILE, REFERENCE_JSON, logits_sha256
from mixquant.model.layout import INDEX_FILE
from mixquant.release.published import HASH_NAMES, HASH_SOURCES

CONTENT, NUMERICAL = "content", "numerical"
HASH_KINDS = {
    "prompt_token_ids": CONTENT,
    "reference_logits": NUMERICAL,
    "quant_config": CONTENT,
    "safetensors_index": CONTENT,
}

PROMPT_FILE = "prompt.safetensors"
# Where a release ships the reference logits (a copy of reference_logits' output) and its fingerprint.
RELEASE_REFERENCE_DIR = "reference"
NUMERICS_JSON = "numerics.json"

PROMPT_ENCODING = "token_ids_sha256: token IDs as int32 little-endian, row-major, no header"
LOGITS_ENCODING = "logits_sha256: float32 little-endian IEEE-754, row-major [T-1, V], no header"
FILE_ENCODING = "the file's bytes as written"


class HashSourceError(RuntimeError):
    """An artifact a hash is computed from is missing or inconsistent (one line naming it)."""


@dataclass(frozen=True)
class ArtifactFile:
    """One file of a keyed output: results/<stage>/<key>/<file>."""

    stage: str
    key: str
    file: str
    path: Path

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "key": self.key, "file": self.file, "path": str(self.path)}

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class HashRecord:
    """One re-derived hash: its name (a ``published`` field), value, source file, encoding and kind."""

    name: str
    sha256: str
    artifact: ArtifactFile
    encoding: str

    @property
    def kind(self) -> str:
        """``content`` or ``numerical`` (:data:`HASH_KINDS`)."""
        return HASH_KINDS[self.name]

    def to_json(self) -> dict[str, Any]:
        artifact = self.artifact.to_json()
        return {
            "name": self.name,
            "kind": self.kind,
            "sha256": self.sha256,
            "artifact": artifact,
            "encoding": self.encoding,
        }


def artifact_file(directory: str | Path, file: str, stage: str) -> ArtifactFile:
    """The file `file` of the keyed directory `directory` (results/<stage>/<key>), checked to exist."""
    directory = Path(directory)
    key = require_sha256_hex(directory.name, f"{stage} directory {directory}")
    path = directory / file
    if not path.is_file():
        raise HashSourceError(f"{stage} {key}: {file} not found in {directory}")
    return ArtifactFile(stage, key, file, path)


def reference_document(directory: str | Path) -> dict[str, Any]:
    """reference_logits' own record (reference.json: the hash it wrote, the engine settings); {} if absent."""
    path = Path(directory) / REFERENCE_JSON
    if not path.is_file():
        return {}
    return json.loads(path.read_text("utf-8"))


def recorded_numerics(document: dict[str, Any]) -> dict[str, Any] | None:
    """The decisive numerics fingerprint a reference.json records (top level, else its engine info); None.

    reference_logits writes the whole fingerprint (``{"decisive": ..., "host": ...}``); only the decisive
    part says whether two runs promise the same bits.
    """
    for numerics in (document.get("numerics"), (document.get("engine") or {}).get("numerics")):
        if isinstance(numerics, dict) and isinstance(numerics.get("decisive"), dict):
            return numerics["decisive"]
    return None


_NUMERICS_LABELS = {
    "threads": "threads",
    "cpu_capability": "ATen CPU capability",
    "host_isa": "host ISA",
    "mkl_cbwr": "MKL CBWR",
}


def numerics_text(decisive: Mapping[str, Any]) -> str:
    """A decisive fingerprint in one line: device and profile, CPU code path; library versions; Python.

    Only the given fields, in a fixed order (the model card quotes it: the same fingerprint, the same text).
    """
    parts = [f"device {decisive.get('device')}", f"profile {decisive.get('profile')}"]
    for name, label in _NUMERICS_LABELS.items():
        if decisive.get(name) is not None:
            parts.append(f"{label} {decisive[name]}")
    if decisive.get("mkldnn") is not None:
        parts.append(f"oneDNN (mkldnn) {'on' if decisive['mkldnn'] else 'off'}")
    known = {"device", "profile", "mkldnn", "libraries", "python", *_NUMERICS_LABELS}
    parts += [f"{name} {decisive[name]}" for name in sorted(set(decisive) - known)]
    libraries = decisive.get("libraries") or {}
    groups = [", ".join(parts)]
    if libraries:
        groups.append(", ".join(f"{name} {version}" for name, version in sorted(libraries.items())))
    if decisive.get("python"):
        groups.append(f"Python {decisive['python']}")
    return "; ".join(groups)


def prompt_token_ids_hash(prompt_dir: str | Path) -> HashRecord:
    source = artifact_file(prompt_dir, PROMPT_FILE, "pin_prompt")
    sha = token_ids_sha256(load_token_ids(source.path))
    return HashRecord("prompt_token_ids", sha, source, PROMPT_ENCODING)


def reference_logits_hash(reference_dir: str | Path) -> HashRecord:
    source = artifact_file(reference_dir, LOGITS_FILE, "reference_logits")
    with safe_open(str(source.path), framework="pt") as handle:
        if "logits" not in handle.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
            raise HashSourceError(f"reference_logits {source.key}: {LOGITS_FILE} has no 'logits' tensor")
        sha = logits_sha256(handle.get_tensor("logits"))
    recorded = reference_document(reference_dir).get("sha256")
    if recorded is not None and recorded != sha:
        raise HashSourceError(
            f"reference_logits {source.key}: {LOGITS_FILE} hashes to {sha} but {REFERENCE_JSON} "
            f"records {recorded} (the artifact changed after it was written)"
        )
    return HashRecord("reference_logits", sha, source, LOGITS_ENCODING)


def _file_hash(name: str, checkpoint_dir: str | Path, file: str) -> HashRecord:
    source = artifact_file(checkpoint_dir, file, "export_checkpoint")
    return HashRecord(name, file_sha256(source.path), source, f"{FILE_ENCODING} ({file})")


def quant_config_hash(checkpoint_dir: str | Path) -> HashRecord:
    return _file_hash("quant_config", checkpoint_dir, QUANT_CONFIG_FILE)


def safetensors_index_hash(checkpoint_dir: str | Path) -> HashRecord:
    return _file_hash("safetensors_index", checkpoint_dir, INDEX_FILE)


# hash name -> (the function deriving it, the keyed directory it reads: prompt, reference_logits, checkpoint)
_HASH_FUNCTIONS = {
    "prompt_token_ids": prompt_token_ids_hash,
    "reference_logits": reference_logits_hash,
    "quant_config": quant_config_hash,
    "safetensors_index": safetensors_index_hash,
}
HASHERS = {name: (_HASH_FUNCTIONS[name], HASH_SOURCES[name]) for name in HASH_NAMES}


def release_hashes(
    prompt_dir: str | Path, reference_dir: str | Path, checkpoint_dir: str | Path
) -> dict[str, HashRecord]:
    """{name: HashRecord} of the four published hashes, in :data:`HASH_NAMES` order.

    `prompt_dir`, `reference_dir` and `checkpoint_dir` are keyed output directories of pin_prompt,
    reference_logits and export_checkpoint. A missing file raises :class:`HashSourceError`.
    """
    dirs = {"prompt": prompt_dir, "reference_logits": reference_dir, "checkpoint": checkpoint_dir}
    return {name: function(dirs[source]) for name, (function, source) in HASHERS.items()}
