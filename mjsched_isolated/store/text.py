"""Fitting text and JSON to the column cap before they are written.

The cap is :data:`mjsched_isolated.protocol.MAX_TEXT_BYTES`, the one cap shared with the worker (which
trims before sending; the store enforces it again here). Subjects get a smaller cap of their own.
"""

from __future__ import annotations

import json
from typing import Any

from mjsched_isolated.protocol import MAX_TEXT_BYTES

MAX_SUBJECT_BYTES = 1_000
"""A notice subject's cap in UTF-8 bytes (a subject is one line, not a body)."""


def fit_text(value: str | None, max_bytes: int = MAX_TEXT_BYTES) -> str | None:
    """``value`` cut to at most ``max_bytes`` of UTF-8 (on a character boundary), marked when cut with
    ``[... cut: N bytes in all]``; None stays None."""
    if value is None or len(value) * 4 <= max_bytes:
        return value
    encoded = value.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return value
    mark = f" [... cut: {len(encoded)} bytes in all]"
    return encoded[:max_bytes - len(mark.encode()) - 8].decode("utf-8", errors="ignore") + mark


def fit_json(details: dict[str, Any] | None, max_bytes: int = MAX_TEXT_BYTES) -> str | None:
    """``details`` as JSON text of at most ``max_bytes`` UTF-8 bytes; a larger one becomes the preview
    object ``{"truncated": true, "size_bytes": N, "preview": "<first 2,000 characters>"}``."""
    if details is None:
        return None
    text = json.dumps(details)
    size = len(text.encode("utf-8"))
    if size <= max_bytes:
        return text
    return json.dumps({"truncated": True, "size_bytes": size, "preview": text[:2000]})
