"""Scheduling decisions as pure functions of a job row and ``now`` (aware UTC). No I/O, no clocks."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from mjsched_isolated.cron import DEFAULT_DST_FOLD, DEFAULT_DST_GAP, min_interval_s, next_run_time
from mjsched_isolated.isotime import iso

Row = Mapping[str, Any]
"""A job's columns by name, read only: a :class:`~mjsched_isolated.store.records.JobRow` or plain values."""
_TICK = dt.timedelta(microseconds=1)


def dst_policies(job: Row) -> tuple[str, str]:
    """The job's ``(dst_gap_policy, dst_fold_policy)``, the defaults where unset (a row from before 0007)."""
    return job.get("dst_gap_policy") or DEFAULT_DST_GAP, job.get("dst_fold_policy") or DEFAULT_DST_FOLD


def occurrence_after(job: Row, after: dt.datetime) -> dt.datetime:
    """The job's first occurrence strictly after ``after``, under its DST policies (``cron.next_run_time``)."""
    return next_run_time(job["cron_expression"], job["timezone"], after, *dst_policies(job))


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
        first = occurrence_after(job, after)
    return _within_end(job, first)


MISSED_RUN_POLICIES = ("Skip", "RunOnce", "RunAll")
RUNALL_LOOKBACK = dt.timedelta(days=366)  # RunAll catches up at most a year of missed occurrences


class Decision(msgspec.Struct, frozen=True):
    """What to do with a due occurrence: ``run`` it or not, and the job's next ``next_run_at``.
    ``skipped_older``: RunAll's backlog was longer than the bound, so older occurrences were dropped;
    ``scheduled_at``: then the occurrence to run now instead of ``job["next_run_at"]`` (the oldest kept),
    None when the due occurrence itself runs (or nothing does). ``deferred``: a RunOnce catch-up moved to
    ``next_run_at`` by the job's ``max_jitter_s`` (not run now, not skipped either)."""

    run: bool
    next_run_at: dt.datetime | None
    missed: bool = False
    skipped_older: bool = False
    scheduled_at: dt.datetime | None = None
    deferred: bool = False


def decide_missed_run(policy: str, scheduled_for: dt.datetime, next_after_scheduled: dt.datetime,
                      now: dt.datetime) -> tuple[str, str | None]:
    """The reference's ``DecideMissedRun`` (reference-engine-spec.md §5): ``("Run", "Now")``,
    ``("Run", "MissedOccurrence")`` or ``("SkipAndAdvance", None)``. An occurrence is *missed* when the
    one after it is already due (``next_after_scheduled <= now``, inclusive). Unknown policies act as
    RunOnce, the default."""
    if next_after_scheduled > now:
        return "Run", "Now"
    if policy == "Skip":
        return "SkipAndAdvance", None
    if policy == "RunAll":
        return "Run", "MissedOccurrence"
    return "Run", "Now"


