"""A real local GCS server for tests: gcp-storage-emulator with two fixes real GCS has.

1. Preconditions: ``ifGenerationMatch`` on uploads and composes is enforced (the stock
   emulator ignores it), so "create exactly once" (``if_generation_match=0``) and "a retry
   never overwrites" can be tested for real.
2. Downloads carry the ``x-goog-generation`` header (orbax/tensorstore need it).

And faults on request, for the fault-injection tests (tests/faults): ``POST /_faults`` with
``{"rules": [{"op", "nth", "count", "status", "mode"}]}`` makes the ``nth`` to
``nth + count - 1``-th request of kind ``op`` (read, write, compose, list, metadata, delete,
any) fail: ``mode`` "before" answers ``status`` without doing it, "after" does it and then
answers ``status`` (a lost response), "drop" closes the connection unanswered. ``GET
/_faults`` reports how many were injected.

Run: ``python -m tests.support.gcs_server --port PORT --bucket NAME``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
from http import HTTPStatus
from urllib.parse import parse_qs, urlparse

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_lock = threading.Lock()
_stock_insert = objects.insert
_stock_download = objects.download
_stock_compose = objects.compose


def _precondition_failed(request, storage) -> bool:
    wanted = request.query.get("ifGenerationMatch")
    if not wanted:
        return False
    name = (request.query.get("name") or [None])[0]
    if name is None and isinstance(request.data, dict):
        name = (request.data.get("meta") or {}).get("name") or request.data.get("name")
    try:
        current = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
    except NotFound:
        current = "0"
    return str(current) != str(wanted[0])


def insert(request, response, storage, *args, **kwargs):
    # One lock makes check-then-create atomic, as a real server's precondition is.
    with _lock:
        if _precondition_failed(request, storage):
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            return None
        return _stock_insert(request, response, storage, *args, **kwargs)


def compose(request, response, storage, *args, **kwargs):
    # The destination's precondition, as real GCS checks it (the stock emulator ignores it).
    with _lock:
        wanted = request.query.get("ifGenerationMatch")
        if wanted:
            try:
                current = storage.get_file_obj(
                    request.params["bucket_name"], request.params["object_id"]
                )["generation"]
            except NotFound:
                current = "0"
            if str(current) != str(wanted[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
        return _stock_compose(request, response, storage, *args, **kwargs)


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    except NotFound:
        pass
    return _stock_download(request, response, storage, *args, **kwargs)


objects.insert = insert
objects.download = download
objects.compose = compose

from gcp_storage_emulator import server as _server  # noqa: E402  (after the patches)

_faults_lock = threading.Lock()
_plan: dict = {"rules": [], "seen": [], "injected": 0}
_answer = threading.local()


def _kind(method: str, path: str, query: dict) -> str:
    if path.endswith("/compose"):
        return "compose"
    if method == "DELETE":
        return "delete"
    if method in ("POST", "PUT") and (path.startswith("/upload") or "uploadType" in query):
        return "write"
    if method == "GET" and (path.startswith("/download") or query.get("alt") == ["media"]):
        return "read"
    if method == "GET" and path.endswith("/o"):
        return "list"
    return "metadata" if method == "GET" else "other"


def _fault_for(kind: str):
    """The rule this request falls under, counting it, or None."""
    with _faults_lock:
        for i, rule in enumerate(_plan["rules"]):
            if rule["op"] not in (kind, "any"):
                continue
            _plan["seen"][i] += 1
            first = int(rule.get("nth", 1))
            if first <= _plan["seen"][i] < first + int(rule.get("count", 1)):
                _plan["injected"] += 1
                return rule
    return None


def _control(handler, method: str) -> None:
    if method == "POST":
        length = int(handler.headers.get("Content-Length") or 0)
        rules = json.loads(handler.rfile.read(length) or b"{}").get("rules", [])
        with _faults_lock:
            _plan.update(rules=rules, seen=[0] * len(rules), injected=0)
    with _faults_lock:
        body = json.dumps({"injected": _plan["injected"], "seen": _plan["seen"]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


_stock_handle = _server.Router.handle
_stock_close = _server.Response.close


def _close(self):
    status = getattr(_answer, "status", None)
    if status:  # the work is done; the client hears an error instead (a lost response)
        _answer.status = None
        self.status = HTTPStatus(status)
        self._headers = {"Content-type": "application/json"}
        self._content = json.dumps({"error": {"code": status, "message": "injected fault"}})
    _stock_close(self)


def _handle(self, method):
    handler = self._request_handler
    method = handler.headers.get("x-http-method-override") or method
    url = urlparse(handler.path)
    if url.path == "/_faults":
        return _control(handler, method)
    rule = _fault_for(_kind(method, url.path, parse_qs(url.query)))
    if rule is None:
        return _stock_handle(self, method)
    mode, status = rule.get("mode", "before"), int(rule.get("status", 503))
    if mode == "after":
        _answer.status = status
        return _stock_handle(self, method)
    handler.close_connection = True  # the request's body is left unread
    if mode == "drop":
        with contextlib.suppress(OSError):
            handler.connection.shutdown(socket.SHUT_RDWR)
        return None
    body = json.dumps({"error": {"code": status, "message": "injected fault"}}).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(body)
    return None


_server.Router.handle = _handle
_server.Response.close = _close
create_server = _server.create_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", default="difforge-test")
    args = parser.parse_args()
    create_server(args.host, args.port, in_memory=True, default_bucket=args.bucket).run()


if __name__ == "__main__":
    main()
