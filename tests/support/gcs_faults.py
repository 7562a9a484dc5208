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
