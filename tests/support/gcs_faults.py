"""Arm the local GCS server's faults (tests/support/gcs_server.py ``/_faults``) from a test."""

from __future__ import annotations

import json
import urllib.request


def arm(server: str, *rules: dict) -> None:
    """Replace the server's fault rules with ``rules`` (none: disarm) and reset its counts."""
    body = json.dumps({"rules": list(rules)}).encode()
    request = urllib.request.Request(f"{server}/_faults", data=body, method="POST")
    urllib.request.urlopen(request, timeout=10).read()


def injected(server: str) -> int:
    """How many requests the server has failed since it was last armed."""
    return json.loads(urllib.request.urlopen(f"{server}/_faults", timeout=10).read())["injected"]


KINDS = ("read", "write", "compose", "list", "metadata", "delete")


def count_requests(server: str) -> None:
    """Arm rules that never fire, one per request kind: :func:`requests_seen` then tells how
    many requests of each kind came since."""
    arm(server, *({"op": kind, "nth": 10**12} for kind in KINDS))


def requests_seen(server: str) -> dict[str, int]:
    """Requests of each kind since :func:`count_requests`."""
    seen = json.loads(urllib.request.urlopen(f"{server}/_faults", timeout=10).read())["seen"]
    return dict(zip(KINDS, seen, strict=True))
