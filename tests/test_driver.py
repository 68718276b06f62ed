"""Driver-level execution of prebuilt statements (``store/driver.py``, issue 11): the same rows, the same type
conversions and the same error classes as SQLAlchemy's ``Connection.execute``, on all three databases."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from conftest import add_job

from mjsched_isolated.store.driver import Prepared
from mjsched_isolated.store.schema import jobs, runs

UTC = dt.UTC


def test_prepared_reads_rows_exactly_as_sqlalchemy_does(any_store):
    now = dt.datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    add_job(any_store, "a", "ok", now=now, next_run_at=now, configuration={"x": 1}, max_jitter_s=1.5,
            notify_on_success=True)
    add_job(any_store, "b", "ok", now=now, next_run_at=now + dt.timedelta(seconds=1))
    query = sa.select(jobs).where(jobs.c.next_run_at <= sa.bindparam("p_now", type_=jobs.c.next_run_at.type)
                                  ).order_by(jobs.c.name)
    prepared = Prepared(query, any_store.engine.dialect)
    with any_store.engine.connect() as conn:
        expected = [dict(r) for r in conn.execute(query, {"p_now": now + dt.timedelta(seconds=5)}).mappings()]
        got = prepared.mappings(conn, {"p_now": now + dt.timedelta(seconds=5)})
        assert prepared.mappings(conn, {"p_now": now}) == [expected[0]]
    assert got == expected
    assert got[0]["next_run_at"] == now and got[0]["next_run_at"].tzinfo is not None
    assert got[0]["notify_on_success"] is True and got[0]["max_jitter_s"] == 1.5


def test_prepared_writes_join_the_transaction_count_rows_and_raise_sqlalchemys_errors(any_store, shared_backend_url):
    job = add_job(any_store, "a", "ok")
    stamp = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    update = Prepared(jobs.update().where(jobs.c.id == sa.bindparam("p_id")).values(
        last_run_at=sa.bindparam("p_at", type_=jobs.c.last_run_at.type), status="Paused"), any_store.engine.dialect)
    with pytest.raises(RuntimeError), any_store.engine.begin() as conn:  # rolled back with its transaction
        assert update.execute(conn, {"p_id": job["id"], "p_at": stamp}) == 1
        raise RuntimeError("roll back")
    assert any_store.get_job("a")["status"] == "Active"
    with any_store.engine.begin() as conn:
        assert update.execute(conn, {"p_id": job["id"], "p_at": stamp}) == 1
        assert update.execute(conn, {"p_id": job["id"] + 99, "p_at": stamp}) == 0
    assert any_store.get_job("a")["status"] == "Paused" and any_store.get_job("a")["last_run_at"] == stamp

    insert = Prepared(runs.insert().values(job_id=sa.bindparam("p_job_id"), status="Running", started_at=stamp,
                                           scheduled_at=sa.bindparam("p_at", type_=runs.c.scheduled_at.type)),
                      any_store.engine.dialect)
    with any_store.engine.begin() as conn:
        insert.executemany(conn, [{"p_job_id": job["id"], "p_at": stamp}])
    with pytest.raises(sa.exc.IntegrityError), any_store.engine.begin() as conn:  # runs(job_id, scheduled_at)
        insert.execute(conn, {"p_job_id": job["id"], "p_at": stamp})


def test_prepared_statements_are_seen_by_engine_event_listeners(any_store):
    seen: list[str] = []
    sa.event.listen(any_store.engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    prepared = Prepared(sa.select(jobs.c.id).where(jobs.c.name == sa.bindparam("p_name")), any_store.engine.dialect)
    with any_store.engine.connect() as conn:
        assert prepared.rows(conn, {"p_name": "none"}) == []
    assert seen == [prepared.sql]


def test_expanding_parameters_are_refused(any_store):
    with pytest.raises(ValueError, match="p_ids: expanding"):
        Prepared(sa.select(jobs.c.id).where(jobs.c.id.in_(sa.bindparam("p_ids", expanding=True))),
                 any_store.engine.dialect)


def test_sqlite_timestamps_are_written_and_read_as_sqlalchemys_datetime_would():
    """UTCDateTime's one-step SQLite conversions (issue 11) against the generic path they replace: SQLite's
    DATETIME text with microseconds, aware UTC out, None for a value that is not a timestamp."""
    from sqlalchemy.dialects import sqlite

    from mjsched_isolated.store.schema import UTCDateTime
    dialect = sqlite.dialect()
    generic = sqlite.DATETIME()._cached_bind_processor(dialect)
    for exact in (False, True):
        bind = UTCDateTime(exact=exact)._cached_bind_processor(dialect)
        read = UTCDateTime(exact=exact)._cached_result_processor(dialect, None)
        for value in (dt.datetime(2026, 3, 29, 1, 30, 0, 0, tzinfo=UTC),
                      dt.datetime(2026, 3, 29, 3, 30, 0, 7, tzinfo=dt.timezone(dt.timedelta(hours=2))),
                      dt.datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)):
            text = bind(value)
            assert text == generic(value.astimezone(UTC).replace(tzinfo=None))
            assert read(text) == value and read(text).tzinfo is UTC
        assert read("2026-03-01 10:00:00") == (None if exact else dt.datetime(2026, 3, 1, 10, tzinfo=UTC))
        assert read("2026-03-01T10:00:00Z") is None and read("x") is None and read(None) is None
        assert bind(None) is None
        with pytest.raises(ValueError, match="naive datetime"):
            bind(dt.datetime(2026, 3, 1))


def test_sqlite_timestamp_caches_give_what_formatting_and_parsing_give():
    """The texts bound and the instants read are kept for the instants and texts met lately (issue 11): an
    equal instant in another zone binds to the same UTC text, a text the lenient columns read is still
    refused by an exact one, and a full cache is emptied, never wrong."""
    from sqlalchemy.dialects import sqlite

    from mjsched_isolated.store import schema
    dialect = sqlite.dialect()
    generic = sqlite.DATETIME()._cached_bind_processor(dialect)
    bind = schema.UTCDateTime()._cached_bind_processor(dialect)
    lenient = schema.UTCDateTime()._cached_result_processor(dialect, None)
    exact = schema.UTCDateTime(exact=True)._cached_result_processor(dialect, None)
    base = dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    for i in range(schema.TIMESTAMP_CACHE_SIZE * 2 + 3):
        value = base + dt.timedelta(seconds=i, microseconds=i)
        for same in (value, value.astimezone(dt.timezone(dt.timedelta(hours=-5))), value):
            text = bind(same)
            assert text == generic(value.replace(tzinfo=None))
            assert lenient(text) == value and exact(text) == value and exact(text).tzinfo is UTC
        assert len(schema._SQLITE_TEXTS) <= schema.TIMESTAMP_CACHE_SIZE
    assert lenient("2026-03-01 10:00:00") == dt.datetime(2026, 3, 1, 10, tzinfo=UTC)
    assert exact("2026-03-01 10:00:00") is None and lenient("2026-03-01 10:00:00").tzinfo is UTC
