"""Artifact I/O on a local folder and on gs:// (a real local GCS server)."""

import threading
from dataclasses import dataclass, field

import pytest

from jaxcore import artifacts, storage


@dataclass(frozen=True)
class _Cfg:
    lr: float = 1e-3
    name: str = "x"


def test_write_read_list_checksum(any_root):
    storage.write_text(storage.join(any_root, "a/b.txt"), "hello")
    storage.write_bytes(storage.join(any_root, "c.bin"), b"\x00\x01")
    assert storage.read_text(storage.join(any_root, "a/b.txt")) == "hello"
    files = storage.list_files(any_root)
    assert [(f.path, f.size) for f in files] == [("a/b.txt", 5), ("c.bin", 2)]
    # md5 of "hello", base64 — the same on both backends
    assert storage.checksum(storage.join(any_root, "a/b.txt")) == "md5:XUFAKrxLKna5cZ2REBfFkg=="
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.read_bytes(storage.join(any_root, "missing"))


def test_create_exclusive_once(any_root):
    uri = storage.join(any_root, "once.json")
    assert storage.create_exclusive(uri, b"first")
    assert not storage.create_exclusive(uri, b"second")
    assert storage.read_text(uri) == "first"


def test_commit_manifest_and_open(any_root):
    writer = artifacts.ArtifactWriter(any_root, "convert", _Cfg())
    assert writer.existing() is None
    storage.write_text(writer.file("data/shard-0.txt"), "abc")
    manifest = writer.commit({"records": 3})
    opened = artifacts.open_artifact(any_root, "convert")
    assert opened.key == writer.key == manifest.key
    assert opened.files == [
        {"path": "data/shard-0.txt", "size": 3, "checksum": opened.files[0]["checksum"]}
    ]
    assert opened.config == {"lr": 1e-3, "name": "x"}
    assert opened.summary == {"records": 3}
    assert opened.sha256 and opened.code_version
    artifacts.verify(opened, checksums=True)
    # identical rerun: found, skipped
    assert artifacts.ArtifactWriter(any_root, "convert", _Cfg()).existing().key == writer.key
    # another config at the same place: refused unless forced
    other = artifacts.ArtifactWriter(any_root, "convert", _Cfg(lr=2e-3))
    with pytest.raises(artifacts.ArtifactError, match="--force"):
        other.existing()
    assert other.existing(force=True) is None
    with pytest.raises(artifacts.ArtifactError, match="no manifest.json"):
        artifacts.open_artifact(any_root, "convert")


@dataclass(frozen=True)
class _Sub:
    steps: int = 10


@dataclass(frozen=True)
class _OldCfg:  # the config as an earlier difforge had it
    lr: float = 1e-3
    sub: _Sub = field(default_factory=_Sub)


@dataclass(frozen=True)
class _NewSub:
    steps: int = 10
    shift: tuple[float, ...] = (1.0, 2.0)  # added later, at its default unless set


@dataclass(frozen=True)
class _NewCfg:  # a later difforge: two keys added, one of them nested
    lr: float = 1e-3
    sub: _NewSub = field(default_factory=_NewSub)
    dropout: float = 0.0


@dataclass(frozen=True)
class _NewRequired:  # a later difforge with a new key that has no default
    mode: str
    lr: float = 1e-3
    sub: _Sub = field(default_factory=_Sub)


def test_rerun_after_upgrade_reuses_the_artifact_when_new_keys_are_at_defaults(tmp_path):
    """A finished artifact whose config lacks keys a newer version added stands for a rerun
    that leaves them at their defaults (its key differs: it hashes the whole config); any
    other difference, or a different input, is still refused."""
    up = artifacts.ArtifactWriter(str(tmp_path / "up"), "convert", _Cfg()).commit()
    out = str(tmp_path / "out")
    made = artifacts.ArtifactWriter(out, "train", _OldCfg(), {"data": up}).commit()

    rerun = artifacts.ArtifactWriter(out, "train", _NewCfg(), {"data": up})
    assert rerun.key != made.key
    assert rerun.existing().sha256 == made.sha256

    refused = [
        _NewCfg(dropout=0.1),  # a new key set away from its default
        _NewCfg(sub=_NewSub(shift=(1.0,))),  # a nested new key away from its default
        _NewCfg(lr=2e-3),  # a key the artifact has, changed
        _NewCfg(sub=_NewSub(steps=11)),
    ]
    for config in refused:
        with pytest.raises(artifacts.ArtifactError, match="different config or inputs"):
            artifacts.ArtifactWriter(out, "train", config, {"data": up}).existing()
    storage.write_text(str(tmp_path / "up" / "extra"), "x")
    storage.delete(str(tmp_path / "up" / "manifest.json"))
    other_input = artifacts.ArtifactWriter(str(tmp_path / "up"), "convert", _Cfg()).commit()
    with pytest.raises(artifacts.ArtifactError, match="different config or inputs"):
        artifacts.ArtifactWriter(out, "train", _NewCfg(), {"data": other_input}).existing()
    # a new key without a default cannot be known to match
    with pytest.raises(artifacts.ArtifactError, match="different config or inputs"):
        artifacts.ArtifactWriter(out, "train", _NewRequired("a"), {"data": up}).existing()
    # a key the artifact has but this version dropped: not the same config either
    with pytest.raises(artifacts.ArtifactError, match="different config or inputs"):
        artifacts.ArtifactWriter(out, "train", _Cfg(), {"data": up}).existing()