def decide(job: Row, now: dt.datetime, max_catchup_runs: int = 100) -> Decision:
    """Apply the job's ``missed_run_policy`` to its due occurrence ``job["next_run_at"]`` at ``now``.

    An occurrence is *missed* when the next one is already due (the reference's rule), or, when the job
    has ``missed_run_grace_s``, when ``now`` is more than that many seconds after it (APScheduler's
    ``misfire_grace_time``; within the grace it runs as on time, folding any later due occurrences as
    RunOnce does). RunOnce: run it, then the next occurrence after ``now``. Skip: a missed occurrence is not run.
    RunAll: run the missed occurrences oldest first, one claim each, but only the newest
    ``max_catchup_runs`` of them, and none older than :data:`RUNALL_LOOKBACK`: a longer backlog is cut in
    one step (found by looking back from ``now``, never by enumerating it; the horizon keeps that look
    short however sparse the schedule, e.g. a leap-day job left at year 4). A cut runs the oldest kept
    occurrence in the same decision (``scheduled_at``): were it left for the next poll, a poll slower
    than the schedule's interval would find the bound moved past it and cut again, for ever, with no
    run. A RunOnce catch-up of a job with ``max_jitter_s`` is first deferred (``deferred``) to ``now`` plus a
    delay in ``[0, max_jitter_s)`` stable per (job, occurrence), so jobs that all missed their runs during an
    outage do not all start at once when it ends; the deferred instant is not one of the job's occurrences,
    which is how the next decision knows not to defer it again. Raises :class:`CronError` for a bad cron or zone.
    """
    cron, zone = job["cron_expression"], job["timezone"]
    scheduled = job["next_run_at"]
    following = occurrence_after(job, scheduled)
    policy = job.get("missed_run_policy") or "RunOnce"
    grace_s = job.get("missed_run_grace_s")
    if grace_s is None:  # the reference's rule: missed once the next occurrence is due
        action, advance = decide_missed_run(policy, scheduled, following, now)
        missed = following <= now
    else:  # APScheduler's misfire_grace_time: missed once found more than grace_s after its instant
        missed = (now - scheduled).total_seconds() > grace_s
        action, advance = ("SkipAndAdvance", None) if missed and policy == "Skip" else (
            ("Run", "MissedOccurrence") if policy == "RunAll" and following <= now else ("Run", "Now"))
    if action == "SkipAndAdvance":
        return Decision(run=False, next_run_at=_within_end(job, occurrence_after(job, now)), missed=True)
    if advance == "Now":
        if missed and policy == "RunOnce" and (job.get("max_jitter_s") or 0) > 0 and _is_occurrence(job, scheduled):
            later = now + dt.timedelta(seconds=_spread_s(job, f"catch-up|{scheduled.isoformat()}"))
            if job.get("end_at") is None or later <= job["end_at"]:
                return Decision(run=False, next_run_at=later, missed=True, deferred=True)
        # next_after_claim(job, now): the first occurrence after max(now, scheduled), which is ``following``
        # itself whenever that lies after now (no occurrence between scheduled and following); issue 11: a
        # cron evaluation less per run, and none per poll (each poll's ``now`` is new to the cron cache)
        after_now = following if following > now else occurrence_after(job, now)
        return Decision(run=True, next_run_at=_within_end(job, after_now), missed=missed)
    horizon = now - RUNALL_LOOKBACK
    if scheduled < horizon:  # older than any catch-up: start from the first occurrence within the horizon
        first = occurrence_after(job, horizon - _TICK)
        return Decision(run=False, next_run_at=_within_end(job, first), missed=True, skipped_older=True)
    oldest_kept = nth_latest_occurrence(cron, zone, now, max(1, max_catchup_runs), not_before=following,
                                        dst=dst_policies(job))
    if oldest_kept is not None and oldest_kept > following:  # too long a backlog: keep only its newest part
        kept = _within_end(job, oldest_kept)  # ... and run the oldest of it now
        if kept is None:
            return Decision(run=False, next_run_at=None, missed=True, skipped_older=True)
        return Decision(run=True, next_run_at=_within_end(job, occurrence_after(job, oldest_kept)), missed=True,
                        skipped_older=True, scheduled_at=kept)
    return Decision(run=True, next_run_at=_within_end(job, following), missed=True)


def nth_latest_occurrence(cron_expression: str, timezone: str, now: dt.datetime, n: int,
                          not_before: dt.datetime,
                          dst: tuple[str, str] = (DEFAULT_DST_GAP, DEFAULT_DST_FOLD)) -> dt.datetime | None:
    """The n-th most recent occurrence at or before ``now`` (n = 1: the latest), or None when fewer than n
    occurrences lie in ``[not_before, now]``. Never enumerates the backlog: it reads at most 2n occurrences
    per look, first over a window behind ``now`` that starts at n times the expression's shortest interval
    and doubles, and, when a window holds more than 2n (an uneven schedule such as ``* * 1 * *``), by
    halving the window between a start with too many and one with too few (about log2(window / 1 s) looks).
    ``dst``: the job's ``(dst_gap_policy, dst_fold_policy)``.
    """
    limit = 2 * n

    def occurrences_since(start: dt.datetime) -> tuple[list[dt.datetime], bool]:
        """Occurrences in ``[start, now]``, at most ``limit``, and whether that is all of them."""
        found: list[dt.datetime] = []
        when = next_run_time(cron_expression, timezone, start - _TICK, *dst)
        while when <= now:
            if len(found) == limit:
                return found, False
            found.append(when)
            when = next_run_time(cron_expression, timezone, when, *dst)
        return found, True

    window_s = max(1.0, min_interval_s(cron_expression, timezone, not_before, 6, *dst)) * n
    backlog_s = (now - not_before).total_seconds()
    while True:  # widen until the window holds n occurrences (or reaches not_before)
        start = not_before if window_s >= backlog_s else now - dt.timedelta(seconds=window_s)
        found, complete = occurrences_since(start)
        if not complete:
            break
        if len(found) >= n:
            return found[-n]
        if start == not_before:
            return None
        window_s *= 2
    # More than 2n occurrences lie in [start, now] and fewer than n in [now, now]: narrow down. Occurrences
    # are at least 1 s apart, so the gap between the two bounds cannot stay wider than n seconds.
    many, few = start, now
    while True:
        middle = many + (few - many) / 2
        found, complete = occurrences_since(middle)
        if not complete:
            many = middle
        elif len(found) >= n:
            return found[-n]
        else:
            few = middle


