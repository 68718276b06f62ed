"""The rows the store hands out and takes in, as ``TypedDict`` s keyed by column name, so a type checker
checks their keys where they cross module lines. At run time each is a plain ``dict``.

Column rows (:class:`JobRow`, :class:`RunRow`, :class:`SupervisorRow`, :class:`NotificationRow`,
:class:`RunOutputRow`, :class:`PluginReloadRow`) have
exactly the columns of their table in :mod:`mjsched_isolated.store.schema` (a test compares them). View
rows add joined columns (``job_name``) or are projections for ``status``. Datetimes are aware UTC;
``status``, ``concurrency_mode``, ``missed_run_policy``, ``event`` and ``priority`` hold the stored text of
the :mod:`mjsched_isolated.enums` members, which compare equal to it. Standard library and msgspec only.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, TypedDict

import msgspec

Values = dict[str, Any]
"""Column values given to a write (``add_job``, ``update_job``): any subset of a table's columns."""


class Claim(msgspec.Struct, frozen=True):
    """A won occurrence: the run row's id, the lease token it runs under (None without a lease) and its
    ``started_at`` (database time, read in the claiming transaction after its lease was judged)."""

    run_id: int
    lock_token: str | None
    started_at: dt.datetime | None = None


class JobRow(TypedDict):
    """A ``jobs`` row. ``configuration`` and ``notify_recipients`` are JSON text as stored."""

    id: int
    name: str
    job_type: str
    description: str | None
    cron_expression: str
    timezone: str
    status: str
    configuration: str | None
    start_at: dt.datetime | None
    end_at: dt.datetime | None
    next_run_at: dt.datetime | None
    last_run_at: dt.datetime | None
    run_count: int
    success_count: int
    failure_count: int
    skipped_count: int
    missed_count: int
    last_duration_ms: float | None
    avg_duration_ms: float | None
    concurrency_mode: str
    max_queued: int
    missed_run_policy: str
    max_jitter_s: float | None
    run_immediately_if_never_run: bool
    max_runtime_minutes: int | None
    max_memory_mb: int | None
    max_cpu_s: int | None
    max_open_files: int | None
    max_processes: int | None
    nice: int | None
    notify_on_success: bool
    notify_on_failure: bool
    notify_on_missed: bool
    notify_recipients: str | None
    dst_gap_policy: str
    dst_fold_policy: str
    missed_run_grace_s: float | None
    max_total_runtime_s: float | None
    max_retries: int
    retry_backoff_s: float
    retry_backoff_factor: float
    retry_backoff_max_s: float | None
    retry_max_jitter_s: float | None
    retry_on: str | None
    retry_at: dt.datetime | None
    retry_attempt: int | None
    retry_scheduled_at: dt.datetime | None
    retry_next_run_at: dt.datetime | None
    pause_after_failures: int | None
    consecutive_failures: int
    paused_reason: str | None
    lock_token: str | None
    locked_at: dt.datetime | None
    locked_by_instance: str | None
    expected_completion_at: dt.datetime | None
    created_at: dt.datetime
    updated_at: dt.datetime


class _RunColumns(TypedDict):
    """The ``runs`` columns but ``details``, whose type differs between raw rows and views."""

    id: int
    job_id: int
    scheduled_at: dt.datetime | None
    started_at: dt.datetime
    completed_at: dt.datetime | None
    status: str
    success: bool | None
    error_message: str | None
    queued_at: dt.datetime | None
    executed_by_instance: str | None
    lock_token: str | None
    deadline_at: dt.datetime | None
    duration_ms: float | None
    cancel_requested_at: dt.datetime | None
    cancel_requested_by: str | None
    missed_count: int
    cpu_s: float | None
    max_rss_mb: float | None
    attempt: int
    late_status: str | None
    late_completed_at: dt.datetime | None
    late_error_message: str | None


class RunRow(_RunColumns):
    """A ``runs`` row as stored: ``details`` and ``late_details`` are JSON text."""

    details: str | None
    late_details: str | None


class RunView(_RunColumns):
    """A run for display (``get_run``, ``list_runs``): its columns plus ``job_name``; ``details`` decoded
    from JSON (left as text if it is not JSON)."""

    job_name: str
    details: Any
    late_details: Any


