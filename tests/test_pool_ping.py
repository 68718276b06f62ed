"""The pool pings a connection only after it sat idle (``store/schema.py``'s ``_ping_when_idle``, issue 11),
and a connection the server dropped is still replaced: found by the ping when it was idle, or by the
statement that failed on it, after which every connection of the pool opened before it is replaced too.
Real servers: the test's own connections are ended by the server (``pg_terminate_backend``, MariaDB's
``KILL``); nothing else is touched."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from waiting import wait_until

from mjsched_isolated.store import Store, schema
from mjsched_isolated.store.driver import Prepared
from mjsched_isolated.store.schema import jobs


def _backend_id(conn: sa.Connection) -> int:
    pg = conn.dialect.name == "postgresql"
    return int(conn.exec_driver_sql("SELECT pg_backend_pid()" if pg else "SELECT CONNECTION_ID()").scalar_one())


def _kill(store: Store, backend_ids: list[int]) -> None:
    """End these server sessions from a connection of another engine; wait until the server lists them gone."""
    pg = store.dialect == "postgresql"
    admin = sa.create_engine(store.engine.url)
    try:
        with admin.connect() as conn:
            for backend in backend_ids:
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({backend})" if pg else f"KILL {backend}")
            conn.commit()

            def gone() -> bool:
                listed = conn.exec_driver_sql(
                    "SELECT pid FROM pg_stat_activity" if pg else "SELECT id FROM information_schema.processlist"
                ).scalars().all()
                conn.rollback()
                return not set(backend_ids) & set(listed)

            wait_until(gone, 10, "the killed sessions gone from the server's list", interval_s=0.02)
    finally:
        admin.dispose()


def _pooled_sessions(store: Store, n: int) -> list[int]:
    """Check ``n`` connections out at once (so the pool holds ``n``), return them; their server session ids."""
    conns = [store.engine.connect() for _ in range(n)]
    try:
        return [_backend_id(c) for c in conns]
    finally:
        for c in conns:
            c.close()


def test_a_connection_is_pinged_only_after_sitting_idle(server_store, monkeypatch):
    pings: list[object] = []
    dialect = server_store.engine.dialect
    real_ping = dialect.do_ping
    monkeypatch.setattr(dialect, "do_ping", lambda dbapi_conn: pings.append(dbapi_conn) or real_ping(dbapi_conn))
    with server_store.engine.connect() as conn:  # a new connection: not pinged
        _backend_id(conn)
    for _ in range(5):  # used a moment ago: not pinged
        assert server_store.jobs.due_jobs(dt.datetime.now(dt.UTC), 10) == []
    assert pings == []
    monkeypatch.setattr(schema, "IDLE_PING_S", 0.0)  # every connection has now sat idle long enough
    with server_store.engine.connect() as conn:
        _backend_id(conn)
    assert len(pings) == 1


def test_a_connection_dropped_while_idle_is_replaced_by_the_ping(server_store, monkeypatch):
    sessions = _pooled_sessions(server_store, 2)
    _kill(server_store, sessions)
    monkeypatch.setattr(schema, "IDLE_PING_S", 0.0)
    for _ in range(3):  # each checkout is a live connection: no error reaches the caller
        with server_store.engine.connect() as conn:
            assert _backend_id(conn) not in sessions


def test_a_dropped_connection_found_by_a_statement_makes_the_pool_replace_its_peers(server_store):
    sessions = _pooled_sessions(server_store, 2)
    _kill(server_store, sessions)  # idle a moment only: not pinged, so the first statement meets the loss
    read = Prepared(sa.select(sa.func.count()).select_from(jobs), server_store.engine.dialect)
    with pytest.raises(sa.exc.OperationalError) as failed, server_store.engine.connect() as conn:
        read.rows(conn)
    assert failed.value.connection_invalidated
    for _ in range(3):  # the other stale connection is replaced at checkout, not handed out to fail once more
        with server_store.engine.connect() as conn:
            assert read.rows(conn) == [(0,)]
            assert _backend_id(conn) not in sessions
