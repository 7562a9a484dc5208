"""Replacing a library's attribute for the span of a ``with`` block (convert's fast paths over
``datasets`` and Beam internals, each guarded by a check of what it replaces)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def replaced(owner, name: str, replacement) -> Iterator[None]:
    """``owner.name`` is ``replacement`` inside the block; afterwards the original again, unless
    something else replaced it meanwhile (then that stays)."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if getattr(owner, name) is replacement:
            setattr(owner, name, original)
