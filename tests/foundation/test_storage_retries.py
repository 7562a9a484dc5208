"""Transient GCS errors are retried, and a retry never overwrites another writer's object:
the local GCS server injects 429/503 answers, lost responses (the work done, an error
answered) and dropped connections (tests/support/gcs_server.py ``/_faults``)."""

from __future__ import annotations

import pytest

from jaxcore import storage
from tests.support.gcs_faults import arm as faults
from tests.support.gcs_faults import injected

pytestmark = pytest.mark.gcs


@pytest.fixture
def server(gcs_server):
    faults(gcs_server)
    yield gcs_server
    faults(gcs_server)


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "write", "status": 503, "count": 2},
        {"op": "write", "status": 429},
        {"op": "write", "mode": "drop"},
        {"op": "write", "status": 503, "mode": "after"},  # landed; the answer was lost
        {"op": "metadata", "status": 503},
    ],
    ids=["503x2", "429", "dropped", "lost-answer", "metadata-503"],
)
def test_writes_survive_transient_errors(server, gcs_root, rule):
    uri = storage.join(gcs_root, "a.txt")
    storage.write_text(uri, "old")
    faults(server, rule)
    storage.write_text(uri, "new")
    assert injected(server) >= 1
    faults(server)
    assert storage.read_text(uri) == "new"
    assert [f.path for f in storage.list_files(gcs_root)] == ["a.txt"]


def test_reads_and_listings_survive_transient_errors(server, gcs_root):
    storage.write_text(storage.join(gcs_root, "a.txt"), "abc")
    faults(server, {"op": "read", "status": 503, "count": 2}, {"op": "list", "status": 429})
    assert storage.read_text(storage.join(gcs_root, "a.txt")) == "abc"
    assert [f.path for f in storage.list_files(gcs_root)] == ["a.txt"]
    assert injected(server) == 3


def test_create_once_whose_answer_was_lost_still_reports_its_own_creation(server, gcs_root):
    uri = storage.join(gcs_root, "manifest.json")
    faults(server, {"op": "write", "status": 503, "mode": "after"})
    assert storage.create_exclusive(uri, b"mine")
    faults(server)
    assert not storage.create_exclusive(uri, b"another")  # and it is created once
    assert storage.read_bytes(uri) == b"mine"


def test_an_append_whose_answer_was_lost_appends_once(server, gcs_root):
    uri = storage.join(gcs_root, "metrics.jsonl")
    storage.append_text(uri, "1\n")
    storage.append_text(uri, "2\n")
    faults(server, {"op": "compose", "status": 503, "mode": "after"})
    storage.append_text(uri, "3\n")
    faults(server, {"op": "write", "status": 503, "count": 2})
    storage.append_text(uri, "4\n")
    faults(server)
    assert storage.read_text(uri) == "1\n2\n3\n4\n"
    assert [f.path for f in storage.list_files(gcs_root)] == ["metrics.jsonl"]  # no parts left


def test_a_retry_never_overwrites_another_writer(server, gcs_root, monkeypatch):
    """This writer read generation g; another replaced the object before its upload landed:
    the upload (conditional on g) is refused, and the other writer's bytes stay."""
    uri = storage.join(gcs_root, "a.txt")
    storage.write_text(uri, "first")
    stale = storage._generation(storage._blob(uri))
    storage.write_text(uri, "the other writer's")
    monkeypatch.setattr(storage, "_generation", lambda blob: stale)
    with pytest.raises(storage.StorageError, match="a.txt was replaced by another writer"):
        storage.write_text(uri, "mine")
    assert storage.read_text(uri) == "the other writer's"


def test_a_permanent_error_is_one_error_naming_the_object(server, gcs_root):
    uri = storage.join(gcs_root, "a.txt")
    faults(server, {"op": "write", "status": 403, "count": 1000})
    with pytest.raises(storage.StorageError, match=r"a.txt: GCS said 403: .*injected fault"):
        storage.write_text(uri, "x")
    faults(server, {"op": "read", "status": 404, "count": 1000})
    with pytest.raises(storage.StorageError, match="a.txt does not exist"):
        storage.read_bytes(uri)