MAX_COUNTED_OCCURRENCES = 1000  # counted one by one (about 65 us each) per decision: a bound on the poll's time


def occurrences_between(job: Row, seen: dt.datetime, next_run_at: dt.datetime | None) -> int:
    """How many of the job's occurrences (each delayed by its jitter, as ``next_run_at`` values are) lie
    strictly between ``seen`` (the occurrence decided) and ``next_run_at`` (the job's next one after the
    decision; None: up to ``end_at``): the occurrences passed over without a run of their own (issue 12's
    accounting: every occurrence is run, skipped or missed). Counted one by one, at most
    :data:`MAX_COUNTED_OCCURRENCES`. Raises :class:`CronError` for a bad cron or zone."""
    count = 0
    when = occurrence_after(job, seen)
    while count < MAX_COUNTED_OCCURRENCES:
        instant = _within_end(job, when)
        if instant is None or (next_run_at is not None and instant >= next_run_at):
            break
        if instant > seen:
            count += 1
        when = occurrence_after(job, when)
    return count


def next_after_claim(job: Row, now: dt.datetime) -> dt.datetime | None:
    """``next_run_at`` once the occurrence ``job["next_run_at"]`` is claimed at ``now``, under RunOnce:
    the first occurrence strictly after ``now``. None when past ``end_at``."""
    after = max(now, job["next_run_at"]) if job.get("next_run_at") else now
    return _within_end(job, occurrence_after(job, after))


def expired(job: Row, now: dt.datetime) -> bool:
    """True when the job's due occurrence ``next_run_at`` lies after ``end_at`` (an ``end_at`` edited to
    before it), judged once ``end_at`` has passed. An occurrence at or before ``end_at`` found a moment
    later is a due occurrence like any late one, decided by the missed-run policy (APScheduler's
    ``end_date``: the trigger fires up to it; the reference's ``isJobDue`` compares the poll's ``now``,
    which always lost an occurrence at exactly ``EndAt``, found a few ms after it)."""
    end_at = job.get("end_at")
    seen = job.get("next_run_at")
    return end_at is not None and now > end_at and (seen is None or seen > end_at)


MAX_RUN_TIMEOUT_S = 10 * 365 * 86400.0  # longer than any run; keeps datetime arithmetic in range


def run_timeout_s(job: Row, lease_timeout_s: float) -> float:
    """A run's allowed duration before any heartbeat: ``max(lease_timeout_s, max_runtime_minutes * 60)``,
    at most ten years. The per-job value only ever lengthens the default (reference §2.5, tests H7/H8);
    ``max_total_runtime_s``, the hard cap, shortens it."""
    minutes = job.get("max_runtime_minutes") or 0
    timeout = max(lease_timeout_s, minutes * 60.0) if minutes > 0 else lease_timeout_s
    cap_s = job.get("max_total_runtime_s")
    return min(timeout, MAX_RUN_TIMEOUT_S, cap_s if cap_s else MAX_RUN_TIMEOUT_S)


