"""Scheduling decisions as pure functions of a job row and ``now`` (aware UTC). No I/O, no clocks."""

from __future__ import annotations

import datetime as dt
from typing import Any

from .cron import next_run_time

Row = dict[str, Any]
_TICK = dt.timedelta(microseconds=1)


def initial_next_run_at(job: Row, now: dt.datetime) -> dt.datetime | None:
    """``next_run_at`` for a job that has none (new, resumed, rescheduled).

    ``run_immediately_if_never_run`` and no ``last_run_at``: due now (reference §3.9), but never before
    ``start_at``. Otherwise the first occurrence at or after ``max(now, start_at)``, strictly after
    ``now``. None when that is past ``end_at``. Raises :class:`CronError` for a bad cron or zone.
    """
    start_at = job.get("start_at")
    if job.get("run_immediately_if_never_run") and job.get("last_run_at") is None:
        first = max(now, start_at) if start_at else now
    else:
        after = start_at - _TICK if start_at and start_at > now else now
        first = next_run_time(job["cron_expression"], job["timezone"], after)
    return _within_end(job, first)


def next_after_claim(job: Row, now: dt.datetime) -> dt.datetime | None:
    """``next_run_at`` once the occurrence ``job["next_run_at"]`` is claimed at ``now``: the first
    occurrence strictly after ``now`` (missed occurrences collapse into the one being run, like the
    reference's default ``RunOnce``). None when past ``end_at``."""
    after = max(now, job["next_run_at"]) if job.get("next_run_at") else now
    return _within_end(job, next_run_time(job["cron_expression"], job["timezone"], after))


def expired(job: Row, now: dt.datetime) -> bool:
    """True when ``end_at`` has passed (the reference's ``isJobDue``: not due when now > EndAt)."""
    end_at = job.get("end_at")
    return end_at is not None and now > end_at


MAX_RUN_TIMEOUT_S = 10 * 365 * 86400.0  # longer than any run; keeps datetime arithmetic in range


def run_timeout_s(job: Row, lease_timeout_s: float) -> float:
    """A run's allowed duration: ``max(lease_timeout_s, max_runtime_minutes * 60)``, at most ten years.
    The per-job value only ever lengthens the default (reference §2.5, tests H7/H8)."""
    minutes = job.get("max_runtime_minutes") or 0
    timeout = max(lease_timeout_s, minutes * 60.0) if minutes > 0 else lease_timeout_s
    return min(timeout, MAX_RUN_TIMEOUT_S)


def queued_at(job: Row, scheduled_at: dt.datetime | None) -> dt.datetime | None:
    """For a Queue job, the occurrence time if it had to wait for the previous run (which finished
    after it came due), else None."""
    last = job.get("last_run_at")
    if job.get("concurrency_mode") == "Queue" and scheduled_at and last and last > scheduled_at:
        return scheduled_at
    return None


def _within_end(job: Row, when: dt.datetime) -> dt.datetime | None:
    end_at = job.get("end_at")
    return None if end_at is not None and when > end_at else when
