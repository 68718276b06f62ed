"""Supervisor liveness rows: one per supervisor process, whose ``lease_expires_at`` it renews by the
database clock. Every job lease and run of a supervisor is live only while its row is
(:mod:`.predicates`), so one renewal keeps them all alive."""

from __future__ import annotations

import datetime as dt
from typing import cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.store import schema
from mjsched_isolated.store.records import SupervisorRow
from mjsched_isolated.store.schema import supervisors

SUPERVISOR_ROW_RETENTION_S = 7 * 86400.0
"""Rows of supervisors dead this many seconds are deleted when a supervisor registers."""


class Supervisors:
    """The ``supervisors`` table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def _heartbeat_at(self, conn: sa.Connection, instance: str) -> dt.datetime:
        return conn.execute(sa.select(supervisors.c.heartbeat_at).where(
            supervisors.c.instance == instance)).scalar_one()

    def register_supervisor(self, instance: str, hostname: str, pid: int, ttl_s: float, *,
                            max_concurrent_jobs: int | None = None, version: str | None = None) -> dt.datetime:
        """Insert (or reset) ``instance``'s row with a lease of ``ttl_s`` seconds, deleting rows of
        supervisors dead for :data:`SUPERVISOR_ROW_RETENTION_S`; ``max_concurrent_jobs`` (its worker cap)
        and ``version`` are labels for ``status`` and the dashboard. Returns the DB time."""
        now_expr, until = schema.db_now(self.dialect), schema.db_now_plus(self.dialect, ttl_s)
        stale = schema.db_now_plus(self.dialect, -SUPERVISOR_ROW_RETENTION_S)
        with self.engine.begin() as conn:
            conn.execute(supervisors.delete().where(sa.or_(supervisors.c.instance == instance,
                                                           supervisors.c.lease_expires_at < stale)))
            conn.execute(supervisors.insert().values(instance=instance, hostname=hostname, pid=pid, started_at=now_expr,
                                                     heartbeat_at=now_expr, lease_expires_at=until,
                                                     max_concurrent_jobs=max_concurrent_jobs,
                                                     version=None if version is None else version[:40]))
            return self._heartbeat_at(conn, instance)

    def renew_supervisor(self, instance: str, ttl_s: float) -> dt.datetime | None:
        """Extend ``instance``'s liveness lease to DB-now + ``ttl_s`` seconds: one statement keeps every
        lease and run of that supervisor alive. Returns the DB time, or None if the row is gone or was
        stopped."""
        live = (supervisors.c.instance == instance, supervisors.c.stopped_at.is_(None))
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
