"""What each dashboard page shows, as plain values: one function per page, shared by its HTML and its
JSON (``/api/...``). Reads only; ``now`` is passed in. Parameters arrive as query-string text and are
checked here: a bad one is an :class:`InputError` naming it (HTTP 400 with the same one line)."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping
from typing import Any

from mjsched_isolated import cron, ops
from mjsched_isolated.config import redact_url
from mjsched_isolated.cronshow import describe_next
from mjsched_isolated.enums import ConcurrencyMode, JobStatus, RunStatus, values
from mjsched_isolated.errors import InputError, MjschedError
from mjsched_isolated.status import (
    HIDE_SUPERVISORS_AFTER_S,
    LIMIT,
    MANUAL_INSTANCE_PREFIX,
    SUPERVISOR_COLUMNS,
)
from mjsched_isolated.store import Store
from mjsched_isolated.store.dashboard_views import MAX_PAGE, DashboardViews

RUN_STATUSES = values(RunStatus)
JOB_STATUSES = values(JobStatus)
MODES = values(ConcurrencyMode)
WINDOWS = {"hour": (300, 12), "day": (3600, 24)}  # bucket seconds, buckets
UPCOMING = 5


@functools.lru_cache(maxsize=4096)
def describe_schedule(cron_expression: str) -> str:
    """The schedule in words (cron-descriptor, 24-hour clock), or the expression itself if it cannot say."""
    try:
        from cron_descriptor import Options, get_description  # noqa: PLC0415 - an extra's package

        options = Options()
        options.use_24hour_time_format = True
        options.verbose = False
        return str(get_description(cron.expand(cron_expression), options))
    except Exception:  # noqa: BLE001 - any failure to phrase it: show the expression as is
        return cron_expression


def _choice(params: Mapping[str, str], key: str, allowed: tuple[str, ...]) -> str | None:
    value = params.get(key) or None
    if value is not None and value not in allowed:
        raise InputError(key, f"must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _int(params: Mapping[str, str], key: str, default: int | None, low: int, high: int) -> int | None:
    text = params.get(key)
    if text in (None, ""):
        return default
    try:
        value = int(text)
    except ValueError:
        raise InputError(key, f"must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise InputError(key, f"must be between {low} and {high}, got {value}")
    return value


def _time(params: Mapping[str, str], key: str) -> dt.datetime | None:
    text = (params.get(key) or "").strip()
    if not text:
        return None
    try:
        value = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise InputError(key, f"not an ISO-8601 date-time: {text!r}") from None
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def _text(params: Mapping[str, str], key: str, max_len: int = 200) -> str | None:
    value = params.get(key) or None
    if value is not None and (len(value) > max_len or "\x00" in value):
        raise InputError(key, f"must be at most {max_len} characters, without NUL")
    return value


def _rate(job: Mapping[str, Any]) -> float | None:
    done = (job.get("success_count") or 0) + (job.get("failure_count") or 0)
    return None if not done else round(100.0 * job["success_count"] / done, 1)


def _job_summary(job: Mapping[str, Any]) -> dict[str, Any]:
    view = ops.job_view(job)
    view["schedule_words"] = describe_schedule(view["cron_expression"])
    view["success_rate_pct"] = _rate(view)
    for key in ("lock_token",):
        view.pop(key, None)
    return view


def overview(store: Store, views: DashboardViews, now: dt.datetime, database_url: str) -> dict[str, Any]:
    """The overview: charts of runs by status (last hour by 5 min, last day by hour), what ``status``
    shows (supervisors, in-flight runs, next due jobs, recent failures, warnings; the in-flight runs and
    failures read by :class:`DashboardViews`' index walks, which stay fast on millions of runs) and totals."""
    db_now = store.db_now()
    report = status_report(store, views, db_now)
    charts = {}
    for name, (bucket_s, buckets) in WINDOWS.items():
        current = db_now.replace(microsecond=0) - dt.timedelta(seconds=db_now.timestamp() // 1 % bucket_s)
        since = current - dt.timedelta(seconds=bucket_s * (buckets - 1))  # the last bucket is the current one
        counts = views.runs_by_status(since, bucket_s, buckets)
        charts[name] = {"since": since, "bucket_s": bucket_s,
                        "buckets": [{"start": since + dt.timedelta(seconds=i * bucket_s), "counts": c}
                                    for i, c in enumerate(counts)],
                        "totals": {s: sum(c.get(s, 0) for c in counts) for s in RUN_STATUSES}}
    for row in report["next_due"]:
        row["schedule_words"] = describe_schedule(row["cron_expression"])
    return {**report, "charts": charts, "totals": views.totals(), "database": redact_url(database_url),
            "now": now}


def status_report(store: Store, views: DashboardViews, db_now: dt.datetime, limit: int = LIMIT) -> dict[str, Any]:
    """:func:`mjsched_isolated.status.collect`'s report (same keys and rules), with in-flight runs and
    recent failures from :class:`DashboardViews`."""
    supervisors: list[dict[str, Any]] = [
        {k: dict(row)[k] for k in (*SUPERVISOR_COLUMNS, "stopped_at")}
        for row in store.status_supervisors(HIDE_SUPERVISORS_AFTER_S)
        if not (row["instance"].startswith(MANUAL_INSTANCE_PREFIX) and row["stopped_at"] is not None)]
    in_flight = [{"id": r["id"], "job_name": r["job_name"], "job_type": r["job_type"],
                  "supervisor": r["executed_by_instance"], "started_at": r["started_at"],
                  "deadline_at": r["deadline_at"],
                  "running_for_s": (None if r["started_at"] is None  # unreadable (edited by hand into SQLite)
                                    else round(max(0.0, (db_now - r["started_at"]).total_seconds()), 3))}
                 for r in views.inflight_runs()]
    failures = [{**r, "error_message": first_line(r["error_message"])} for r in views.recent_failures(limit)]
    next_due: list[dict[str, Any]] = [dict(r) for r in store.next_due_jobs(limit)]
    warnings = []
    overdue = [job for job in next_due if job["next_run_at"] <= db_now]
    if overdue and not any(s["alive"] for s in supervisors):
        warnings.append(f"no supervisor is alive and {len(overdue)}{'+' if len(overdue) == limit else ''} job(s) "
                        f"are overdue (the oldest, {overdue[0]['name']}, since "
                        f"{overdue[0]['next_run_at']:%Y-%m-%dT%H:%M:%SZ}): start `mjsched serve`")
    return {"db_time": db_now, "supervisors": supervisors, "in_flight": in_flight, "next_due": next_due,
            "recent_failures": failures, "warnings": warnings}


def first_line(text: str | None) -> str | None:
    """The first line of ``text`` (None stays None)."""
    if text is None:
        return None
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def jobs_page(views: DashboardViews, params: Mapping[str, str]) -> dict[str, Any]:
    """The jobs list: filters ``q``, ``status``, ``type``, ``mode``, ``failing`` (``1``), keyset ``after``
    (a name), ``limit`` (1-500, default 50). ``next_after`` is the next page's ``after`` (None at the end)."""
    limit = _int(params, "limit", 50, 1, MAX_PAGE) or 50
    search, status, job_type = _text(params, "q"), _choice(params, "status", JOB_STATUSES), _text(params, "type", 100)
    mode, after = _choice(params, "mode", MODES), _text(params, "after")
    failing = _choice(params, "failing", ("0", "1", "true", "false")) in ("1", "true")
    filters = {"q": search, "status": status, "type": job_type, "mode": mode, "failing": failing}
    rows = views.list_jobs(search=search, status=status, job_type=job_type, concurrency_mode=mode, failing=failing,
                           after=after, limit=limit + 1)
    more = len(rows) > limit
    jobs = [_job_summary(r) for r in rows[:limit]]
    return {"jobs": jobs, "filters": filters, "after": after, "limit": limit,
            "next_after": jobs[-1]["name"] if more and jobs else None,
            "job_types": views.job_types(), "statuses": JOB_STATUSES, "modes": MODES}


def upcoming(job: Mapping[str, Any], now: dt.datetime, count: int = UPCOMING) -> list[dict[str, Any]]:
    """The job's next ``count`` occurrences from its ``next_run_at`` (or ``now``), by its own DST
    policies: ``utc``, ``local`` (the job's zone) and ``note`` (daylight-saving notes,
    :mod:`mjsched_isolated.cronshow`). Empty when it is not scheduled (not Active)."""
    if job["status"] != JobStatus.ACTIVE:
        return []
    first = job.get("next_run_at")
    try:
        rows = describe_next(job["cron_expression"], job["timezone"], now if first is None else first
                             - dt.timedelta(microseconds=1), count,
                             **{k: job[k] for k in ("dst_gap_policy", "dst_fold_policy") if job.get(k)})
    except MjschedError:
        return []
    end = job.get("end_at")
    return [r for r in rows if end is None or r["utc"] <= end]


def job_page(store: Store, views: DashboardViews, name: str, params: Mapping[str, str],
             now: dt.datetime) -> dict[str, Any]:
    """One job: its configuration and statistics, runs of the last day by status, upcoming occurrences,
    its pending backfill (``pending_backfill_count`` and the first entries) and its run history (keyset
    ``before``, ``limit``). Raises :class:`NotFoundError` (``name``)."""
    job = _job_summary(store.get_job(name))
    runs = runs_page(views, {**{k: v for k, v in params.items() if k in ("before", "limit")}, "job": name})
    pending_count, pending = store.backfills.pending(job["id"])
    return {"job": job, "upcoming": upcoming(job, now), "pending_backfill_count": pending_count,
            "pending_backfill": pending,
            "last_day": views.job_run_counts(job["id"], now - dt.timedelta(days=1)),
            "runs": runs["runs"], "next_before": runs["next_before"], "before": runs["before"], "modes": MODES}


def runs_page(views: DashboardViews, params: Mapping[str, str]) -> dict[str, Any]:
    """Runs newest first: filters ``job``, ``status``, ``supervisor``, ``since``/``until`` (ISO-8601 start
    times), keyset ``before`` (a run id), ``limit`` (1-500, default 50)."""
    limit = _int(params, "limit", 50, 1, MAX_PAGE) or 50
    job, status, supervisor = _text(params, "job"), _choice(params, "status", RUN_STATUSES), _text(
        params, "supervisor", 255)
    since, until = _time(params, "since"), _time(params, "until")
    filters = {"job": job, "status": status, "supervisor": supervisor, "since": since, "until": until}
    before = _int(params, "before", None, 1, 2**63 - 1)
    rows = views.list_runs(job_name=job, status=status, supervisor=supervisor, started_after=since,
                           started_before=until, before=before, limit=limit + 1)
    more = len(rows) > limit
    runs = [_run_summary(r) for r in rows[:limit]]
    return {"runs": runs, "filters": filters, "before": before, "limit": limit,
            "next_before": runs[-1]["id"] if more and runs else None, "statuses": RUN_STATUSES,
            "supervisors": views.supervisor_names()}


def _run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    view = ops.run_view(run)
    view.pop("lock_token", None)
    return view


def run_page(views: DashboardViews, run_id: str) -> dict[str, Any]:
    """One run: every column (``details`` decoded), its job's name, and the tail of its captured output
    (``output``; ``output_earlier_chunks`` chunks before it are left out, ``mjsched runs logs`` has them).
    Raises :class:`NotFoundError` (``id``)."""
    try:
        number = int(run_id)
    except ValueError:
        raise InputError("id", f"must be an integer, got {run_id!r}") from None
    if not 0 < number < 2**63:
        raise InputError("id", f"no run with id {number}")
    run = _run_summary(views.get_run(number))
    output, earlier_chunks = views.output_tail(number)
    return {"run": run, "output": output, "output_earlier_chunks": earlier_chunks}


def audit_page(views: DashboardViews, params: Mapping[str, str]) -> dict[str, Any]:
    """The audit log newest first: keyset ``before`` (an id), ``limit`` (1-500, default 50)."""
    limit = _int(params, "limit", 50, 1, MAX_PAGE) or 50
    before = _int(params, "before", None, 1, 2**63 - 1)
    rows = views.list_actions(before=before, limit=limit + 1)
    actions = [dict(r) for r in rows[:limit]]
    return {"actions": actions, "before": before, "limit": limit,
            "next_before": actions[-1]["id"] if len(rows) > limit and actions else None}
