"""The Python API for applications: manage jobs and read runs in a scheduler database without a shell.

Peers: APScheduler's ``add_job`` and db-scheduler's ``SchedulerClient``. A :class:`Client` writes the
same rows as the CLI, through the same validated operations (:mod:`mjsched_isolated.ops`), so it raises
the same one-line errors: :class:`~mjsched_isolated.errors.InputError` with ``.field`` (the store's
field name, such as ``cron_expression``) and ``.message``; :class:`~mjsched_isolated.errors.NotFoundError`
for an unknown job or run. A running ``mjsched serve`` picks the changes up within its
``rescan_interval_s``. Results are typed: :class:`Job` and :class:`Run` (msgspec Structs) with
``StrEnum`` statuses and ``configuration`` as a dict.

Example::

    from mjsched_isolated import Client

    with Client("sqlite:///mjsched.db") as client:
        client.add_job("backup", job_type="shell", cron_expression="@daily", timezone="Europe/Berlin",
                       configuration={"command": ["/usr/local/bin/backup"]})
        run_id = client.run_job("backup")
        print(client.get_run(run_id).status)
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Self

import msgspec

from mjsched_isolated import ops
from mjsched_isolated.config import Settings
from mjsched_isolated.enums import (
    ConcurrencyMode,
    DstFoldPolicy,
    DstGapPolicy,
    JobStatus,
    MissedRunPolicy,
    RunStatus,
)
from mjsched_isolated.errors import InputError


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A job as stored (the ``jobs`` table): definition, schedule state, statistics and lease. Times are
    aware UTC; durations in milliseconds (``*_ms``) or seconds (``*_s``)."""

    id: int
    name: str
    job_type: str
    cron_expression: str
    timezone: str
    status: JobStatus
    description: str | None = None
    configuration: dict[str, Any] | None = None
    start_at: dt.datetime | None = None
    end_at: dt.datetime | None = None
    next_run_at: dt.datetime | None = None
    last_run_at: dt.datetime | None = None
    run_count: int = 0
    success_count: int = 0
    failure_count: int = 0
    skipped_count: int = 0
    missed_count: int = 0
    last_duration_ms: float | None = None
    avg_duration_ms: float | None = None
    concurrency_mode: ConcurrencyMode = ConcurrencyMode.SKIP
    max_queued: int = 10
    missed_run_policy: MissedRunPolicy = MissedRunPolicy.RUN_ONCE
    max_jitter_s: float | None = None
    run_immediately_if_never_run: bool = False
    max_runtime_minutes: int | None = None
    max_memory_mb: int | None = None
    max_cpu_s: int | None = None
    max_open_files: int | None = None
    max_processes: int | None = None
    nice: int | None = None
    notify_on_success: bool = False
    notify_on_failure: bool = True
    notify_on_missed: bool = False
    notify_recipients: list[str] | None = None
    dst_gap_policy: DstGapPolicy = DstGapPolicy.SHIFT
    dst_fold_policy: DstFoldPolicy = DstFoldPolicy.ONCE_IF_FIXED_HOUR
    missed_run_grace_s: float | None = None
    max_total_runtime_s: float | None = None
    max_retries: int = 0
    retry_backoff_s: float = 10.0
    retry_backoff_factor: float = 2.0
    retry_backoff_max_s: float | None = None
    retry_max_jitter_s: float | None = None
    retry_on: list[str] | None = None
    retry_at: dt.datetime | None = None
    retry_attempt: int | None = None
    retry_scheduled_at: dt.datetime | None = None
    retry_next_run_at: dt.datetime | None = None
    pause_after_failures: int | None = None
    consecutive_failures: int = 0
    paused_reason: str | None = None
    locked_at: dt.datetime | None = None
    locked_by_instance: str | None = None
    expected_completion_at: dt.datetime | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    pending_backfill_count: int = 0  # pending `jobs backfill` / `runs retry` entries (get_job only; jobs(): 0)


class Run(msgspec.Struct, frozen=True, kw_only=True):
    """A run (the ``runs`` table, plus ``job_name``). ``scheduled_at`` is None for a manual run;
    ``details`` is the plugin's result details; ``duration_ms`` in milliseconds; ``cpu_s`` (CPU seconds)
    and ``max_rss_mb`` (peak resident memory, MiB): what the run used, None when not measured (a killed
    run, a run before revision 0011). ``late_status``, ``late_completed_at``, ``late_error_message`` and
    ``late_details``: the true outcome of a run recorded Failed (abandoned) by another supervisor, as its
    own supervisor reported it later (None: none came; revision 0015)."""

    id: int
    job_id: int
    job_name: str
    status: RunStatus
    started_at: dt.datetime
    scheduled_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None
    success: bool | None = None
    error_message: str | None = None
    details: dict[str, Any] | None = None
    queued_at: dt.datetime | None = None
    executed_by_instance: str | None = None
    deadline_at: dt.datetime | None = None
    duration_ms: float | None = None
    cancel_requested_at: dt.datetime | None = None
    cancel_requested_by: str | None = None
    missed_count: int = 0
    cpu_s: float | None = None
    max_rss_mb: float | None = None
    attempt: int = 1
    late_status: RunStatus | None = None
    late_completed_at: dt.datetime | None = None
    late_error_message: str | None = None
    late_details: dict[str, Any] | None = None


