import pytest
from mixquant.graph import keyed_path
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.hashing import file_sha256
from mixquant.keys.manifest import publish_keyed_dir, read_manifest, verify_manifest

PREIMAGE = {"key_schema": 1, "stage": "demo", "config": {"n": 3}, "upstream": {}}
KEY = canonical_sha256(PREIMAGE)


def test_publish_writes_manifest_that_matches_the_files(tmp_path):
    final = tmp_path / "demo" / KEY
    summary = {}
    with publish_keyed_dir(final, PREIMAGE, summary) as tmp:
        (tmp / "a.bin").write_bytes(b"\x00\x01" * 100)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("hello")
        summary["answer"] = 42
        assert not final.exists()  # nothing visible before completion
    manifest = read_manifest(final)
    assert manifest["key"] == KEY and manifest["preimage"] == PREIMAGE
    assert manifest["files"]["a.bin"] == {"sha256": file_sha256(final / "a.bin"), "size": 200}
    assert manifest["files"]["sub/b.txt"]["size"] == 5
    assert manifest["summary"] == {"answer": 42}
    assert "torch" in manifest["environment"]["packages"]
    assert verify_manifest(final) == []
    assert [p.name for p in final.parent.iterdir()] == [KEY]  # no temporary left


def test_verify_detects_changed_missing_and_extra_files(tmp_path):
    final = tmp_path / KEY
    with publish_keyed_dir(final, PREIMAGE) as tmp:
        (tmp / "a.bin").write_bytes(b"abc")
        (tmp / "b.bin").write_bytes(b"def")
    (final / "a.bin").write_bytes(b"abd")
    (final / "b.bin").unlink()
    (final / "c.bin").write_bytes(b"new")
    problems = verify_manifest(final)
    assert any(p.startswith("a.bin: sha256/size") for p in problems)
    assert "b.bin: listed in the manifest but missing" in problems
    assert "c.bin: present but not in the manifest" in problems


def test_failure_leaves_nothing_behind(tmp_path):
    final = tmp_path / "demo" / KEY
    with pytest.raises(RuntimeError, match="boom"):
        with publish_keyed_dir(final, PREIMAGE) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not final.exists()
    assert list((tmp_path / "demo").iterdir()) == []


def test_empty_placeholder_is_replaced_but_a_complete_dir_is_immutable(tmp_path):
    final = tmp_path / KEY
    final.mkdir()
    (final / ".snakemake_timestamp").write_text("")
    with publish_keyed_dir(final, PREIMAGE) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(FileExistsError):
        with publish_keyed_dir(final, PREIMAGE) as tmp:
            (tmp / "a").write_text("2")
    assert (final / "a").read_text() == "1"


def test_directory_name_must_be_the_key_of_the_preimage(tmp_path):
    with pytest.raises(ValueError, match="not the key"):
        with publish_keyed_dir(tmp_path / ("0" * 64), PREIMAGE):
            pass
    with pytest.raises(ValueError, match="64 lowercase hex"):
        with publish_keyed_dir(tmp_path / "not-a-key", PREIMAGE):
            pass


@pytest.mark.parametrize(
    "bad", ["../../etc", "A" * 64, "0" * 63, "0" * 63 + "/", "0" * 64 + "\x00", "0" * 64 + "\n"]
)
def test_keys_are_validated_before_becoming_paths(bad):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        keyed_path("results", "demo", bad)


def test_run_facts_stay_out_of_the_manifest_at_any_depth(tmp_path, caplog):
    """Timings and rates describe one run: logged, never written (two machines write the same bytes)."""
    final = tmp_path / "demo" / KEY
    summary = {"seconds": 1.5, "export": {"tensors": 3, "seconds": 2.5, "write_rate_bytes_per_s": 9.0}}
    with caplog.at_level("INFO"), publish_keyed_dir(final, PREIMAGE, summary) as tmp:
        (tmp / "a.bin").write_bytes(b"\x00")
    assert read_manifest(final)["summary"] == {"export": {"tensors": 3}}
    assert '"export.seconds": 2.5' in caplog.text and '"seconds": 1.5' in caplog.text