def test_wrong_stage_refused(any_root):
    artifacts.ArtifactWriter(any_root, "train", _Cfg()).commit()
    with pytest.raises(artifacts.ArtifactError, match="'train' artifact, but a 'convert'"):
        artifacts.open_artifact(any_root, "convert")


def test_killed_writer_leaves_refused_artifact(any_root):
    """Data written, manifest never written (the writer died): consumers refuse it."""
    writer = artifacts.ArtifactWriter(any_root, "convert", _Cfg())
    storage.write_text(writer.file("data/shard-0.txt"), "partial")
    with pytest.raises(artifacts.ArtifactError, match="The convert stage writes the manifest last"):
        artifacts.open_artifact(any_root, "convert")
    assert writer.existing() is None  # a rerun does the work


def test_input_hash_changes_key(tmp_path):
    up = artifacts.ArtifactWriter(str(tmp_path / "up"), "convert", _Cfg()).commit()
    a = artifacts.ArtifactWriter(str(tmp_path / "down"), "train", _Cfg(), {"data": up})
    storage.write_text(str(tmp_path / "up" / "extra"), "x")
    storage.delete(str(tmp_path / "up" / "manifest.json"))
    up2 = artifacts.ArtifactWriter(str(tmp_path / "up"), "convert", _Cfg()).commit()
    b = artifacts.ArtifactWriter(str(tmp_path / "down"), "train", _Cfg(), {"data": up2})
    assert up.sha256 != up2.sha256 and a.key != b.key


def test_verify_detects_missing_file(any_root):
    writer = artifacts.ArtifactWriter(any_root, "convert", _Cfg())
    storage.write_text(writer.file("x.txt"), "123")
    m = writer.commit()
    storage.delete(storage.join(any_root, "x.txt"))
    with pytest.raises(
        artifacts.ArtifactError, match="x.txt is listed in the manifest but missing"
    ):
        artifacts.verify(m)


@pytest.mark.parametrize("same_key", [True, False])
def test_racing_writers_exactly_one_manifest(any_root, same_key):
    """Two writers commit the same artifact at once: exactly one manifest is created."""
    storage.write_text(storage.join(any_root, "data.txt"), "d")
    outcomes = []
    barrier = threading.Barrier(2)

    def commit(lr):
        w = artifacts.ArtifactWriter(any_root, "convert", _Cfg(lr=lr))
        barrier.wait()
        try:
            outcomes.append(("ok", w.commit().key, w.key))
        except artifacts.ArtifactError as err:
            outcomes.append(("lost", str(err), w.key))

    lrs = (1e-3, 1e-3) if same_key else (1e-3, 2e-3)
    threads = [threading.Thread(target=commit, args=(lr,)) for lr in lrs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = artifacts.open_artifact(any_root, "convert")
    if same_key:
        assert [o[0] for o in outcomes] == ["ok", "ok"]
        assert all(o[1] == final.key for o in outcomes)
    else:
        assert sorted(o[0] for o in outcomes) == ["lost", "ok"]
        winner = next(o for o in outcomes if o[0] == "ok")
        assert winner[2] == final.key


def test_local_copy_follows_rewritten_objects(gcs_root, tmp_path, monkeypatch):
    """A gs:// object rewritten at the same URI with the same size (re-exported weights,
    shards rebuilt with --force) is fetched again; a deleted one leaves the cache; an
    unchanged one is not downloaded twice."""
    monkeypatch.setenv("DIFFORGE_CACHE", str(tmp_path / "cache"))
    tree = f"{gcs_root}/weights"
    storage.write_bytes(f"{tree}/a.bin", b"old!")
    storage.write_bytes(f"{tree}/b.bin", b"keep")
    storage.write_bytes(f"{tree}/gone.bin", b"xx")
    local = storage.local_copy(tree)
    assert (local / "a.bin").read_bytes() == b"old!"
    kept_mtime = (local / "b.bin").stat().st_mtime_ns

    storage.write_bytes(f"{tree}/a.bin", b"new!")  # same size: the old cache served this stale
    storage.delete(f"{tree}/gone.bin")
    local = storage.local_copy(tree)
    assert (local / "a.bin").read_bytes() == b"new!"
    assert not (local / "gone.bin").exists()
    assert (local / "b.bin").stat().st_mtime_ns == kept_mtime  # not downloaded again

    single = f"{gcs_root}/shard.tfrecord"
    storage.write_bytes(single, b"v1")
    assert storage.local_copy(single).read_bytes() == b"v1"
    storage.write_bytes(single, b"v2")
    assert storage.local_copy(single).read_bytes() == b"v2"
