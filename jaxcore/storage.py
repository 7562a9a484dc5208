"""URI-based file I/O over local paths and ``gs://`` (google-cloud-storage, never tf.io.gfile).

Everything a stage reads or writes goes through here, so the same code runs against a local
folder, a local GCS server (``STORAGE_EMULATOR_HOST``) and real GCS.

Guarantees:
- :func:`write_bytes` is atomic: a reader sees the old object, or the whole new one.
- :func:`create_exclusive` creates an object only if it does not exist (local: ``link``;
  GCS: ``if_generation_match=0``), so two racing writers cannot both win.
- :func:`checksum` is ``md5:<base64>`` on both backends (GCS reports it without a download).
- :func:`local_copy` serves a cached file only while its object has the generation it was
  downloaded at; downloads ask for that generation and are checksum-verified.
- Transient GCS errors (429, 5xx, dropped connections, timeouts) are retried with exponential
  backoff (:data:`RETRY`). Every write names the generation it replaces
  (``if_generation_match``), so a retry never overwrites what another writer put there; a
  retry that finds its own earlier attempt landed (the response was lost) takes it as done.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import inspect
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GCS_PREFIX = "gs://"


class StorageError(OSError):
    """An I/O failure naming the URI."""


def _named_errors(fn):
    """GCS failures that retries did not mend (a permanent 403, a deadline past) as a
    :class:`StorageError` naming the URI (the function's ``uri`` argument)."""
    position = list(inspect.signature(fn).parameters).index("uri")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        uri = kwargs.get("uri", args[position] if len(args) > position else "?")
        try:
            return fn(*args, **kwargs)
        except StorageError:
            raise
        except Exception as err:
            module = type(err).__module__
            if not module.startswith(("google.", "requests", "urllib3")):
                raise
            code = getattr(err, "code", None)
            what = f"GCS said {int(code)}" if code else type(err).__name__
            message = getattr(err, "message", None) or str(err)
            raise StorageError(f"{uri}: {what}: {message.splitlines()[0][:200]}") from None

    return wrapper


def is_gcs(uri: str) -> bool:
    return str(uri).startswith(GCS_PREFIX)


def join(uri: str, *parts: str) -> str:
    uri = str(uri)
    if is_gcs(uri):
        out = uri.rstrip("/")
        for p in parts:
            out = f"{out}/{str(p).strip('/')}"
        return out
    return str(Path(uri).joinpath(*parts))


def split_gcs(uri: str) -> tuple[str, str]:
    rest = uri[len(GCS_PREFIX) :]
    bucket, _, name = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket in gs:// URI")
    return bucket, name


@functools.lru_cache(maxsize=1)
def _client():
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="local", credentials=AnonymousCredentials())
    return storage.Client()


def _blob(uri: str):
    bucket, name = split_gcs(uri)
    return _client().bucket(bucket).blob(name)


@_named_errors
def exists(uri: str) -> bool:
    if is_gcs(uri):
        return _blob(uri).exists()
    return Path(uri).exists()


@_named_errors
def read_bytes(uri: str) -> bytes:
    try:
        if is_gcs(uri):
            return _blob(uri).download_as_bytes(retry=_retry())
        with open(uri, "rb") as file:  # (not pathlib: convert reads every media file here)
            return file.read()
    except FileNotFoundError:
        raise StorageError(f"{uri} does not exist") from None
    except Exception as err:
        if type(err).__name__ == "NotFound":
            raise StorageError(f"{uri} does not exist") from None
        raise


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def _local_tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")


@functools.lru_cache(maxsize=1)
def _retry():
    """google-cloud-storage's own retry (429, 5xx, connection errors, timeouts), sooner."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_delay(initial=0.25, maximum=16.0, multiplier=2.0)


def _generation(blob) -> int:
    """The object's current generation; 0 when it does not exist (what a create matches)."""
    from google.api_core.exceptions import NotFound

    try:
        blob.reload(retry=_retry())
    except NotFound:
        return 0
    return int(blob.generation or 0)


def _holds(uri: str, data: bytes) -> bool:
    """Whether the object at ``uri`` now holds exactly ``data``."""
    try:
        return read_bytes(uri) == data
    except StorageError:
        return False


