"""Which outcomes notify, and the text of the notices the supervisor formats itself.

A notice is decided when its cause is recorded and becomes one outbox row per enabled channel
(:func:`outbox_rows`), written by the store in the transaction that records the cause. Rules (reference
§7.3 ``NotificationManager``, made complete):

* ``Success``: a Completed run of a job with ``notify_on_success``.
* ``Failure``: a Failed or Timeout run of a job with ``notify_on_failure``: plugin errors, exceptions, dead
  workers, deadline kills, fenced and abandoned runs (the reference missed runs that throw).
* ``Skipped`` / ``Missed``: an occurrence dropped by ``concurrency_mode`` Skip / by the missed-run policy,
  for a job with ``notify_on_missed``.
* Cancelled runs (shutdown) never notify.
* A run abandoned by another supervisor whose own supervisor later reports its true outcome: a notice
  to the failure notice's audience saying so (:func:`for_late_result`).
* A failure that will be retried (``max_retries``) says so in its subject ("failed, retry 2 of 3 at ...",
  Normal priority); the final failure reads as any failure. A job paused on repeated failure
  (``pause_after_failures``) sends a High-priority ``Failure`` notice naming the reason (:func:`for_pause`).

The plugin's ``format_notification`` text (formatted in the worker child, carried by ``RunFinished``) is
used when present; crashes, timeouts, abandoned runs and skips get the defaults below. No SQL, no I/O.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from mjsched_isolated.api import default_notification
from mjsched_isolated.isotime import iso
from mjsched_isolated.protocol import NoticeText

if TYPE_CHECKING:  # types only: importing the store at run time would pull SQLAlchemy in
    from mjsched_isolated.store.records import OutboxRow

Row = Mapping[str, Any]  # a job's columns, read only (a JobRow, or the few fields an InFlight keeps)


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """One notice before it is fanned out to channels. ``event``: Success, Failure, Skipped or Missed;
    ``priority``: Low, Normal or High; ``recipients``: the job's own addresses (None: the channel's)."""

    event: str
    job_id: int | None
    job_name: str
    run_id: int | None
    subject: str
    body: str
    priority: str = "Normal"
    details: dict[str, Any] | None = None
    recipients: list[str] | None = None


def job_recipients(job: Row) -> list[str] | None:
    """The job's ``notify_recipients`` column (JSON list text) as a list; None when unset or unreadable."""
    raw = job.get("notify_recipients")
    if not raw:
        return None
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None
    return [str(v) for v in value] if isinstance(value, list) and value else None


def for_run(job: Row, run_id: int, *, status: str, error_message: str | None,
            text: NoticeText | None = None, scheduled_at: dt.datetime | None = None,
            retry: tuple[int, int, dt.datetime] | None = None) -> Notice | None:
    """The notice for run ``run_id`` of ``job`` (a row with ``id``, ``name``, ``notify_*``) ending in
    ``status`` (Completed, Failed, Timeout, Cancelled), or None when it does not notify. ``text`` is the
    plugin's formatted notice; a default is used without it. ``retry``: (retry number, ``max_retries``,
    when) of a failure that will be retried: the subject says so ("failed, retry 2 of 3 at 12:05:00Z"),
    so only the final failure reads as one."""
    if status == "Completed" and job.get("notify_on_success"):
        event = "Success"
    elif status in ("Failed", "Timeout") and job.get("notify_on_failure", True):
        event = "Failure"
    else:
        return None
    if text is None:
        content = default_notification(job["name"], run_id, success=event == "Success", error_message=error_message,
                                       timed_out=status == "Timeout")
        text = NoticeText(subject=content.subject, body=content.body, priority=content.priority)
    details = {**(text.metadata or {}), "status": status}
    if retry is not None and event == "Failure":
        number, of, when = retry
        what = "timed out" if status == "Timeout" else "failed"
        text = NoticeText(subject=f"Scheduled job '{job['name']}' {what}, retry {number} of {of} at {iso(when)}",
                          body=f"{text.body}\nRetry {number} of {of} at {iso(when)}.", priority="Normal",
                          metadata=text.metadata)
        details.update(retry=number, max_retries=of, retry_at=iso(when))
    if scheduled_at is not None:
        details["scheduled_at"] = iso(scheduled_at)
    if error_message and event == "Failure":
        details.setdefault("error_message", error_message)
    return Notice(event=event, job_id=job["id"], job_name=job["name"], run_id=run_id, subject=text.subject,
                  body=text.body, priority=text.priority, details=details, recipients=job_recipients(job))


