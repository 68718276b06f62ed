"""Show the next occurrences of a cron expression, explaining daylight-saving adjustments.

Backs ``python -m mjsched_isolated cron next EXPR [--tz ZONE] [--after ISO] [--count N] [--dst-gap POLICY]
[--dst-fold POLICY]``.

Example::

    >>> import datetime as dt
    >>> from mjsched_isolated.cronshow import describe_next
    >>> for row in describe_next("30 2 * * *", "Europe/Berlin", "2024-03-30T12:00:00Z", 2):
    ...     print(row["utc"].isoformat(), row["local"].isoformat(), row["note"])
    2024-03-31T01:00:00+00:00 2024-03-31T03:00:00+02:00 moved: 2024-03-31 02:30 does not exist (DST gap)
    2024-04-01T00:30:00+00:00 2024-04-01T02:30:00+02:00 None
    >>> [r["note"] for r in describe_next("0 * * * *", "America/Los_Angeles",
    ...                                   dt.datetime(2025, 11, 2, 7, 30, tzinfo=dt.timezone.utc), 3)]
    ['repeated hour: first copy', 'repeated hour: second copy', None]

Notes are ``None``, ``"moved: <wall time> does not exist (DST gap)"`` (when several nonexistent slots
collapse into the one run, ``"; N slots <first>-<last> run once"`` is appended), or
``"repeated hour: first copy"`` / ``"repeated hour: second copy"`` when the local wall time occurs twice
that day. Under ``dst_gap_policy="Skip"`` the first occurrence after a gap whose slots did not run says
``"skipped before this: <wall time> does not exist (DST gap)"`` instead of a ``moved:`` note::

    >>> [r["note"] for r in describe_next("30 2 * * *", "Europe/Berlin", "2024-03-30T12:00:00Z", 1,
    ...                                   dst_gap_policy="Skip")]
    ['skipped before this: 2024-03-31 02:30 does not exist (DST gap)']
"""

from __future__ import annotations

import datetime as dt

from mjsched_isolated import cron
from mjsched_isolated.errors import CronError

MAX_COUNT = 10_000


def _parse_after(after: dt.datetime | str | None, tz) -> dt.datetime:
    if after is None:
        return dt.datetime.now(dt.UTC)
    if isinstance(after, str):
        text = after.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            after = dt.datetime.fromisoformat(text)
        except ValueError:
            raise CronError("after", f"{after!r} is not an ISO 8601 date-time such as 2024-03-31T01:00:00Z") from None
    if not isinstance(after, dt.datetime):
        raise CronError("after", f"must be a datetime or ISO 8601 string, not {type(after).__name__}")
    if after.tzinfo is None:  # a naive time is a wall time in the expression's zone
        after = after.replace(tzinfo=tz)
    return after


def _wall_text(wall: dt.datetime, six_fields: bool) -> str:
    return wall.strftime("%Y-%m-%d %H:%M:%S" if six_fields else "%Y-%m-%d %H:%M")


def _slots(walls: list[dt.datetime], six: bool) -> str:
    text = f"{_wall_text(walls[0], six)} does not exist (DST gap)"
    if len(walls) > 1:
        text += f"; {len(walls)} slots {_wall_text(walls[0], six)}-{_wall_text(walls[-1], six)[11:]}"
    return text


def describe_next(
    cron_expression: str, timezone: str = "UTC", after: dt.datetime | str | None = None, count: int = 5,
    dst_gap_policy: str = cron.DEFAULT_DST_GAP, dst_fold_policy: str = cron.DEFAULT_DST_FOLD,
) -> list[dict]:
    """The next ``count`` occurrences strictly after ``after`` as dicts ``{"utc", "local", "note"}``.

    ``utc`` is an aware UTC datetime, ``local`` the same instant in ``timezone``; ``note`` explains a DST
    adjustment (see the module docstring) or is ``None``. ``after`` may be an aware datetime, a naive one
    (read as a wall time in ``timezone``), an ISO 8601 string (``Z`` allowed) or ``None`` for now.
    ``dst_gap_policy`` and ``dst_fold_policy`` are the job fields of those names (:mod:`mjsched_isolated.cron`).
    Raises :class:`CronError` naming ``cron_expression``, ``timezone``, ``after``, ``count``,
    ``dst_gap_policy`` or ``dst_fold_policy``.
    """
    cron.validate(cron_expression if isinstance(cron_expression, str) else "", timezone)
    cron.check_dst_policies(dst_gap_policy, dst_fold_policy)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise CronError("count", f"must be an integer from 1 to {MAX_COUNT}, not {count!r}")
    tz = cron.zone(timezone)
    six = len(cron.expand(cron_expression).split()) == 6
    t = _parse_after(after, tz)
    rows: list[dict] = []
    for _ in range(count):
        previous, t = t, cron.next_run_time(cron_expression, timezone, t, dst_gap_policy, dst_fold_policy)
        local = t.astimezone(tz)
        note = None
        moved = (cron.moved_wall_times(cron_expression, timezone, t, limit=100_000)
                 if dst_gap_policy == "Shift" else [])
        skipped = ([] if dst_gap_policy == "Shift"
                   else cron.skipped_wall_times(cron_expression, timezone, previous, t, limit=100_000))
        if moved:
            note = f"moved: {_slots(moved, six)}{' run once' if len(moved) > 1 else ''}"
        elif skipped:
            note = f"skipped before this: {_slots(skipped, six)}"
        else:
            wall = local.replace(tzinfo=None)
            if wall.replace(tzinfo=tz, fold=0).utcoffset() != wall.replace(tzinfo=tz, fold=1).utcoffset():
                # the wall time exists (it came from a real instant) and has two offsets: a repeated hour
                note = f"repeated hour: {'second' if local.fold else 'first'} copy"
        rows.append({"utc": t, "local": local, "note": note})
    return rows
