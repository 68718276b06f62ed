"""Supervisor liveness rows: one per supervisor process, whose ``lease_expires_at`` it renews by the
database clock. Every job lease and run of a supervisor is live only while its row is
(:mod:`.predicates`), so one renewal keeps them all alive."""

from __future__ import annotations

import datetime as dt
from typing import cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.errors import InputError
from mjsched_isolated.store import schema
from mjsched_isolated.store.records import SupervisorRow
from mjsched_isolated.store.schema import supervisors

SUPERVISOR_ROW_RETENTION_S = 7 * 86400.0
"""Rows of supervisors dead this many seconds are deleted when a supervisor registers."""


class InstanceInUseError(InputError):
    """``serve --instance NAME`` while a live supervisor (another host or pid) holds ``NAME``: field
    ``instance``; ``holder`` is that supervisor's row."""

    def __init__(self, holder: SupervisorRow) -> None:
        self.holder = holder
        expires = holder["lease_expires_at"]
        shown = expires.strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(expires, dt.datetime) else str(expires)
        super().__init__("instance", f"a live supervisor holds the name {holder['instance']!r} "
                                     f"(host {holder['hostname']}, pid {holder['pid']}, lease until {shown}); "
                                     "names must be unique among live supervisors")


class Supervisors:
    """The ``supervisors`` table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def _heartbeat_at(self, conn: sa.Connection, instance: str) -> dt.datetime:
        return conn.execute(sa.select(supervisors.c.heartbeat_at).where(
            supervisors.c.instance == instance)).scalar_one()

    def live_holder(self, instance: str, hostname: str, pid: int,
                    conn: sa.Connection | None = None) -> SupervisorRow | None:
        """The row of another live supervisor named ``instance`` (lease not expired by the database
        clock, and not ``hostname``/``pid``: a container's PID 1 restarting is its own previous life), or
        None if the name is free to take."""
        query = sa.select(supervisors).where(supervisors.c.instance == instance,
                                             supervisors.c.lease_expires_at > schema.db_now(self.dialect),
                                             sa.not_(self._same_process(hostname, pid)))
        if conn is not None:
            return cast("SupervisorRow | None", conn.execute(query).mappings().first())
        with self.engine.connect() as own:
            return cast("SupervisorRow | None", own.execute(query).mappings().first())

    @staticmethod
    def _same_process(hostname: str, pid: int) -> sa.ColumnElement[bool]:
        return sa.and_(supervisors.c.hostname == hostname, supervisors.c.pid == pid)

    def register_supervisor(self, instance: str, hostname: str, pid: int, ttl_s: float, *,
                            max_concurrent_jobs: int | None = None, version: str | None = None) -> dt.datetime:
        """Insert (or reset) ``instance``'s row with a lease of ``ttl_s`` seconds, deleting rows of
        supervisors dead for :data:`SUPERVISOR_ROW_RETENTION_S`; ``max_concurrent_jobs`` (its worker cap)
        and ``version`` are labels for ``status`` and the dashboard. Returns the DB time.

        Raises :class:`InstanceInUseError` (nothing written) if another live supervisor holds ``instance``
        (:meth:`live_holder`). The row is replaced only if its lease has expired or it is this
        ``hostname``/``pid``'s own; the insert then relies on the primary key, so of two supervisors
        registering one name at once exactly one wins and the other sees the winner's live row."""
        now_expr, until = schema.db_now(self.dialect), schema.db_now_plus(self.dialect, ttl_s)
        stale = schema.db_now_plus(self.dialect, -SUPERVISOR_ROW_RETENTION_S)
        takeable = sa.or_(supervisors.c.lease_expires_at <= now_expr, self._same_process(hostname, pid))
        try:
            return self._register(instance, hostname, pid, now_expr, until, stale, takeable,
                                  max_concurrent_jobs, version)
        except sa.exc.IntegrityError:  # a live row was there, or another registration committed first
            holder = self.live_holder(instance, hostname, pid)
            if holder is None:  # that row ended meanwhile: try once more
                return self._register(instance, hostname, pid, now_expr, until, stale, takeable,
                                      max_concurrent_jobs, version)
            raise InstanceInUseError(holder) from None

    def _register(self, instance: str, hostname: str, pid: int, now_expr: sa.ColumnElement,
                  until: sa.ColumnElement, stale: sa.ColumnElement, takeable: sa.ColumnElement[bool],
                  max_concurrent_jobs: int | None, version: str | None) -> dt.datetime:
        with self.engine.begin() as conn:
            conn.execute(supervisors.delete().where(sa.or_(sa.and_(supervisors.c.instance == instance, takeable),
                                                           supervisors.c.lease_expires_at < stale)))
            holder = self.live_holder(instance, hostname, pid, conn)
            if holder is not None:
                raise InstanceInUseError(holder)
            conn.execute(supervisors.insert().values(instance=instance, hostname=hostname, pid=pid, started_at=now_expr,
                                                     heartbeat_at=now_expr, lease_expires_at=until,
                                                     max_concurrent_jobs=max_concurrent_jobs,
                                                     version=None if version is None else version[:40]))
            return self._heartbeat_at(conn, instance)

    def live_instances(self) -> list[str]:
        """The names of the supervisors whose liveness lease has not expired (database clock) and that did not
        stop, sorted: a fleet divides the jobs among them (:class:`~mjsched_isolated.store.jobs.Share`)."""
        live = (supervisors.c.lease_expires_at > schema.db_now(self.dialect), supervisors.c.stopped_at.is_(None))
        query = sa.select(supervisors.c.instance).where(*live).order_by(supervisors.c.instance)
        with self.engine.connect() as conn:
            return [row[0] for row in conn.execute(query)]

    def renew_supervisor(self, instance: str, ttl_s: float, *, hostname: str | None = None,
                         pid: int | None = None) -> dt.datetime | None:
        """Extend ``instance``'s liveness lease to DB-now + ``ttl_s`` seconds: one statement keeps every
        lease and run of that supervisor alive. Returns the DB time, or None if the row is gone or was
        stopped, or (``hostname`` and ``pid`` given) is now another process's: one that took the name
        after this one's lease expired."""
        live: list[sa.ColumnElement[bool]] = [supervisors.c.instance == instance, supervisors.c.stopped_at.is_(None)]
        if hostname is not None and pid is not None:
            live.append(self._same_process(hostname, pid))
        stmt = supervisors.update().where(*live).values(
            heartbeat_at=schema.db_now(self.dialect), lease_expires_at=schema.db_now_plus(self.dialect, ttl_s))
        with self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                return None
            return self._heartbeat_at(conn, instance)

    def stop_supervisor(self, instance: str) -> None:
        """A clean stop: the lease ends now, so nobody waits for it."""
        now_expr = schema.db_now(self.dialect)
        with self.engine.begin() as conn:
            conn.execute(supervisors.update().where(supervisors.c.instance == instance).values(
                stopped_at=now_expr, lease_expires_at=now_expr))

    def list_supervisors(self) -> list[SupervisorRow]:
        """Every supervisor row, latest heartbeat first."""
        query = sa.select(supervisors).order_by(supervisors.c.heartbeat_at.desc())
        with self.engine.connect() as conn:
            return [cast(SupervisorRow, dict(r)) for r in conn.execute(query).mappings()]

    def read_only_reason(self) -> str | None:
        """Why this database refuses writes (a read-only SQLite file or ``mode=ro`` URL, a PostgreSQL hot
        standby or read-only transaction, MySQL's ``read_only``), or None if a no-op write is accepted.
        The probe is an UPDATE that matches no row, rolled back: nothing is written."""
        with self.engine.connect() as conn:
            try:
                conn.execute(supervisors.update().where(sa.false()).values(pid=supervisors.c.pid))
            except sa.exc.OperationalError as exc:  # SQLite: "attempt to write a readonly database"
                return _read_only(exc)
            except sa.exc.DBAPIError as exc:  # PostgreSQL: InternalError/ReadOnlySqlTransaction
                return _read_only(exc)
            finally:
                conn.rollback()
        return None


READ_ONLY_MARKERS = ("readonly database", "read-only", "read only", "readonly")


def _read_only(exc: sa.exc.DBAPIError) -> str | None:
    """The error's first line if it says the database is read-only; else re-raise ``exc``."""
    text = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig).__name__
    if any(marker in text.lower() for marker in READ_ONLY_MARKERS):
        return text
    raise exc