def hard_deadline(job: Row, started_at: dt.datetime) -> dt.datetime | None:
    """``started_at + max_total_runtime_s``: the instant no heartbeat moves a run's deadline past (Celery's
    ``time_limit``, against the soft, heartbeat-extended deadline); None when the job has no cap."""
    cap_s = job.get("max_total_runtime_s")
    return started_at + dt.timedelta(seconds=min(cap_s, MAX_RUN_TIMEOUT_S)) if cap_s else None


def queued_at(job: Row, scheduled_at: dt.datetime | None) -> dt.datetime | None:
    """For a Queue or QueueAll job, the occurrence time if it had to wait for the previous run (which
    finished after it came due), else None."""
    last = job.get("last_run_at")
    if job.get("concurrency_mode") in ("Queue", "QueueAll") and scheduled_at and last and last > scheduled_at:
        return scheduled_at
    return None


DEFAULT_MAX_QUEUED = 10
"""QueueAll's bound when a job does not set ``max_queued``."""
MAX_QUEUED = 1000
"""The largest ``max_queued`` accepted (Temporal bounds its BufferAll buffer too)."""


class Overlap(msgspec.Struct, frozen=True):
    """A QueueAll or Replace decision about a due job: run occurrence ``scheduled_at`` (``next_run_at`` is the
    job's next one after it). When ``scheduled_at`` is later than the job's due ``next_run_at``, the
    occurrences from that one up to ``scheduled_at`` (excluded) are skipped first (by concurrency)."""

    scheduled_at: dt.datetime
    next_run_at: dt.datetime | None


def queue_all_next(job: Row, now: dt.datetime) -> Overlap | None:
    """QueueAll (Temporal's BufferAll, bounded): the occurrence to run for a due job whose occurrence
    ``next_run_at`` waited for a live run, i.e. is not after ``last_run_at`` (the end of the last run: the
    rule of :func:`queued_at`). The occurrences that came due meanwhile, up to ``min(last_run_at, now)``,
    are its queue: they run oldest first, one claim each (``next_run_at`` moves to the following
    occurrence, not past ``now``). When more than ``max_queued`` (default :data:`DEFAULT_MAX_QUEUED`) wait,
    the oldest are skipped and the newest ``max_queued`` kept, so a job whose runs always outlast its
    interval runs recent occurrences, not ever older ones (found by looking back, never by enumerating the
    backlog). None when the job is not QueueAll or its occurrence did not wait for a run: then the
    missed-run policy decides it (:func:`decide`), as for Queue. Raises :class:`CronError`."""
    scheduled, last = job.get("next_run_at"), job.get("last_run_at")
    if job.get("concurrency_mode") != "QueueAll" or scheduled is None or last is None or scheduled > last:
        return None
    bound = max(1, int(job.get("max_queued") or DEFAULT_MAX_QUEUED))
    following = occurrence_after(job, scheduled)
    kept = scheduled
    # bound occurrences after the due one also waited: the queue is longer than the bound
    oldest_kept = nth_latest_occurrence(job["cron_expression"], job["timezone"], min(last, now), bound,
                                        not_before=following, dst=dst_policies(job))
    if oldest_kept is not None:
        kept = _within_end(job, oldest_kept) or scheduled
        following = occurrence_after(job, kept)
    return Overlap(scheduled_at=kept, next_run_at=_within_end(job, following))


def newest_due(job: Row, now: dt.datetime) -> dt.datetime | None:
    """Replace: the job's newest occurrence due at ``now`` (delayed by its jitter, as ``next_run_at`` values
    are) when it is later than its due ``next_run_at``, else None (``next_run_at`` is the newest, or not
    due). The occurrences before it are superseded: a Replace job runs its newest occurrence (Kubernetes'
    ``concurrencyPolicy: Replace`` starts the newest Job). Raises :class:`CronError`."""
    scheduled = job.get("next_run_at")
    if scheduled is None or scheduled > now:
        return None
    following = occurrence_after(job, scheduled)
    for n in (1, 2):  # the latest occurrence may not be due yet once delayed by its jitter
        base = nth_latest_occurrence(job["cron_expression"], job["timezone"], now, n, not_before=following,
                                     dst=dst_policies(job))
        if base is None:
            return None
        when = _within_end(job, base)
        if when is not None and when <= now:
            return when if when > scheduled else None
    return None


