"""A repeating failure logged once, not at every try (:class:`Trouble`), and a SQLite file deleted or
replaced under a running supervisor (:class:`DatabaseFile`).

The loop polls every ``rescan_interval_s`` and renews every second while the database is away; logging
each failure would bury the log (issue 12: "poll failures are logged every second, not once as
documented"). A :class:`Trouble` logs the first failure, a reminder with the count of repeats at most every
:data:`REMIND_S` seconds (and at once if the reason changes), and one line when it is over, with how many
tries failed over how long. Times are monotonic seconds passed in by the caller.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import sqlalchemy as sa

REMIND_S = 60.0


class Trouble:
    """One kind of failure (``what``: "poll", "lease renewal", ...) reported on ``logger``."""

    def __init__(self, logger: logging.Logger, what: str, remind_s: float = REMIND_S) -> None:
        self.log = logger
        self.what = what
        self.remind_s = remind_s
        self.since: float | None = None  # monotonic start of the current trouble
        self.count = 0  # failures since then
        self.reason: str | None = None
        self._reminded_at = 0.0
        self._reminded_count = 0

    @property
    def failing(self) -> bool:
        return self.since is not None

    def failed(self, reason: str, mono: float, extra: str = "") -> None:
        """A failure at ``mono``: logged if it is the first, if ``reason`` changed, or as a reminder with the
        count of repeats once ``remind_s`` passed since the last line. ``extra``: appended to the first line."""
        self.count += 1
        if self.since is None:
            self.since, self.reason, self._reminded_at, self._reminded_count = mono, reason, mono, self.count
            self.log.warning("%s failed (%s)%s; repeats are counted and logged at most every %.0f s", self.what,
                             reason, extra, self.remind_s)
            return
        changed = reason != self.reason
        if changed or mono - self._reminded_at >= self.remind_s:
            self.log.warning("%s still failing: %d failure(s) in %.0f s (%d since the last report); latest: %s",
                             self.what, self.count, mono - self.since, self.count - self._reminded_count, reason)
            self.reason, self._reminded_at, self._reminded_count = reason, mono, self.count

    def reset(self) -> int:
        """End the trouble without a line (the caller says it its own way); returns the failure count."""
        count = self.count
        self.since, self.count, self.reason = None, 0, None
        return count

    def recovered(self, mono: float) -> None:
        """A success: if failing, log the end with the count and duration, and reset."""
        if self.since is None:
            return
        self.log.warning("%s works again after %d failure(s) over %.1f s", self.what, self.count, mono - self.since)
        self.since, self.count, self.reason = None, 0, None


def is_read_only_error(exc: BaseException) -> bool:
    """Does ``exc`` say the database refuses writes (SQLite "attempt to write a readonly database",
    PostgreSQL "cannot execute ... in a read-only transaction", MySQL "--read-only option")?"""
    text = str(getattr(exc, "orig", None) or exc).lower()
    return any(marker in text for marker in ("readonly database", "read-only", "read only"))


class DatabaseLostError(Exception):
    """The SQLite file this supervisor opened is gone or is another file now."""


class DatabaseFile:
    """The identity (device, inode) of the SQLite file a supervisor opened. SQLite keeps writing to a
    deleted file through its open descriptor, unnoticed, while the next CLI command creates a new empty
    database at the path (issue 12); :meth:`check` (one ``stat`` per loop step) turns that into a poll
    failure: nothing more is dispatched, the failure is logged once and ``/healthz`` is unhealthy."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.identity = self._identity() if path is not None else None

    @classmethod
    def of(cls, url: sa.engine.URL) -> DatabaseFile:
        """For a file-backed SQLite URL; a no-op checker for anything else (memory, servers)."""
        database = url.database or ""
        if not url.drivername.startswith("sqlite") or database in ("", ":memory:") or database.startswith("file:"):
            return cls(None)
        return cls(Path(database).resolve())

    def _identity(self) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def check(self) -> None:
        """Raise :class:`DatabaseLostError` if the file was deleted or replaced since it was opened."""
        if self.path is None or self.identity is None:
            return
        now = self._identity()
        if now is None:
            raise DatabaseLostError(f"database file {self.path} was deleted while this supervisor had it open; "
                                    "nothing is dispatched until it is restored (restart serve to use a new one)")
        if now != self.identity:
            raise DatabaseLostError(f"database file {self.path} was replaced by another file while this "
                                    "supervisor had it open; nothing is dispatched (restart serve to use it)")
