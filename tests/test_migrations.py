"""Schema migrations (mjsched_isolated.store.migrate, mjsched_isolated/migrations) on real databases.

The drift guard: a database made by the migrations must equal ``schema.metadata`` - Alembic's
``compare_metadata`` finds no difference, and its reflection (columns, types, defaults, keys, indexes,
unique and check constraints) equals that of a database made by ``metadata.create_all``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from clirun import Cli
from conftest import BACKENDS, FIXTURE_PLUGINS, isolated_database
from procs import Serve

from mjsched_isolated import planner
from mjsched_isolated.store import Store, migrate, schema
from mjsched_isolated.store.leases import Outcome
from mjsched_isolated.store.schema import jobs, runs, supervisors

UTC = dt.UTC
T0 = dt.datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
HEAD = migrate.head_revision()
OUTDATED = (f"database schema is at revision 0001, this version needs {HEAD}: run `python -m mjsched_isolated db "
            "upgrade` (or serve --auto-upgrade)")
NEW_JOB_COLUMNS = {"notify_on_missed", "notify_recipients"}
NEW_RUN_COLUMNS = {"cancel_requested_at", "cancel_requested_by"}  # 0003
RESOURCE_RUN_COLUMNS = {"cpu_s", "max_rss_mb"}  # 0011
TIME_KNOB_COLUMNS = {"dst_gap_policy", "dst_fold_policy", "missed_run_grace_s", "max_total_runtime_s"}  # 0007
RETRY_JOB_COLUMNS = {"max_retries", "retry_backoff_s", "retry_backoff_factor", "retry_backoff_max_s",  # 0012
                     "retry_max_jitter_s", "retry_on", "retry_at", "retry_attempt", "retry_scheduled_at",
                     "retry_next_run_at", "pause_after_failures", "consecutive_failures", "paused_reason"}
LIMIT_COLUMNS = {"max_memory_mb", "max_cpu_s", "max_open_files", "max_processes", "nice"}  # 0004
NEW_SUPERVISOR_COLUMNS = {"max_concurrent_jobs", "version"}  # 0008
ACCOUNTING_COLUMNS = {"missed_count"}  # 0010, on jobs and runs
LATE_RESULT_COLUMNS = {"late_status", "late_completed_at", "late_error_message", "late_details"}  # 0015
OVERLAP_JOB_COLUMNS = {"max_queued"}  # 0013


# -- helpers -----------------------------------------------------------------------------------------
def make_at(url: str, revision: str, *, stamped: bool = True) -> sa.Engine:
    """A database migrated to ``revision``; without ``stamped`` it has no alembic_version, like one made
    by create_all before migrations existed."""
    engine = schema.connect(url)
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":  # as migrate does: a table rebuild must not cascade
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        command.upgrade(migrate.config(conn), revision)
        if not stamped:
            conn.execute(sa.text("DROP TABLE alembic_version"))
        conn.commit()
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA foreign_keys=ON")
            conn.commit()
    return engine


def fill(engine: sa.Engine) -> None:
    """Rows in every 0001 table: jobs with statistics and a lease, a run of every status, supervisors."""
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(
            id=1, name="leased", job_type="ok", cron_expression="*/5 * * * *", timezone="Europe/Paris",
            status="Active", configuration=json.dumps({"a": [1, 2], "b": "x"}), description="with stats",
            start_at=T0, end_at=T0 + dt.timedelta(days=30), next_run_at=T0 + dt.timedelta(minutes=5),
            last_run_at=T0, run_count=7, success_count=4, failure_count=2, skipped_count=1, last_duration_ms=12.5,
            avg_duration_ms=20.25, concurrency_mode="Queue", missed_run_policy="RunAll", max_jitter_s=3.0,
            run_immediately_if_never_run=True, max_runtime_minutes=9, notify_on_success=True,
            notify_on_failure=False, lock_token="0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11", locked_at=T0,
            locked_by_instance="host:1:abc", expected_completion_at=T0 + dt.timedelta(minutes=10),
            created_at=T0, updated_at=T0))
        conn.execute(jobs.insert().values(  # only what is required: the rest takes 0001's server defaults
            id=2, name="plain", job_type="fail", cron_expression="0 0 * * *", created_at=T0, updated_at=T0))
        for i, status in enumerate(schema.RUN_STATUSES):
            conn.execute(runs.insert().values(
                id=10 + i, job_id=1, scheduled_at=T0 + dt.timedelta(minutes=i), started_at=T0 + dt.timedelta(minutes=i),
                completed_at=None if status == "Running" else T0 + dt.timedelta(minutes=i, seconds=1),
                status=status, success={"Completed": True, "Running": None}.get(status, False),
                error_message=None if status in ("Running", "Completed") else f"{status} because",
                details=json.dumps({"status": status, "nested": {"rows": [i, i + 1]}, "text": "é"}),
                queued_at=T0, executed_by_instance="host:1:abc", lock_token="0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11",
                deadline_at=T0 + dt.timedelta(minutes=10), duration_ms=None if status == "Running" else 1000.0 + i))
        conn.execute(supervisors.insert(), [
            {"instance": "host:1:abc", "hostname": "host", "pid": 1, "started_at": T0, "heartbeat_at": T0,
             "lease_expires_at": T0 + dt.timedelta(seconds=30), "stopped_at": None},
            {"instance": "host:2:def", "hostname": "host", "pid": 2, "started_at": T0, "heartbeat_at": T0,
             "lease_expires_at": T0, "stopped_at": T0}])


def snapshot(engine: sa.Engine, columns: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Every row of the given tables, only the given columns, read through the live (typed) tables."""
    out = {}
    with engine.connect() as conn:
        for name, cols in columns.items():
            table = schema.metadata.tables[name]
            rows = conn.execute(sa.select(*[table.c[c] for c in cols]).order_by(*table.primary_key.columns))
            out[name] = [dict(r) for r in rows.mappings()]
    return out


