"""Self-describing stage artifacts: data files first, ``manifest.json`` last, exactly once.

An artifact is a folder (local or ``gs://``). It is complete if and only if its manifest
exists; consumers open it only through :func:`open_artifact`, which refuses a folder without
one. The manifest records the stage, the resolved config, the input artifacts (URI + manifest
hash), the code version, the creation time, every file with size and checksum, and a
stage-specific ``summary``.

The artifact *key* hashes stage + config + input manifest hashes: a rerun with the same key
finds the finished artifact and skips; a different key at the same URI is an error unless the
caller forces a rebuild.

An artifact is read where it is opened: ``Manifest.uri`` is that location, and the URI the
writer recorded stays as provenance (``recorded_uri``). So a copy (``cp -r``, ``gsutil cp -r``
to another bucket) reads its own files, and :func:`open_artifact` checks them against the
manifest first (presence and size of every file; the checksum of each small file, and of
every file on GCS, whose listing carries it). References to *other* artifacts recorded inside
one (an evaluation's train artifact, an incremental convert's base shards, a pointer's target)
follow a copy that moved them together (:func:`relocate`), else stay where they were.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import posixpath
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxcore import storage
from jaxcore.config import to_dict

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ArtifactError(RuntimeError):
    """A missing, incomplete or mismatched artifact; the message names the URI."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    stage: str
    uri: str
    key: str
    config: dict
    inputs: dict  # name -> {"uri": ..., "manifest_sha256": ..., "stage": ...}
    code_version: str
    created: str
    files: list  # [{"path", "size", "checksum"}]
    summary: dict
    format_version: int = FORMAT_VERSION
    sha256: str = ""  # of the manifest bytes as stored (filled on read)
    recorded_uri: str = ""  # where the writer put it (filled on read; ``uri`` is where it is)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data.pop("sha256")
        data.pop("recorded_uri")
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @property
    def moved(self) -> bool:
        """Whether it was opened somewhere other than where it was written."""
        return _normalized(self.recorded_uri or self.uri) != _normalized(self.uri)

    def path(self, relative: str) -> str:
        """URI of one of the artifact's files (must be listed in the manifest)."""
        if relative not in {f["path"] for f in self.files}:
            raise ArtifactError(f"{self.uri}: the manifest lists no file {relative!r}")
        return storage.join(self.uri, relative)

    def file_paths(self, prefix: str = "", suffix: str = "") -> list[str]:
        return [
            f["path"]
            for f in self.files
            if f["path"].startswith(prefix) and f["path"].endswith(suffix)
        ]


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus the git commit (with '+dirty') when run from a checkout."""
    try:
        from importlib.metadata import version

        pkg = version("difforge")
    except Exception:
        pkg = "unknown"
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", ""
    return f"{pkg}+git.{sha}{'.dirty' if dirty else ''}" if sha else pkg


def artifact_key(stage: str, config: Any, inputs: Mapping[str, Manifest]) -> str:
    """Deterministic key of what an artifact is made from (not where, not when)."""
    payload = {
        "stage": stage,
        "config": to_dict(config),
        "inputs": {name: m.sha256 for name, m in sorted(inputs.items())},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _artifact_uri(uri: str) -> str:
    uri = str(uri)
    return uri.rstrip("/") if storage.is_gcs(uri) else uri


def read_manifest(uri: str) -> Manifest | None:
    """The manifest at ``uri``, or None when the artifact is not complete.

    The manifest's ``uri`` is ``uri`` (where its files are read from); the location its writer
    recorded is ``recorded_uri``. Its files are not checked here: see :func:`check_files`."""
    uri = _artifact_uri(uri)
    murl = storage.join(uri, MANIFEST)
    try:
        raw = storage.read_bytes(murl)
    except storage.StorageError:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{murl}: corrupt manifest: {err}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{murl}: corrupt manifest: not a JSON object")
    data["sha256"] = hashlib.sha256(raw).hexdigest()
    data["recorded_uri"] = data.get("uri") or uri
    data["uri"] = uri
    known = {f.name for f in dataclasses.fields(Manifest)}
    missing = sorted({"stage", "key", "files"} - set(data))
    if missing:
        raise ArtifactError(f"{murl}: corrupt manifest: no {', '.join(missing)}")
    defaults = {"config": {}, "inputs": {}, "code_version": "", "created": "", "summary": {}}
    return Manifest(**{**defaults, **{k: v for k, v in data.items() if k in known}})


# --- where a reference recorded in an artifact lies now -----------------------------------


def _normalized(uri: str) -> str:
    uri = str(uri)
    if storage.is_gcs(uri):
        bucket, name = storage.split_gcs(uri)
        return f"gs://{bucket}/{posixpath.normpath('/' + name).lstrip('/')}".rstrip("/")
    return os.path.normpath(os.path.abspath(uri))


def _relative(target: str, base: str) -> str | None:
    """``target`` as a '/'-separated path relative to ``base``; None when the two do not share
    a root (another bucket, or one local and one on GCS)."""
    target, base = _normalized(target), _normalized(base)
    if storage.is_gcs(target) != storage.is_gcs(base):
        return None
    if storage.is_gcs(target):
        (t_bucket, t_name), (b_bucket, b_name) = storage.split_gcs(target), storage.split_gcs(base)
        if t_bucket != b_bucket:
            return None
        return posixpath.relpath("/" + t_name, "/" + b_name)
    return Path(os.path.relpath(target, base)).as_posix()


def _resolve(base: str, relative: str) -> str | None:
    """``relative`` (from :func:`_relative`) taken from ``base``; None when it would climb out
    of ``base``'s bucket."""
    if storage.is_gcs(base):
        bucket, name = storage.split_gcs(_normalized(base))
        joined = posixpath.normpath(posixpath.join("/" + name, relative))
        if joined.startswith("/.."):
            return None
        return f"gs://{bucket}{joined}".rstrip("/")
    return os.path.normpath(os.path.join(base, relative))


