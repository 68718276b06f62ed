"""The :class:`Store` facade: the one object every caller (supervisor, CLI, status, API) uses for the
database. Each method is a delegation to the module that owns the rule; read the module for the rule.

==========================  ===============================================================================
module                      owns
==========================  ===============================================================================
:mod:`.jobs`                job CRUD, the poll's reads, ``next_run_at`` compare-and-set, ``queue_now``
:mod:`.leases`              claim, extend, release, ``finish_run``, ``running_runs``, ``held_runs``,
                            abandoning runs of dead supervisors
:mod:`.supervisors`         supervisor liveness rows
:mod:`.outbox`              the notification outbox (claim, settle, list)
:mod:`.views`               read-only views: ``get_run``, ``list_runs``, the ``status`` projections
:mod:`.retention`           pruning runs and notifications
:mod:`.output`              runs' captured output (``run_output`` chunks), ``plugins reload`` requests
:mod:`.backfills`           pending occurrences outside the schedule (``jobs backfill``, ``runs retry``)
:mod:`.records`             the typed rows (``TypedDict``) returned here; :class:`Claim`
:mod:`.text`                fitting text/JSON to the column cap; :mod:`.errors`: refused data vs outage
:mod:`.schema`              tables, engine, database clock; :mod:`.migrate`: the schema's revisions
==========================  ===============================================================================

The store records facts; it never formats notices or decides schedules (callers pass outbox rows and
next occurrences in). All datetimes are aware UTC; lease expiry is judged by the database clock.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.store import schema
from mjsched_isolated.store.backfills import Backfills
from mjsched_isolated.store.jobs import Jobs, Share, unreadable_next_run_at_chunk, unreadable_time_window
from mjsched_isolated.store.leases import ClaimRequest, HeldBeforeStart, Leases, Outcome
from mjsched_isolated.store.outbox import Outbox
from mjsched_isolated.store.output import PluginReloads, RunOutput
from mjsched_isolated.store.records import (
    AbandonedRun,
    Claim,
    InflightRun,
    JobRow,
    LateResult,
    NextDueJob,
    NotificationRow,
    OutboxRow,
    PluginReloadRow,
    RecentFailure,
    RunRow,
    RunView,
    SupervisorRow,
    SupervisorStatus,
    Values,
)
from mjsched_isolated.store.retention import Retention
from mjsched_isolated.store.supervisors import Supervisors
from mjsched_isolated.store.views import Views


class Store:
    """The database behind one supervisor or CLI call. ``engine`` must have the schema (see
    :func:`schema.create_engine`, or :meth:`open`). The parts are attributes: ``jobs``, ``leases``,
    ``supervisors``, ``outbox``, ``views``, ``retention``, ``output``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.jobs = Jobs(engine)
        self.leases = Leases(engine)
        self.supervisors = Supervisors(engine)
        self.outbox = Outbox(engine)
        self.views = Views(engine)
        self.retention = Retention(engine)
        self.output = RunOutput(engine)
        self.reloads = PluginReloads(engine)
        self.backfills = Backfills(engine)

    @classmethod
    def open(cls, url: str, *, auto_upgrade: bool = False) -> Store:
        """Connect to ``url``; an empty database gets the schema, an outdated one is migrated with
        ``auto_upgrade`` and otherwise refused (:class:`migrate.SchemaError`, nothing written)."""
        return cls(schema.create_engine(url, auto_upgrade=auto_upgrade))

    def close(self) -> None:
        """Close the engine's connections."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def db_now(self) -> dt.datetime:
        """The database server's current time (aware UTC)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(schema.db_now(self.dialect))).scalar_one()

    # -- jobs (:mod:`.jobs`) -----------------------------------------------------------------------
    def add_job(self, values: Values, now: dt.datetime) -> int:
        """Insert a job; returns its id (:meth:`Jobs.add_job`)."""
        return self.jobs.add_job(values, now)

    def update_job(self, name: str, values: Values, now: dt.datetime) -> None:
        """Update non-lease columns of job ``name`` (:meth:`Jobs.update_job`)."""
        self.jobs.update_job(name, values, now)

    def apply_job_changes(self, creates: list[Values], updates: list[tuple[str, Values]], now: dt.datetime) -> None:
        """Create and update jobs in one transaction, all or none (:meth:`Jobs.apply_job_changes`)."""
        self.jobs.apply_job_changes(creates, updates, now)

    def remove_job(self, name: str) -> None:
        """Delete job ``name`` and its runs (:meth:`Jobs.remove_job`)."""
        self.jobs.remove_job(name)

    def get_job(self, name: str) -> JobRow:
        """Job ``name``, or :class:`NotFoundError` (:meth:`Jobs.get_job`)."""
        return self.jobs.get_job(name)

    def get_job_by_id(self, job_id: int) -> JobRow | None:
        """Job ``job_id`` or None (:meth:`Jobs.get_job_by_id`)."""
        return self.jobs.get_job_by_id(job_id)

    def list_jobs(self) -> list[JobRow]:
        """Every job, by name (:meth:`Jobs.list_jobs`)."""
        return self.jobs.list_jobs()

    def due_jobs(self, now: dt.datetime, limit: int, exclude: AbstractSet[int] = frozenset(),
                 skip_locked: bool = False, share: Share | None = None) -> list[JobRow]:
        """Dispatchable jobs due by ``now``, earliest first; ``skip_locked``: pass over rows a peer's claim
        holds (PostgreSQL); ``share``: this supervisor's share of a fleet's jobs (:meth:`Jobs.due_jobs`)."""
        return self.jobs.due_jobs(now, limit, exclude, skip_locked, share)

    def due_live_skip_jobs(self, now: dt.datetime, limit: int, exclude: AbstractSet[int] = frozenset(),
                           mode: str = "Skip") -> list[JobRow]:
        """Due Skip (or ``mode``) jobs whose run is live, oldest first (:meth:`Jobs.due_live_skip_jobs`)."""
        return self.jobs.due_live_skip_jobs(now, limit, exclude, mode)

    def next_due_at(self, exclude: AbstractSet[int] = frozenset(), share: Share | None = None) -> dt.datetime | None:
        """The earliest dispatchable ``next_run_at`` (:meth:`Jobs.next_due_at`)."""
        return self.jobs.next_due_at(exclude, share)

    def live_instances(self) -> list[str]:
        """The names of the live supervisors, sorted (:meth:`Supervisors.live_instances`)."""
        return self.supervisors.live_instances()

    def active_jobs_signature(self) -> tuple[int, dt.datetime | None]:
        """(count, latest updated_at) of Active jobs (:meth:`Jobs.active_jobs_signature`)."""
        return self.jobs.active_jobs_signature()

    def unscheduled_active_jobs(self) -> list[JobRow]:
        """Active jobs without a next_run_at (:meth:`Jobs.unscheduled_active_jobs`)."""
        return self.jobs.unscheduled_active_jobs()

    def active_schedules_named(self, limit: int) -> list[tuple[str, str, int, list[str]]]:
        """(cron, zone, count, first names) per schedule of the Active jobs, one read
        (:meth:`Jobs.active_schedules_named`)."""
        return self.jobs.active_schedules_named(limit)

    def active_jobs(self) -> list[JobRow]:
        """Every Active job (:meth:`Jobs.active_jobs`)."""
        return self.jobs.active_jobs()

    def set_next_run_at(self, job_id: int, seen: dt.datetime | None, next_run_at: dt.datetime | None,
                        now: dt.datetime, *, skipped: int = 0, missed: int = 0, status: str | None = None,
                        notices: list[OutboxRow] | None = None) -> bool:
        """Compare-and-set ``next_run_at`` from ``seen`` (:meth:`Jobs.set_next_run_at`)."""
        return self.jobs.set_next_run_at(job_id, seen, next_run_at, now, skipped=skipped, missed=missed,
                                         status=status, notices=notices)

    def repair_next_run_at(self, job_id: int, next_run_at: dt.datetime | None) -> bool:
        """Replace an unreadable SQLite ``next_run_at`` (:meth:`Jobs.repair_next_run_at`)."""
        return self.jobs.repair_next_run_at(job_id, next_run_at)

    def unreadable_next_run_at_jobs(self) -> list[JobRow]:
        """Active jobs whose ``next_run_at`` cannot be read (:meth:`Jobs.unreadable_next_run_at_jobs`)."""
        return self.jobs.unreadable_next_run_at_jobs()

    def unreadable_next_run_at_chunk(self, after_id: int, limit: int) -> tuple[list[JobRow], int]:
        """Unreadable ``next_run_at`` among the next ``limit`` job ids (:func:`jobs.unreadable_next_run_at_chunk`)."""
        return unreadable_next_run_at_chunk(self.engine, after_id, limit)

    def unreadable_time_window(self, after_id: int = 0, limit: int | None = None) -> dict[int, tuple[str, str]]:
        """SQLite: jobs whose ``start_at``/``end_at`` is not a timestamp (:func:`jobs.unreadable_time_window`)."""
        return unreadable_time_window(self.engine, after_id, limit)

    def queue_now(self, job_id: int, now: dt.datetime) -> bool:
        """Make a Queue job's pending occurrence due now (:meth:`Jobs.queue_now`)."""
        return self.jobs.queue_now(job_id, now)

    # -- leases and runs (:mod:`.leases`) ----------------------------------------------------------
    def claim(self, job: Mapping[str, Any], *, now: dt.datetime, next_run_at: dt.datetime | None, instance: str,
              lease_s: float, deadline_at: dt.datetime, take_lease: bool = True,
              scheduled_at: dt.datetime | None = None, queued_at: dt.datetime | None = None,
              status: str | None = None, only_free_lease: bool = False) -> Claim | None:
        """Claim an occurrence and insert its Running run, atomically (:meth:`Leases.claim`)."""
        self.jobs.forget_due({job["id"]})  # claimed or lost, its row has moved or waits: not a due candidate
        return self.leases.claim(job, now=now, next_run_at=next_run_at, instance=instance, lease_s=lease_s,
                                 deadline_at=deadline_at, take_lease=take_lease, scheduled_at=scheduled_at,
                                 queued_at=queued_at, status=status, only_free_lease=only_free_lease)

    def claim_many(self, requests: Sequence[ClaimRequest], *, now: dt.datetime, instance: str,
                   not_before: dt.datetime | None = None, busy: set[int] | None = None) -> list[Claim | None]:
        """Claim several occurrences in one transaction, each judged alone; with ``busy``, job rows locked
        by another transaction are skipped, not waited for, and their indexes added to it
        (:meth:`Leases.claim_many`)."""
        self.jobs.forget_due({r.job["id"] for r in requests})  # see claim
        return self.leases.claim_many(requests, now=now, instance=instance, not_before=not_before, busy=busy)

    def claim_replacement(self, request: ClaimRequest, replaced: Outcome, *, now: dt.datetime,
                          instance: str) -> Claim | None:
        """Replace: claim the newest due occurrence over the lease of the run it replaces and record that run
        Cancelled, in one transaction, before that run is killed (:meth:`Leases.claim_replacement`)."""
        self.jobs.forget_due({request.job["id"]})  # see claim
        return self.leases.claim_replacement(request, replaced, now=now, instance=instance)

    def claim_pool(self, requests: Sequence[ClaimRequest], limit: int, *, instance: str,
                   not_before: dt.datetime | None = None) -> list[Claim | None]:
        """PostgreSQL: claim at most ``limit`` of the plain candidates ``requests``, the first ones no peer
        holds (:meth:`Leases.claim_pool`)."""
        self.jobs.forget_due({r.job["id"] for r in requests})  # see claim
        return self.leases.claim_pool(requests, limit, instance=instance, not_before=not_before)

    def extend(self, job_id: int, token: str | None, lease_s: float, run_id: int, deadline_at: dt.datetime) -> bool:
        """Heartbeat a run and its lease (:meth:`Leases.extend`)."""
        return self.leases.extend(job_id, token, lease_s, run_id, deadline_at)

    def release(self, job_id: int, token: str) -> bool:
        """Clear the lease if ``token`` holds it (:meth:`Leases.release`)."""
        return self.leases.release(job_id, token)

    def finish_run(self, run_id: int, job_id: int, token: str | None, *, status: str, success: bool | None,
                   error_message: str | None, details: dict[str, Any] | None, duration_ms: float | None,
                   count: bool = True, notices: list[OutboxRow] | None = None,
                   completed_at: dt.datetime | None = None) -> bool:
        """Record a run's terminal state, statistics, release and notices (:meth:`Leases.finish_run`)."""
        return self.leases.finish_run(run_id, job_id, token, status=status, success=success,
                                      error_message=error_message, details=details, duration_ms=duration_ms,
                                      count=count, notices=notices, completed_at=completed_at)

    def finish_runs(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """Record several runs' outcomes in one transaction (group commit) (:meth:`Leases.finish_runs`)."""
        return self.leases.finish_runs(outcomes)

    def keep_late_result(self, outcome: Outcome, instance: str,
                         notices_for: Callable[[LateResult], list[OutboxRow]] | None = None) -> LateResult | None:
        """Keep an abandoned run's true outcome, reported late by its own supervisor, without un-fencing it
        (:meth:`Leases.keep_late_result`)."""
        return self.leases.keep_late_result(outcome, instance, notices_for)

    def running_runs(self, instance: str | None = None) -> list[RunRow]:
        """Running runs (of ``instance``) (:meth:`Leases.running_runs`)."""
        return self.leases.running_runs(instance)

    def held_runs(self, tokens: Mapping[int, str | None], instance: str) -> dict[int, str | None]:
        """Of these runs of ``instance``, those it still holds, each with who asked to cancel it
        (:meth:`Leases.held_runs`)."""
        return self.leases.held_runs(tokens, instance)

    def held_before_start(self, tokens: Mapping[int, str | None], instance: str) -> dict[int, HeldBeforeStart]:
        """:meth:`held_runs` with each held run's job status and next run time, for runs claimed ahead just
        before their instant (:meth:`Leases.held_before_start`)."""
        return self.leases.held_before_start(tokens, instance)

    def request_replace(self, job_id: int, token: str, requested_by: str) -> int:
        """Ask the holder of the job's lease to cancel its run (:meth:`Leases.request_replace`)."""
        return self.leases.request_replace(job_id, token, requested_by)

    def request_cancel(self, run_id: int, requested_by: str) -> RunRow | None:
        """Ask the holder of a Running run to cancel it (:meth:`Leases.request_cancel`)."""
        return self.leases.request_cancel(run_id, requested_by)

    def abandon_orphaned_runs(self, exclude_run_ids: AbstractSet[int] = frozenset(),
                              notices_for: Callable[[AbandonedRun], list[OutboxRow]] | None = None,
                              previous_life_of: str | None = None) -> list[AbandonedRun]:
        """Fail runs of dead supervisors (and, ``previous_life_of``, of a dead process that had this name);
        ``notices_for`` gives each one's outbox rows (:meth:`Leases.abandon_orphaned_runs`)."""
        return self.leases.abandon_orphaned_runs(exclude_run_ids, notices_for, previous_life_of)

    # -- supervisors (:mod:`.supervisors`) ---------------------------------------------------------
    def register_supervisor(self, instance: str, hostname: str, pid: int, ttl_s: float, *,
                            max_concurrent_jobs: int | None = None, version: str | None = None) -> dt.datetime:
        """Insert or reset ``instance``'s liveness row (:meth:`Supervisors.register_supervisor`); raises
        :class:`~mjsched_isolated.store.supervisors.InstanceInUseError` if another live supervisor holds it."""
        return self.supervisors.register_supervisor(instance, hostname, pid, ttl_s,
                                                    max_concurrent_jobs=max_concurrent_jobs, version=version)

    def instance_holder(self, instance: str, hostname: str, pid: int) -> SupervisorRow | None:
        """Another live supervisor's row named ``instance``, or None (:meth:`Supervisors.live_holder`)."""
        return self.supervisors.live_holder(instance, hostname, pid)

    def renew_supervisor(self, instance: str, ttl_s: float, *, hostname: str | None = None,
                         pid: int | None = None) -> dt.datetime | None:
        """Extend ``instance``'s liveness lease (:meth:`Supervisors.renew_supervisor`)."""
        return self.supervisors.renew_supervisor(instance, ttl_s, hostname=hostname, pid=pid)

    def read_only_reason(self) -> str | None:
        """Why the database refuses writes, or None (:meth:`Supervisors.read_only_reason`)."""
        return self.supervisors.read_only_reason()

    def stop_supervisor(self, instance: str) -> None:
        """End ``instance``'s liveness lease now (:meth:`Supervisors.stop_supervisor`)."""
        self.supervisors.stop_supervisor(instance)

    def list_supervisors(self) -> list[SupervisorRow]:
        """Every supervisor row (:meth:`Supervisors.list_supervisors`)."""
        return self.supervisors.list_supervisors()

    # -- notification outbox (:mod:`.outbox`) ------------------------------------------------------
    def due_notification_ids(self, limit: int, channel: str | None = None) -> list[int]:
        """Ids of claimable Pending notifications (:meth:`Outbox.due_notification_ids`)."""
        return self.outbox.due_notification_ids(limit, channel)

    def claim_notification(self, notification_id: int, instance: str, lease_s: float) -> NotificationRow | None:
        """Claim one due notification (:meth:`Outbox.claim_notification`)."""
        return self.outbox.claim_notification(notification_id, instance, lease_s)

    def notification_sent(self, notification_id: int, instance: str) -> bool:
        """Mark a claimed notification Sent (:meth:`Outbox.notification_sent`)."""
        return self.outbox.notification_sent(notification_id, instance)

    def notification_attempt_failed(self, notification_id: int, instance: str, error: str,
                                    retry_in_s: float | None) -> bool:
        """Record a failed delivery (:meth:`Outbox.notification_attempt_failed`)."""
        return self.outbox.notification_attempt_failed(notification_id, instance, error, retry_in_s)

    def list_notifications(self, *, status: str | None = None, limit: int = 1000) -> list[NotificationRow]:
        """Outbox rows, oldest first (:meth:`Outbox.list_notifications`)."""
        return self.outbox.list_notifications(status=status, limit=limit)

    # -- read-only views (:mod:`.views`) -----------------------------------------------------------
    def get_run(self, run_id: int) -> RunView:
        """Run ``run_id`` with its job's name (:meth:`Views.get_run`)."""
        return self.views.get_run(run_id)

    def append_run_output(self, run_id: int, first_seq: int, texts: list[str], now: dt.datetime) -> int:
        """Store output chunks of run ``run_id`` from ``first_seq`` on; returns the next ``seq``
        (:meth:`RunOutput.append`)."""
        return self.output.append(run_id, first_seq, texts, now)

    def run_output(self, run_id: int, after_seq: int = -1) -> list[tuple[int, str]]:
        """``(seq, text)`` chunks of run ``run_id``'s output after ``after_seq``, in order (:meth:`RunOutput.read`)."""
        return self.output.read(run_id, after_seq)

    def request_plugin_reload(self, requested_by: str) -> PluginReloadRow:
        """Ask every supervisor to reload its plugins (:meth:`PluginReloads.request`)."""
        return self.reloads.request(requested_by)

    def latest_plugin_reload(self) -> int:
        """The newest ``plugins reload`` request's id, 0 if none (:meth:`PluginReloads.latest`)."""
        return self.reloads.latest()

    def previous_attempt_details(self, job_id: int, scheduled_at: dt.datetime, attempt: int) -> str | None:
        """A retry's previous attempt's stored details, JSON text (:meth:`Views.previous_attempt_details`)."""
        return self.views.previous_attempt_details(job_id, scheduled_at, attempt)

    def list_runs(self, *, job_name: str | None = None, status: str | None = None, limit: int = 50) -> list[RunView]:
        """Runs, newest first (:meth:`Views.list_runs`)."""
        return self.views.list_runs(job_name=job_name, status=status, limit=limit)

    def status_supervisors(self, hide_after_s: float = 3600.0) -> list[SupervisorStatus]:
        """Recently live supervisors with ``alive`` (:meth:`Views.status_supervisors`)."""
        return self.views.status_supervisors(hide_after_s)

    def inflight_runs(self) -> list[InflightRun]:
        """Running runs, oldest first (:meth:`Views.inflight_runs`)."""
        return self.views.inflight_runs()

    def next_due_jobs(self, limit: int = 10) -> list[NextDueJob]:
        """The next ``limit`` Active jobs by next_run_at (:meth:`Views.next_due_jobs`)."""
        return self.views.next_due_jobs(limit)

    def recent_failures(self, limit: int = 10) -> list[RecentFailure]:
        """The last ``limit`` Failed or Timeout runs (:meth:`Views.recent_failures`)."""
        return self.views.recent_failures(limit)

    # -- retention (:mod:`.retention`) -------------------------------------------------------------
    def count_prunable_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int) -> int:
        """How many runs :meth:`prune_runs` would delete (:meth:`Retention.count_prunable_runs`)."""
        return self.retention.count_prunable_runs(now, keep_days, keep_min_per_job)

    def prunable_run_ids(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, limit: int) -> list[int]:
        """Up to ``limit`` prunable run ids (:meth:`Retention.prunable_run_ids`)."""
        return self.retention.prunable_run_ids(now, keep_days, keep_min_per_job, limit)

    def delete_finished_runs(self, run_ids: list[int]) -> int:
        """Delete the given runs unless Running (:meth:`Retention.delete_finished_runs`)."""
        return self.retention.delete_finished_runs(run_ids)

    def prune_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, batch_size: int = 500,
                   max_batches: int | None = None) -> int:
        """Delete old finished runs in batches (:meth:`Retention.prune_runs`)."""
        return self.retention.prune_runs(now, keep_days, keep_min_per_job, batch_size, max_batches)

    def count_prunable_notifications(self, now: dt.datetime, keep_days: float) -> int:
        """How many notifications would be pruned (:meth:`Retention.count_prunable_notifications`)."""
        return self.retention.count_prunable_notifications(now, keep_days)

    def prune_notifications(self, now: dt.datetime, keep_days: float, batch_size: int = 500,
                            max_batches: int | None = None) -> int:
        """Delete old settled notifications in batches (:meth:`Retention.prune_notifications`)."""
        return self.retention.prune_notifications(now, keep_days, batch_size, max_batches)
