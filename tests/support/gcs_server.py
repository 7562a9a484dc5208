"""A real local GCS server for tests: gcp-storage-emulator with two fixes real GCS has.

1. Preconditions: ``ifGenerationMatch`` on uploads is enforced (the stock emulator ignores it),
   so "create exactly once" (``if_generation_match=0``) can be tested for real.
2. Downloads carry the ``x-goog-generation`` header (orbax/tensorstore need it).

Run: ``python -m tests.support.gcs_server --port PORT --bucket NAME``.
"""

from __future__ import annotations

import argparse
import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_lock = threading.Lock()
_stock_insert = objects.insert
_stock_download = objects.download


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

from gcp_storage_emulator.server import create_server  # noqa: E402  (after the patches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", default="difforge-test")
    args = parser.parse_args()
    create_server(args.host, args.port, in_memory=True, default_bucket=args.bucket).run()


if __name__ == "__main__":
    main()
