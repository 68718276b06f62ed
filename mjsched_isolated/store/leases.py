"""The job lease and the life of a run: claim, extend, release, finish, and the abandonment of runs whose
supervisor died.

Lease protocol (reference-engine-spec.md §2, without its defects): each step is **one conditional UPDATE
judged by its row count**, never read-then-write, and expiry is judged by the **database clock**:

* :meth:`Leases.claim` - take the lease if free or expired *and* move ``next_run_at`` past the occurrence
  (compare-and-set on the ``next_run_at`` that was read), then insert the Running run row, in one
  transaction. Each occurrence is claimed at most once (a unique index on ``runs(job_id, scheduled_at)``
  backs this up).
* A job lease is live while its token is set, its ``expected_completion_at`` (the run's deadline plus a
  grace) has not passed, **and** its holder's row in ``supervisors`` has not expired
  (:mod:`.predicates`). Supervisors renew that one row (:mod:`.supervisors`): one statement keeps all
  their leases and runs alive.
* :meth:`Leases.release` / :meth:`Leases.extend` - only if the token matches.
* :meth:`Leases.finish_run` - terminal run row, then statistics (which never touch lease columns), then a
  token-checked release, in one transaction.

Run timestamps (``started_at``, ``completed_at``, ``last_run_at``) are written by the database clock, so
the records of every supervisor share one time base and follow the order in which leases serialised them.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import RunStatus
from mjsched_isolated.store import schema
from mjsched_isolated.store.outbox import insert_notices
from mjsched_isolated.store.predicates import holder_alive, lease_free
from mjsched_isolated.store.records import (
    AbandonedRun,
    Claim,
    OutboxRow,
    RunRow,
    Values,
)
from mjsched_isolated.store.schema import jobs, runs, supervisors
from mjsched_isolated.store.text import fit_json, fit_text

log = logging.getLogger("mjsched.store")


def _release_stmt(job_id: int, token: str) -> sa.Update:
    return jobs.update().where(jobs.c.id == job_id, jobs.c.lock_token == token).values(
        lock_token=None, locked_at=None, locked_by_instance=None, expected_completion_at=None)


def _token_is(token: str | None) -> sa.ColumnElement[bool]:
    """The run row was claimed with ``token`` (None: a run without a lease)."""
    return runs.c.lock_token.is_(None) if token is None else runs.c.lock_token == token


def _stats_stmt(job_id: int, success: bool, duration_ms: float | None, completed_at: Any) -> sa.Update:
    """Counts, last_run_at and durations; never a lease column. The running average is assigned before
    ``run_count`` (MySQL evaluates SET left to right with updated values)."""
    pairs: list[tuple[Any, Any]] = []
    if duration_ms is not None:
        pairs.append((jobs.c.avg_duration_ms, sa.case(
            (jobs.c.avg_duration_ms.is_(None), duration_ms),
            else_=(jobs.c.avg_duration_ms * jobs.c.run_count + duration_ms) / (jobs.c.run_count + 1))))
        pairs.append((jobs.c.last_duration_ms, duration_ms))
    pairs += [
        (jobs.c.run_count, jobs.c.run_count + 1),
        (jobs.c.success_count, jobs.c.success_count + (1 if success else 0)),
        (jobs.c.failure_count, jobs.c.failure_count + (0 if success else 1)),
        (jobs.c.last_run_at, completed_at),
    ]
    return jobs.update().where(jobs.c.id == job_id).ordered_values(*pairs)


def _abandon_message(run: Mapping[str, Any]) -> str:
    expired = run["holder_expired_at"]
    return (f"abandoned: supervisor {run['executed_by_instance']} stopped renewing its lease "
            f"({'expired ' + expired.isoformat() if expired else 'no longer registered'}) while "
            f"the run (started {run['started_at'].isoformat()}) was in flight")


class Leases:
    """Job leases and run rows from claim to terminal state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def claim(self, job: Mapping[str, Any], *, now: dt.datetime, next_run_at: dt.datetime | None, instance: str,
              lease_s: float, deadline_at: dt.datetime, take_lease: bool = True,
              scheduled_at: dt.datetime | None = None, queued_at: dt.datetime | None = None,
              status: str | None = None, only_free_lease: bool = False) -> Claim | None:
        """Claim the occurrence ``job["next_run_at"]`` (or a manual run when ``scheduled_at`` is None and
        ``next_run_at`` is ``job["next_run_at"]``) and insert its Running run row, atomically. ``job``
        needs ``id``, ``name`` and ``next_run_at``; ``status`` optionally changes the job's status too.

        With ``take_lease`` the job's lease must be free or expired (DB clock) and becomes this run's for
        ``lease_s`` seconds with a fresh random token; ``only_free_lease``: a lease held by anyone, even one
        that looks expired, is not taken. Returns None if another holder has the lease or the occurrence
        was already claimed (``next_run_at`` changed since it was read).
        """
        token = uuid.uuid4().hex if take_lease else None
        seen = job["next_run_at"]
        conds = [jobs.c.id == job["id"], jobs.c.next_run_at.is_(None) if seen is None else jobs.c.next_run_at == seen]
        values: Values = {"next_run_at": next_run_at}  # scheduling progress: updated_at marks definition changes
        if status is not None:
            values.update(status=status, updated_at=now)
        if take_lease:
            conds.append(jobs.c.lock_token.is_(None) if only_free_lease else lease_free(self.dialect))
            values.update(lock_token=token, locked_at=schema.db_now(self.dialect), locked_by_instance=instance,
                          expected_completion_at=schema.db_now_plus(self.dialect, lease_s))
        try:
            with self.engine.begin() as conn:
                if conn.execute(jobs.update().where(*conds).values(**values)).rowcount != 1:
                    conn.rollback()
                    return None
                key = conn.execute(runs.insert().values(
                    job_id=job["id"], scheduled_at=scheduled_at, started_at=schema.db_now(self.dialect),
                    status=RunStatus.RUNNING, executed_by_instance=instance, lock_token=token,
                    deadline_at=deadline_at, queued_at=queued_at,
                )).inserted_primary_key
                assert key is not None  # an INSERT of one row always has one
        except sa.exc.IntegrityError:  # the unique index caught a second run of one occurrence
            log.warning("job %s: occurrence %s already has a run; claim refused by the unique index",
                        job["name"], seen)
            return None
        return Claim(run_id=int(key[0]), lock_token=token)

    def extend(self, job_id: int, token: str | None, lease_s: float, run_id: int, deadline_at: dt.datetime) -> bool:
        """Heartbeat: move run ``run_id``'s deadline to ``deadline_at`` and, if ``token`` still holds the
        job's lease, its expiry to DB-now + ``lease_s``. False (and nothing written) if the token lost
        the lease; a run without a lease (Concurrent) only gets its deadline moved."""
        with self.engine.begin() as conn:
            if token is not None:
                stmt = jobs.update().where(jobs.c.id == job_id, jobs.c.lock_token == token).values(
                    expected_completion_at=schema.db_now_plus(self.dialect, lease_s))
                if conn.execute(stmt).rowcount != 1:
                    return False
            conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING,
                                             _token_is(token)).values(deadline_at=deadline_at))
        return True

    def release(self, job_id: int, token: str) -> bool:
        """Clear the lease if ``token`` still holds it (idempotent: a second call returns False)."""
        with self.engine.begin() as conn:
            return conn.execute(_release_stmt(job_id, token)).rowcount == 1

    def finish_run(self, run_id: int, job_id: int, token: str | None, *, status: str, success: bool | None,
                   error_message: str | None, details: dict[str, Any] | None, duration_ms: float | None,
                   count: bool = True, notices: list[OutboxRow] | None = None) -> bool:
        """Record a run's terminal state (``status``, a :class:`RunStatus` other than Running), update the
        job's statistics (if ``count``), release its lease and write ``notices`` (outbox rows), in one
        transaction; ``error_message`` and ``details`` are fitted to the column cap (:mod:`.text`). Only a
        run still ``Running`` and claimed with ``token`` is finished; returns False otherwise (e.g. it was
        abandoned meanwhile), and then touches nothing else."""
        with self.engine.begin() as conn:
            done = conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING,
                                                    _token_is(token)).values(
                status=status, success=success, error_message=fit_text(error_message),
                completed_at=schema.db_now(self.dialect), details=fit_json(details), duration_ms=duration_ms,
            )).rowcount == 1
            if not done:
                return False
            if count:
                conn.execute(_stats_stmt(job_id, bool(success), duration_ms, schema.db_now(self.dialect)))
            if token is not None:
                conn.execute(_release_stmt(job_id, token))
            if notices:
                insert_notices(conn, self.dialect, notices)
        return True

    def running_runs(self, instance: str | None = None) -> list[RunRow]:
        """Running runs (of supervisor ``instance``, if given)."""
        query = sa.select(runs).where(runs.c.status == RunStatus.RUNNING)
        if instance is not None:
            query = query.where(runs.c.executed_by_instance == instance)
        with self.engine.connect() as conn:
            return [cast(RunRow, dict(r)) for r in conn.execute(query).mappings()]

    def held_runs(self, tokens: Mapping[int, str | None], instance: str) -> dict[int, str | None]:
        """Of the runs ``tokens`` (run id -> the job lease token it was claimed with, None for a run
        without a lease), those still Running, executed by ``instance`` under that same token, and whose
        job lease (if they had one) still carries it. Each held run maps to who asked to cancel it (its
        ``cancel_requested_by``, ``"someone"`` if only the time was set) or None. Matching the token and
        the instance, not the id alone, means a run row that is not this run's is never taken for it."""
        if not tokens:
            return {}
        query = (sa.select(runs.c.id, runs.c.lock_token, runs.c.cancel_requested_at, runs.c.cancel_requested_by,
                           jobs.c.lock_token.label("job_token"))
                 .outerjoin(jobs, jobs.c.id == runs.c.job_id)
                 .where(runs.c.id.in_(sorted(tokens)), runs.c.status == RunStatus.RUNNING,
                        runs.c.executed_by_instance == instance))
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        held: dict[int, str | None] = {}
        for row in rows:
            token = tokens[row["id"]]
            if row["lock_token"] != token or (token is not None and row["job_token"] != token):
                continue
            held[row["id"]] = ((row["cancel_requested_by"] or "someone")
                               if row["cancel_requested_at"] is not None else None)
        return held

    def request_cancel(self, run_id: int, requested_by: str) -> RunRow | None:
        """Ask whichever supervisor holds run ``run_id`` to cancel it: sets ``cancel_requested_at`` (DB
        clock) and ``cancel_requested_by`` on the row if it is still Running (a repeated request keeps the
        first time and asker). Returns the row as it is afterwards, None if no run has that id. The
        holder sees the request at its next lease renewal (:meth:`held_runs`)."""
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING,
                                             runs.c.cancel_requested_at.is_(None))
                         .values(cancel_requested_at=schema.db_now(self.dialect),
                                 cancel_requested_by=requested_by[:255]))
            row = conn.execute(sa.select(runs).where(runs.c.id == run_id)).mappings().first()
        return None if row is None else cast(RunRow, dict(row))

    def abandon_orphaned_runs(self, exclude_run_ids: AbstractSet[int] = frozenset(),
                              notices_for: Callable[[AbandonedRun], list[OutboxRow]] | None = None,
                              ) -> list[AbandonedRun]:
        """Mark Failed every Running run whose supervisor is gone (its ``supervisors`` row expired by the DB
        clock, or missing), count it as a failure and free its job lease (token-checked), each in one short
        transaction guarded by ``status = 'Running'``. ``exclude_run_ids``: runs the caller itself
        supervises. ``notices_for``: the caller's outbox rows for an abandoned run (the store records facts
        and formats no notice), written in that run's transaction. Returns the abandoned runs."""
        orphan_q = (sa.select(runs, supervisors.c.lease_expires_at.label("holder_expired_at"),
                              schema.db_now(self.dialect).label("db_now"), jobs.c.name.label("job_name"),
                              jobs.c.notify_on_failure, jobs.c.notify_recipients)
                    .join(jobs, jobs.c.id == runs.c.job_id)
                    .outerjoin(supervisors, supervisors.c.instance == runs.c.executed_by_instance)
                    .where(runs.c.status == RunStatus.RUNNING,
                           sa.not_(holder_alive(self.dialect, runs.c.executed_by_instance))))
        if exclude_run_ids:
            orphan_q = orphan_q.where(runs.c.id.not_in(sorted(exclude_run_ids)))
        with self.engine.connect() as conn:
            orphans = conn.execute(orphan_q).mappings().all()
        abandoned = []
        for orphan in orphans:
            row = dict(orphan)
            run = cast(AbandonedRun, {**row, "error_message": _abandon_message(row)})
            if self._abandon(run, notices_for):
                abandoned.append(run)
        return abandoned

    def _abandon(self, run: AbandonedRun, notices_for: Callable[[AbandonedRun], list[OutboxRow]] | None) -> bool:
        # the run was lost when its supervisor's lease ended, not when this sweep noticed: any takeover
        # claim came after that moment, so the records never show the two runs overlapping
        expired = run["holder_expired_at"]
        ended = min(run["db_now"], expired) if expired else run["db_now"]
        with self.engine.begin() as conn:
            if not conn.execute(runs.update().where(runs.c.id == run["id"], runs.c.status == RunStatus.RUNNING)
                                .values(status=RunStatus.FAILED, success=False, completed_at=ended,
                                        error_message=run["error_message"])).rowcount:
                return False
            duration_ms = max(0.0, (ended - run["started_at"]).total_seconds() * 1000)
            conn.execute(_stats_stmt(run["job_id"], False, duration_ms, ended))
            if run["lock_token"] is not None:
                conn.execute(_release_stmt(run["job_id"], run["lock_token"]))
            rows = notices_for(run) if notices_for is not None else []
            if rows:
                insert_notices(conn, self.dialect, rows)
        return True