def _upload_over(uri: str, data: bytes, generation: int) -> bool:
    """Upload ``data`` in place of ``generation`` (0: create). False when the object has
    moved on without this write; a retry that finds its own lost attempt landed is True."""
    from google.api_core.exceptions import PreconditionFailed

    try:
        _blob(uri).upload_from_string(data, if_generation_match=generation, retry=_retry())
    except PreconditionFailed:
        return _holds(uri, data)
    return True


@_named_errors
def write_bytes(uri: str, data: bytes) -> None:
    """Atomic write (local: temp file + rename; GCS: a single-object upload is atomic)."""
    if is_gcs(uri):
        if not _upload_over(uri, data, _generation(_blob(uri))):
            raise StorageError(f"{uri} was replaced by another writer while this one wrote it")
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _local_tmp_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


# GCS caps a composite object's components; past this many, an append rewrites it whole once.
MAX_COMPOSE_COMPONENTS = 1000


@_named_errors
def append_text(uri: str, text: str) -> None:
    """Add ``text`` at the end of a file, creating it (not atomic: a crash may leave a torn
    last line, which readers of append-only logs skip).

    Local: an ``"a"`` write. GCS: the new bytes are uploaded as a temporary object and
    composed onto the end server-side, so the existing bytes are never re-sent."""
    if not text:
        return
    if not is_gcs(uri):
        path = Path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    from google.api_core.exceptions import PreconditionFailed

    data = text.encode("utf-8")
    blob = _blob(uri)
    generation = _generation(blob)
    if generation == 0 or (blob.component_count or 1) >= MAX_COMPOSE_COMPONENTS:
        old = blob.download_as_bytes(retry=_retry()) if generation else b""
        if not _upload_over(uri, old + data, generation):
            raise StorageError(f"{uri} was appended to by another writer at the same time")
        return
    part = _blob(f"{uri}.append-{uuid.uuid4().hex[:8]}")
    part.upload_from_string(data, if_generation_match=0, retry=_retry())
    try:
        # a fresh handle as the destination: the request must not carry the old checksums
        _blob(uri).compose([blob, part], if_generation_match=generation, retry=_retry())
    except PreconditionFailed:
        # a retry of a compose that landed (its response lost) finds the object one append on
        now = _blob(uri)
        now.reload(retry=_retry())
        landed = now.size == blob.size + len(data) and read_bytes(uri).endswith(data)
        if not landed:
            raise StorageError(
                f"{uri} was appended to by another writer at the same time"
            ) from None
    finally:
        part.delete(retry=_retry())


@_named_errors
def create_exclusive(uri: str, data: bytes) -> bool:
    """Create ``uri`` with ``data`` only if it does not exist yet. True if this call created it."""
    if is_gcs(uri):
        from google.api_core.exceptions import PreconditionFailed

        try:
            _blob(uri).upload_from_string(data, if_generation_match=0, retry=_retry())
        except PreconditionFailed:  # another writer's, or this call's own retried attempt
            return _holds(uri, data)
        return True
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _local_tmp_path(path)
    try:
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)  # fails if path exists: atomic create-once
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


@_named_errors
def delete(uri: str) -> None:
    if is_gcs(uri):
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            _blob(uri).delete(retry=_retry())
        return
    Path(uri).unlink(missing_ok=True)


@_named_errors
def delete_tree(uri: str) -> None:
    if is_gcs(uri):
        bucket, prefix = split_gcs(uri)
        for blob in _client().list_blobs(bucket, prefix=prefix.rstrip("/") + "/"):
            blob.delete()
        return
    shutil.rmtree(uri, ignore_errors=True)


@dataclass(frozen=True)
class FileInfo:
    path: str  # relative to the listed root, '/'-separated
    size: int
    generation: int | None = None  # GCS: the object's generation (new on every write)
    checksum: str | None = None  # GCS: as :func:`checksum` gives it, free with the listing


