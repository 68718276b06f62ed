"""Every read and write of jobs and runs, in SQLAlchemy Core.

Lease protocol (reference-engine-spec.md §2, without its defects): each step is **one conditional UPDATE
judged by its row count**, never read-then-write, and expiry is judged by the **database clock**:

* :meth:`Store.claim` - take the lease if free or expired *and* move ``next_run_at`` past the occurrence
  (compare-and-set on the ``next_run_at`` that was read), then insert the Running run row, in one
  transaction. Each occurrence is claimed at most once (a unique index on ``runs(job_id, scheduled_at)``
  backs this up).
* A job lease is live while its token is set, its ``expected_completion_at`` (the run's deadline plus a
  grace) has not passed, **and** its holder's row in ``supervisors`` has not expired. Supervisors renew
  that one row (:meth:`Store.renew_supervisor`): one statement keeps all their leases and runs alive.
* :meth:`Store.release` / :meth:`Store.extend` - only if the token matches.
* :meth:`Store.finish_run` - terminal run row, then statistics (which never touch lease columns), then a
  token-checked release, in one transaction.

Run timestamps (``started_at``, ``completed_at``, ``last_run_at``) are written by the database clock, so
the records of every supervisor share one time base and follow the order in which leases serialised them.
Rows are returned as plain dicts keyed by column name. All datetimes are aware UTC.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated import notices as notices_mod
from mjsched_isolated.store import schema
from mjsched_isolated.errors import InputError, NotFoundError
from mjsched_isolated.store.schema import jobs, notifications, runs, supervisors

Row = dict[str, Any]
log = logging.getLogger("mjsched.store")
SUPERVISOR_ROW_RETENTION_S = 7 * 86400.0  # rows of supervisors dead this long are deleted at registrations


class Claim(msgspec.Struct, frozen=True):
    """A won occurrence: the run row's id and the lease token it runs under (None without a lease)."""

    run_id: int
    lock_token: str | None


