"""``sqlite_backup`` job type: online backup of a SQLite database with ``sqlite3.Connection.backup``.

The source is opened read-only (``file:...?mode=ro``), so a missing path is an error and never creates an
empty database. The copy is written to ``.<name>.partial`` in ``destination_dir``, fsynced, then renamed
with ``os.replace`` to ``<stem>-YYYYMMDDTHHMMSSffffffZ.db`` (UTC), so a partial copy never counts as a
backup. The copy is switched to ``journal_mode=DELETE`` (a single self-contained file, even when the
source uses WAL). Afterwards only the newest ``keep_last`` files named ``<stem>-<timestamp>Z.db`` are kept; other
files in the directory are never touched.

Details: ``database``, ``backup_path``, ``size_bytes``, ``pages`` (database pages copied),
``duration_ms``, ``removed`` (file names of pruned older backups), ``kept`` (backups now present),
``prune_errors`` (``{"file", "error"}`` for backups that could not be removed).
"""

import datetime as dt
import os
import re
import sqlite3
import time
import urllib.parse
from pathlib import Path
from typing import Annotated

import msgspec

from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
)
from mjsched_isolated.errors import ConfigurationError

_HEARTBEAT_EVERY_S = 1.0


class SqliteBackupConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``database``: path of the SQLite file to copy. ``destination_dir``: where backups go (created if
    absent). ``keep_last``: backups of this database to keep, newest first, including the new one.
    ``pages_per_step``: pages copied per backup step (between steps other connections may write and a
    heartbeat is sent)."""

    database: str
    destination_dir: str
    keep_last: Annotated[int, msgspec.Meta(ge=1)] = 5
    pages_per_step: Annotated[int, msgspec.Meta(ge=1)] = 1024


def backup_pattern(stem: str) -> re.Pattern[str]:
    """Regex matching the backup file names made for a database with this ``stem``."""
    return re.compile(re.escape(stem) + r"-\d{8}T\d{12}Z\.db\Z")


class SqliteBackupJob(BaseScheduledJob[SqliteBackupConfiguration]):
    """Copy a live SQLite database to a timestamped file and prune old copies."""

    job_type = "sqlite_backup"
    configuration_type = SqliteBackupConfiguration
    description = "Online backup of a SQLite database to timestamped files, keeping the newest N"

    def validate_configuration(self, configuration: SqliteBackupConfiguration) -> None:
        db = configuration.database
        if not db or "\0" in db or db == ":memory:" or db.startswith("file:"):
            raise ConfigurationError("configuration.database: must be a plain file path (not ':memory:' or a URI)")
        if not Path(db).stem:
            raise ConfigurationError("configuration.database: file name must not be empty")
        if not configuration.destination_dir or "\0" in configuration.destination_dir:
            raise ConfigurationError("configuration.destination_dir: must be a non-empty path without NUL characters")

    def execute(self, context: JobContext[SqliteBackupConfiguration]) -> ScheduledJobResult:
        cfg: SqliteBackupConfiguration = context.configuration
        start = time.monotonic()
        source = Path(cfg.database)
        details: dict = {"database": cfg.database, "backup_path": None, "removed": []}
        if not source.is_file():
            return _fail(details, start, f"database not found: {cfg.database}")
        dest_dir = Path(cfg.destination_dir)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        final = dest_dir / f"{source.stem}-{stamp}.db"
        partial = dest_dir / f".{final.name}.partial"
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
            details["pages"] = self._copy(source, partial, cfg.pages_per_step, context)
            with open(partial, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(partial, final)
        except (sqlite3.Error, OSError) as exc:
            partial.unlink(missing_ok=True)
            return _fail(details, start, f"backup failed: {type(exc).__name__}: {exc}")
        details["backup_path"] = str(final)
        details["size_bytes"] = final.stat().st_size

        try:
            removed, errors, kept = _prune(dest_dir, source.stem, cfg.keep_last)
        except OSError as exc:  # the directory itself could not be listed
            removed, errors, kept = [], [{"file": str(dest_dir), "error": f"{type(exc).__name__}: {exc}"}], None
        details.update(removed=removed, kept=kept, prune_errors=errors, duration_ms=_ms(start))
        if errors:
            return ScheduledJobResult(
                success=False, details=details,
                error_message=f"backup written but {len(errors)} old backup(s) could not be removed",
            )
        return ScheduledJobResult(success=True, details=details)

    @staticmethod
    def _copy(source: Path, target: Path, pages_per_step: int, context: JobContext[SqliteBackupConfiguration]) -> int:
        """Back up ``source`` into a fresh ``target`` file; return the page count copied."""
        uri = "file:" + urllib.parse.quote(str(source.resolve())) + "?mode=ro"
        total = 0
        last_beat = time.monotonic()

        def progress(_status: int, _remaining: int, page_count: int) -> None:
            nonlocal total, last_beat
            total = page_count
            if time.monotonic() - last_beat >= _HEARTBEAT_EVERY_S:
                context.heartbeat()
                last_beat = time.monotonic()

        target.unlink(missing_ok=True)
        src = sqlite3.connect(uri, uri=True)
        try:
            dst = sqlite3.connect(str(target))
            try:
                src.backup(dst, pages=pages_per_step, progress=progress)
                # The copy inherits the source's journal mode; a WAL-mode copy would grow -wal/-shm files
                # whenever it is opened. Make it a self-contained rollback-journal file.
                dst.execute("PRAGMA journal_mode=DELETE").fetchone()
                if not total:
                    total = dst.execute("PRAGMA page_count").fetchone()[0]
            finally:
                dst.close()
        finally:
            src.close()
        return total

    def format_notification(self, context: JobContext[SqliteBackupConfiguration],
            result: ScheduledJobResult) -> NotificationContent:
        d = result.details or {}
        if result.success:
            return NotificationContent(
                subject=f"Scheduled job '{context.job_name}' completed",
                body=(
                    f"Run {context.run_id}: backed up {d.get('database')} to {d.get('backup_path')} "
                    f"({d.get('size_bytes')} bytes, {d.get('pages')} pages); "
                    f"removed {len(d.get('removed') or [])} old backup(s)."
                ),
            )
        return NotificationContent(
            subject=f"Scheduled job '{context.job_name}' failed",
            body=f"Run {context.run_id}: backup of {d.get('database')} failed: {result.error_message}.",
            priority="High",
        )


def _prune(dest_dir: Path, stem: str, keep_last: int) -> tuple[list[str], list[dict], int | None]:
    """Remove all but the newest ``keep_last`` backups of ``stem``; return (removed, errors, kept)."""
    pattern = backup_pattern(stem)
    names = sorted((p.name for p in dest_dir.iterdir() if pattern.match(p.name) and p.is_file()), reverse=True)
    removed, errors = [], []
    for name in names[keep_last:]:
        try:
            (dest_dir / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            removed.append(name)
        except OSError as exc:
            errors.append({"file": name, "error": f"{type(exc).__name__}: {exc.strerror or exc}"})
    return removed, errors, len(names) - len(removed)


def _fail(details: dict, start: float, message: str) -> ScheduledJobResult:
    details["duration_ms"] = _ms(start)
    return ScheduledJobResult(success=False, details=details, error_message=message)


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