def _job(row: dict[str, Any]) -> Job:
    return msgspec.convert(row, Job)


def _run(row: dict[str, Any]) -> Run:
    return msgspec.convert(row, Run)


class Client:
    """A connection to one scheduler database.

    ``db_url``: a SQLAlchemy URL (an empty database gets the schema, as with ``mjsched jobs add``).
    ``plugins_dir``: the local plugins folder used to validate configurations and to :meth:`run_job`
    (default: ``settings.plugins_dir``). ``settings``: the rest (import and ready timeouts, recycling);
    default :class:`Settings` ``()``; the environment is not read. Raises :class:`InputError` naming
    ``db_url`` when the database cannot be used. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, db_url: str, *, plugins_dir: str | None = None, settings: Settings | None = None) -> None:
        if not isinstance(db_url, str):
            raise InputError("db_url", f"must be a database URL string, got {type(db_url).__name__}")
        base = settings if settings is not None else Settings()
        changes: dict[str, Any] = {"database_url": db_url}
        if plugins_dir is not None:
            changes["plugins_dir"] = plugins_dir
        self.settings = msgspec.structs.replace(base, **changes)
        self._store = ops.open_store(db_url, field="db_url")

    # -- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the database connections (idempotent)."""
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _now() -> dt.datetime:  # the Client is an outer layer: it reads the clock, the operations take it
        return dt.datetime.now(dt.UTC)

    # -- jobs ----------------------------------------------------------------------------------------
    def add_job(self, name: str, *, job_type: str, cron_expression: str, timezone: str = "UTC",
                configuration: dict[str, Any] | None = None, **fields: Any) -> Job:
        """Create job ``name`` (Active unless ``status=`` says otherwise). ``fields``: the other job
        fields by their store names (``concurrency_mode``, ``max_queued``, ``missed_run_policy``,
        ``max_jitter_s``, ``max_runtime_minutes``, the resource limits ``max_memory_mb``, ``max_cpu_s``,
        ``max_open_files``, ``max_processes``, ``nice``, ``start_at``/``end_at`` (datetimes; naive ones are read in
        ``timezone``), ``notify_*``, ``description``, ``run_immediately_if_never_run``, and the time
        knobs ``dst_gap_policy``, ``dst_fold_policy``, ``missed_run_grace_s``, ``max_total_runtime_s``; retries
        ``max_retries``, ``retry_backoff_s``, ``retry_backoff_factor``, ``retry_backoff_max_s``,
        ``retry_max_jitter_s``, ``retry_on`` (a list of statuses); ``pause_after_failures``). The
        configuration is validated by the plugin in a worker child. Raises :class:`InputError` naming
        the field (``name`` if taken); nothing is written then."""
        values = {"name": name, "job_type": job_type, "cron_expression": cron_expression, "timezone": timezone,
                  "configuration": configuration, **fields}
        return _job(ops.add_job(self._store, self.settings, values, self._now()))

    def update_job(self, name: str, /, **fields: Any) -> Job:
        """Change fields of job ``name`` (store names, as :meth:`add_job`), keeping its runs and counters; a
        schedule change recomputes ``next_run_at``. Raises :class:`NotFoundError` / :class:`InputError`."""
        return _job(ops.update_job(self._store, self.settings, name, fields, self._now()))

    def pause_job(self, name: str) -> Job:
        """Stop scheduling job ``name`` (a run in progress goes on). Raises :class:`NotFoundError`."""
        return _job(ops.pause_job(self._store, name, self._now()))

    def resume_job(self, name: str) -> Job:
        """Schedule job ``name`` again from now (Expired if its ``end_at`` has passed)."""
        return _job(ops.resume_job(self._store, name, self._now()))

    def remove_job(self, name: str) -> None:
        """Delete job ``name`` and its runs. Raises :class:`NotFoundError`."""
        ops.remove_job(self._store, name)

    def get_job(self, name: str) -> Job:
        """Job ``name``. Raises :class:`NotFoundError` (field ``name``)."""
        return _job(ops.get_job(self._store, name))

    def jobs(self) -> list[Job]:
        """Every job, by name."""
        return [_job(row) for row in ops.list_jobs(self._store)]

    def run_job(self, name: str) -> int | None:
        """Run job ``name`` once now in a worker child, like ``mjsched jobs run``, and wait until its run is
        recorded; returns the run id (see :meth:`get_run` for its outcome). A Paused job runs and stays
        Paused. A Queue job whose run is live is queued instead (returns None). Raises
        :class:`~mjsched_isolated.ops.AlreadyRunningError` for a Skip or Replace job whose run is live,
        :class:`InputError` (``job_type``) when its plugin is unavailable, ``TimeoutError`` when no worker
        becomes ready in ``settings.worker_ready_timeout_s``."""
        return ops.run_job(self._store, self.settings, name).run_id

    def backfill_job(self, name: str, start: dt.datetime, end: dt.datetime, *,
                     max_occurrences: int = ops.DEFAULT_BACKFILL_MAX,
                     requested_by: str | None = None) -> ops.BackfillResult:
        """Run job ``name``'s occurrences in the past window ``[start, end]``, like ``mjsched jobs backfill``
        (naive times in the job's timezone): they become pending (durable) and the supervisors run them
        under the cap, the job's concurrency mode and lease, each with its own ``scheduled_at``; the regular
        schedule is untouched. Idempotent (an occurrence already run or pending is not added again).
        Raises :class:`InputError` naming this method's parameter: ``start``, ``end``, ``max_occurrences`` (a
        window of more than ``max_occurrences``), ``requested_by``; :class:`NotFoundError` (``name``); nothing
        is written then."""
        try:
            return ops.backfill_job(self._store, name, start, end, self._now(), max_occurrences=max_occurrences,
                                    requested_by=requested_by, audit_role="api")
        except InputError as exc:  # ops names the CLI's words (from, to, max): say the parameters' names
            names = {"from": "start", "to": "end", "max": "max_occurrences"}
            raise (exc.renamed(names[exc.field]) if exc.field in names else exc) from None

    # -- runs ----------------------------------------------------------------------------------------
    def runs(self, job: str | None = None, status: RunStatus | str | None = None, limit: int = 50) -> list[Run]:
        """Runs, newest first: of job ``job`` only, in ``status`` only, at most ``limit``. Raises
        :class:`NotFoundError` for an unknown job, :class:`InputError` for a bad status or limit."""
        return [_run(row) for row in ops.list_runs(self._store, job=job, status=status, limit=limit)]

    def get_run(self, run_id: int) -> Run:
        """Run ``run_id``. Raises :class:`NotFoundError` (field ``id``)."""
        return _run(ops.get_run(self._store, run_id))

    def cancel_run(self, run_id: int, *, requested_by: str | None = None) -> Run:
        """Ask for live run ``run_id`` to be cancelled, like ``mjsched runs cancel``: whichever supervisor
        holds it kills its process tree within one ``lease_renew_interval_s`` and records it Cancelled
        (``cancel_requested_by``: ``requested_by``, default ``<user>@<host>``); a run that finishes first
        keeps its outcome (poll :meth:`get_run`). Returns the run as it is now (Running). Raises
        :class:`NotFoundError` (``id``) for an unknown run, :class:`InputError` (``id``) for one that is
        no longer Running."""
        return _run(ops.cancel_run(self._store, run_id, requested_by))
    def retry_run(self, run_id: int, *, requested_by: str | None = None) -> dict[str, Any]:
        """Run run ``run_id``'s occurrence again, like ``mjsched runs retry``: a new run with the same
        ``scheduled_at`` and the next ``attempt``, pending (durable) until a supervisor starts it at its next
        poll under the job's cap, mode and lease. Returns the pending entry (``job_name``,
        ``scheduled_at``, ``attempt``, ``retry_of_run_id``, ``requested_by``, ``requested_at``). Raises
        :class:`NotFoundError` (``id``); :class:`InputError` (``id``) when the run has not ended, another
        run of a non-Concurrent job is live, or that retry is already pending."""
        return ops.retry_run(self._store, run_id, self._now(), requested_by=requested_by)

    def run_logs(self, run_id: int) -> str:
        """What run ``run_id`` wrote so far (stdout, stderr, logging records, its subprocesses'), in order,
        bounded by ``max_run_output_bytes`` (its first and last halves, with a marker line between). A live
        run's output grows about once a second. Raises :class:`NotFoundError` (field ``id``)."""
        chunks, _running = ops.run_output(self._store, run_id)
        return "".join(text for _, text in chunks)