def _bool_defaults_equal(context, inspected_column, metadata_column, inspected_default, metadata_default,
                         rendered_metadata_default):
    """MySQL/MariaDB report a Boolean's server default false()/true() as '0'/'1': the same default, which
    Alembic's textual comparison would report as a change. Anything else: Alembic's own comparison."""
    pairs = {("0", "false"), ("1", "true")}
    seen = (str(inspected_default or "").strip("'\""), str(rendered_metadata_default or "").strip("'\"").lower())
    return False if seen in pairs else None


def metadata_diffs(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True,
                                                         "compare_server_default": _bool_defaults_equal})
        return compare_metadata(context, schema.metadata)


def reflect(engine: sa.Engine) -> dict:
    """The schema as the database reports it, in comparable form (column order ignored)."""
    insp = sa.inspect(engine)
    out = {}
    for table in sorted(set(insp.get_table_names()) - {"alembic_version"}):
        out[table] = {
            "columns": {c["name"]: (str(c["type"].compile(dialect=engine.dialect)), c["nullable"],
                                    None if c.get("default") is None else str(c["default"]))
                        for c in insp.get_columns(table)},
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted((tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]),
                           (f.get("options") or {}).get("ondelete")) for f in insp.get_foreign_keys(table)),
            "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                              for i in insp.get_indexes(table)),
            "uniques": sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(table)),
            "checks": sorted((c["name"], " ".join(c["sqltext"].split())) for c in insp.get_check_constraints(table)),
        }
    return out


