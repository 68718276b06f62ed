"""``status``: one look at a scheduler database: who supervises, what runs, what is next, what failed.

Read-only; every query is a :class:`Store` method. Liveness and "running for" are judged by the
database clock (the one every lease uses), so the answer is the same from any machine. The short-lived
supervisors of ``jobs run`` (instance ``jobs-run-...``) are listed only while alive or when they did not
stop cleanly; when no supervisor is alive and jobs are overdue, or the database refuses writes (probed by
an UPDATE that matches no row, rolled back), ``warnings`` says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mjsched_isolated.store import Store

MANUAL_INSTANCE_PREFIX = "jobs-run-"  # the instance prefix of `jobs run`'s supervisor (ops.run_job)
HIDE_SUPERVISORS_AFTER_S = 3600.0  # supervisors stopped or expired longer ago than this are not listed
LIMIT = 10

SUPERVISOR_COLUMNS = ["instance", "hostname", "pid", "started_at", "heartbeat_at", "lease_expires_at", "alive",
                      "max_concurrent_jobs", "version"]
IN_FLIGHT_COLUMNS = ["id", "job_name", "job_type", "supervisor", "started_at", "deadline_at", "running_for_s",
                     "cancel_requested_by"]
NEXT_DUE_COLUMNS = ["name", "next_run_at", "cron_expression", "timezone"]
FAILURE_COLUMNS = ["id", "job_name", "status", "completed_at", "error_message"]


def collect(store: Store, *, hide_after_s: float = HIDE_SUPERVISORS_AFTER_S, limit: int = LIMIT) -> dict[str, Any]:
    """The status as plain values: ``{"db_time", "supervisors", "in_flight", "next_due", "recent_failures",
    "warnings"}`` (``warnings``: one-line strings);
    each list holds dicts with the keys of the matching ``*_COLUMNS`` (``supervisors`` also has
    ``stopped_at``). ``running_for_s`` is seconds since ``started_at`` by the database clock;
    ``error_message`` is the first line only. Works on an empty database (empty lists)."""
    now = store.db_now()
    supervisors = [_pick(row, (*SUPERVISOR_COLUMNS, "stopped_at"))
                   for row in store.status_supervisors(hide_after_s)
                   if not (row["instance"].startswith(MANUAL_INSTANCE_PREFIX) and row["stopped_at"] is not None)]
    in_flight = [{"id": r["id"], "job_name": r["job_name"], "job_type": r["job_type"],
                  "supervisor": r["executed_by_instance"], "started_at": r["started_at"],
                  "deadline_at": r["deadline_at"],
                  "running_for_s": (None if r["started_at"] is None  # unreadable (edited by hand into SQLite)
                                    else round(max(0.0, (now - r["started_at"]).total_seconds()), 3)),
                  "cancel_requested_by": r["cancel_requested_by"]}
                 for r in store.inflight_runs()]
    failures = [{**r, "error_message": _first_line(r["error_message"])} for r in store.recent_failures(limit)]
    next_due = store.next_due_jobs(limit)
    warnings = []
    if (read_only := store.read_only_reason()) is not None:
        warnings.append(f"the database refuses writes ({read_only}): no supervisor can register, claim or "
                        "record a run")
    overdue = [job for job in next_due if job["next_run_at"] <= now]
    if overdue and not any(s["alive"] for s in supervisors):
        count = f"{len(overdue)}{'+' if len(overdue) == limit else ''}"
        warnings.append(f"no supervisor is alive and {count} job(s) are overdue (the oldest, {overdue[0]['name']}, "
                        f"since {overdue[0]['next_run_at']:%Y-%m-%dT%H:%M:%SZ}): start `mjsched serve`")
    return {"db_time": now, "supervisors": supervisors, "in_flight": in_flight,
            "next_due": next_due, "recent_failures": failures, "warnings": warnings}


def _pick(row: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {k: row[k] for k in keys}


def _first_line(text: str | None) -> str | None:
    if text is None:
        return None
    lines = text.strip().splitlines()
    return lines[0] if lines else ""
