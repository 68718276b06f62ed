"""``file_retention`` job type: delete regular files under a directory whose age exceeds a limit.

Matching: ``pattern`` is a relative glob on ``/``-separated paths below ``directory``: ``*`` and ``?``
never cross a ``/``, ``[...]`` is a character class, a ``**`` component matches zero or more
directories. As with ``pathlib``, ``*`` also matches names starting with a dot. The walk never follows
symbolic links (a link to a directory is not entered, a link to a file is not a regular file), so nothing
outside ``directory`` is touched; directories are never removed. Age is ``time.time() - st_mtime``.
With ``max_deletes`` the oldest eligible files go first.

Details: ``directory``, ``pattern``, ``dry_run``, ``cutoff`` (ISO-8601 UTC: files modified before it are
eligible), ``matched`` (regular files matching), ``eligible`` (of those, old enough), ``removed`` (relative
paths, first 100; in a dry run, what would be removed), ``removed_count``, ``removed_truncated``,
``bytes_freed`` (sum of sizes, would-be in a dry run), ``skipped_by_cap`` (eligible files left because of
``max_deletes``), ``errors`` (first 100 ``{"path", "error"}``), ``error_count``.
"""

import datetime as dt
import os
import re
import stat
import time
from typing import Annotated

import msgspec

from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
)
from mjsched_isolated.errors import ConfigurationError

_LIST_LIMIT = 100
_HEARTBEAT_EVERY_S = 10.0


class FileRetentionConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``directory``: the root (relative paths are relative to the worker's cwd). ``pattern``: relative
    glob, e.g. ``"*.log"`` or ``"**/*.tmp"``. ``older_than_days``: age limit in days (fractions allowed).
    ``dry_run``: only report. ``max_deletes``: cap on files deleted per run (None = no cap)."""

    directory: str
    pattern: str
    older_than_days: Annotated[float, msgspec.Meta(gt=0)]
    dry_run: bool = False
    max_deletes: Annotated[int, msgspec.Meta(ge=1)] | None = None


class FileRetentionJob(BaseScheduledJob[FileRetentionConfiguration]):
    """Remove old files matching a glob; fails (after trying all) if any file could not be removed."""

    job_type = "file_retention"
    configuration_type = FileRetentionConfiguration
    description = "Delete regular files matching a glob under a directory once older than N days"

    def validate_configuration(self, configuration: FileRetentionConfiguration) -> None:
        if not configuration.directory or "\0" in configuration.directory:
            raise ConfigurationError("configuration.directory: must be a non-empty path without NUL characters")
        pattern = configuration.pattern
        if not pattern or "\0" in pattern:
            raise ConfigurationError("configuration.pattern: must be a non-empty glob without NUL characters")
        if pattern.startswith("/") or os.path.isabs(pattern) or "\\" in pattern:
            raise ConfigurationError("configuration.pattern: must be a relative glob using '/' separators")
        parts = pattern.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ConfigurationError("configuration.pattern: empty, '.' and '..' path components are not allowed")
        if any("**" in part and part != "**" for part in parts):
            raise ConfigurationError("configuration.pattern: '**' must be a whole path component")
        if parts[-1] == "**":
            raise ConfigurationError("configuration.pattern: must not end in '**' (use '**/*')")
        try:
            _compile(pattern)
        except re.error as exc:
            raise ConfigurationError(f"configuration.pattern: invalid glob ({exc})") from None

    def execute(self, context: JobContext[FileRetentionConfiguration]) -> ScheduledJobResult:
        cfg: FileRetentionConfiguration = context.configuration
        now = time.time()
        cutoff = now - cfg.older_than_days * 86400
        details: dict = {
            "directory": cfg.directory, "pattern": cfg.pattern, "dry_run": cfg.dry_run,
            "cutoff": dt.datetime.fromtimestamp(cutoff, dt.UTC).isoformat(),
            "matched": 0, "eligible": 0, "removed": [], "removed_count": 0, "removed_truncated": False,
            "bytes_freed": 0, "skipped_by_cap": 0, "errors": [], "error_count": 0,
        }
        if not os.path.isdir(cfg.directory):
            return ScheduledJobResult(success=False, details=details, error_message=f"not a directory: {cfg.directory}")

        errors: list[dict] = []
        candidates = self._scan(cfg, cutoff, details, errors, context)
        candidates.sort()  # oldest first
        if cfg.max_deletes is not None and len(candidates) > cfg.max_deletes:
            details["skipped_by_cap"] = len(candidates) - cfg.max_deletes
            candidates = candidates[: cfg.max_deletes]
        removed: list[str] = []
        last_beat = time.monotonic()
        for _mtime, rel, size in candidates:
            if not cfg.dry_run:
                try:
                    os.unlink(os.path.join(cfg.directory, rel))
                except FileNotFoundError:
                    continue  # gone meanwhile: nothing to do
                except OSError as exc:
                    errors.append({"path": rel, "error": f"{type(exc).__name__}: {exc.strerror or exc}"})
                    continue
            removed.append(rel)
            details["bytes_freed"] += size
            if time.monotonic() - last_beat >= _HEARTBEAT_EVERY_S:
                context.heartbeat()
                last_beat = time.monotonic()

        details.update(
            removed=removed[:_LIST_LIMIT], removed_count=len(removed), removed_truncated=len(removed) > _LIST_LIMIT,
            errors=errors[:_LIST_LIMIT], error_count=len(errors),
        )
        if errors:
            return ScheduledJobResult(
                success=False, details=details,
                error_message=f"{len(errors)} error(s), first: {errors[0]['path']}: {errors[0]['error']}",
            )
        return ScheduledJobResult(success=True, details=details)

    @staticmethod
    def _scan(cfg, cutoff: float, details: dict, errors: list,
            context: JobContext[FileRetentionConfiguration]) -> list[tuple[float, str, int]]:
        """Walk without following links; return ``(mtime, relative path, size)`` of eligible files."""
        regex = _compile(cfg.pattern)
        parts = cfg.pattern.split("/")
        max_depth = None if "**" in parts else len(parts) - 1  # directories below this cannot match
        found: list[tuple[float, str, int]] = []
        last_beat = time.monotonic()

        def on_error(exc: OSError) -> None:
            rel = os.path.relpath(exc.filename, cfg.directory) if exc.filename else cfg.directory
            errors.append({"path": rel, "error": f"{type(exc).__name__}: {exc.strerror or exc}"})

        for dirpath, dirnames, filenames in os.walk(cfg.directory, onerror=on_error, followlinks=False):
            rel_dir = os.path.relpath(dirpath, cfg.directory)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            if max_depth is not None and rel_dir.count("/") >= max_depth:
                dirnames.clear()
            for name in filenames:
                rel = rel_dir + name
                if not regex.match(rel):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    errors.append({"path": rel, "error": f"{type(exc).__name__}: {exc.strerror or exc}"})
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                details["matched"] += 1
                if st.st_mtime < cutoff:
                    details["eligible"] += 1
                    found.append((st.st_mtime, rel, st.st_size))
            if time.monotonic() - last_beat >= _HEARTBEAT_EVERY_S:
                context.heartbeat()
                last_beat = time.monotonic()
        return found

    def format_notification(self, context: JobContext[FileRetentionConfiguration],
            result: ScheduledJobResult) -> NotificationContent:
        d = result.details or {}
        verb = "would remove" if d.get("dry_run") else "removed"
        summary = (f"{verb} {d.get('removed_count', 0)} file(s), {d.get('bytes_freed', 0)} bytes, "
                   f"in {d.get('directory')}")
        if result.success:
            return NotificationContent(
                subject=f"Scheduled job '{context.job_name}' completed",
                body=f"Run {context.run_id}: {summary}.",
            )
        return NotificationContent(
            subject=f"Scheduled job '{context.job_name}' failed",
            body=f"Run {context.run_id}: {summary}; {result.error_message}.",
            priority="High",
        )


def _compile(pattern: str) -> re.Pattern[str]:
    """Translate a ``/``-separated glob (with ``**`` components) to an anchored regex."""
    parts = pattern.split("/")
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append("(?:[^/]+/)*")
        else:
            out.append(_component(part) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def _component(part: str) -> str:
    """One path component: ``*`` -> ``[^/]*``, ``?`` -> ``[^/]``, ``[!...]``/``[...]`` classes."""
    out, i, n = [], 0, len(part)
    while i < n:
        c = part[i]
        i += 1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i
            if j < n and part[j] in "!^":
                j += 1
            if j < n and part[j] == "]":
                j += 1
            while j < n and part[j] != "]":
                j += 1
            if j >= n:
                out.append(r"\[")
                continue
            body = part[i:j].replace("\\", "\\\\")
            if body[:1] in "!^":
                body = "^" + body[1:]
            out.append(f"(?!/)[{body}]")
            i = j + 1
        else:
            out.append(re.escape(c))
    return "".join(out)