class Store:
    """The database behind one supervisor or CLI call. ``engine`` must have the schema (see
    :func:`schema.create_engine`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    @classmethod
    def open(cls, url: str, *, auto_upgrade: bool = False) -> "Store":
        """Connect to ``url``; an empty database gets the schema, an outdated one is migrated with
        ``auto_upgrade`` and otherwise refused (:class:`migrate.SchemaError`, nothing written)."""
        return cls(schema.create_engine(url, auto_upgrade=auto_upgrade))

    def close(self) -> None:
        self.engine.dispose()

    def db_now(self) -> dt.datetime:
        """The database server's current time (aware UTC)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(schema.db_now(self.dialect))).scalar_one()

    # -- jobs: management --------------------------------------------------------------------------
    def add_job(self, values: Row, now: dt.datetime) -> int:
        """Insert a job; ``values`` are column values. Raises :class:`InputError` (field ``name``) if the
        name is taken."""
        row = {**values, "created_at": now, "updated_at": now}
        if row.get("configuration") is not None and not isinstance(row["configuration"], str):
            row["configuration"] = json.dumps(row["configuration"])
        try:
            with self.engine.begin() as conn:
                return conn.execute(jobs.insert().values(**row)).inserted_primary_key[0]
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not _is_constraint_violation(exc):
                raise
            with self.engine.connect() as conn:
                taken = conn.execute(sa.select(jobs.c.id).where(jobs.c.name == values.get("name"))).first()
            if taken:
                raise InputError("name", f"a job named {values['name']!r} already exists") from None
            raise InputError("job", f"rejected by the database: {exc.orig}") from None

    def update_job(self, name: str, values: Row, now: dt.datetime) -> None:
        """Update the given (non-lease) columns of job ``name``. Raises :class:`NotFoundError`."""
        values = dict(values)
        if values.get("configuration") is not None and not isinstance(values["configuration"], str):
            values["configuration"] = json.dumps(values["configuration"])
        with self.engine.begin() as conn:
            result = conn.execute(jobs.update().where(jobs.c.name == name).values(**values, updated_at=now))
        if result.rowcount != 1:
            raise NotFoundError("name", f"no job named {name!r}")

    def remove_job(self, name: str) -> None:
        """Delete job ``name`` and its runs. Raises :class:`NotFoundError`."""
        with self.engine.begin() as conn:  # writes only: no read-then-write upgrade on SQLite
            conn.execute(runs.delete().where(runs.c.job_id.in_(sa.select(jobs.c.id).where(jobs.c.name == name))))
            if conn.execute(jobs.delete().where(jobs.c.name == name)).rowcount != 1:
                raise NotFoundError("name", f"no job named {name!r}")

    def get_job(self, name: str) -> Row:
        """Job ``name`` as a dict. Raises :class:`NotFoundError`."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.name == name)).mappings().first()
        if row is None:
            raise NotFoundError("name", f"no job named {name!r}")
        return dict(row)

    def get_job_by_id(self, job_id: int) -> Row | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().first()
        return None if row is None else dict(row)

    def list_jobs(self) -> list[Row]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs).order_by(jobs.c.name)).mappings()]

    # == BEGIN jobs sync (helper cli): one transaction for a whole jobs file; move with the jobs module ====
    def apply_job_changes(self, creates: list[Row], updates: list[tuple[str, Row]], now: dt.datetime) -> None:
        """Insert every row of ``creates`` and apply every ``(name, column values)`` of ``updates``, in ONE
        transaction: all of them or none (``jobs sync`` is all-or-nothing). Raises :class:`InputError`
        naming ``name`` when a created name is taken (e.g. by another supervisor's sync meanwhile: the
        caller re-reads and retries), :class:`NotFoundError` when an updated job is gone; nothing is
        written then."""
        def encoded(values: Row) -> Row:
            values = dict(values)
            if values.get("configuration") is not None and not isinstance(values["configuration"], str):
                values["configuration"] = json.dumps(values["configuration"])
            return values

        try:
            with self.engine.begin() as conn:
                for values in creates:
                    conn.execute(jobs.insert().values(**encoded(values), created_at=now, updated_at=now))
                for name, values in updates:
                    stmt = jobs.update().where(jobs.c.name == name).values(**encoded(values), updated_at=now)
                    if conn.execute(stmt).rowcount != 1:
                        raise NotFoundError("name", f"no job named {name!r}")
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not _is_constraint_violation(exc):
                raise
            names = [values.get("name") for values in creates]
            with self.engine.connect() as conn:
                taken = conn.execute(sa.select(jobs.c.name).where(jobs.c.name.in_(names))).scalars().first()
            if taken:
                raise InputError("name", f"a job named {taken!r} already exists") from None
            raise InputError("job", f"rejected by the database: {exc.orig}") from None
    # == END jobs sync ===================================================================================

    # -- jobs: what the poll loop reads ------------------------------------------------------------
    def _dispatchable(self, exclude: set[int]):
        """Active, scheduled, not excluded, and not waiting: a Queue job (or a RunAll job, which never
        drops an occurrence) waits while its lease is live."""
        queue_waiting = sa.and_(sa.or_(jobs.c.concurrency_mode == "Queue", jobs.c.missed_run_policy == "RunAll"),
                                sa.not_(self._lease_free()))
        conds = [jobs.c.status == "Active", jobs.c.next_run_at.is_not(None), sa.not_(queue_waiting)]
        if exclude:
            conds.append(jobs.c.id.not_in(sorted(exclude)))
        return conds

    def due_jobs(self, now: dt.datetime, limit: int, exclude: set[int] = frozenset()) -> list[Row]:
        """Jobs with ``next_run_at <= now``, earliest first (an index range on ``(status, next_run_at)``).
        A Queue job whose lease is live is not due yet: its occurrence waits until the lease ends.
        ``start_at`` is the caller's to check (writers keep ``next_run_at >= start_at``)."""
        query = (sa.select(jobs).where(*self._dispatchable(exclude), jobs.c.next_run_at <= now)
                 .order_by(jobs.c.next_run_at, jobs.c.id).limit(limit))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def next_due_at(self, exclude: set[int] = frozenset()) -> dt.datetime | None:
        """The earliest ``next_run_at`` by the rules of :meth:`due_jobs` (None if none): the first row
        of an ordered index walk, not a scan."""
        query = (sa.select(jobs.c.next_run_at).where(*self._dispatchable(exclude))
                 .order_by(jobs.c.next_run_at).limit(1))
        with self.engine.connect() as conn:
            return conn.execute(query).scalar()

    def active_jobs_signature(self) -> tuple:
        """(count, latest updated_at) of Active jobs: a cheap way to notice that any of them changed."""
        query = sa.select(sa.func.count(), sa.type_coerce(sa.func.max(jobs.c.updated_at), schema.UTCDateTime)).where(
            jobs.c.status == "Active")
        with self.engine.connect() as conn:
            return tuple(conn.execute(query).one())

    def unscheduled_active_jobs(self) -> list[Row]:
        """Active jobs without a next_run_at (new, resumed or edited outside the CLI)."""
        query = sa.select(jobs).where(jobs.c.status == "Active", jobs.c.next_run_at.is_(None))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def active_jobs(self) -> list[Row]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs).where(jobs.c.status == "Active")).mappings()]

    def set_next_run_at(self, job_id: int, seen: dt.datetime | None, next_run_at: dt.datetime | None,
                        now: dt.datetime, *, skipped: bool = False, status: str | None = None,
                        notices: list[Row] | None = None) -> bool:
        """Compare-and-set ``next_run_at`` from ``seen`` (the value read). ``skipped`` counts a skipped
        occurrence; ``status`` optionally changes the status too (e.g. Expired). ``notices``: outbox rows
        (:func:`notices.outbox_rows`) written in the same transaction, only if it won. True if it won."""
        cond = jobs.c.next_run_at.is_(None) if seen is None else jobs.c.next_run_at == seen
        values: Row = {"next_run_at": next_run_at}  # scheduling progress: updated_at marks definition changes
        if skipped:
            values["skipped_count"] = jobs.c.skipped_count + 1
        if status:
            values.update(status=status, updated_at=now)
        with self.engine.begin() as conn:
            won = conn.execute(jobs.update().where(jobs.c.id == job_id, cond).values(**values)).rowcount == 1
            if won and notices:
                self._insert_notices(conn, notices)
            return won

    def repair_next_run_at(self, job_id: int, next_run_at: dt.datetime | None) -> bool:
        """Replace a ``next_run_at`` that cannot be read (a number or hand-edited text in a SQLite file; the
        other databases type their columns) with ``next_run_at``. Only a value still unreadable is replaced,
        so two supervisors repairing at once cannot bring back an occurrence one of them already claimed.
        True if this call replaced it."""
        if self.dialect != "sqlite":
            return False
        with self.engine.begin() as conn:
            stmt = jobs.update().where(jobs.c.id == job_id, self._unreadable_next_run_at())
            return conn.execute(stmt.values(next_run_at=next_run_at)).rowcount == 1

    def unreadable_next_run_at_jobs(self) -> list[Row]:
        """Active jobs whose stored ``next_run_at`` cannot be read (SQLite only; see :meth:`repair_next_run_at`),
        wherever it sorts: ISO text such as ``2026-12-01T00:00:00Z`` sorts after every real timestamp of that
        day, so such a row would never come due."""
        if self.dialect != "sqlite":
            return []
        query = sa.select(jobs).where(jobs.c.status == "Active", self._unreadable_next_run_at())
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    @staticmethod
    def _unreadable_next_run_at():
        col = sa.type_coerce(jobs.c.next_run_at, sa.String)
        exact = col.op("GLOB", is_comparison=True)(sa.literal(schema.SQLITE_EXACT_FORM, sa.String))
        return sa.and_(jobs.c.next_run_at.is_not(None),
                       sa.or_(sa.func.typeof(jobs.c.next_run_at) != "text", sa.not_(exact)))

    # -- the lease ---------------------------------------------------------------------------------
    def _holder_alive(self, instance_column):
        """EXISTS a supervisors row for ``instance_column`` whose liveness lease has not expired (DB clock)."""
        holder = supervisors.alias("holder")
        return sa.exists().where(holder.c.instance == instance_column,
                                 holder.c.lease_expires_at > schema.db_now(self.dialect))

    def _lease_free(self):
        return sa.or_(jobs.c.lock_token.is_(None), jobs.c.expected_completion_at.is_(None),
                      jobs.c.expected_completion_at < schema.db_now(self.dialect),
                      sa.not_(self._holder_alive(jobs.c.locked_by_instance)))

    def claim(self, job: Row, *, now: dt.datetime, next_run_at: dt.datetime | None, instance: str,
              lease_s: float, deadline_at: dt.datetime, take_lease: bool = True,
              scheduled_at: dt.datetime | None = None, queued_at: dt.datetime | None = None,
              status: str | None = None, only_free_lease: bool = False) -> Claim | None:
        """Claim the occurrence ``job["next_run_at"]`` (or a manual run when ``scheduled_at`` is None and
        ``next_run_at`` is ``job["next_run_at"]``) and insert its Running run row, atomically.

        With ``take_lease`` the job's lease must be free or expired (DB clock) and becomes this run's for
        ``lease_s`` seconds with a fresh random token; ``only_free_lease``: a lease held by anyone, even one
        that looks expired, is not taken. Returns None if another holder has the lease or the occurrence
        was already claimed (``next_run_at`` changed since it was read).
        """
        token = uuid.uuid4().hex if take_lease else None
        seen = job["next_run_at"]
        conds = [jobs.c.id == job["id"], jobs.c.next_run_at.is_(None) if seen is None else jobs.c.next_run_at == seen]
        values: Row = {"next_run_at": next_run_at}  # scheduling progress: updated_at marks definition changes
        if status is not None:
            values.update(status=status, updated_at=now)
        if take_lease:
            conds.append(jobs.c.lock_token.is_(None) if only_free_lease else self._lease_free())
            values.update(lock_token=token, locked_at=schema.db_now(self.dialect), locked_by_instance=instance,
                          expected_completion_at=schema.db_now_plus(self.dialect, lease_s))
        try:
            with self.engine.begin() as conn:
                if conn.execute(jobs.update().where(*conds).values(**values)).rowcount != 1:
                    conn.rollback()
                    return None
                run_id = conn.execute(runs.insert().values(
                    job_id=job["id"], scheduled_at=scheduled_at, started_at=schema.db_now(self.dialect), status="Running",
                    executed_by_instance=instance, lock_token=token, deadline_at=deadline_at, queued_at=queued_at,
                )).inserted_primary_key[0]
        except sa.exc.IntegrityError:  # the unique index caught a second run of one occurrence
            log.warning("job %s: occurrence %s already has a run; claim refused by the unique index",
                        job["name"], seen)
            return None
        return Claim(run_id=run_id, lock_token=token)

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
            conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == "Running")
                         .values(deadline_at=deadline_at))
        return True

    def release(self, job_id: int, token: str) -> bool:
        """Clear the lease if ``token`` still holds it (idempotent: a second call returns False)."""
        with self.engine.begin() as conn:
            return conn.execute(_release_stmt(job_id, token)).rowcount == 1

    # -- runs --------------------------------------------------------------------------------------
    def finish_run(self, run_id: int, job_id: int, token: str | None, *, status: str, success: bool | None,
                   error_message: str | None, details: dict | None, duration_ms: float | None,
                   count: bool = True, notices: list[Row] | None = None) -> bool:
        """Record a run's terminal state, update the job's statistics (if ``count``), release its lease
        and write ``notices`` (outbox rows, :func:`notices.outbox_rows`), in one transaction. Only a run
        still ``Running`` is finished; returns False otherwise (e.g. it was abandoned meanwhile), and then
        touches nothing else."""
        with self.engine.begin() as conn:
            done = conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == "Running").values(
                status=status, success=success, error_message=_fit_text(error_message),
                completed_at=schema.db_now(self.dialect), details=_fit_json(details), duration_ms=duration_ms,
            )).rowcount == 1
            if not done:
                return False
            if count:
                conn.execute(_stats_stmt(job_id, bool(success), duration_ms, schema.db_now(self.dialect)))
            if token is not None:
                conn.execute(_release_stmt(job_id, token))
            if notices:
                self._insert_notices(conn, notices)
        return True

    def running_runs(self, instance: str | None = None) -> list[Row]:
        query = sa.select(runs).where(runs.c.status == "Running")
        if instance is not None:
            query = query.where(runs.c.executed_by_instance == instance)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def abandon_orphaned_runs(self, exclude_run_ids: set[int] = frozenset(),
                              notice_channels: tuple[str, ...] | list[str] = ()) -> list[Row]:
        """Mark Failed every Running run whose supervisor is gone (its ``supervisors`` row expired by the DB
        clock, or missing), count it as a failure and free its job lease (token-checked), and, for jobs
        with ``notify_on_failure``, write a Failure notice per channel of ``notice_channels`` in the same
        transaction. ``exclude_run_ids``: runs the caller itself supervises. Returns the abandoned runs."""
        orphan_q = (sa.select(runs, supervisors.c.lease_expires_at.label("holder_expired_at"),
                              schema.db_now(self.dialect).label("db_now"), jobs.c.name.label("job_name"),
                              jobs.c.notify_on_failure, jobs.c.notify_recipients)
                    .join(jobs, jobs.c.id == runs.c.job_id)
                    .outerjoin(supervisors, supervisors.c.instance == runs.c.executed_by_instance)
                    .where(runs.c.status == "Running", sa.not_(self._holder_alive(runs.c.executed_by_instance))))
        if exclude_run_ids:
            orphan_q = orphan_q.where(runs.c.id.not_in(sorted(exclude_run_ids)))
        with self.engine.connect() as conn:
            orphans = conn.execute(orphan_q).mappings().all()
        abandoned = []
        for run in orphans:  # one short write transaction each, guarded by status = 'Running'
            expired = run["holder_expired_at"]
            message = (f"abandoned: supervisor {run['executed_by_instance']} stopped renewing its lease "
                       f"({'expired ' + expired.isoformat() if expired else 'no longer registered'}) while "
                       f"the run (started {run['started_at'].isoformat()}) was in flight")
            # the run was lost when its supervisor's lease ended, not when this sweep noticed: any takeover
            # claim came after that moment, so the records never show the two runs overlapping
            ended = min(run["db_now"], expired) if expired else run["db_now"]
            with self.engine.begin() as conn:
                if not conn.execute(runs.update().where(runs.c.id == run["id"], runs.c.status == "Running").values(
                        status="Failed", success=False, completed_at=ended, error_message=message)).rowcount:
                    continue
                duration_ms = max(0.0, (ended - run["started_at"]).total_seconds() * 1000)
                conn.execute(_stats_stmt(run["job_id"], False, duration_ms, ended))
                if run["lock_token"] is not None:
                    conn.execute(_release_stmt(run["job_id"], run["lock_token"]))
                rows = notices_mod.outbox_rows(notices_mod.for_abandoned({**run, "error_message": message}),
                                               notice_channels)
                if rows:
                    self._insert_notices(conn, rows)
            abandoned.append({**run, "error_message": message})
        return abandoned

    # -- notifications: the durable outbox ----------------------------------------------------------
    def _insert_notices(self, conn: sa.Connection, rows: list[Row]) -> None:
        """Insert outbox rows (Pending, due now by the DB clock) on ``conn``, inside the caller's transaction."""
        now_expr = schema.db_now(self.dialect)
        for row in rows:
            row = {**row, "subject": _fit_text(row["subject"], MAX_SUBJECT_BYTES), "body": _fit_text(row["body"]),
                   "details": _fit_text(row.get("details")), "recipients": _fit_text(row.get("recipients"))}
            conn.execute(notifications.insert().values(**row, status="Pending", attempts=0, created_at=now_expr,
                                                       next_attempt_at=now_expr))

    def due_notification_ids(self, limit: int, channel: str | None = None) -> list[int]:
        """Ids of Pending notifications (of ``channel``, if given) due by the DB clock and not claimed (or
        whose claim expired), oldest first (an index range on ``(status, next_attempt_at)``)."""
        now_expr = schema.db_now(self.dialect)
        query = (sa.select(notifications.c.id)
                 .where(notifications.c.status == "Pending", notifications.c.next_attempt_at <= now_expr,
                        sa.or_(notifications.c.claimed_until.is_(None), notifications.c.claimed_until < now_expr))
                 .order_by(notifications.c.next_attempt_at, notifications.c.id).limit(limit))
        if channel is not None:
            query = query.where(notifications.c.channel == channel)
        with self.engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def claim_notification(self, notification_id: int, instance: str, lease_s: float) -> Row | None:
        """Claim one due notification for ``lease_s`` seconds (DB clock) and count the attempt: one
        conditional UPDATE judged by its row count, so of several senders exactly one wins. Returns the
        claimed row, or None if it is no longer due or another sender holds it."""
        now_expr = schema.db_now(self.dialect)
        stmt = notifications.update().where(
            notifications.c.id == notification_id, notifications.c.status == "Pending",
            notifications.c.next_attempt_at <= now_expr,
            sa.or_(notifications.c.claimed_until.is_(None), notifications.c.claimed_until < now_expr),
        ).values(claimed_by=instance, claimed_until=schema.db_now_plus(self.dialect, lease_s),
                 attempts=notifications.c.attempts + 1)
        with self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                return None
            return dict(conn.execute(sa.select(notifications).where(notifications.c.id == notification_id))
                        .mappings().one())

    def notification_sent(self, notification_id: int, instance: str) -> bool:
        """Mark a notification this sender claimed as Sent (DB clock). False if the claim was lost."""
        return self._settle_notification(notification_id, instance, status="Sent",
                                         sent_at=schema.db_now(self.dialect), last_error=None)

    def notification_attempt_failed(self, notification_id: int, instance: str, error: str,
                                    retry_in_s: float | None) -> bool:
        """Record a failed delivery: Pending again, due in ``retry_in_s`` seconds (DB clock), or Failed for
        good when ``retry_in_s`` is None. ``error`` is stored as ``last_error`` (callers keep secrets out
        of it). False if the claim was lost."""
        if retry_in_s is None:
            return self._settle_notification(notification_id, instance, status="Failed", last_error=error)
        return self._settle_notification(notification_id, instance, status="Pending", last_error=error,
                                         next_attempt_at=schema.db_now_plus(self.dialect, retry_in_s))

    def _settle_notification(self, notification_id: int, instance: str, **values: Any) -> bool:
        stmt = notifications.update().where(
            notifications.c.id == notification_id, notifications.c.status == "Pending",
            notifications.c.claimed_by == instance).values(claimed_until=None, **values)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def list_notifications(self, *, status: str | None = None, limit: int = 1000) -> list[Row]:
        """Outbox rows, oldest first (``recipients``/``details`` as stored: JSON text)."""
        query = sa.select(notifications).order_by(notifications.c.id).limit(limit)
        if status is not None:
            query = query.where(notifications.c.status == status)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    # -- supervisors (liveness leases) ---------------------------------------------------------------
    def register_supervisor(self, instance: str, hostname: str, pid: int, ttl_s: float) -> dt.datetime:
        """Insert (or reset) ``instance``'s row with a lease of ``ttl_s``. Returns the DB time."""
        now_expr, until = schema.db_now(self.dialect), schema.db_now_plus(self.dialect, ttl_s)
        stale = schema.db_now_plus(self.dialect, -SUPERVISOR_ROW_RETENTION_S)
        with self.engine.begin() as conn:
            conn.execute(supervisors.delete().where(sa.or_(supervisors.c.instance == instance,
                                                           supervisors.c.lease_expires_at < stale)))
            conn.execute(supervisors.insert().values(instance=instance, hostname=hostname, pid=pid, started_at=now_expr,
                                                     heartbeat_at=now_expr, lease_expires_at=until))
            return conn.execute(sa.select(supervisors.c.heartbeat_at).where(
                supervisors.c.instance == instance)).scalar_one()

    def renew_supervisor(self, instance: str, ttl_s: float) -> dt.datetime | None:
        """Extend ``instance``'s liveness lease to DB-now + ``ttl_s``: one statement keeps every lease and run
        of that supervisor alive. Returns the DB time, or None if the row is gone or was stopped."""
        stmt = supervisors.update().where(supervisors.c.instance == instance, supervisors.c.stopped_at.is_(None)).values(
            heartbeat_at=schema.db_now(self.dialect), lease_expires_at=schema.db_now_plus(self.dialect, ttl_s))
        with self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                return None
            return conn.execute(sa.select(supervisors.c.heartbeat_at).where(
                supervisors.c.instance == instance)).scalar_one()

    def stop_supervisor(self, instance: str) -> None:
        """A clean stop: the lease ends now, so nobody waits for it."""
        now_expr = schema.db_now(self.dialect)
        with self.engine.begin() as conn:
            conn.execute(supervisors.update().where(supervisors.c.instance == instance).values(
                stopped_at=now_expr, lease_expires_at=now_expr))

    def held_runs(self, run_ids: set[int]) -> set[int]:
        """Of ``run_ids``, those still Running whose job lease (if they had one) still carries their token."""
        if not run_ids:
            return set()
        query = (sa.select(runs.c.id).outerjoin(jobs, sa.and_(jobs.c.id == runs.c.job_id,
                                                               jobs.c.lock_token == runs.c.lock_token))
                 .where(runs.c.id.in_(sorted(run_ids)), runs.c.status == "Running",
                        sa.or_(runs.c.lock_token.is_(None), jobs.c.id.is_not(None))))
        with self.engine.connect() as conn:
            return set(conn.execute(query).scalars())

    def list_supervisors(self) -> list[Row]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(supervisors).order_by(supervisors.c.heartbeat_at.desc()))
                    .mappings()]

    def queue_now(self, job_id: int, now: dt.datetime) -> bool:
        """Queue mode's manual run: make the job's pending occurrence due now (if it is not already due)."""
        stmt = jobs.update().where(jobs.c.id == job_id, sa.or_(jobs.c.next_run_at.is_(None), jobs.c.next_run_at > now)
                                   ).values(next_run_at=now)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def get_run(self, run_id: int) -> Row:
        query = sa.select(runs, jobs.c.name.label("job_name")).join(jobs, jobs.c.id == runs.c.job_id).where(
            runs.c.id == run_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        if row is None:
            raise NotFoundError("id", f"no run with id {run_id}")
        return _decode_details(dict(row))

    def list_runs(self, *, job_name: str | None = None, status: str | None = None, limit: int = 50) -> list[Row]:
        """Newest first. Raises :class:`NotFoundError` for an unknown ``job_name``."""
        query = sa.select(runs, jobs.c.name.label("job_name")).join(jobs, jobs.c.id == runs.c.job_id)
        if job_name is not None:
            self.get_job(job_name)
            query = query.where(jobs.c.name == job_name)
        if status is not None:
            query = query.where(runs.c.status == status)
        query = query.order_by(runs.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [_decode_details(dict(r)) for r in conn.execute(query).mappings()]

    # -- status (read-only views for `status`) -----------------------------------------------------
    def status_supervisors(self, hide_after_s: float = 3600.0) -> list[Row]:
        """Supervisors whose liveness lease is live or ended less than ``hide_after_s`` seconds ago (a clean
        stop ends it at once), latest lease expiry first (the live ones). Each row has the ``supervisors`` columns plus
        ``alive`` (lease not expired by the database clock)."""
        now_expr = schema.db_now(self.dialect)
        alive = sa.case((supervisors.c.lease_expires_at > now_expr, sa.true()), else_=sa.false())
        query = (sa.select(supervisors, alive.label("alive"))
                 .where(supervisors.c.lease_expires_at > schema.db_now_plus(self.dialect, -hide_after_s))
                 .order_by(supervisors.c.lease_expires_at.desc(), supervisors.c.instance))
        with self.engine.connect() as conn:
            return [{**r, "alive": bool(r["alive"])} for r in conn.execute(query).mappings()]

    def inflight_runs(self) -> list[Row]:
        """Running runs, oldest first: ``id, job_name, job_type, executed_by_instance, started_at,
        deadline_at, scheduled_at`` (the ``ix_runs_status`` index)."""
        query = (sa.select(runs.c.id, jobs.c.name.label("job_name"), jobs.c.job_type, runs.c.executed_by_instance,
                           runs.c.started_at, runs.c.deadline_at, runs.c.scheduled_at)
                 .join(jobs, jobs.c.id == runs.c.job_id).where(runs.c.status == "Running")
                 .order_by(runs.c.started_at, runs.c.id))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def next_due_jobs(self, limit: int = 10) -> list[Row]:
        """The first ``limit`` Active jobs by ``next_run_at``: ``name, next_run_at, cron_expression,
        timezone`` (an index walk on ``(status, next_run_at)``)."""
        query = (sa.select(jobs.c.name, jobs.c.next_run_at, jobs.c.cron_expression, jobs.c.timezone)
                 .where(jobs.c.status == "Active", jobs.c.next_run_at.is_not(None))
                 .order_by(jobs.c.next_run_at, jobs.c.id).limit(limit))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def recent_failures(self, limit: int = 10) -> list[Row]:
        """The last ``limit`` Failed or Timeout runs, newest ``completed_at`` first: ``id, job_name, status,
        completed_at, error_message`` (whole; callers shorten it)."""
        query = (sa.select(runs.c.id, jobs.c.name.label("job_name"), runs.c.status, runs.c.completed_at,
                           runs.c.error_message)
                 .join(jobs, jobs.c.id == runs.c.job_id).where(runs.c.status.in_(("Failed", "Timeout")))
                 .order_by(runs.c.completed_at.desc(), runs.c.id.desc()).limit(limit))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    # -- run retention -------------------------------------------------------------------------------
    def _prunable(self, now: dt.datetime, keep_days: float, keep_min_per_job: int):
        """(ranked subquery, condition): finished runs that started before ``now - keep_days`` and are not
        among their job's newest ``keep_min_per_job`` finished runs. ROW_NUMBER() is a window function of
        SQLite >= 3.25, PostgreSQL and MySQL 8 / MariaDB 10.2."""
        rank = sa.func.row_number().over(partition_by=runs.c.job_id, order_by=(runs.c.started_at.desc(), runs.c.id.desc()))
        ranked = (sa.select(runs.c.id, runs.c.started_at, rank.label("rank"))
                  .where(runs.c.status != "Running").subquery("ranked"))
        cutoff = now - dt.timedelta(days=keep_days)
        return ranked, sa.and_(ranked.c.rank > keep_min_per_job, ranked.c.started_at < cutoff)

    def count_prunable_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int) -> int:
        """How many runs :meth:`prune_runs` would delete now (0 when ``keep_days`` is 0: keep everything)."""
        if keep_days <= 0:
            return 0
        ranked, cond = self._prunable(now, keep_days, keep_min_per_job)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(ranked).where(cond)).scalar_one()

    def prunable_run_ids(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, limit: int) -> list[int]:
        """Up to ``limit`` ids of runs :meth:`prune_runs` would delete, lowest first (one read; no lock held
        on SQLite in WAL mode, PostgreSQL or InnoDB). Empty when ``keep_days`` is 0."""
        if keep_days <= 0:
            return []
        ranked, cond = self._prunable(now, keep_days, keep_min_per_job)
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(ranked.c.id).where(cond).order_by(ranked.c.id).limit(limit)).scalars())

    def delete_finished_runs(self, run_ids: list[int]) -> int:
        """Delete the given runs unless Running, in one short transaction. Returns how many were deleted
        (ids already gone, e.g. pruned by another supervisor, are not counted)."""
        if not run_ids:
            return 0
        with self.engine.begin() as conn:
            return conn.execute(runs.delete().where(runs.c.id.in_(run_ids), runs.c.status != "Running")).rowcount

    def count_prunable_notifications(self, now: dt.datetime, keep_days: float) -> int:
        """How many notifications :meth:`prune_notifications` would delete now (``runs prune --dry-run``)."""
        if keep_days <= 0:
            return 0
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(notifications).where(
                notifications.c.status.in_(("Sent", "Failed")),
                notifications.c.created_at < now - dt.timedelta(days=keep_days))).scalar_one()

    def prune_notifications(self, now: dt.datetime, keep_days: float, batch_size: int = 500,
                            max_batches: int | None = None) -> int:
        """Delete delivered (Sent) and given-up (Failed) notifications created more than ``keep_days`` days
        before ``now``, ``batch_size`` per short transaction; Pending ones are never touched. ``keep_days =
        0`` keeps everything. Returns the number deleted."""
        if keep_days <= 0:
            return 0
        cutoff = now - dt.timedelta(days=keep_days)
        deleted = batches = 0
        while max_batches is None or batches < max_batches:
            with self.engine.connect() as conn:
                ids = list(conn.execute(sa.select(notifications.c.id).where(
                    notifications.c.status.in_(("Sent", "Failed")), notifications.c.created_at < cutoff)
                    .order_by(notifications.c.id).limit(batch_size)).scalars())
            if ids:
                with self.engine.begin() as conn:
                    deleted += conn.execute(notifications.delete().where(
                        notifications.c.id.in_(ids), notifications.c.status != "Pending")).rowcount
            batches += 1
            if len(ids) < batch_size:
                break
        return deleted

    def prune_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, batch_size: int = 500,
                   max_batches: int | None = None) -> int:
        """Delete finished runs that started more than ``keep_days`` days before ``now``, keeping each job's
        newest ``keep_min_per_job`` finished runs whatever their age; ``keep_days = 0`` keeps everything.
        Running runs are never touched. Works in batches of at most ``batch_size`` rows, each a read of ids
        then its own short DELETE transaction (no long locks; several supervisors may prune at once), until
        nothing is left or ``max_batches`` batches ran. Returns the number of runs deleted."""
        deleted = batches = 0
        while max_batches is None or batches < max_batches:
            ids = self.prunable_run_ids(now, keep_days, keep_min_per_job, batch_size)
            deleted += self.delete_finished_runs(ids)
            batches += 1
            if len(ids) < batch_size:
                break
        return deleted


