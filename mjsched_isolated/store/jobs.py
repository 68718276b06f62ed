"""Job definitions (add, update, remove, read) and what the poll loop reads and writes of them: due jobs,
the next due time, and the compare-and-set of ``next_run_at`` (reference-engine-spec.md §2: one
conditional UPDATE judged by its row count, never read-then-write)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Set as AbstractSet
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import ConcurrencyMode, JobStatus, MissedRunPolicy, RunStatus
from mjsched_isolated.errors import InputError, NotFoundError, require_utf8
from mjsched_isolated.store import schema
from mjsched_isolated.store.driver import Prepared
from mjsched_isolated.store.errors import is_constraint_violation
from mjsched_isolated.store.outbox import insert_notices
from mjsched_isolated.store.output import RunOutput
from mjsched_isolated.store.predicates import lease_free
from mjsched_isolated.store.records import JobRow, OutboxRow, Values
from mjsched_isolated.store.schema import backfills, jobs, runs

WAITING_MODES = (ConcurrencyMode.QUEUE, ConcurrencyMode.QUEUE_ALL, ConcurrencyMode.REPLACE)
"""Modes whose due occurrence waits, not due, while the job's lease is live."""
READ_AHEAD_ROWS = 256
"""SQLite: due rows read ahead by one due read (:meth:`Jobs.due_jobs`), kept as candidates for later polls."""
READ_AHEAD_MAX_LIMIT = 64
"""SQLite: more idle workers than this read the due jobs in one ordered read, as the other databases do."""
READ_AHEAD_FOR = dt.timedelta(seconds=1)
"""SQLite: the read-ahead candidates are read afresh at least this often (by the callers' ``now``)."""


@dataclasses.dataclass(frozen=True)
class Share:
    """A fleet's division of the jobs (issue 11): supervisor ``index`` of ``count`` live ones prefers the jobs
    with ``id % count == index`` and takes another's only when its occurrence is older than ``steal_before``;
    its wake-up for such a row comes ``steal_after`` after that row's instant. A preference only: every claim
    is judged by the lease and the occurrence as before, so exactly-once never rests on it."""

    index: int
    count: int
    steal_before: dt.datetime
    steal_after: dt.timedelta


def _in_share(mine: bool) -> sa.ColumnElement[bool]:
    """The job is in (``mine``) or out of the share ``p_index`` of ``p_count``."""
    modulo = jobs.c.id % sa.bindparam("p_count", type_=sa.Integer)
    index = sa.bindparam("p_index", type_=sa.Integer)
    return modulo == index if mine else modulo != index


def _job_rows(result: sa.CursorResult[Any]) -> list[JobRow]:
    return [cast(JobRow, dict(r)) for r in result.mappings()]


def _with_json_configuration(values: Values) -> Values:
    """``values`` with a non-text ``configuration`` stored as JSON text."""
    if values.get("configuration") is not None and not isinstance(values["configuration"], str):
        return {**values, "configuration": json.dumps(values["configuration"])}
    return values