def moved_with(manifest: Manifest, recorded: str) -> str | None:
    """Where ``recorded`` (a URI ``manifest``'s writer wrote down) would lie had it moved
    together with the artifact; None when the artifact did not move or that cannot be told."""
    if not manifest.moved:
        return None
    relative = _relative(recorded, manifest.recorded_uri)
    if relative is None:
        return None
    return _resolve(manifest.uri, relative)


def relocate(manifest: Manifest, recorded: str, manifest_sha256: str | None = None) -> str:
    """The URI of the artifact ``manifest`` refers to as ``recorded``: its copy beside a moved
    ``manifest`` (same relative place, a finished artifact, and when ``manifest_sha256`` is
    given the same manifest bytes), else ``recorded`` itself."""
    candidate = moved_with(manifest, recorded)
    if candidate is None or _normalized(candidate) == _normalized(recorded):
        return recorded
    if manifest_sha256 is None:  # an input of the artifact: its hash is recorded with it
        for entry in manifest.inputs.values():
            if isinstance(entry, Mapping) and entry.get("uri") == recorded:
                manifest_sha256 = entry.get("manifest_sha256")
    found = read_manifest(candidate)
    if found is None or (manifest_sha256 and found.sha256 != manifest_sha256):
        return recorded
    log.info(
        "%s moved to %s; reading %s there, not at %s",
        manifest.recorded_uri,
        manifest.uri,
        candidate,
        recorded,
    )
    return candidate


def relocate_files(manifest: Manifest, recorded: list[str]) -> list[str]:
    """:func:`relocate` for files (an incremental convert's base shards): each one's copy
    beside a moved ``manifest`` when that folder holds a file of that name, else as recorded.
    One listing per folder."""
    listings: dict[str, set[str]] = {}
    out = []
    for uri in recorded:
        candidate = moved_with(manifest, uri)
        if candidate is None:
            out.append(uri)
            continue
        folder, _, name = candidate.rpartition("/")
        if folder not in listings:
            listings[folder] = {f.path for f in storage.list_files(folder)}
        out.append(candidate if name in listings[folder] else uri)
    return out


# --- checking an artifact's files against its manifest ------------------------------------

SMALL_FILE = 1 << 20  # local files up to this size are hashed on open; larger ones on read


def check_files(manifest: Manifest) -> None:
    """Every file the manifest lists is present at ``manifest.uri`` with its size; its checksum
    matches too where that is cheap: every file on GCS (the listing carries it), each local
    file up to :data:`SMALL_FILE`. Larger local files are checked by their readers (TFRecord
    shards: a CRC per record; safetensors: header and offsets).

    Raises ArtifactError naming the first file that differs."""
    present = {f.path: f for f in storage.list_files(manifest.uri)}
    if not present and manifest.files:
        raise ArtifactError(
            f"{manifest.uri}: the manifest lists {len(manifest.files)} files, but the folder "
            "holds none of them (an incomplete copy?)"
        )
    for entry in manifest.files:
        path, size, expected = entry["path"], entry["size"], entry.get("checksum")
        found = present.get(path)
        where = f"{manifest.uri}: {path}"
        if found is None:
            raise ArtifactError(f"{where} is listed in the manifest but missing")
        if found.size != size:
            raise ArtifactError(f"{where} has {found.size} bytes, the manifest says {size}")
        actual = _cheap_checksum(storage.join(manifest.uri, path), found, expected)
        if actual is not None and actual != expected:
            raise ArtifactError(
                f"{where} does not match the checksum in its manifest ({actual}, the manifest "
                f"says {expected}): the file changed after the artifact was written"
            )


