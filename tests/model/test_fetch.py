"""Model sources: local directory identity/records, pinned Hub revisions, artifact resolution."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from mixquant.model import fetch


@pytest.fixture
def model_dir(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "config.json").write_text('{"model_type": "laguna"}')
    (src / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * 1000)
    (src / "sub" / "b.txt").write_text("b")
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main")
    return src


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_local_dir_identity(model_dir):
    identity = fetch.local_dir_identity(model_dir)
    assert list(identity) == ["config.json", "model-00001-of-00001.safetensors", "sub/b.txt"]
    assert identity["sub/b.txt"] == {"sha256": sha(b"b"), "size": 1}
    assert identity["model-00001-of-00001.safetensors"] == {"sha256": sha(b"\x00" * 1000), "size": 1000}


def test_identity_cache_avoids_rehash_and_sees_changes(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = fetch.local_dir_identity(model_dir, cache_dir=cache)
    assert (cache / fetch.HASH_CACHE_FILE).is_file()
    calls = []
    real = fetch.file_sha256
    monkeypatch.setattr(fetch, "file_sha256", lambda p: calls.append(p) or real(p))
    assert fetch.local_dir_identity(model_dir, cache_dir=cache) == first
    assert calls == []
    # a change in size/mtime gives a new cache key: only that file is rehashed
    target = model_dir / "sub" / "b.txt"
    target.write_text("bb")
    os.utime(target, ns=(1, 1))
    changed = fetch.local_dir_identity(model_dir, cache_dir=cache)
    assert [p.name for p in calls] == ["b.txt"]
    assert changed["sub/b.txt"] == {"sha256": sha(b"bb"), "size": 2}
    assert fetch.identity_sha256(changed) != fetch.identity_sha256(first)


def test_corrupt_cache_is_ignored(model_dir, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / fetch.HASH_CACHE_FILE).write_text("not json")
    assert fetch.local_dir_identity(model_dir, cache_dir=cache) == fetch.local_dir_identity(model_dir)


def test_fetch_local_model_records_source(model_dir, tmp_path):
    out = tmp_path / "artifact"
    source = fetch.fetch_local_model(model_dir, out)
    on_disk = json.loads((out / fetch.SOURCE_FILE).read_text())
    assert on_disk == source
    assert source["kind"] == "local" and source["path"] == str(model_dir)  # outside the workdir: absolute
    assert source["files"] == fetch.local_dir_identity(model_dir)
    assert fetch.resolve_model_dir(out) == model_dir


def test_a_local_model_inside_the_workdir_is_recorded_as_the_workdir_names_it(
    model_dir, tmp_path, monkeypatch
):
    """Two clones record the same bytes: the path is relative to the working directory."""
    records = []
    for clone in ("a", "b"):
        root = tmp_path / clone
        (root / "data").mkdir(parents=True)
        shutil.copytree(model_dir, root / "data" / "model")
        monkeypatch.chdir(root)
        for given in ("data/model", "./data/../data/model", root / "data" / "model"):
            source = fetch.fetch_local_model(given, root / "out")
            assert source["path"] == "data/model"
            assert fetch.resolve_model_dir(root / "out") == Path("data/model")
        records.append((root / "out" / fetch.SOURCE_FILE).read_bytes())
    assert records[0] == records[1]


def test_fetch_local_requires_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        fetch.fetch_local_model(tmp_path / "empty", tmp_path / "out")


def test_resolve_model_dir_toy_artifact_is_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fetch.resolve_model_dir(tmp_path) == tmp_path


def test_resolve_model_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        fetch.resolve_model_dir(tmp_path)


@pytest.mark.parametrize("revision", ["main", "v1.0", "abc123", "A" * 40, "0" * 39, "0" * 41, None, 5])
def test_hub_refuses_unpinned_revision(tmp_path, revision):
    with pytest.raises(ValueError, match="40-hex") as info:
        fetch.fetch_hub_model("poolside/laguna-XS.2", revision, tmp_path)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.iterdir())


def test_pinned_revision_accepted():
    assert fetch.require_pinned_revision("0123456789abcdef0123456789abcdef01234567")


def test_a_hub_download_resolves_after_its_directory_is_renamed_into_place(model_dir, tmp_path, monkeypatch):
    """The record names the download relative to the artifact: the keyed directory is written under a
    temporary name and renamed, so an absolute path would point at the temporary one."""
    import huggingface_hub

    def fake_download(repo, revision, local_dir):
        shutil.copytree(model_dir, local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    tmp = tmp_path / ".tmp-artifact"
    source = fetch.fetch_hub_model("org/name", "0123456789abcdef0123456789abcdef01234567", tmp)
    assert source["path"] == "model"
    final = tmp_path / "artifact"
    tmp.rename(final)
    assert fetch.resolve_model_dir(final) == final / "model"
    assert (fetch.resolve_model_dir(final) / "config.json").read_text() == '{"model_type": "laguna"}'


REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at a closed local port (a real connection error, at once), with an empty
    cache of its own and no waits between its retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # CI's test command sets it: the network is tried
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(_http.time, "sleep", lambda seconds: None)
    return tmp_path / "hub-cache"


def test_a_hub_model_without_network_is_one_line_naming_repo_revision_and_the_offline_cache(no_hub, tmp_path):
    with pytest.raises(OSError) as info:
        fetch.fetch_hub_model("org/name", REVISION, tmp_path / "artifact")
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(
        f"model.hub: cannot download org/name at revision {REVISION} from http://127.0.0.1:9"
    )
    assert "Connection refused" in line  # the client's own reason, not a guess
    assert "HF_HUB_OFFLINE=1" in line and f"Hugging Face cache at {no_hub}" in line


def test_offline_a_hub_model_comes_from_the_populated_cache(no_hub, tmp_path, monkeypatch):
    """What the line advises works: with the revision in the cache and no network, the fetch records it."""
    snapshot = no_hub / "models--org--name" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "laguna"}')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = fetch.fetch_hub_model("org/name", REVISION, tmp_path / "artifact")
    assert source["files"] == {"config.json": {"sha256": sha(b'{"model_type": "laguna"}'), "size": 24}}
    assert fetch.resolve_model_dir(tmp_path / "artifact") == tmp_path / "artifact" / "model"
