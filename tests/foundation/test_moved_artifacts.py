"""An artifact is read where it is: a copy (to another folder, to or from gs://) reads its own
files, checked against its manifest, and references to other artifacts follow a copy that
moved them together. On a local folder and on gs:// (a real local GCS server)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest

from jaxcore import artifacts, storage


@dataclass(frozen=True)
class _Cfg:
    name: str = "x"


def _write(root: str, stage: str = "convert", inputs=(), files=None) -> artifacts.Manifest:
    writer = artifacts.ArtifactWriter(root, stage, _Cfg(), dict(inputs))
    for path, text in (files or {"data/shard-0.txt": "abc", "ids.jsonl": "{}\n"}).items():
        storage.write_text(writer.file(path), text)
    return writer.commit({"records": 3})


def _copy_tree(source: str, dest: str) -> None:
    """``cp -r`` / ``gsutil cp -r``: every file, byte for byte, across backends."""
    for f in storage.list_files(source):
        storage.write_bytes(
            storage.join(dest, f.path), storage.read_bytes(storage.join(source, f.path))
        )


def _delete_tree(uri: str) -> None:
    if storage.is_gcs(uri):
        storage.delete_tree(uri)
    else:
        shutil.rmtree(uri)


@pytest.fixture(params=["local", "gcs"])
def other_root(request, tmp_path) -> str:
    """Where the copy goes: a local folder, or gs://."""
    if request.param == "local":
        return str(tmp_path / "elsewhere")
    return request.getfixturevalue("gcs_root") + "-elsewhere"  # beside any_root's gs:// folder


def test_a_copy_reads_its_own_files_after_the_original_is_gone(any_root, other_root):
    made = _write(storage.join(any_root, "a"))
    copy = storage.join(other_root, "copied")
    _copy_tree(made.uri, copy)
    _delete_tree(made.uri)
    opened = artifacts.open_artifact(copy, "convert")
    assert opened.uri == copy and opened.recorded_uri == made.uri and opened.moved
    assert opened.sha256 == made.sha256  # the same manifest bytes: lineage unchanged
    assert storage.read_text(opened.path("data/shard-0.txt")) == "abc"
    # and a copy that was not moved is not
    again = artifacts.open_artifact(copy, "convert")
    assert again.uri == copy


def test_a_copy_whose_file_differs_from_its_manifest_is_refused_naming_it(any_root, other_root):
    made = _write(storage.join(any_root, "a"))
    copy = storage.join(other_root, "copied")

    _copy_tree(made.uri, copy)
    storage.write_text(storage.join(copy, "data/shard-0.txt"), "abd")  # same size, other bytes
    with pytest.raises(
        artifacts.ArtifactError, match="data/shard-0.txt does not match the checksum"
    ):
        artifacts.open_artifact(copy, "convert")

    storage.write_text(storage.join(copy, "data/shard-0.txt"), "ab")  # truncated
    with pytest.raises(
        artifacts.ArtifactError, match="data/shard-0.txt has 2 bytes, the manifest says 3"
    ):
        artifacts.open_artifact(copy, "convert")

    storage.delete(storage.join(copy, "data/shard-0.txt"))  # an incomplete copy
    with pytest.raises(
        artifacts.ArtifactError, match="data/shard-0.txt is listed in the manifest but missing"
    ):
        artifacts.open_artifact(copy, "convert")


def test_only_small_local_files_are_hashed_on_open(tmp_path, monkeypatch):
    """A large local file's bytes are checked by its reader, not on every open; its size is."""
    made = _write(str(tmp_path / "a"), files={"big.bin": "x" * 64, "small.txt": "abc"})
    monkeypatch.setattr(artifacts, "SMALL_FILE", 10)
    (tmp_path / "a" / "big.bin").write_text("y" * 64)
    artifacts.open_artifact(made.uri, "convert")  # big.bin's change is left to its reader
    (tmp_path / "a" / "small.txt").write_text("abd")
    with pytest.raises(artifacts.ArtifactError, match="small.txt does not match"):
        artifacts.open_artifact(made.uri, "convert")
    (tmp_path / "a" / "small.txt").write_text("abc")
    with pytest.raises(artifacts.ArtifactError, match="big.bin does not match its checksum"):
        artifacts.verify(made, checksums=True)


def test_references_follow_artifacts_moved_together(any_root, other_root):
    """An artifact that names another (as an input, or in its summary) reads the copy beside
    it when both were copied together; copied alone, it reads the original."""
    runs = storage.join(any_root, "runs")
    data = _write(storage.join(runs, "data"))
    train = _write(storage.join(runs, "train"), "train", {"data": data})
    assert artifacts.relocate(train, data.uri) == data.uri  # not moved: as recorded

    together = storage.join(other_root, "runs")
    _copy_tree(runs, together)
    moved = artifacts.open_artifact(storage.join(together, "train"), "train")
    assert artifacts.relocate(moved, data.uri) == storage.join(together, "data")

    alone = storage.join(other_root, "alone")
    _copy_tree(train.uri, alone)
    assert artifacts.relocate(artifacts.open_artifact(alone, "train"), data.uri) == data.uri

    # a different artifact at the relative place (not the input, by its manifest hash): ignored
    storage.delete(storage.join(together, "data", artifacts.MANIFEST))
    other = artifacts.ArtifactWriter(storage.join(together, "data"), "convert", _Cfg("y")).commit()
    assert other.sha256 != data.sha256
    assert artifacts.relocate(moved, data.uri) == data.uri

    # files (an incremental convert's base shards): the copy's when it holds them
    shard = storage.join(data.uri, "data/shard-0.txt")
    assert artifacts.relocate_files(moved, [shard]) == [
        storage.join(together, "data/data/shard-0.txt")
    ]
    assert artifacts.relocate_files(train, [shard]) == [shard]


def test_a_pointer_copied_with_its_artifact_points_at_the_copy(any_root, other_root):
    root = storage.join(any_root, "daily")
    made = _write(storage.join(root, "2026-12-06"))
    artifacts.write_pointer(storage.join(root, "LATEST"), made)
    assert artifacts.read_pointer(storage.join(root, "LATEST")) == made.uri

    copy = storage.join(other_root, "daily")
    _copy_tree(root, copy)
    _delete_tree(root)
    opened = artifacts.open_artifact(storage.join(copy, "LATEST"), "convert")
    assert opened.uri == storage.join(copy, "2026-12-06")


def test_a_pointer_copied_alone_still_names_the_original(any_root, other_root):
    made = _write(storage.join(any_root, "a"))
    artifacts.write_pointer(storage.join(any_root, "LATEST"), made)
    copy = storage.join(other_root, "LATEST")
    storage.write_bytes(copy, storage.read_bytes(storage.join(any_root, "LATEST")))
    assert artifacts.open_artifact(copy, "convert").uri == made.uri


def test_a_corrupt_manifest_names_the_file(tmp_path):
    root = tmp_path / "a"
    _write(str(root))
    (root / "manifest.json").write_text("[1, 2]")
    with pytest.raises(
        artifacts.ArtifactError, match="manifest.json: corrupt manifest: not a JSON object"
    ):
        artifacts.open_artifact(str(root))
    (root / "manifest.json").write_text('{"stage": "convert"}')
    with pytest.raises(
        artifacts.ArtifactError, match="manifest.json: corrupt manifest: no files, key"
    ):
        artifacts.open_artifact(str(root))