def _cheap_checksum(uri: str, found: storage.FileInfo, expected: str | None) -> str | None:
    """The file's checksum in ``expected``'s kind when it costs no more than a small read;
    None when it would cost a download or a hash of a large file."""
    if not expected or ":" not in expected:
        return None
    kind = expected.split(":", 1)[0]
    if found.checksum is not None and found.checksum.startswith(kind + ":"):
        return found.checksum  # GCS, from the listing
    if found.size > SMALL_FILE:
        return None
    if storage.is_gcs(uri):  # the copy has the other kind (e.g. a composite object)
        data = storage.read_bytes(uri)
        return storage.bytes_checksum(data, kind)
    return storage.checksum(uri, kind)


POINTER_KIND = "difforge-artifact-pointer"


def write_pointer(pointer_uri: str, manifest: Manifest) -> None:
    """Point ``pointer_uri`` (an object such as ``.../LATEST``) at a finished artifact.

    Written after the artifact's manifest, in one atomic write, so a reader of the pointer
    always finds a complete artifact (the previous one until this write lands). It records
    the target both as a URI and relative to the pointer's folder, so a copy of a folder
    holding both points at the copied artifact."""
    data = {
        "kind": POINTER_KIND,
        "artifact": manifest.uri,
        "stage": manifest.stage,
        "manifest_sha256": manifest.sha256,
        "updated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    relative = _relative(manifest.uri, _parent(pointer_uri))
    if relative is not None:
        data["relative"] = relative
    storage.write_text(pointer_uri, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _parent(uri: str) -> str:
    uri = str(uri)
    if storage.is_gcs(uri):
        return uri.rstrip("/").rpartition("/")[0]
    return os.path.dirname(os.path.abspath(uri))


def read_pointer(uri: str) -> str | None:
    """The artifact URI a pointer object names; None when ``uri`` is no pointer (absent, a
    folder, or another file). A target at the pointer's recorded relative place (the same
    finished artifact, by its manifest's hash) wins over the recorded URI: the pointer and
    its artifact were copied together."""
    try:
        raw = storage.read_bytes(uri)
    except (storage.StorageError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("kind") != POINTER_KIND:
        return None
    target = data.get("artifact")
    if not isinstance(target, str) or not target:
        raise ArtifactError(f"{uri}: an artifact pointer without an 'artifact' URI")
    relative = data.get("relative")
    if isinstance(relative, str) and relative:
        beside = _resolve(_parent(uri), relative)
        if beside is not None and _normalized(beside) != _normalized(target):
            found = read_manifest(beside)
            if found is not None and found.sha256 == data.get("manifest_sha256"):
                return beside
    return target


def open_artifact(uri: str, stage: str | None = None) -> Manifest:
    """Open a finished artifact through its manifest, its files checked (:func:`check_files`);
    refuse anything else.

    ``stage`` (e.g. "convert") is the stage expected to have produced it. ``uri`` may also
    be a pointer (:func:`write_pointer`), which opens the artifact it names.
    """
    target = read_pointer(uri)
    if target is not None:
        log.info("%s points at %s", uri, target)
        uri = target
    manifest = read_manifest(uri)
    producer = f"the {stage} stage" if stage else "the stage that produces it"
    if manifest is None:
        raise ArtifactError(
            f"{uri} has no {MANIFEST}: it is not a finished artifact. {producer.capitalize()} "
            "writes the manifest last; run (or rerun) it to completion first."
        )
    if stage and manifest.stage != stage:
        raise ArtifactError(
            f"{uri} is a {manifest.stage!r} artifact, but a {stage!r} artifact was expected"
        )
    check_files(manifest)
    return manifest


class ArtifactWriter:
    """Writes one stage artifact; :meth:`commit` lists the files and writes the manifest last."""

    def __init__(self, uri: str, stage: str, config: Any, inputs: Mapping[str, Manifest] = ()):
        self.uri = str(uri).rstrip("/") if storage.is_gcs(str(uri)) else str(uri)
        self.stage = stage
        self.config = config
        self.inputs = dict(inputs or {})
        self.key = artifact_key(stage, config, self.inputs)

    def existing(self, force: bool = False) -> Manifest | None:
        """The finished artifact for this exact key (rerun -> skip), or None if work is needed.

        A finished artifact with another key is an error unless ``force`` (then it is removed).
        """
        found = read_manifest(self.uri)
        if found is None:
            return None
        if force:
            log.info("--force: removing the finished artifact at %s", self.uri)
            storage.delete(storage.join(self.uri, MANIFEST))
            return None
        if found.key == self.key:
            return found
        added = self._only_new_defaults(found)
        if added is not None:
            log.info(
                "%s was made by an earlier difforge whose %s config lacked %s; this run leaves "
                "them at their defaults, so the finished artifact stands",
                self.uri,
                self.stage,
                ", ".join(added),
            )
            return found
        raise ArtifactError(
            f"{self.uri} already holds a finished {found.stage!r} artifact made from a different "
            f"config or inputs (key {found.key}, this run {self.key}). Choose another output "
            "location, or pass --force to rebuild it."
        )

    def _only_new_defaults(self, found: Manifest) -> list[str] | None:
        """The config keys this run has and ``found`` lacks, when that is the whole difference
        and each is at its default (a newer difforge added them); else None.

        The key hashes the whole config, so without this a rerun of an unchanged command
        after an upgrade would refuse its own finished artifact. Inputs, every key ``found``
        has, and any key whose default cannot be told must still match."""
        if found.stage != self.stage or found.inputs.keys() != self.inputs.keys():
            return None
        for name, manifest in self.inputs.items():
            if found.inputs[name].get("manifest_sha256") != manifest.sha256:
                return None
        added: list[str] = []
        if not _matches_with_defaults(found.config, self.config, "", added):
            return None
        return added

    def file(self, relative: str) -> str:
        return storage.join(self.uri, relative)

    def commit(self, summary: Mapping | None = None) -> Manifest:
        """List and checksum every file, then create the manifest exactly once.

        If another writer committed first, its manifest wins: returned when it has the same
        key, an ArtifactError otherwise.
        """
        files = [
            {"path": f.path, "size": f.size, "checksum": storage.checksum(self.file(f.path))}
            for f in storage.list_files(self.uri)
            if f.path != MANIFEST
        ]
        manifest = Manifest(
            stage=self.stage,
            uri=self.uri,
            key=self.key,
            config=to_dict(self.config),
            inputs={
                name: {"uri": m.uri, "manifest_sha256": m.sha256, "stage": m.stage}
                for name, m in sorted(self.inputs.items())
            },
            code_version=code_version(),
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            files=files,
            summary=to_dict(dict(summary or {})),
        )
        if storage.create_exclusive(storage.join(self.uri, MANIFEST), manifest.to_json().encode()):
            log.info("committed %s artifact %s (%d files)", self.stage, self.uri, len(files))
            return read_manifest(self.uri)
        winner = read_manifest(self.uri)
        if winner is not None and winner.key == self.key:
            log.info("another writer committed %s first with the same key", self.uri)
            return winner
        raise ArtifactError(f"{self.uri}: another writer committed a different artifact first")


_NO_DEFAULT = object()


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


def _matches_with_defaults(stored: Any, config: Any, path: str, added: list[str]) -> bool:
    """Whether ``stored`` (a manifest's config, plain data) equals ``config`` except for
    dataclass fields ``stored`` lacks that are at their declared defaults (collected in
    ``added`` as dotted paths)."""
    if not dataclasses.is_dataclass(config):
        return stored == to_dict(config)
    if not isinstance(stored, Mapping):
        return False
    names = {f.name for f in dataclasses.fields(config)}
    if set(stored) - names:
        return False  # a key this version no longer has: not the same config
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        where = f"{path}{field.name}"
        if field.name in stored:
            if not _matches_with_defaults(stored[field.name], value, f"{where}.", added):
                return False
            continue
        default = _field_default(field)
        if default is _NO_DEFAULT or to_dict(default) != to_dict(value):
            return False
        added.append(where)
    return True


def verify(manifest: Manifest, checksums: bool = False) -> None:
    """:func:`check_files`, and with ``checksums`` every file's checksum, however large."""
    check_files(manifest)
    if not checksums:
        return
    for f in manifest.files:
        uri = storage.join(manifest.uri, f["path"])
        kind = str(f.get("checksum") or "md5:").split(":", 1)[0]
        if storage.checksum(uri, kind) != f["checksum"]:
            raise ArtifactError(f"{manifest.uri}: {f['path']} does not match its checksum")