class AbandonedRun(RunRow):
    """A run :meth:`Store.abandon_orphaned_runs` marked Failed: its row as read (``status`` still
    ``Running``), the ``error_message`` it was given, the job's name and notice settings, and
    ``holder_expired_at`` (its supervisor's lease expiry, None when no longer registered) and ``db_now``
    (the database time of the sweep's read)."""

    holder_expired_at: dt.datetime | None
    db_now: dt.datetime
    job_name: str
    notify_on_failure: bool
    notify_recipients: str | None


class LateResult(TypedDict):
    """An abandoned run's true outcome, kept by :meth:`Store.keep_late_result`: the run's ``id``,
    ``job_id``, ``job_name``, ``executed_by_instance``, ``started_at``, the abandonment (``completed_at``
    and ``error_message`` as the sweep recorded them), the late outcome (``late_status``,
    ``late_completed_at``, ``late_error_message``) and the job's ``notify_on_failure`` and
    ``notify_recipients`` (who got the abandonment's failure notice)."""

    id: int
    job_id: int
    job_name: str
    executed_by_instance: str | None
    started_at: dt.datetime
    completed_at: dt.datetime | None
    error_message: str | None
    late_status: str
    late_completed_at: dt.datetime
    late_error_message: str | None
    notify_on_failure: bool
    notify_recipients: str | None


class RunOutputRow(TypedDict):
    """A ``run_output`` row: one chunk (``seq`` from 0, in order) of a run's captured output."""

    run_id: int
    seq: int
    data: str
    created_at: dt.datetime


class PluginReloadRow(TypedDict):
    """A ``plugin_reloads`` row: one ``plugins reload`` request (database time, and who asked)."""

    id: int
    requested_at: dt.datetime
    requested_by: str


class SupervisorRow(TypedDict):
    """A ``supervisors`` row: one supervisor process's liveness lease."""

    instance: str
    hostname: str
    pid: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    lease_expires_at: dt.datetime
    stopped_at: dt.datetime | None
    max_concurrent_jobs: int | None
    version: str | None


class SupervisorStatus(SupervisorRow):
    """A supervisor for ``status``: its row plus ``alive`` (lease not expired by the database clock)."""

    alive: bool


class OutboxRow(TypedDict):
    """What a caller gives the store for one ``notifications`` row (one notice on one channel);
    ``recipients`` (JSON list) and ``details`` (JSON object) are text. Status, attempts and timestamps are
    the store's (database clock)."""

    channel: str
    event: str
    job_id: int | None
    job_name: str
    run_id: int | None
    subject: str
    body: str
    priority: str
    recipients: str | None
    details: str | None


class NotificationRow(OutboxRow):
    """A ``notifications`` row: the outbox row plus its delivery state."""

    id: int
    status: str
    attempts: int
    next_attempt_at: dt.datetime
    claimed_by: str | None
    claimed_until: dt.datetime | None
    last_error: str | None
    created_at: dt.datetime
    sent_at: dt.datetime | None


class InflightRun(TypedDict):
    """A Running run for ``status``."""

    id: int
    job_name: str
    job_type: str
    executed_by_instance: str | None
    started_at: dt.datetime
    deadline_at: dt.datetime | None
    scheduled_at: dt.datetime | None
    cancel_requested_by: str | None


class NextDueJob(TypedDict):
    """An Active job's next occurrence for ``status``."""

    name: str
    next_run_at: dt.datetime
    cron_expression: str
    timezone: str


class RecentFailure(TypedDict):
    """A Failed or Timeout run for ``status``; ``error_message`` whole (callers shorten it)."""

    id: int
    job_name: str
    status: str
    completed_at: dt.datetime | None
    error_message: str | None


class AuditRow(TypedDict):
    """An ``audit_log`` row: one dashboard action. ``outcome`` is ``ok``, ``refused`` or ``error``;
    ``details`` is JSON text (the action's arguments, or the error's one line)."""

    id: int
    at: dt.datetime
    actor: str
    role: str
    action: str
    target: str | None
    outcome: str
    details: str | None
    remote_addr: str | None
