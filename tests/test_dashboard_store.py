"""The dashboard's store side on every database: revision 0006 (the audit log, ``ix_runs_started_at``)
upgrading a database with data, and :class:`DashboardViews`' per-dialect SQL (chart buckets, filters,
keyset pages, the audit log)."""

from __future__ import annotations

import datetime as dt
import json

import sqlalchemy as sa
from alembic import command
from test_migrations import fill, make_at, snapshot

from mjsched_isolated.store import Store, migrate
from mjsched_isolated.store.dashboard_views import DashboardViews
from mjsched_isolated.store.records import AuditRow
from mjsched_isolated.store.schema import audit_log, jobs, runs

UTC = dt.UTC
T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def test_audit_row_declares_exactly_the_tables_columns():
    assert set(AuditRow.__required_keys__ | AuditRow.__optional_keys__) == set(audit_log.c.keys())


def test_revision_0006_upgrades_a_database_with_data(backend_url):
    previous = migrate._scripts().get_revision("0006").down_revision  # whatever the chain puts before it
    engine = make_at(backend_url, previous)
    try:
        fill(engine)
        columns = {t: [c["name"] for c in sa.inspect(engine).get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, columns)
        with engine.begin() as conn:
            command.upgrade(migrate.config(conn), "0006")
        assert snapshot(engine, columns) == before
        inspector = sa.inspect(engine)
        assert "audit_log" in inspector.get_table_names()
        assert ("ix_runs_started_at", ["started_at", "status"]) in [
            (i["name"], i["column_names"]) for i in inspector.get_indexes("runs")]
        views = DashboardViews(engine)
        views.record_action(actor="a", role="operator", action="pause", target="leased", outcome="ok",
                            details={"x": 1}, remote_addr="127.0.0.1")
        [row] = views.list_actions()
        assert (row["actor"], row["target"], json.loads(row["details"] or "{}")) == ("a", "leased", {"x": 1})
        assert set(row) == set(audit_log.c.keys())
    finally:
        engine.dispose()


def _job(conn, name: str, job_type: str = "ok", **values) -> int:
    return conn.execute(jobs.insert().values(name=name, job_type=job_type, cron_expression="* * * * *",
                                             status="Active", created_at=T0, updated_at=T0, **values)
                        ).inserted_primary_key[0]


def test_views_on_every_database(backend_url):
    store = Store.open(backend_url)
    try:
        with store.engine.begin() as conn:
            a = _job(conn, "alpha", description="The 100% job")
            b = _job(conn, "beta", "fail", concurrency_mode="Queue")
            for i in range(30):  # one run a minute from T0 - 30 min; alpha fails every third
                job = a if i % 2 else b
                status = "Failed" if job == a and i % 3 == 0 else "Completed"
                conn.execute(runs.insert().values(job_id=job, started_at=T0 - dt.timedelta(minutes=30 - i),
                                                  status=status, executed_by_instance=f"sup-{i % 2}"))
        views = DashboardViews(store.engine)
        buckets = views.runs_by_status(T0 - dt.timedelta(hours=1), 600, 6)
        assert [sum(b.values()) for b in buckets] == [0, 0, 0, 10, 10, 10]
        assert sum(b.get("Failed", 0) for b in buckets) == 5
        assert [j["name"] for j in views.list_jobs(search="100%")] == ["alpha"]
        assert [j["name"] for j in views.list_jobs(search="_")] == []  # LIKE wildcards are literal
        assert [j["name"] for j in views.list_jobs(concurrency_mode="Queue")] == ["beta"]
        assert [(j["name"], j["last_status"]) for j in views.list_jobs()] == [("alpha", "Completed"),
                                                                              ("beta", "Completed")]
        assert [j["name"] for j in views.list_jobs(after="alpha")] == ["beta"]
        page = views.list_runs(limit=7)
        assert [r["id"] for r in page] == list(range(30, 23, -1))
        assert [r["id"] for r in views.list_runs(before=page[-1]["id"], limit=3)] == [23, 22, 21]
        assert {r["executed_by_instance"] for r in views.list_runs(supervisor="sup-1", limit=100)} == {"sup-1"}
        since = views.list_runs(started_after=T0 - dt.timedelta(minutes=5), limit=100)
        assert [r["id"] for r in since] == [30, 29, 28, 27, 26]
        assert views.job_run_counts(a, T0 - dt.timedelta(hours=1)) == {"Completed": 10, "Failed": 5}
        assert views.totals() == {"jobs": 2, "skipped": 0, "running": 0}
        first = views.fingerprint()
        with store.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.id == 30).values(status="Running"))
        assert views.fingerprint() != first
    finally:
        store.close()


def test_a_time_window_pages_by_start_time_without_gaps_or_repeats(backend_url):
    store = Store.open(backend_url)
    try:
        minutes = [5, 3, 9, 3, 7, 1, 3, 8, 0, 6, 2, 9]  # ids out of start order, with ties
        with store.engine.begin() as conn:
            job = _job(conn, "alpha")
            for m in minutes:
                conn.execute(runs.insert().values(job_id=job, started_at=T0 + dt.timedelta(minutes=m),
                                                  status="Completed"))
        views = DashboardViews(store.engine)
        since = T0 + dt.timedelta(minutes=1)
        seen, before = [], None
        while page := views.list_runs(started_after=since, before=before, limit=3):
            seen += [(r["started_at"], r["id"]) for r in page]
            before = page[-1]["id"]
        expected = sorted(((T0 + dt.timedelta(minutes=m), i + 1) for i, m in enumerate(minutes) if m >= 1),
                          reverse=True)
        assert seen == expected
    finally:
        store.close()
