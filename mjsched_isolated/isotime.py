"""One spelling of instants in text: ISO 8601, UTC, with a ``Z`` (logs, notices, CLI tables and JSON)."""

from __future__ import annotations

import datetime as dt
from typing import Any, TypeVar, overload

T = TypeVar("T")

UTC = dt.UTC


@overload
def iso(when: dt.datetime, *, timespec: str = ..., missing: str | None = ...) -> str: ...
@overload
def iso(when: None, *, timespec: str = ..., missing: T = ...) -> T: ...
@overload
def iso(when: dt.datetime | None, *, timespec: str = ..., missing: T = ...) -> str | T: ...
def iso(when: dt.datetime | None, *, timespec: str = "auto", missing: Any = "-") -> Any:
    """``when`` as ``2026-12-01T21:00:00.123456Z`` (aware: converted to UTC; naive: taken as UTC), or
    ``missing`` for None. ``timespec`` as for :meth:`datetime.isoformat` (``"seconds"`` for tables)."""
    if when is None:
        return missing
    if timespec == "auto":  # log lines name the same instants again and again (a due occurrence, a deadline)
        text = _AUTO.get(when)
        if text is None:
            if len(_AUTO) >= CACHE_SIZE:
                _AUTO.clear()
            text = _AUTO[when] = _iso(when, timespec)
        return text
    return _iso(when, timespec)


def _iso(when: dt.datetime, timespec: str) -> str:
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


CACHE_SIZE = 256
_AUTO: dict[dt.datetime, str] = {}  # the texts of recent instants (equal datetimes: one instant, one text)


def parse_iso(text: str) -> dt.datetime:
    """Parse ISO 8601 (a trailing ``Z`` allowed); naive results stay naive. Raises ``ValueError``."""
    text = text.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    return dt.datetime.fromisoformat(text)