class Jobs:
    """The ``jobs`` table, but its lease columns (those are :mod:`.leases`'s)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        # the poll's reads without exclusions: compiled once, run through the DBAPI cursor (:mod:`.driver`)
        self._due_prepared: Prepared | None = None
        self._next_due_prepared: Prepared | None = None
        self._live_skip_prepared: dict[str, Prepared] = {}  # by concurrency mode (Skip, Replace)
        self._due_locking_prebuilt: sa.Select | None = None  # PostgreSQL's SKIP LOCKED read, built once
        self._due_share_prepared: dict[bool, Prepared] = {}  # a fleet's share read, by locking
        self._next_due_share_prepared: dict[bool, Prepared] = {}
        # SQLite's read-ahead (see due_jobs): the due order's next candidates, (id, next_run_at seen) each,
        # as of the read at ``_ahead_read_at``; the recheck of n candidates by id, compiled once per n
        self._ahead: list[tuple[int, dt.datetime]] = []
        self._ahead_read_at: dt.datetime | None = None
        self._recheck_prepared: dict[int, Prepared] = {}
        self._due_ids_prepared: Prepared | None = None
        self.reader = schema.reader(engine)  # the poll's reads: no transaction round trips (PostgreSQL)

    # -- management --------------------------------------------------------------------------------
    def add_job(self, values: Values, now: dt.datetime) -> int:
        """Insert a job; ``values`` are column values (a non-text ``configuration`` is stored as JSON).
        Returns its id. Raises :class:`InputError` (field ``name``) if the name is taken, (field ``job``)
        if the database refuses the row otherwise."""
        row = {**_with_json_configuration(values), "created_at": now, "updated_at": now}
        try:
            with self.engine.begin() as conn:
                key = conn.execute(jobs.insert().values(**row)).inserted_primary_key
                assert key is not None  # an INSERT of one row always has one
                return int(key[0])
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not is_constraint_violation(exc):
                raise
            with self.engine.connect() as conn:
                taken = conn.execute(sa.select(jobs.c.id).where(jobs.c.name == values.get("name"))).first()
            if taken:
                raise InputError("name", f"a job named {values['name']!r} already exists") from None
            raise InputError("job", f"rejected by the database: {exc.orig}") from None

    def update_job(self, name: str, values: Values, now: dt.datetime) -> None:
        """Update the given (non-lease) columns of job ``name``. Raises :class:`NotFoundError`."""
        require_utf8("name", name)  # a lookup by a name that was not UTF-8: one line, not the driver's traceback
        stmt = jobs.update().where(jobs.c.name == name).values(**_with_json_configuration(values), updated_at=now)
        with self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                raise NotFoundError("name", f"no job named {name!r}")

    def apply_job_changes(self, creates: list[Values], updates: list[tuple[str, Values]], now: dt.datetime) -> None:
        """Insert every row of ``creates`` and apply every ``(name, column values)`` of ``updates``, in ONE
        transaction: all of them or none (``jobs sync`` is all-or-nothing). Raises :class:`InputError`
        naming ``name`` when a created name is taken (e.g. by another supervisor's sync meanwhile: the
        caller re-reads and retries), :class:`NotFoundError` when an updated job is gone; nothing is
        written then."""
        try:
            with self.engine.begin() as conn:
                for values in creates:
                    conn.execute(jobs.insert().values(**_with_json_configuration(values), created_at=now,
                                                      updated_at=now))
                for name, values in updates:
                    stmt = jobs.update().where(jobs.c.name == name).values(**_with_json_configuration(values),
                                                                           updated_at=now)
                    if conn.execute(stmt).rowcount != 1:
                        raise NotFoundError("name", f"no job named {name!r}")
        except (sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            if not is_constraint_violation(exc):
                raise
            names = [values.get("name") for values in creates]
            with self.engine.connect() as conn:
                taken = conn.execute(sa.select(jobs.c.name).where(jobs.c.name.in_(names))).scalars().first()
            if taken:
                raise InputError("name", f"a job named {taken!r} already exists") from None
            raise InputError("job", f"rejected by the database: {exc.orig}") from None

    def remove_job(self, name: str) -> None:
        """Delete job ``name`` and its runs. Raises :class:`NotFoundError`."""
        require_utf8("name", name)  # a lookup by a name that was not UTF-8: one line, not the driver's traceback
        with self.engine.begin() as conn:  # writes only: no read-then-write upgrade on SQLite
            job_runs = sa.select(runs.c.id).where(runs.c.job_id.in_(sa.select(jobs.c.id).where(jobs.c.name == name)))
            RunOutput.delete_for_runs(conn, job_runs)
            # its pending backfill (explicitly too, like run_output: a SQLite connection without foreign keys)
            conn.execute(backfills.delete().where(
                backfills.c.job_id.in_(sa.select(jobs.c.id).where(jobs.c.name == name))))
            conn.execute(runs.delete().where(runs.c.job_id.in_(sa.select(jobs.c.id).where(jobs.c.name == name))))
            if conn.execute(jobs.delete().where(jobs.c.name == name)).rowcount != 1:
                raise NotFoundError("name", f"no job named {name!r}")

    def get_job(self, name: str) -> JobRow:
        """Job ``name``. Raises :class:`NotFoundError` (field ``name``)."""
        require_utf8("name", name)  # a lookup by a name that was not UTF-8: one line, not the driver's traceback
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.name == name)).mappings().first()
        if row is None:
            raise NotFoundError("name", f"no job named {name!r}")
        return cast(JobRow, dict(row))

    def get_job_by_id(self, job_id: int) -> JobRow | None:
        """Job ``job_id``, or None if there is none."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().first()
        return None if row is None else cast(JobRow, dict(row))

    def list_jobs(self) -> list[JobRow]:
        """Every job, by name."""
        with self.engine.connect() as conn:
            return _job_rows(conn.execute(sa.select(jobs).order_by(jobs.c.name)))

    # -- what the poll loop reads ------------------------------------------------------------------
    def _dispatchable(self, exclude: AbstractSet[int]) -> list[sa.ColumnElement[bool]]:
        """Active, scheduled, not excluded, and not waiting: a Queue, QueueAll or Replace job (or a RunAll
        job, which never drops an occurrence) waits while its lease is live (a Replace job's run is being
        cancelled: its occurrence starts once the lease is released)."""
        # equalities, not an expanding IN: the due read is compiled once (store/driver.py's Prepared)
        queue_waiting = sa.and_(sa.or_(*(jobs.c.concurrency_mode == mode for mode in WAITING_MODES),
                                       jobs.c.missed_run_policy == MissedRunPolicy.RUN_ALL),
                                sa.not_(lease_free(self.dialect)))
        conds = [jobs.c.status == JobStatus.ACTIVE, jobs.c.next_run_at.is_not(None), sa.not_(queue_waiting)]
        if exclude:
            conds.append(jobs.c.id.not_in(sorted(exclude)))
        return conds

    def due_jobs(self, now: dt.datetime, limit: int, exclude: AbstractSet[int] = frozenset(),
                 skip_locked: bool = False, share: Share | None = None) -> list[JobRow]:
        """Jobs with ``next_run_at <= now`` (an index range on ``(status, next_run_at)``: the cost follows
        the due jobs, not all jobs), fairest first: the oldest due occurrence first; among occurrences due at
        the same instant, the job least recently run (never run first: ``last_run_at`` NULLS FIRST), then
        by id. So when more jobs are due than there are slots, no job waits behind lower ids every time.
        A Queue job whose lease is live is not due yet: its occurrence waits until the lease ends.
        ``start_at`` is the caller's to check (writers keep ``next_run_at >= start_at``).

        ``skip_locked`` (PostgreSQL; elsewhere ignored): the read is ``FOR KEY SHARE OF jobs SKIP LOCKED``
        (db-scheduler's lock-and-fetch): a job row another supervisor's claim holds is passed over, so
        supervisors polling together claim different jobs instead of all reaching for the same first rows
        (the share lock ends with the read; it does not hold up a result's write). It costs the server a
        transaction id and the row locks (~0.2 ms of server CPU a run measured with one supervisor), so the
        dispatcher asks for it only while it meets contention.

        ``share`` (a fleet on PostgreSQL or MariaDB, :class:`Share`): only the jobs of this supervisor's share
        (``id % count == index``) and the others' whose occurrence is older than ``share.steal_before`` (late:
        their owner is dead, or saturated), so supervisors stop reading and reaching for each other's rows."""
        locking = skip_locked and self.dialect == "postgresql"
        params: dict[str, Any] = {"p_now": now, "p_limit": limit}
        if share is not None and self.dialect != "sqlite":
            params.update(p_count=share.count, p_index=share.index, p_steal=share.steal_before)
            with self.reader.connect() as conn:
                if exclude:
                    return _job_rows(conn.execute(self._due_query(exclude, locking, shared=True), params))
                prepared = self._due_share_prepared.get(locking)
                if prepared is None:
                    prepared = self._due_share_prepared[locking] = Prepared(
                        self._due_query((), locking, shared=True), self.engine.dialect)
                return cast(list[JobRow], prepared.mappings(conn, params))
        if exclude or locking:
            if exclude:
                query = self._due_query(exclude, locking)
            else:
                if self._due_locking_prebuilt is None:
                    self._due_locking_prebuilt = self._due_query((), True)
                query = self._due_locking_prebuilt
            with self.reader.connect() as conn:
                return _job_rows(conn.execute(query, params))
        with self.reader.connect() as conn:
            # the usual case: built once (building it cost more than running it); SQLite: read ahead
            if self.dialect != "sqlite" or limit > READ_AHEAD_MAX_LIMIT:
                if self._due_prepared is None:
                    self._due_prepared = Prepared(self._due_query(()), self.engine.dialect)
                return cast(list[JobRow], self._due_prepared.mappings(conn, params))
            at = self._ahead_read_at
            if at is not None and at <= now < at + READ_AHEAD_FOR and len(self._ahead) >= limit:
                found = self._from_read_ahead(conn, now, limit)
                if len(found) == limit:
                    return found
            if self._due_ids_prepared is None:
                self._due_ids_prepared = Prepared(self._due_ids_query(), self.engine.dialect)
            self._ahead = [(job_id, seen) for job_id, seen in self._due_ids_prepared.rows(
                conn, {"p_now": now, "p_limit": max(limit, READ_AHEAD_ROWS)})]
            self._ahead_read_at = now
            return self._from_read_ahead(conn, now, limit)

    def _from_read_ahead(self, conn: sa.Connection, now: dt.datetime, limit: int) -> list[JobRow]:
        """SQLite (issue 11): ordering the due jobs sorts the whole backlog (thousands of rows when thousands
        are due) at every poll, so one read takes the ids of up to :data:`READ_AHEAD_ROWS` of them, in order,
        and the polls take their rows from these candidates, at most ``limit``, each rechecked by id with the
        due read's own conditions (primary-key lookups): a candidate claimed, moved or no longer due since
        is dropped (a fresh read finds it where it belongs now); one edited otherwise is read as it is now.
        :meth:`due_jobs` reads the candidates afresh when they are older than :data:`READ_AHEAD_FOR` (by the
        callers' ``now``), ``now`` went back, or they cannot fill ``limit``, so a job that came due since is
        never held back by a short list. What the read-ahead can delay, by at most :data:`READ_AHEAD_FOR`
        and only while more jobs are due than workers are idle: a job moved *earlier* than the candidates (an
        edit) and the tie-break among jobs due at the same instant."""
        out: list[JobRow] = []
        for look in range(2):  # a second look, twice as wide, when the first found candidates gone
            need = limit - len(out)
            want = self._ahead[len(out):len(out) + need * (1 + look)]
            if not want:
                break
            size = max(4, 1 << (len(want) - 1).bit_length())  # a few statement shapes: padded with id 0
            prepared = self._recheck_prepared.get(size)
            if prepared is None:
                prepared = self._recheck_prepared[size] = Prepared(self._recheck_query(size), self.engine.dialect)
            params: dict[str, Any] = {f"p_id{i}": want[i][0] if i < len(want) else 0 for i in range(size)}
            params["p_now"] = now
            fresh = {r["id"]: r for r in prepared.mappings(conn, params)}
            gone = set()
            for job_id, seen in want:
                row = fresh.get(job_id)
                if row is None or row["next_run_at"] != seen:
                    gone.add(job_id)
                elif len(out) < limit:
                    out.append(cast(JobRow, row))
            self.forget_due(gone)
            if not gone or len(out) >= limit:
                break
        return out

    def forget_due(self, job_ids: AbstractSet[int]) -> None:
        """Drop ``job_ids`` from the read-ahead candidates (:meth:`due_jobs`): their occurrence was claimed
        or moved here (a candidate changed elsewhere is found out by the recheck)."""
        if self._ahead and job_ids:
            self._ahead = [c for c in self._ahead if c[0] not in job_ids]

    def _due_ids_query(self) -> sa.Select:
        """The ids and ``next_run_at`` of the due jobs, in the order of :meth:`_due_query`."""
        order = (jobs.c.next_run_at, jobs.c.last_run_at.is_not(None), jobs.c.last_run_at, jobs.c.id)
        due = (*self._dispatchable(frozenset()),
               jobs.c.next_run_at <= sa.bindparam("p_now", type_=schema.UTCDateTime(exact=True)))
        return (sa.select(jobs.c.id, jobs.c.next_run_at).where(*due).order_by(*order)
                .limit(sa.bindparam("p_limit", type_=sa.Integer)))

    def _recheck_query(self, n: int) -> sa.Select:
        """The due read's conditions on ``n`` job ids (``p_id0`` ...), by primary key."""
        due = (*self._dispatchable(frozenset()),
               jobs.c.next_run_at <= sa.bindparam("p_now", type_=schema.UTCDateTime(exact=True)))
        ids = [sa.bindparam(f"p_id{i}", type_=sa.Integer) for i in range(n)]
        return sa.select(jobs).where(jobs.c.id.in_(ids), *due)

    def _due_query(self, exclude: AbstractSet[int] | tuple[()], locking: bool = False,
                   shared: bool = False) -> sa.Select:
        """The ids of the due jobs are chosen first (a derived table: its sort carries the order's columns
        only, not whole rows, 2.3x cheaper with 1,000 due on SQLite), then their rows are read by id.
        ``locking`` (PostgreSQL): one plain read ``FOR KEY SHARE OF jobs SKIP LOCKED`` instead."""
        order = (jobs.c.next_run_at, jobs.c.last_run_at.is_not(None), jobs.c.last_run_at, jobs.c.id)
        due = (*self._dispatchable(frozenset(exclude)),
               jobs.c.next_run_at <= sa.bindparam("p_now", type_=schema.UTCDateTime(exact=True)))
        if shared:
            due = (*due, sa.or_(_in_share(True),
                                jobs.c.next_run_at < sa.bindparam("p_steal", type_=schema.UTCDateTime(exact=True))))
        limit = sa.bindparam("p_limit", type_=sa.Integer)
        if locking:
            return (sa.select(jobs).where(*due).order_by(*order).limit(limit)
                    .with_for_update(read=True, key_share=True, skip_locked=True, of=jobs))
        # the sort is bounded by the limit-th earliest next_run_at among the due (an ordered index walk that
        # stops after ``limit`` rows): the first ``limit`` rows of the full order are all due by then, so only
        # those rows and the ties of that instant are sorted, not the whole backlog (issue 11: 3,000 overdue
        # jobs were all read and sorted at every poll, O(backlog))
        firsts = sa.select(jobs.c.next_run_at).where(*due).order_by(jobs.c.next_run_at).limit(limit).subquery("firsts")
        bound = sa.select(sa.func.max(firsts.c.next_run_at)).scalar_subquery()
        chosen = (sa.select(jobs.c.id).where(*due, jobs.c.next_run_at <= bound).order_by(*order).limit(limit)
                  .subquery("due"))
        return sa.select(jobs).join(chosen, chosen.c.id == jobs.c.id).order_by(*order)

    def due_live_skip_jobs(self, now: dt.datetime, limit: int, exclude: AbstractSet[int] = frozenset(),
                           mode: str = ConcurrencyMode.SKIP) -> list[JobRow]:
        """Due Active jobs whose occurrence must be skipped because their run is live: ``concurrency_mode``
        Skip (not RunAll, which waits) and the job lease held by a live supervisor, oldest due first, at most
        ``limit``. One index range on ``(status, next_run_at)`` up to ``now``, like :meth:`due_jobs`: the
        supervisor reads it when it has no idle worker, so a Skip is decided on time (issue 12). ``mode``
        Replace: the due Replace jobs whose run is live (to be replaced; RunAll ones too)."""
        params = {"p_now": now, "p_limit": limit}
        if exclude:
            with self.reader.connect() as conn:
                return _job_rows(conn.execute(self._live_skip_query(exclude, mode), params))
        prepared = self._live_skip_prepared.get(mode)
        if prepared is None:
            prepared = self._live_skip_prepared[mode] = Prepared(self._live_skip_query((), mode), self.engine.dialect)
        with self.reader.connect() as conn:
            return cast(list[JobRow], prepared.mappings(conn, params))

    def _live_skip_query(self, exclude: AbstractSet[int] | tuple[()], mode: str) -> sa.Select:
        """Read from the Running runs (``ix_runs_status``) holding their job's lease (the same token), so
        its cost follows the live runs, not the due jobs (a saturated supervisor reads it at every poll)."""
        leased = sa.select(runs.c.job_id).where(runs.c.status == RunStatus.RUNNING, runs.c.lock_token.is_not(None))
        # the status compared as an expression: no index on it, so every database reads from the live runs
        conds = [jobs.c.id.in_(leased), jobs.c.status.concat("") == JobStatus.ACTIVE, jobs.c.next_run_at.is_not(None),
                 jobs.c.next_run_at <= sa.bindparam("p_now", type_=schema.UTCDateTime(exact=True)),
                 jobs.c.concurrency_mode == str(mode), sa.not_(lease_free(self.dialect))]
        if mode == ConcurrencyMode.SKIP:
            conds.append(jobs.c.missed_run_policy != MissedRunPolicy.RUN_ALL)
        if exclude:
            conds.append(jobs.c.id.not_in(sorted(exclude)))
        return (sa.select(jobs).where(*conds)
                .order_by(jobs.c.next_run_at, jobs.c.id).limit(sa.bindparam("p_limit", type_=sa.Integer)))

    def next_due_at(self, exclude: AbstractSet[int] = frozenset(), share: Share | None = None) -> dt.datetime | None:
        """The earliest ``next_run_at`` by the rules of :meth:`due_jobs` (None if none): the first row
        of an ordered index walk, not a scan. ``share``: the earliest of this supervisor's share, or of the
        others' ``share.steal_after`` later (the moment it would take such a row over), whichever is first."""
        if share is not None and self.dialect != "sqlite":
            params = {"p_count": share.count, "p_index": share.index}
            found = []
            with self.reader.connect() as conn:
                for mine in (True, False):
                    if exclude:
                        at = conn.execute(self._next_due_query(exclude, mine), params).scalar()
                    else:
                        prepared = self._next_due_share_prepared.get(mine)
                        if prepared is None:
                            prepared = self._next_due_share_prepared[mine] = Prepared(
                                self._next_due_query((), mine), self.engine.dialect)
                        rows = prepared.rows(conn, params)
                        at = rows[0][0] if rows else None
                    if at is not None:
                        found.append(at if mine else at + share.steal_after)
            return min(found, default=None)
        if exclude:
            with self.reader.connect() as conn:
                return conn.execute(self._next_due_query(exclude)).scalar()
        if self._next_due_prepared is None:
            self._next_due_prepared = Prepared(self._next_due_query(exclude), self.engine.dialect)
        with self.reader.connect() as conn:
            rows = self._next_due_prepared.rows(conn)
        return rows[0][0] if rows else None

    def _next_due_query(self, exclude: AbstractSet[int] | tuple[()], mine: bool | None = None) -> sa.Select:
        conds = self._dispatchable(frozenset(exclude))
        if mine is not None:
            conds.append(_in_share(mine))
        return sa.select(jobs.c.next_run_at).where(*conds).order_by(jobs.c.next_run_at).limit(1)

    def active_jobs_signature(self) -> tuple[int, dt.datetime | None]:
        """(count, latest ``updated_at``) of Active jobs: a cheap way to notice that any of them changed."""
        query = sa.select(sa.func.count(), sa.type_coerce(sa.func.max(jobs.c.updated_at), schema.UTCDateTime)).where(
            jobs.c.status == JobStatus.ACTIVE)
        with self.engine.connect() as conn:
            count, latest = conn.execute(query).one()
        return count, latest

    def unscheduled_active_jobs(self) -> list[JobRow]:
        """Active jobs without a ``next_run_at`` (new, resumed or edited outside the CLI)."""
        query = sa.select(jobs).where(jobs.c.status == JobStatus.ACTIVE, jobs.c.next_run_at.is_(None))
        with self.engine.connect() as conn:
            return _job_rows(conn.execute(query))

    def active_schedules_named(self, limit: int) -> list[tuple[str, str, int, list[str]]]:
        """``(cron_expression, timezone, number of Active jobs, the first limit names in order)`` per distinct
        schedule of the Active jobs, from ONE read (a window over the Active jobs), so the counts and the
        names agree even while jobs change (two reads could count a schedule whose jobs were then paused)."""
        part = (jobs.c.cron_expression, jobs.c.timezone)
        ranked = (sa.select(jobs.c.cron_expression, jobs.c.timezone, jobs.c.name,
                            sa.func.count().over(partition_by=part).label("n"),
                            sa.func.row_number().over(partition_by=part, order_by=jobs.c.name).label("rn"))
                  .where(jobs.c.status == JobStatus.ACTIVE).subquery())
        query = (sa.select(ranked.c.cron_expression, ranked.c.timezone, ranked.c.n, ranked.c.name)
                 .where(ranked.c.rn <= limit)
                 .order_by(ranked.c.cron_expression, ranked.c.timezone, ranked.c.rn))
        out: dict[tuple[str, str], tuple[int, list[str]]] = {}
        with self.engine.connect() as conn:
            for expr, zone, n, name in conn.execute(query):
                out.setdefault((expr, zone), (int(n), []))[1].append(name)
        return [(expr, zone, n, names) for (expr, zone), (n, names) in out.items()]

    def active_jobs(self) -> list[JobRow]:
        """Every Active job."""
        with self.engine.connect() as conn:
            return _job_rows(conn.execute(sa.select(jobs).where(jobs.c.status == JobStatus.ACTIVE)))

    def set_next_run_at(self, job_id: int, seen: dt.datetime | None, next_run_at: dt.datetime | None,
                        now: dt.datetime, *, skipped: int = 0, missed: int = 0, status: str | None = None,
                        notices: list[OutboxRow] | None = None) -> bool:
        """Compare-and-set ``next_run_at`` from ``seen`` (the value read). ``skipped`` (a count, or True for
        one) is added to ``skipped_count``, ``missed`` to ``missed_count``; ``status`` optionally changes the
        status too (e.g. Expired). ``notices``: outbox rows written in the same transaction, only if it won.
        True if it won."""
        cond = jobs.c.next_run_at.is_(None) if seen is None else jobs.c.next_run_at == seen
        values: Values = {"next_run_at": next_run_at}  # scheduling progress: updated_at marks definition changes
        if skipped:
            values["skipped_count"] = jobs.c.skipped_count + int(skipped)
        if missed:
            values["missed_count"] = jobs.c.missed_count + int(missed)
        if status:
            values.update(status=status, updated_at=now)
        self.forget_due({job_id})
        with self.engine.begin() as conn:
            won = conn.execute(jobs.update().where(jobs.c.id == job_id, cond).values(**values)).rowcount == 1
            if won and notices:
                insert_notices(conn, self.dialect, notices)
            return won

    def queue_now(self, job_id: int, now: dt.datetime) -> bool:
        """Queue mode's manual run: make the job's pending occurrence due now (if it is not already due).
        True if it changed."""
        stmt = jobs.update().where(jobs.c.id == job_id, sa.or_(jobs.c.next_run_at.is_(None), jobs.c.next_run_at > now)
                                   ).values(next_run_at=now)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    # -- next_run_at values a SQLite file can hold but not be read (edited by hand) -----------------
    def repair_next_run_at(self, job_id: int, next_run_at: dt.datetime | None) -> bool:
        """Replace a ``next_run_at`` that cannot be read (a number or hand-edited text in a SQLite file; the
        other databases type their columns) with ``next_run_at``. Only a value still unreadable is replaced,
        so two supervisors repairing at once cannot bring back an occurrence one of them already claimed.
        True if this call replaced it."""
        if self.dialect != "sqlite":
            return False
        with self.engine.begin() as conn:
            stmt = jobs.update().where(jobs.c.id == job_id, _unreadable_next_run_at())
            return conn.execute(stmt.values(next_run_at=next_run_at)).rowcount == 1

    def unreadable_next_run_at_jobs(self) -> list[JobRow]:
        """Active jobs whose stored ``next_run_at`` cannot be read (SQLite only; see :meth:`repair_next_run_at`),
        wherever it sorts: ISO text such as ``2026-12-01T00:00:00Z`` sorts after every real timestamp of that
        day, so such a row would never come due."""
        if self.dialect != "sqlite":
            return []
        query = sa.select(jobs).where(jobs.c.status == JobStatus.ACTIVE, _unreadable_next_run_at())
        with self.engine.connect() as conn:
            return _job_rows(conn.execute(query))