def without_0002(reflected: dict) -> dict:
    """What 0001 should be: the current schema minus what 0002 and later revisions add (tables
    notifications, run_output, plugin_reloads, audit_log, backfills; columns below; 0006's ix_runs_started_at)."""
    out = {k: v for k, v in reflected.items()
           if k not in ("notifications", "run_output", "plugin_reloads", "audit_log", "backfills")}

    def before_0013(check: tuple) -> tuple:  # 0013 allowed two more concurrency modes
        name, text = check
        if name != "ck_concurrency_mode":
            return check
        return name, re.sub(r",\s*'(Replace|QueueAll)'(::character varying)?", "", text)

    out["jobs"] = {**out["jobs"], "columns": {k: v for k, v in out["jobs"]["columns"].items()
                                               if k not in NEW_JOB_COLUMNS | TIME_KNOB_COLUMNS | LIMIT_COLUMNS
                                               | ACCOUNTING_COLUMNS | RETRY_JOB_COLUMNS | OVERLAP_JOB_COLUMNS},
                   "checks": sorted(before_0013(c) for c in out["jobs"]["checks"])}

    def before_0012(item: tuple) -> tuple:  # 0012 widened the occurrence's unique index by attempt
        if item == ("uq_runs_job_id_scheduled_at_attempt", ("job_id", "scheduled_at", "attempt"), True):
            return "uq_runs_job_id_scheduled_at", ("job_id", "scheduled_at"), True
        return ("job_id", "scheduled_at") if item == ("job_id", "scheduled_at", "attempt") else item

    out["runs"] = {**out["runs"], "columns": {k: v for k, v in out["runs"]["columns"].items()
                                               if k not in NEW_RUN_COLUMNS | RESOURCE_RUN_COLUMNS | ACCOUNTING_COLUMNS
                                               | LATE_RESULT_COLUMNS | {"attempt"}},
                   "indexes": sorted(before_0012(i) for i in out["runs"]["indexes"] if i[0] != "ix_runs_started_at"),
                   "uniques": sorted(before_0012(u) for u in out["runs"]["uniques"])}
    out["supervisors"] = {**out["supervisors"], "columns": {k: v for k, v in out["supervisors"]["columns"].items()
                                                             if k not in NEW_SUPERVISOR_COLUMNS}}
    return out


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """``mjsched`` in-process (each test checks the exit code)."""
    run = Cli(capsys, monkeypatch, tmp_path)
    return lambda *args: run(*args, expect=None)


def sqlite_dump(path: Path) -> list[str]:
    import sqlite3

    with sqlite3.connect(path) as conn:
        return list(conn.iterdump())