def for_pause(job: Row, run_id: int, reason: str) -> Notice:
    """The notice of a job paused on repeated failure (``pause_after_failures``): always sent (a paused
    job runs no more until someone resumes it), High priority."""
    return Notice(event="Failure", job_id=job["id"], job_name=job["name"], run_id=run_id,
                  subject=f"Scheduled job '{job['name']}' paused after repeated failures",
                  body=f"Job '{job['name']}' was paused: {reason}. Resume it with `mjsched jobs resume {job['name']}`.",
                  priority="High", details={"paused_reason": reason}, recipients=job_recipients(job))


def for_abandoned(run: Mapping[str, Any]) -> Notice | None:
    """The Failure notice of a run abandoned because its supervisor died (``run``, e.g. a
    :class:`~mjsched_isolated.store.records.AbandonedRun`, carries ``id``, ``job_id``, ``job_name``,
    ``error_message``, ``notify_on_failure``, ``notify_recipients``)."""
    if not run.get("notify_on_failure"):
        return None
    job = {"id": run["job_id"], "name": run["job_name"], "notify_on_failure": True,
           "notify_recipients": run.get("notify_recipients")}
    return for_run(job, run["id"], status="Failed", error_message=run["error_message"])


def late_result_text(result: Mapping[str, Any]) -> str:
    """One line saying that run ``result["id"]`` was recorded abandoned, then reported late by its own
    supervisor (``result``: a :class:`~mjsched_isolated.store.records.LateResult`)."""
    abandoned_at = result.get("completed_at")
    return (f"run {result['id']} was abandoned at {iso(abandoned_at) if abandoned_at else '-'}; its supervisor "
            f"{result.get('executed_by_instance')} later reported {result['late_status']} at "
            f"{iso(result['late_completed_at'])}")


def for_late_result(result: Mapping[str, Any]) -> Notice | None:
    """The notice correcting an abandoned run's failure notice once its own supervisor reported the true
    outcome (``result``: a :class:`~mjsched_isolated.store.records.LateResult`): sent to whoever got the
    failure notice (a job with ``notify_on_failure``), as a ``Success`` for a late Completed, else a
    ``Failure``; Normal priority. The run stays Failed in the records (its late outcome is kept beside)."""
    if not result.get("notify_on_failure"):
        return None
    late = result["late_status"]
    line = late_result_text(result)
    body = (f"Job '{result['job_name']}': {line}. The run stays recorded Failed (abandoned) for its job's "
            f"statistics and lease; its true outcome is kept on the run (late_status {late})."
            + (f"\nIts error: {result['late_error_message']}" if result.get("late_error_message") else ""))
    return Notice(event="Success" if late == "Completed" else "Failure", job_id=result["job_id"],
                  job_name=result["job_name"], run_id=result["id"],
                  subject=f"Scheduled job '{result['job_name']}': abandoned run {result['id']} really ended {late}",
                  body=body, priority="Normal",
                  details={"late_status": late, "late_completed_at": iso(result["late_completed_at"]),
                           "abandoned_at": iso(result["completed_at"]) if result.get("completed_at") else None},
                  recipients=job_recipients({"notify_recipients": result.get("notify_recipients")}))


def for_skip(job: Row, occurrence: dt.datetime | None, *, event: str, reason: str) -> Notice | None:
    """The notice of an occurrence not run: ``event`` Skipped (concurrency_mode) or Missed (missed-run
    policy), None unless the job has ``notify_on_missed``."""
    if not job.get("notify_on_missed"):
        return None
    when = iso(occurrence)
    verb = "skipped" if event == "Skipped" else "missed"
    return Notice(event=event, job_id=job["id"], job_name=job["name"], run_id=None,
                  subject=f"Scheduled job '{job['name']}' {verb} an occurrence",
                  body=f"The occurrence {when} of job '{job['name']}' was not run: {reason}.", priority="Normal",
                  details={"scheduled_at": when, "reason": reason}, recipients=job_recipients(job))


def outbox_rows(notice: Notice | None, channels: Iterable[str]) -> list[OutboxRow]:
    """Column values of the ``notifications`` rows for ``notice``: one per channel (none if ``notice`` is
    None). Timestamps, status and attempts are left to the store (database clock)."""
    if notice is None:
        return []
    details = None if notice.details is None else json.dumps(notice.details, sort_keys=True, default=repr)
    recipients = None if notice.recipients is None else json.dumps(notice.recipients)
    return [{"channel": channel, "event": notice.event, "job_id": notice.job_id, "job_name": notice.job_name,
             "run_id": notice.run_id, "subject": notice.subject, "body": notice.body, "priority": notice.priority,
             "recipients": recipients, "details": details} for channel in channels]