def unreadable_next_run_at_chunk(engine: Engine, after_id: int, limit: int) -> tuple[list[JobRow], int]:
    """:meth:`Jobs.unreadable_next_run_at_jobs` over the next ``limit`` job ids after ``after_id`` only (a
    primary-key range: the cost is ``limit`` rows, not every job). Returns the jobs found and the id to
    continue after (0 once past the last job: the sweep starts again)."""
    if engine.dialect.name != "sqlite":
        return [], 0
    window = sa.select(jobs.c.id).where(jobs.c.id > after_id).order_by(jobs.c.id).limit(limit).subquery()
    with engine.connect() as conn:
        upper = conn.execute(sa.select(sa.func.max(window.c.id))).scalar()
        if upper is None:
            return [], 0
        # the status is checked here, not in SQL, or SQLite would walk the status index: every Active job
        query = sa.select(jobs).where(jobs.c.id > after_id, jobs.c.id <= upper, _unreadable_next_run_at())
        return [j for j in _job_rows(conn.execute(query)) if j["status"] == JobStatus.ACTIVE], upper


def _unreadable_next_run_at() -> sa.ColumnElement[bool]:
    """SQLite: a ``next_run_at`` that is not text in the store's exact form (:data:`schema.SQLITE_EXACT_FORM`)."""
    return sa.and_(jobs.c.next_run_at.is_not(None), _not_exact(jobs.c.next_run_at))