@_named_errors
def list_files(uri: str) -> list[FileInfo]:
    """Every file below ``uri`` (recursive), sorted, with sizes. Temp files are skipped."""
    out = []
    if is_gcs(uri):
        bucket, prefix = split_gcs(uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        for blob in _client().list_blobs(bucket, prefix=prefix, retry=_retry()):
            name = blob.name[len(prefix) :]
            out.append(
                FileInfo(name, int(blob.size or 0), int(blob.generation or 0), _blob_checksum(blob))
            )
    else:
        root = Path(uri)
        if root.is_dir():
            for p in root.rglob("*"):
                if p.is_file() and not p.name.endswith(".partial"):
                    out.append(FileInfo(p.relative_to(root).as_posix(), p.stat().st_size))
    return sorted(out, key=lambda f: f.path)


def _blob_checksum(blob) -> str:
    if blob.md5_hash:
        return f"md5:{blob.md5_hash}"
    return f"crc32c:{blob.crc32c}"  # composite objects carry no md5


@_named_errors
def checksum(uri: str, kind: str = "md5") -> str:
    """``md5:<base64>`` of the object's bytes (the form GCS reports natively).

    GCS gives the object's own (``crc32c:`` for a composite object, which carries no md5)
    without a download; a local file is hashed as ``kind`` asks ("md5" or "crc32c"), so a
    file copied down from a composite object can be compared with what its listing said."""
    if is_gcs(uri):
        blob = _blob(uri)
        blob.reload()
        return _blob_checksum(blob)
    hasher = _hasher(kind)
    with open(uri, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            hasher.update(chunk)
    return f"{kind}:" + base64.b64encode(hasher.digest()).decode()


def bytes_checksum(data: bytes, kind: str = "md5") -> str:
    """:func:`checksum` of bytes in memory."""
    hasher = _hasher(kind)
    hasher.update(data)
    return f"{kind}:" + base64.b64encode(hasher.digest()).decode()


def _hasher(kind: str):
    if kind == "crc32c":
        import google_crc32c

        return google_crc32c.Checksum()
    return hashlib.md5(usedforsecurity=False)


@_named_errors
def upload_file(local_path: str | os.PathLike, uri: str) -> None:
    """Copy a local file to ``uri`` (atomic, as :func:`write_bytes`)."""
    if is_gcs(uri):
        from google.api_core.exceptions import PreconditionFailed

        generation = _generation(_blob(uri))
        try:
            _blob(uri).upload_from_filename(
                str(local_path), if_generation_match=generation, retry=_retry()
            )
        except PreconditionFailed:  # landed on an earlier attempt, or another writer's
            if checksum(uri) != checksum(str(local_path)):
                raise StorageError(
                    f"{uri} was replaced by another writer while this one wrote it"
                ) from None
        return
    dest = Path(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _local_tmp_path(dest)
    try:
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def cache_dir() -> Path:
    root = os.environ.get("DIFFORGE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "difforge"
    )
    return Path(root)


@_named_errors
def local_copy(uri: str) -> Path:
    """A local directory/file for ``uri``: itself when local, else a cached download.

    GCS objects are downloaded into ``$DIFFORGE_CACHE/gcs/<bucket>/<path>``; a cached file is
    reused only while its object still has the generation it was downloaded at (recorded in
    an index beside the cached tree), so an object rewritten at the same URI (re-exported
    weights, shards rebuilt with ``--force``) is fetched again even when its size is the same.
    Each download asks for the listed generation and is checksum-verified by the client;
    cached files whose objects are gone are removed.
    """
    if not is_gcs(uri):
        return Path(uri)
    bucket, name = split_gcs(uri)
    dest = cache_dir() / "gcs" / bucket / name
    files = list_files(uri)
    if not files:  # a single object
        blob = _blob(uri)
        blob.reload()
        files, single = [FileInfo("", int(blob.size or 0), int(blob.generation or 0))], True
    else:
        single = False
    index_path = dest.parent / f".{dest.name}.difforge-cache.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    fresh = {}
    for f in files:
        target = dest if single else dest / f.path
        if (
            index.get(f.path) == f.generation
            and target.is_file()
            and target.stat().st_size == f.size
        ):
            fresh[f.path] = f.generation
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _local_tmp_path(target)
        source = uri if single else join(uri, f.path)
        try:
            _blob(source).download_to_filename(
                str(tmp), if_generation_match=f.generation or None, checksum="auto"
            )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        fresh[f.path] = f.generation
    if not single and dest.is_dir():  # files of objects deleted since the last copy
        listed = {f.path for f in files}
        for path in dest.rglob("*"):
            if path.is_file() and path.relative_to(dest).as_posix() not in listed:
                path.unlink()
    index_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _local_tmp_path(index_path)
    tmp.write_text(json.dumps(fresh, sort_keys=True))
    os.replace(tmp, index_path)
    return dest


def iter_lines(uri: str) -> Iterator[str]:
    yield from read_text(uri).splitlines()