# -- upgrade, drift --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_pre_migration_database_with_data_is_recognised_and_upgraded(backend_url):
    engine = make_at(backend_url, "0001", stamped=False)
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        reflected_before = reflect(engine)

        assert migrate.check(engine) == migrate.SchemaStatus("0001", HEAD, "legacy")
        assert migrate.current_revision(engine) == "0001"
        with pytest.raises(migrate.SchemaError) as refused:
            Store.open(backend_url)
        assert str(refused.value) == OUTDATED
        assert reflect(engine) == reflected_before  # refused: nothing written, not even alembic_version
        assert "alembic_version" not in sa.inspect(engine).get_table_names()

        was, now = migrate.upgrade(engine)
        assert (was.current, was.state, now.current, now.state) == ("0001", "legacy", HEAD, "current")
        assert snapshot(engine, old_columns) == before  # nothing lost or changed
        with engine.connect() as conn:
            new = conn.execute(sa.select(jobs.c.id, jobs.c.notify_on_missed, jobs.c.notify_recipients)
                               .order_by(jobs.c.id)).all()
        assert [tuple(r) for r in new] == [(1, False, None), (2, False, None)]
        assert metadata_diffs(engine) == []

        store = Store.open(backend_url)  # the Store is happy now, and reads the old rows
        try:
            assert store.get_job("leased")["lock_token"] == "0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11"
            assert {r["status"]: r["details"]["nested"]["rows"] for r in store.list_runs(limit=10)} == {
                s: [i, i + 1] for i, s in enumerate(schema.RUN_STATUSES)}
            with store.engine.begin() as conn:  # the outbox takes rows, with its server defaults
                conn.execute(schema.notifications.insert().values(
                    channel="email", event="Failure", job_id=1, job_name="leased", run_id=11, subject="s", body="b",
                    next_attempt_at=T0, created_at=T0))
                row = conn.execute(sa.select(schema.notifications)).mappings().one()
            assert (row["priority"], row["status"], row["attempts"]) == ("Normal", "Pending", 0)
        finally:
            store.close()
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_unstamped_database_that_already_has_the_outbox_is_recognised_as_0002(backend_url):
    """A build between the two revisions made the outbox with create_all and no alembic_version: it must
    be stamped 0002, not 0001 (whose upgrade would add existing columns and fail)."""
    engine = make_at(backend_url, "0002", stamped=False)
    try:
        fill(engine)
        assert migrate.check(engine) == migrate.SchemaStatus("0002", HEAD, "legacy")
        message = migrate.check(engine).message()  # head 0002: nothing but the stamp is missing; later: an upgrade
        assert ("no version stamp" if HEAD == "0002" else f"this version needs {HEAD}") in message
        assert "db upgrade" in message
        was, now = migrate.upgrade(engine)
        assert (was.current, now.current, now.state) == ("0002", HEAD, "current")
        store = Store.open(backend_url)
        try:
            assert store.get_job("leased")["lock_token"] == "0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11"
        finally:
            store.close()
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_0003_keeps_every_row_and_id_and_ids_are_never_reused(backend_url):
    """0003 (SQLite: a rebuild of jobs, runs and notifications with AUTOINCREMENT; elsewhere: two added
    columns) keeps every row and id, the foreign key and cascade still work, existing runs carry no cancel
    request, and a deleted newest run's or job's id is not handed out again."""
    engine = make_at(backend_url, "0002")
    try:
        fill(engine)
        with engine.begin() as conn:
            conn.execute(schema.notifications.insert().values(
                id=5, channel="email", event="Failure", job_id=1, job_name="leased", run_id=11, subject="s",
                body="b", next_attempt_at=T0, created_at=T0))
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)]
                       for t in ("jobs", "runs", "supervisors", "notifications")}
        before = snapshot(engine, old_columns)
        if engine.dialect.name == "sqlite":  # only through migrate (foreign keys off), or the runs would go
            with engine.begin() as conn, pytest.raises(RuntimeError, match="foreign keys off"):
                command.upgrade(migrate.config(conn), "0003")
        assert migrate.upgrade(engine)[1].current == HEAD
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            cancels = conn.execute(sa.select(runs.c.cancel_requested_at, runs.c.cancel_requested_by)).all()
        assert cancels and all(tuple(c) == (None, None) for c in cancels)
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                ddl = dict(conn.execute(sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'table'")).all())
            assert all("AUTOINCREMENT" in ddl[t] for t in ("jobs", "runs", "notifications"))
            assert "ON DELETE CASCADE" in ddl["runs"] and "ck_status" in ddl["runs"]

        with engine.begin() as conn:
            conn.execute(jobs.delete().where(jobs.c.id == 1))  # the foreign key's cascade still removes runs
            assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
        if engine.dialect.name != "sqlite":  # the rows above have explicit ids: their sequences never moved
            return
        with engine.begin() as conn:
            for table in (jobs, schema.notifications):
                conn.execute(table.delete())
            job_id = conn.execute(jobs.insert().values(name="again", job_type="ok", cron_expression="* * * * *",
                                                       created_at=T0, updated_at=T0)).inserted_primary_key
            run_id = conn.execute(runs.insert().values(job_id=job_id[0], started_at=T0)).inserted_primary_key
            note_id = conn.execute(schema.notifications.insert().values(
                channel="email", event="Failure", job_name="again", subject="s", body="b", next_attempt_at=T0,
                created_at=T0)).inserted_primary_key
        newest_run = max(r["id"] for r in before["runs"])
        assert (run_id[0], job_id[0], note_id[0]) == (newest_run + 1, 3, 6)  # not 1, 1, 1: nothing reused
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_0007_upgrade_keeps_rows_and_gives_old_jobs_todays_dst_rules(backend_url):
    """0002 -> 0007 with data: nothing changes, every existing job gets Shift / OnceIfFixedHour (the rules
    it had), and the planner reads the upgraded row as before."""
    engine = make_at(backend_url, "0002")
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            rows = conn.execute(sa.select(jobs.c.id, jobs.c.dst_gap_policy, jobs.c.dst_fold_policy,
                                          jobs.c.missed_run_grace_s, jobs.c.max_total_runtime_s)
                                .order_by(jobs.c.id)).all()
        assert [tuple(r) for r in rows] == [(1, "Shift", "OnceIfFixedHour", None, None),
                                            (2, "Shift", "OnceIfFixedHour", None, None)]
        store = Store.open(backend_url, auto_upgrade=True)
        try:
            job = store.get_job("leased")
            assert planner.occurrence_after(job, T0) == dt.datetime(2026, 3, 1, 12, 5, tzinfo=UTC)
        finally:
            store.close()
    finally:
        engine.dispose()


def test_0010_upgrade_keeps_rows_and_counts_nothing_missed_before_it(backend_url):
    """0008 -> 0010 with data: nothing changes, every job and run gets missed_count 0, and a claim after
    the upgrade adds to it."""
    engine = make_at(backend_url, "0008")
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            assert set(conn.execute(sa.select(jobs.c.missed_count)).scalars()) == {0}
            assert set(conn.execute(sa.select(runs.c.missed_count)).scalars()) == {0}
        store = Store.open(backend_url, auto_upgrade=True)
        try:
            job = store.get_job("plain")
            assert store.set_next_run_at(job["id"], job["next_run_at"], T0, T0, skipped=1, missed=3)
            after = store.get_job("plain")
            assert (after["skipped_count"], after["missed_count"]) == (1, 3)
        finally:
            store.close()
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_0011_upgrade_keeps_every_run_and_old_runs_have_no_resource_figures(backend_url):
    """0008 -> 0011 with data: every row is kept as it was; runs recorded before have no cpu_s/max_rss_mb,
    and a run finished afterwards records both."""
    engine = make_at(backend_url, "0008")
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        assert not RESOURCE_RUN_COLUMNS & set(old_columns["runs"])
        before = snapshot(engine, old_columns)
        command_upgrade_to(engine, "0011")
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            figures = conn.execute(sa.select(runs.c.cpu_s, runs.c.max_rss_mb)).all()
        assert figures and all(tuple(f) == (None, None) for f in figures)
    finally:
        engine.dispose()
    store = Store.open(backend_url, auto_upgrade=True)
    try:
        assert store.finish_runs([Outcome(run_id=10, job_id=1, token="0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11",
                                          status="Completed", success=True, duration_ms=5.0, cpu_s=1.25,
                                          max_rss_mb=99.5)]) == [True]
        by_id = {r["id"]: r for r in store.list_runs(job_name="leased", limit=100)}
        assert (by_id[10]["cpu_s"], by_id[10]["max_rss_mb"]) == (1.25, 99.5)
        assert (by_id[11]["cpu_s"], by_id[11]["max_rss_mb"]) == (None, None)
    finally:
        store.close()


def command_upgrade_to(engine: sa.Engine, revision: str) -> None:
    with engine.connect() as conn:
        command.upgrade(migrate.config(conn), revision)
        conn.commit()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_migrated_schema_equals_metadata(backend, tmp_path):
    """Guards 0001/0002 against drifting from schema.py: fresh migrated == create_all, and 0001 == the
    schema before 0002."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    with (isolated_database(backend, tmp_path / "a") as migrated_url,
          isolated_database(backend, tmp_path / "b") as created_url,
          isolated_database(backend, tmp_path / "c") as baseline_url):
        store = Store.open(migrated_url)  # an empty database: brought to head on first open
        created = schema.connect(created_url)
        baseline = make_at(baseline_url, "0001")
        try:
            schema.metadata.create_all(created)
            assert migrate.check(store.engine) == migrate.SchemaStatus(HEAD, HEAD, "current")
            assert metadata_diffs(store.engine) == []
            assert metadata_diffs(created) == []  # the comparison itself is sound
            assert reflect(store.engine) == reflect(created)
            assert reflect(baseline) == without_0002(reflect(created))
        finally:
            store.close(), created.dispose(), baseline.dispose()


@pytest.mark.timeout(30)
def test_drift_is_detected(db_url):
    """The guard can fail: a column missing from the migrations shows up in both comparisons."""
    engine = make_at(db_url, "head")
    created = schema.connect(db_url.replace("mjsched.db", "created.db"))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE notifications DROP COLUMN sent_at"))
        schema.metadata.create_all(created)
        assert any(d[0] == "add_column" and d[3].name == "sent_at" for d in metadata_diffs(engine))
        assert reflect(engine) != reflect(created)
    finally:
        engine.dispose(), created.dispose()


@pytest.mark.timeout(30)
def test_unknown_revision_is_refused(db_url):
    engine = make_at(db_url, "head")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '0999'"))
        assert migrate.check(engine).state == "unknown"
        for call in (lambda: Store.open(db_url), lambda: Store.open(db_url, auto_upgrade=True),
                     lambda: migrate.upgrade(engine)):
            with pytest.raises(migrate.SchemaError, match="revision 0999, which this version does not know"):
                call()
    finally:
        engine.dispose()


# -- CLI -------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_serve_and_other_commands_refuse_an_outdated_database(cli, db_url, tmp_path):
    engine = make_at(db_url, "0001")
    fill(engine)
    engine.dispose()
    dump = sqlite_dump(tmp_path / "mjsched.db")
    for args in (["serve", "--plugins", FIXTURE_PLUGINS, "--run-for", "5"],
                 ["jobs", "add", "new", "--type", "ok", "--cron", "* * * * *", "--plugins", FIXTURE_PLUGINS],
                 ["jobs", "pause", "leased"], ["jobs", "list"]):
        proc = cli(*args, "--db", db_url)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {OUTDATED}\n", ""), args
    assert sqlite_dump(tmp_path / "mjsched.db") == dump


@pytest.mark.timeout(60)
def test_serve_auto_upgrade_upgrades_then_runs_a_job(db_url):
    engine = make_at(db_url, "0001", stamped=False)  # made by the previous version
    now = dt.datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(name="due", job_type="ok", cron_expression="0 0 1 1 *", status="Active",
                                          next_run_at=now, created_at=now, updated_at=now))
    serve = Serve(db_url, "--auto-upgrade")
    try:
        serve.wait_for(rf"database schema upgraded from 0001 to {HEAD}")
        serve.wait_for(r"run \d+ finished: job due Completed")
    finally:
        serve.stop()
    assert migrate.check(engine) == migrate.SchemaStatus(HEAD, HEAD, "current")
    engine.dispose()


@pytest.mark.timeout(60)
def test_db_current_and_upgrade(cli, db_url):
    make_at(db_url, "0001", stamped=False).dispose()
    proc = cli("db", "current", "--db", db_url)
    assert (proc.returncode, proc.stdout) == (1, OUTDATED + "\n")
    proc = cli("db", "upgrade", "--db", db_url, "--log-level", "WARNING")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"database schema upgraded: 0001 -> {HEAD}\n", "")
    proc = cli("db", "current", "--db", db_url)
    assert (proc.returncode, proc.stdout) == (0, f"database schema is at revision {HEAD} (head): up to date\n")
    proc = cli("db", "upgrade", "--db", db_url)
    assert (proc.returncode, proc.stdout) == (0, f"database schema already at {HEAD} (head): nothing to do\n")
    engine = schema.connect(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0999'"))
    engine.dispose()
    assert cli("db", "current", "--db", db_url).returncode == 1
    proc = cli("db", "upgrade", "--db", db_url)
    assert proc.returncode == 2 and "revision 0999, which this version does not know" in proc.stderr


# -- race ------------------------------------------------------------------------------------------
OPENER = """
import sys
from mjsched_isolated.store import Store
print("ready", flush=True)
sys.stdin.readline()
Store.open(sys.argv[1]).close()
print("opened", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mysql"])
def test_concurrent_first_opens_all_succeed(backend, tmp_path):
    """Several processes open one empty database at the same moment (released together once all have
    imported): every one succeeds and the schema is made once."""
    with isolated_database(backend, tmp_path) as url:
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, url], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        try:
            for p in procs:
                assert p.stdout.readline() == "ready\n"
            for p in procs:  # release them together
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [(p.wait(60), p.stdout.read(), p.stderr.read()) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert [r[:2] for r in results] == [(0, "opened\n")] * 4, [r[2][-2000:] for r in results]
        engine = schema.connect(url)
        try:
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD]
            assert migrate.check(engine).up_to_date
        finally:
            engine.dispose()


def test_0012_upgrade_keeps_rows_makes_them_attempt_1_and_allows_a_retry_of_an_occurrence(backend_url):
    """0002 -> head with data: nothing changes, old runs are attempt 1, old jobs have no retries, no pending
    retry and no pause on failure; afterwards a second attempt of an occurrence is accepted, a second run of
    the same attempt still refused."""
    engine = make_at(backend_url, "0002")
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            assert set(conn.execute(sa.select(runs.c.attempt)).scalars()) == {1}
            rows = conn.execute(sa.select(jobs.c.max_retries, jobs.c.retry_backoff_s, jobs.c.retry_backoff_factor,
                                          jobs.c.retry_at, jobs.c.pause_after_failures, jobs.c.consecutive_failures,
                                          jobs.c.paused_reason).order_by(jobs.c.id)).all()
        assert [tuple(r) for r in rows] == [(0, 10.0, 2.0, None, None, 0, None)] * 2
        retry = {"job_id": 1, "scheduled_at": T0, "started_at": T0, "status": "Failed"}  # run 10's occurrence
        with engine.begin() as conn:
            conn.execute(runs.insert().values(**retry, attempt=2))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(runs.insert().values(**retry, attempt=2))
    finally:
        engine.dispose()


def test_0012_keeps_the_values_of_columns_added_by_other_revisions(backend_url):
    """0012 rebuilds runs on SQLite: it copies the table as it finds it, so a column another revision
    added before it (0011's cpu_s, here) keeps its values."""
    engine = make_at(backend_url, "0011")
    try:
        fill(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE runs SET cpu_s = 1.5, max_rss_mb = 64.0 WHERE id = 11"))
        migrate.upgrade(engine)
        with engine.connect() as conn:
            row = conn.execute(sa.select(runs.c.cpu_s, runs.c.max_rss_mb, runs.c.attempt).where(runs.c.id == 11)).one()
        assert tuple(row) == (1.5, 64.0, 1)
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_0015_upgrade_keeps_every_run_and_old_runs_have_no_late_result(backend_url):
    """0012 -> 0015 with data: every row is kept as it was, no run has a late result; afterwards an
    abandoned run's late result can be kept (and its typed timestamp reads back exactly)."""
    engine = make_at(backend_url, "0012")
    try:
        fill(engine)
        with engine.begin() as conn:  # run 12 (Failed) as a sweep leaves an abandoned run
            conn.execute(sa.text("UPDATE runs SET error_message = 'abandoned: supervisor host:1:abc stopped' "
                                 "WHERE id = 12"))
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        assert not LATE_RESULT_COLUMNS & set(old_columns["runs"])
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)  # to head (0015; 0013 rebuilds the jobs table on SQLite with foreign keys off)
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            late = conn.execute(sa.select(*[runs.c[c] for c in sorted(LATE_RESULT_COLUMNS)])).all()
        assert late and all(set(r) == {None} for r in late)
    finally:
        engine.dispose()
    store = Store.open(backend_url, auto_upgrade=True)
    try:
        assert store.get_run(12)["status"] == "Failed"
        ended = T0 + dt.timedelta(hours=1)
        kept = store.keep_late_result(Outcome(12, 1, "0b5f6d0e-1c1f-4a55-9a86-3b0e2f6f1d11", "Completed", True,
                                              details={"é": 1}, completed_at=ended), "host:1:abc")
        assert kept is not None
        run = store.get_run(12)
        assert (run["late_status"], run["late_completed_at"], run["late_details"]) == ("Completed", ended, {"é": 1})
    finally:
        store.close()


def test_0013_upgrade_keeps_rows_allows_replace_and_queue_all_and_downgrades_them(backend_url):
    """0012 -> head with data: every row and column kept (on SQLite the jobs table is rebuilt), old jobs get
    max_queued 10; Replace and QueueAll are accepted afterwards, another mode still refused by the CHECK
    constraint; a downgrade turns them into Skip and Queue and refuses them again."""
    engine = make_at(backend_url, "0012")
    try:
        fill(engine)
        with engine.begin() as conn:  # a column of an earlier revision with a value, to see it kept
            conn.execute(sa.text("UPDATE jobs SET max_retries = 3, paused_reason = 'x' WHERE id = 1"))
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)
        assert snapshot(engine, old_columns) == before
        with engine.begin() as conn:
            assert list(conn.execute(sa.select(jobs.c.max_queued).order_by(jobs.c.id)).scalars()) == [10, 10]
            conn.execute(jobs.update().where(jobs.c.id == 1).values(concurrency_mode="Replace"))
            conn.execute(jobs.update().where(jobs.c.id == 2).values(concurrency_mode="QueueAll", max_queued=3))
        with pytest.raises((sa.exc.IntegrityError, sa.exc.OperationalError)), engine.begin() as conn:
            conn.execute(jobs.update().where(jobs.c.id == 2).values(concurrency_mode="Everything"))
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":  # as migrate does: a table rebuild must not cascade
                conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                conn.commit()
            command.downgrade(migrate.config(conn), "0012")
            conn.commit()
            modes = conn.execute(sa.text("SELECT concurrency_mode FROM jobs ORDER BY id")).scalars().all()
            assert modes == ["Skip", "Queue"]
            assert conn.execute(sa.text("SELECT COUNT(*) FROM runs")).scalar() == len(schema.RUN_STATUSES)
        with pytest.raises((sa.exc.IntegrityError, sa.exc.OperationalError)), engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET concurrency_mode = 'Replace' WHERE id = 1"))
    finally:
        engine.dispose()



def test_0014_upgrade_keeps_rows_adds_an_empty_backfills_table_that_takes_pending_occurrences(backend_url):
    """0012 -> head with data: every row kept, no pending backfill; afterwards an occurrence can be made
    pending once per attempt, and removing the job removes its pending entries."""
    from mjsched_isolated.store.schema import backfills

    engine = make_at(backend_url, "0012")
    try:
        fill(engine)
        inspector = sa.inspect(engine)
        old_columns = {t: [c["name"] for c in inspector.get_columns(t)] for t in ("jobs", "runs", "supervisors")}
        before = snapshot(engine, old_columns)
        migrate.upgrade(engine)
        assert snapshot(engine, old_columns) == before
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(backfills)).scalar() == 0
        entry = {"job_id": 2, "scheduled_at": T0, "requested_at": T0, "requested_by": "ann"}
        with engine.begin() as conn:
            conn.execute(backfills.insert().values(**entry))
            conn.execute(backfills.insert().values(**entry, attempt=2, kind="Retry", retry_of_run_id=10))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(backfills.insert().values(**entry))
        store = Store(engine)
        store.remove_job("plain")
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(backfills)).scalar() == 0
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_postgresql_keeps_every_table_in_the_schema_the_urls_search_path_names(tmp_path, capsys, monkeypatch):
    """The documented way to keep mjsched's tables in a PostgreSQL schema of their own: libpq's
    ``?options=-csearch_path%3Dname`` in the URL. Migrations, ``serve`` (a run), the dashboard and the CLI
    all work there, and the tables land in that schema; a schema not created yet is one line saying so."""
    import uuid

    from clirun import error_line
    from conftest import POSTGRES_URL, _server_or_skip, add_job
    from starlette.testclient import TestClient

    from mjsched_isolated.config import build_settings
    from mjsched_isolated.dashboard.app import create_app

    admin = _server_or_skip(POSTGRES_URL)
    name = f"mjsched_{uuid.uuid4().hex[:10]}"
    url = f"{POSTGRES_URL}?options=-csearch_path%3D{name}"
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": url})
    try:
        assert error_line(cli("db", "upgrade", expect=2)) == (
            f"error: database schema: no schema of PostgreSQL's search_path ({name}) exists: create it first "
            "(CREATE SCHEMA name), or correct the URL's options=-csearch_path%3Dname")
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {name}")
        assert "upgraded: none -> " in cli("db", "upgrade").stdout
        with Store.open(url) as store:
            add_job(store, "hello", "ok", "0 0 1 1 *")  # due now
            serve = Serve(url, "--plugins", FIXTURE_PLUGINS)
            try:
                run_id = int(serve.wait_for(r"run (\d+) finished: job hello Completed").group(1))
            finally:
                serve.stop()
            settings = build_settings({"database_url": url, "plugins_dir": FIXTURE_PLUGINS})
            with TestClient(create_app(settings, store, poll_s=0.05), base_url="http://127.0.0.1") as client:
                assert client.get(f"/api/runs/{run_id}").json()["run"]["status"] == "Completed"
        assert "hello" in cli("jobs", "list").stdout
        with admin.connect() as conn:
            tables = set(conn.execute(sa.text("SELECT table_name FROM information_schema.tables "
                                              "WHERE table_schema = :s"), {"s": name}).scalars())
            assert {t.name for t in schema.metadata.sorted_tables} | {"alembic_version"} <= tables
            assert conn.exec_driver_sql(f"SELECT status FROM {name}.runs").scalars().all() == ["Completed"]
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        admin.dispose()
