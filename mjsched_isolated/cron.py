"""Cron expressions: the only module that imports croniter.

Expressions have 5 fields (minute hour day-of-month month day-of-week) or 6 fields with **seconds
first**, as in the reference engine (cron-parser): ``0 30 9 * * MON-FRI`` is 09:30:00 on weekdays
(reference-engine-spec.md §6). Every expression is read in an IANA time zone; results are aware UTC.
"""

from __future__ import annotations

import datetime as dt
import functools
import zoneinfo

from croniter import croniter

from .errors import CronError

UTC = dt.timezone.utc


@functools.lru_cache(maxsize=512)
def zone(timezone: str) -> zoneinfo.ZoneInfo:
    """The ``ZoneInfo`` for an IANA name. Raises :class:`CronError` (field ``timezone``) if unknown."""
    if not timezone or not isinstance(timezone, str):
        raise CronError("timezone", "must be an IANA time zone name such as 'UTC' or 'Europe/Berlin'")
    try:
        return zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError("timezone", f"unknown time zone {timezone!r}") from None


def _fields(cron_expression: str) -> list[str]:
    if not isinstance(cron_expression, str) or not cron_expression.strip():
        raise CronError("cron_expression", "is required")
    fields = cron_expression.split()
    if len(fields) not in (5, 6):
        raise CronError(
            "cron_expression",
            f"{cron_expression!r} has {len(fields)} fields; expected 5 (min hour dom month dow) "
            "or 6 (sec min hour dom month dow)",
        )
    return fields


def validate(cron_expression: str, timezone: str = "UTC") -> None:
    """Raise :class:`CronError` naming ``cron_expression`` or ``timezone`` if either is invalid."""
    fields = _fields(cron_expression)
    zone(timezone)
    if not croniter.is_valid(cron_expression, second_at_beginning=len(fields) == 6):
        raise CronError("cron_expression", f"invalid cron expression {cron_expression!r}")


def next_run_time(cron_expression: str, timezone: str, after: dt.datetime) -> dt.datetime:
    """The first occurrence strictly after ``after``, as an aware UTC datetime.

    ``after`` must be aware (any zone). The expression is evaluated in ``timezone``.
    Raises :class:`CronError` for an invalid expression or zone, :class:`ValueError` for a naive ``after``.
    """
    if after.tzinfo is None:
        raise ValueError("after must be an aware datetime")
    fields = _fields(cron_expression)
    tz = zone(timezone)
    try:
        itr = croniter(cron_expression, after.astimezone(tz), second_at_beginning=len(fields) == 6)
        result: dt.datetime = itr.get_next(dt.datetime)
    except (ValueError, KeyError, TypeError) as exc:
        raise CronError("cron_expression", f"invalid cron expression {cron_expression!r} ({exc})") from None
    result = result.astimezone(UTC)
    if result <= after:  # guard croniter's DST edge cases: never return a non-increasing time
        return next_run_time(cron_expression, timezone, after + dt.timedelta(seconds=1))
    return result


def min_interval_s(cron_expression: str, timezone: str, after: dt.datetime, samples: int = 6) -> float:
    """Smallest gap between the next ``samples`` occurrences, in seconds (reference §6.4
    ``GetMinIntervalMs``). ``inf`` if the expression is invalid."""
    try:
        times = [next_run_time(cron_expression, timezone, after)]
        for _ in range(samples - 1):
            times.append(next_run_time(cron_expression, timezone, times[-1]))
    except CronError:
        return float("inf")
    return min((b - a).total_seconds() for a, b in zip(times, times[1:]))