# the smallest TEXT of our databases (MySQL/MariaDB: 65,535 bytes), with room to spare
MAX_TEXT_BYTES = 60_000
MAX_SUBJECT_BYTES = 1_000


def _fit_text(value: str | None, max_bytes: int = MAX_TEXT_BYTES) -> str | None:
    """``value`` cut to at most ``max_bytes`` of UTF-8 (on a character boundary), marked when cut."""
    if value is None or len(value) * 4 <= max_bytes:
        return value
    encoded = value.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return value
    mark = f" [... cut: {len(encoded)} bytes in all]"
    return encoded[:max_bytes - len(mark.encode()) - 8].decode("utf-8", errors="ignore") + mark


def _fit_json(details: dict | None, max_bytes: int = MAX_TEXT_BYTES) -> str | None:
    """``details`` as JSON text of at most ``max_bytes``; larger ones become a preview object."""
    if details is None:
        return None
    text = json.dumps(details)
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    return json.dumps({"truncated": True, "size_bytes": len(text.encode("utf-8")), "preview": text[:2000]})


def is_permanent_error(exc: BaseException) -> bool:
    """True if retrying the same statement cannot help: the data was refused (a NUL byte PostgreSQL will
    not store, a constraint, a value that cannot be bound), as opposed to a database that is unreachable
    or busy (``OperationalError``/``InterfaceError``), which is worth retrying."""
    if isinstance(exc, (sa.exc.DataError, sa.exc.IntegrityError, sa.exc.ProgrammingError)):
        return True
    if isinstance(exc, sa.exc.DBAPIError):
        return _is_constraint_violation(exc)
    return isinstance(exc, (sa.exc.StatementError, TypeError, ValueError))  # failed while binding, client side


def _is_constraint_violation(exc: sa.exc.DBAPIError) -> bool:
    """IntegrityError, or MySQL/MariaDB's CHECK violation, which PyMySQL reports as OperationalError."""
    if isinstance(exc, sa.exc.IntegrityError):
        return True
    code = exc.orig.args[0] if getattr(exc.orig, "args", None) else None
    return code in (3819, 4025)  # ER_CHECK_CONSTRAINT_VIOLATED (MySQL), ER_CONSTRAINT_FAILED (MariaDB)


def _release_stmt(job_id: int, token: str):
    return jobs.update().where(jobs.c.id == job_id, jobs.c.lock_token == token).values(
        lock_token=None, locked_at=None, locked_by_instance=None, expected_completion_at=None)


def _stats_stmt(job_id: int, success: bool, duration_ms: float | None, completed_at: Any):
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


def _decode_details(row: Row) -> Row:
    if row.get("details"):
        try:
            row["details"] = json.loads(row["details"])
        except ValueError:
            pass
    return row