def _not_exact(column: sa.Column[Any]) -> sa.ColumnElement[bool]:
    """SQLite: ``column`` holds something other than text in the store's exact form."""
    exact = sa.type_coerce(column, sa.String).op("GLOB", is_comparison=True)(
        sa.literal(schema.SQLITE_EXACT_FORM, sa.String))
    return sa.or_(sa.func.typeof(column) != "text", sa.not_(exact))


TIME_WINDOW_COLUMNS = ("start_at", "end_at")


def unreadable_time_window(engine: Engine, after_id: int = 0, limit: int | None = None) -> dict[int, tuple[str, str]]:
    """SQLite: the jobs (among the next ``limit`` ids after ``after_id``; every job when ``limit`` is None)
    whose ``start_at`` or ``end_at`` holds a value that is not a timestamp (text edited by hand, which reads
    as unset): job id -> (column, the stored value as text). Elsewhere the column type refuses such a value:
    always empty."""
    if engine.dialect.name != "sqlite":
        return {}
    raw = [sa.type_coerce(getattr(jobs.c, name), sa.String).label(name) for name in TIME_WINDOW_COLUMNS]
    query = sa.select(jobs.c.id, *raw).where(
        jobs.c.id > after_id, sa.or_(*(sa.and_(getattr(jobs.c, name).is_not(None), _not_exact(getattr(jobs.c, name)))
                                       for name in TIME_WINDOW_COLUMNS)))
    if limit is not None:
        window = sa.select(jobs.c.id).where(jobs.c.id > after_id).order_by(jobs.c.id).limit(limit).subquery()
        query = query.where(jobs.c.id <= sa.select(sa.func.max(window.c.id)).scalar_subquery())
    found: dict[int, tuple[str, str]] = {}
    with engine.connect() as conn:
        for row in conn.execute(query):
            for name in TIME_WINDOW_COLUMNS:
                value = getattr(row, name)
                if value is None or found.get(row.id):
                    continue
                try:
                    dt.datetime.fromisoformat(str(value))
                except ValueError:
                    found[row.id] = (name, str(value))
    return found