REPLACED_BY = "replaced by occurrence "
"""How a run cancelled by Replace names its cause (``cancel_requested_by`` and the run's error message)."""


def replaced_by(occurrence: dt.datetime) -> str:
    """``cancel_requested_by`` of a run that occurrence ``occurrence`` (aware UTC) replaces."""
    return f"{REPLACED_BY}{iso(occurrence)} (concurrency_mode Replace)"


def is_replacement(requested_by: str | None) -> bool:
    """True when a cancel request was made by Replace (:func:`replaced_by`): such a run is never retried."""
    return requested_by is not None and requested_by.startswith(REPLACED_BY)


def jitter_s(job: Row, occurrence: dt.datetime) -> float:
    """The job's delay for ``occurrence``: in ``[0, max_jitter_s)``, the same for the same (job, occurrence)
    on every supervisor (a hash, not a random draw), so an occurrence keeps one identity. Spreads jobs that
    share a schedule (many on ``0 * * * *``) over a window; like systemd's ``RandomizedDelaySec`` with
    ``FixedRandomDelay``. Keep it below the job's interval."""
    if not job.get("max_jitter_s"):  # most jobs: no key to build (issue 11: twice per run on the hot path)
        return 0.0
    return _spread_s(job, occurrence.isoformat())


def _spread_s(job: Row, key: str) -> float:
    """``[0, max_jitter_s)``, from a hash of the job's name and ``key``: the same on every supervisor."""
    window = job.get("max_jitter_s") or 0.0
    if window <= 0:
        return 0.0
    digest = hashlib.sha256(f"{job.get('name')}|{key}".encode()).digest()
    return window * int.from_bytes(digest[:8], "big") / 2**64


def _is_occurrence(job: Row, when: dt.datetime) -> bool:
    """True when ``when`` is one of the job's occurrences delayed by its jitter (as :func:`_within_end`
    makes them); False for an instant set otherwise (a deferred catch-up, a "run now")."""
    window = dt.timedelta(seconds=job.get("max_jitter_s") or 0.0)
    base = occurrence_after(job, when - window - _TICK)
    return base <= when and base + dt.timedelta(seconds=jitter_s(job, base)) == when


def _within_end(job: Row, when: dt.datetime) -> dt.datetime | None:
    """``when`` delayed by the job's jitter; None when the occurrence is past ``end_at``."""
    end_at = job.get("end_at")
    if end_at is not None and when > end_at:
        return None
    if not job.get("max_jitter_s"):
        return when
    return when + dt.timedelta(seconds=jitter_s(job, when))


HIGH_FREQUENCY_S = 300.0  # reference §6.4: HIGH_FREQUENCY_WARNING_THRESHOLD_MS = 5 min


def high_frequency_interval_s(job: Row, now: dt.datetime) -> float | None:
    """The job's shortest interval if it fires more often than every 5 minutes (reference §6.4), else None.
    Advice only: such jobs still run."""
    interval = min_interval_s(job["cron_expression"], job["timezone"], now)
    return interval if interval < HIGH_FREQUENCY_S else None


