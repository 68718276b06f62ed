"""Pending occurrences run outside the regular schedule (revision 0014): ``jobs backfill`` (attempt 1 of the
occurrences of a past window) and ``runs retry`` (the next attempt of one run's occurrence).

Each is a ``backfills`` row until a supervisor claims it: :meth:`Backfills.claim` deletes the row, takes the
job lease (unless the job is Concurrent) and inserts the Running run row with the row's ``scheduled_at`` and
``attempt``, in ONE transaction judged by row counts, like the regular claim (:mod:`.leases`). So a pending
occurrence survives any supervisor's restart or death (it is in the database) and runs at most once (the
delete is the compare-and-set; the unique index on ``runs(job_id, scheduled_at, attempt)`` backs it up).

The regular schedule is never touched: ``next_run_at`` stays as it is. The due read (:meth:`Backfills.due`)
returns only rows whose job is Active and whose lease is free (or which is Concurrent), oldest request
first: every row it returns can be claimed now, so its cost follows the work that can start.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypedDict, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import ConcurrencyMode, JobStatus, RunStatus
from mjsched_isolated.errors import InputError
from mjsched_isolated.store import schema
from mjsched_isolated.store.errors import is_constraint_violation
from mjsched_isolated.store.predicates import lease_free
from mjsched_isolated.store.records import Claim, JobRow
from mjsched_isolated.store.schema import audit_log, backfills, jobs, runs

log = logging.getLogger("mjsched.store")


class BackfillRow(TypedDict):
    """A ``backfills`` row: a pending occurrence (``scheduled_at``, None for a retry of a manual run) and
    attempt of job ``job_id``; ``kind`` ``Backfill`` or ``Retry`` (then ``retry_of_run_id``)."""

    id: int
    job_id: int
    scheduled_at: dt.datetime | None
    attempt: int
    kind: str
    retry_of_run_id: int | None
    requested_at: dt.datetime
    requested_by: str


class BackfillAdded(TypedDict):
    """What :meth:`Backfills.add_backfill` did with the occurrences it was given: ``added`` (now pending),
    ``already_run`` (the occurrence has a run, any attempt), ``already_pending`` (a pending entry exists)."""

    added: list[dt.datetime]
    already_run: list[dt.datetime]
    already_pending: list[dt.datetime]


class _LostError(Exception):
    """The lease was taken meanwhile: roll the claim back."""


ATTEMPTS = 3  # add_backfill re-reads and tries again when a concurrent request inserted the same rows


class Backfills:
    """The ``backfills`` table: requests, the supervisors' due read and claim, and ``jobs show``'s view."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._due_prebuilt: sa.Select | None = None
        self._any_entry = sa.select(backfills.c.id).limit(1)
        self.reader = schema.reader(engine)  # the poll's due read: no transaction round trips (PostgreSQL)

    # -- requests ------------------------------------------------------------------------------------
    def add_backfill(self, job_id: int, occurrences: Sequence[dt.datetime], *, requested_by: str,
                     requested_at: dt.datetime, audit: dict[str, Any] | None = None) -> BackfillAdded:
        """Make the ``occurrences`` (aware UTC) of job ``job_id`` pending as attempt 1, but those that already
        have a run (any attempt) or a pending entry: idempotent, in one transaction (with ``audit``, the
        column values of an ``audit_log`` row, written in it). A concurrent request that inserted the same
        rows first makes this one read again and retry (at most :data:`ATTEMPTS` times)."""
        wanted = sorted(set(occurrences))
        for attempt in range(ATTEMPTS):
            try:
                with self.engine.begin() as conn:
                    result = self._add(conn, job_id, wanted, requested_by, requested_at)
                    if audit is not None:
                        conn.execute(audit_log.insert().values(at=requested_at, **audit))
                    return result
            except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
                if not is_constraint_violation(exc) or attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _add(self, conn: sa.Connection, job_id: int, wanted: list[dt.datetime], requested_by: str,
             requested_at: dt.datetime) -> BackfillAdded:
        result: BackfillAdded = {"added": [], "already_run": [], "already_pending": []}
        if not wanted:
            return result
        lo, hi = wanted[0], wanted[-1]
        ran = set(conn.execute(sa.select(runs.c.scheduled_at).where(
            runs.c.job_id == job_id, runs.c.scheduled_at >= lo, runs.c.scheduled_at <= hi)).scalars())
        pending = set(conn.execute(sa.select(backfills.c.scheduled_at).where(
            backfills.c.job_id == job_id, backfills.c.scheduled_at >= lo, backfills.c.scheduled_at <= hi)).scalars())
        for when in wanted:
            key = "already_run" if when in ran else "already_pending" if when in pending else "added"
            result[key].append(when)  # type: ignore[literal-required]
        if result["added"]:
            conn.execute(backfills.insert(), [
                {"job_id": job_id, "scheduled_at": when, "attempt": 1, "kind": "Backfill",
                 "requested_at": requested_at, "requested_by": requested_by[:255]} for when in result["added"]])
        return result

    def add_retry(self, job_id: int, scheduled_at: dt.datetime | None, attempt: int, *, retry_of_run_id: int,
                  requested_by: str, requested_at: dt.datetime) -> BackfillRow:
        """Make attempt ``attempt`` of occurrence ``scheduled_at`` pending (``runs retry``). Raises
        :class:`InputError` (field ``id``) when that attempt already has a run or a pending entry."""
        row = {"job_id": job_id, "scheduled_at": scheduled_at, "attempt": attempt, "kind": "Retry",
               "retry_of_run_id": retry_of_run_id, "requested_at": requested_at, "requested_by": requested_by[:255]}
        try:
            with self.engine.begin() as conn:
                if scheduled_at is not None and conn.execute(sa.select(runs.c.id).where(
                        runs.c.job_id == job_id, runs.c.scheduled_at == scheduled_at,
                        runs.c.attempt == attempt)).first() is not None:
                    raise InputError("id", f"attempt {attempt} of this occurrence already has a run")
                key = conn.execute(backfills.insert().values(**row)).inserted_primary_key
                assert key is not None  # an INSERT of one row always has one
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not is_constraint_violation(exc):
                raise
            raise InputError("id", f"attempt {attempt} of this occurrence is already pending") from None
        return cast(BackfillRow, {"id": int(key[0]), **row})

    # -- reads ---------------------------------------------------------------------------------------
    def pending(self, job_id: int, limit: int = 10) -> tuple[int, list[BackfillRow]]:
        """How many entries job ``job_id`` has pending, and the first ``limit`` of them by occurrence."""
        with self.engine.connect() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(backfills)
                                 .where(backfills.c.job_id == job_id)).scalar_one()
            rows = conn.execute(sa.select(backfills).where(backfills.c.job_id == job_id)
                                .order_by(backfills.c.scheduled_at, backfills.c.attempt).limit(limit)).mappings()
            return int(count), [cast(BackfillRow, dict(r)) for r in rows]

    def attempts_of(self, job_id: int, scheduled_at: dt.datetime) -> int:
        """The highest attempt of occurrence ``scheduled_at`` of job ``job_id``, run or pending (0: none)."""
        with self.engine.connect() as conn:
            ran = conn.execute(sa.select(sa.func.max(runs.c.attempt)).where(
                runs.c.job_id == job_id, runs.c.scheduled_at == scheduled_at)).scalar()
            waiting = conn.execute(sa.select(sa.func.max(backfills.c.attempt)).where(
                backfills.c.job_id == job_id, backfills.c.scheduled_at == scheduled_at)).scalar()
        return max(ran or 0, waiting or 0)

    def pending_retry(self, job_id: int, scheduled_at: dt.datetime | None, run_id: int) -> BackfillRow | None:
        """A pending entry of occurrence ``scheduled_at`` of job ``job_id`` (a backfill or retry; for a
        manual run, None, a retry of run ``run_id``), or None."""
        where = (backfills.c.scheduled_at == scheduled_at if scheduled_at is not None
                 else sa.and_(backfills.c.scheduled_at.is_(None), backfills.c.retry_of_run_id == run_id))
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(backfills).where(backfills.c.job_id == job_id, where)
                               .order_by(backfills.c.id).limit(1)).mappings().first()
        return None if row is None else cast(BackfillRow, dict(row))

    def live_run_id(self, job_id: int) -> int | None:
        """A Running run of job ``job_id`` (the oldest), or None."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(runs.c.id).where(runs.c.job_id == job_id, runs.c.status == RunStatus.RUNNING)
                                .order_by(runs.c.id).limit(1)).scalar()

    def due(self, limit: int, exclude: AbstractSet[int] = frozenset()) -> list[tuple[BackfillRow, JobRow]]:
        """At most ``limit`` pending entries that can start now, oldest request first, with their job: the job
        is Active and not in ``exclude``, and its lease is free (DB clock) unless it is Concurrent. A job
        with several entries appears once per entry (the caller claims the first; the lease stops the rest).
        The statement is built once (building it costs far more than running it on an empty table). With no
        entry at all (the usual case) only that is read: SQLite plans the join from the Active jobs, so on an
        empty table it still walked every Active job (22 ms a read at 100,000 jobs, at every rescan)."""
        if exclude:
            query = self._due_query(exclude)
        else:
            query = self._due_prebuilt = self._due_prebuilt if self._due_prebuilt is not None else self._due_query(())
        out: list[tuple[BackfillRow, JobRow]] = []
        with self.reader.connect() as conn:
            if conn.execute(self._any_entry).first() is None:
                return out
            for r in conn.execute(query, {"p_limit": limit}).mappings():
                entry = {c.name: r[c.name] for c in backfills.c}
                job = {c.name: r[f"job__{c.name}"] for c in jobs.c}
                out.append((cast(BackfillRow, entry), cast(JobRow, job)))
        return out

    def _due_query(self, exclude: AbstractSet[int] | tuple[()]) -> sa.Select:
        conds = [jobs.c.status == JobStatus.ACTIVE,
                 sa.or_(jobs.c.concurrency_mode == ConcurrencyMode.CONCURRENT, lease_free(self.dialect))]
        if exclude:
            conds.append(backfills.c.job_id.not_in(sorted(exclude)))
        job_cols = [c.label(f"job__{c.name}") for c in jobs.c]
        return (sa.select(backfills, *job_cols).join(jobs, jobs.c.id == backfills.c.job_id).where(*conds)
                .order_by(backfills.c.id).limit(sa.bindparam("p_limit", type_=sa.Integer)))

    # -- the claim -----------------------------------------------------------------------------------
    def claim(self, entry: BackfillRow, *, take_lease: bool, instance: str, lease_s: float,
              deadline_at: dt.datetime, not_before: dt.datetime | None = None) -> Claim | None:
        """Run pending ``entry`` now: delete its row, take the job lease (``take_lease``: free or expired by the
        DB clock, job still Active) and insert its Running run row (``scheduled_at``, ``attempt``,
        ``queued_at`` = when it was requested), in one transaction. None (nothing written) if another
        supervisor claimed the entry or holds the lease. An entry whose run the unique index refuses (that
        attempt ran meanwhile, e.g. by an automatic retry) is dropped, logged."""
        token = uuid.uuid4().hex if take_lease else None
        try:
            with self.engine.begin() as conn:
                if conn.execute(backfills.delete().where(backfills.c.id == entry["id"])).rowcount != 1:
                    return None
                active = jobs.c.status == JobStatus.ACTIVE
                if take_lease:
                    took = conn.execute(jobs.update().where(jobs.c.id == entry["job_id"], active,
                                                            lease_free(self.dialect)).values(
                        lock_token=token, locked_at=schema.db_now(self.dialect), locked_by_instance=instance,
                        expected_completion_at=schema.db_now_plus(self.dialect, lease_s))).rowcount == 1
                else:
                    took = conn.execute(sa.select(jobs.c.id).where(jobs.c.id == entry["job_id"], active)).first() \
                        is not None
                if not took:
                    raise _LostError
                started_at = conn.execute(sa.select(schema.db_now(self.dialect))).scalar_one()
                if not_before is not None and started_at < not_before:
                    started_at = not_before
                key = conn.execute(runs.insert().values(
                    job_id=entry["job_id"], scheduled_at=entry["scheduled_at"], started_at=started_at,
                    status=RunStatus.RUNNING, executed_by_instance=instance, lock_token=token,
                    deadline_at=deadline_at, queued_at=entry["requested_at"], attempt=entry["attempt"])
                ).inserted_primary_key
                assert key is not None  # an INSERT of one row always has one
                return Claim(run_id=int(key[0]), lock_token=token, started_at=started_at)
        except _LostError:
            return None
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not is_constraint_violation(exc):
                raise
        with self.engine.begin() as conn:
            conn.execute(backfills.delete().where(backfills.c.id == entry["id"]))
        log.warning("job %d: pending %s of occurrence %s attempt %d dropped: that attempt already has a run",
                    entry["job_id"], entry["kind"].lower(), entry["scheduled_at"], entry["attempt"])
        return None