def human_interval(seconds: float) -> str:
    """``90`` -> ``"1 minute 30 seconds"``, ``0.5`` -> ``"500 ms"`` (the reference's wording)."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    minutes, secs = divmod(round(seconds), 60)
    parts = [f"{minutes} minute{'s' * (minutes != 1)}"] if minutes else []
    if secs or not parts:
        parts.append(f"{secs} second{'s' * (secs != 1)}")
    return " ".join(parts)


RETRY_ON_DEFAULT = ("Failed", "Timeout")
"""The run statuses that retry when a job does not say (``retry_on``): a failure (a plugin's error, a worker
crash) and a deadline kill. A Cancelled run is retried only when asked (Celery's ``autoretry_for``,
Temporal's ``RetryPolicy.non_retryable_error_types``: the default retries errors, never a cancellation)."""
RETRY_ON_CHOICES = ("Failed", "Timeout", "Cancelled", "Fenced")
"""``Fenced``: a run killed because its supervisor lost the job lease or its liveness lease (recorded
Failed, retried only when listed: another supervisor may hold the job by then)."""


def retry_on(job: Row) -> tuple[str, ...]:
    """The statuses that retry a run of ``job``: its ``retry_on`` (comma-separated), else
    :data:`RETRY_ON_DEFAULT`."""
    value = job.get("retry_on")
    if not value:
        return RETRY_ON_DEFAULT
    return tuple(s.strip() for s in value.split(",") if s.strip())


def retry_delay_s(job: Row, attempt: int, scheduled_at: dt.datetime) -> float:
    """Seconds from the end of attempt ``attempt`` (1: the first run) to its retry: ``retry_backoff_s *
    retry_backoff_factor ** (attempt - 1)``, at most ``retry_backoff_max_s``, plus a jitter in ``[0,
    retry_max_jitter_s)`` stable per (job, occurrence, attempt) on every supervisor (Celery's
    ``retry_backoff``/``retry_backoff_max``/``retry_jitter``, Temporal's ``RetryPolicy`` initial interval,
    backoff coefficient and maximum interval). At most ten years."""
    backoff_s = job.get("retry_backoff_s")
    base = 10.0 if backoff_s is None else float(backoff_s)
    factor = float(job.get("retry_backoff_factor") or 1.0)
    try:
        delay = base * factor ** (attempt - 1)
    except OverflowError:
        delay = MAX_RUN_TIMEOUT_S
    cap_s = job.get("retry_backoff_max_s")
    if cap_s is not None:
        delay = min(delay, cap_s)
    jitter = job.get("retry_max_jitter_s") or 0.0
    if jitter > 0:
        digest = hashlib.sha256(f"{job.get('name')}|retry|{scheduled_at.isoformat()}|{attempt}".encode()).digest()
        delay += jitter * int.from_bytes(digest[:8], "big") / 2**64
    return min(delay, MAX_RUN_TIMEOUT_S)


def retry_at(job: Row, *, attempt: int, status: str, scheduled_at: dt.datetime | None,
             ended_at: dt.datetime) -> dt.datetime | None:
    """When attempt ``attempt`` of occurrence ``scheduled_at``, which ended ``status`` (a run status, or
    ``Fenced``) at ``ended_at``, is retried; None when it is not (its failure is final): a manual run (no
    ``scheduled_at``), a status not in :func:`retry_on` (Completed never), or ``max_retries`` used up
    (attempt ``max_retries + 1`` is the last). Pure: the caller writes the result with the run's outcome,
    in one transaction."""
    max_retries = job.get("max_retries") or 0
    if scheduled_at is None or max_retries <= 0 or attempt > max_retries or status not in retry_on(job):
        return None
    return ended_at + dt.timedelta(seconds=retry_delay_s(job, attempt, scheduled_at))


def pending_retry(job: Row) -> bool:
    """True when the job's due ``next_run_at`` is a pending retry (its ``retry_at``), not an occurrence."""
    return (job.get("retry_attempt") is not None and job.get("retry_at") is not None
            and job.get("retry_scheduled_at") is not None and job.get("retry_at") == job.get("next_run_at"))


DEFAULT_BACKFILL_MAX = 100  # occurrences a backfill may add unless the caller raises the bound


def occurrences_in_window(job: Row, start: dt.datetime, end: dt.datetime, limit: int) -> list[dt.datetime]:
    """The job's occurrences whose cron instant lies in ``[start, end]`` (aware), as the regular schedule
    would give them as ``next_run_at`` values (its zone and DST policies, delayed by its jitter), none
    before ``start_at`` or past ``end_at``: a backfill's occurrences. At most ``limit`` + 1 are computed,
    so a caller can tell a window larger than its bound. Raises :class:`CronError` for a bad cron or zone."""
    out: list[dt.datetime] = []
    start_at = job.get("start_at")
    when = occurrence_after(job, max(start, start_at) - _TICK if start_at else start - _TICK)
    while when <= end and len(out) <= limit:
        instant = _within_end(job, when)
        if instant is None:
            break
        out.append(instant)
        when = occurrence_after(job, when)
    return out
