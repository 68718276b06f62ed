"""Run retention: Store.prune_runs on SQLite, PostgreSQL and MySQL/MariaDB (contract), the supervisor's
batch-per-step pruning, and ``runs prune``."""

from __future__ import annotations

import datetime as dt
import json
import logging

import pytest
import sqlalchemy as sa
from clirun import Cli
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated.config import Retention, Settings
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import runs
from mjsched_isolated.supervisor import Supervisor
from mjsched_isolated.supervisor.pool import Pool

UTC = dt.UTC
NOW = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)


def _insert_run(conn: sa.Connection, **values: object) -> int:
    """Insert one ``runs`` row on ``conn``; return its id."""
    key = conn.execute(runs.insert().values(**values)).inserted_primary_key
    assert key is not None
    return int(key[0])


def _runs(store: Store, job_id: int, ages_days: list[float], status: str = "Completed",
          now: dt.datetime = NOW) -> list[int]:
    """Insert runs of ``job_id`` that started ``age`` days before ``now``; returns their ids in order."""
    ids = []
    with store.engine.begin() as conn:
        for age in ages_days:
            started = now - dt.timedelta(days=age)
            ids.append(_insert_run(conn, job_id=job_id, started_at=started, status=status,
                                   completed_at=None if status == "Running" else started + dt.timedelta(seconds=1)))
    return ids


def _remaining(store: Store) -> set[int]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(runs.c.id)).scalars())


def _fixture(store: Store) -> tuple[set[int], set[int]]:
    """Runs exercising both rules; returns (all ids, ids that keep_days=10, keep_min_per_job=2 must delete)."""
    a = add_job(store, "a", "ok", now=NOW)["id"]
    b = add_job(store, "b", "ok", now=NOW)["id"]
    d = add_job(store, "d", "ok", now=NOW)["id"]
    add_job(store, "empty", "ok", now=NOW)
    young = _runs(store, a, [1, 2, 3, 5])  # ranks 1-4: kept by keep_days although beyond keep_min
    old_a = _runs(store, a, [20, 30, 40, 50, 60])  # ranks 5-9 and old: deleted
    failed_a = _runs(store, a, [45], status="Failed")  # finished too, whatever its outcome: deleted
    running_a = _runs(store, a, [100], status="Running")  # never touched, and not ranked
    old_b = _runs(store, b, [40, 50, 60])  # the newest 2 are kept by keep_min_per_job although old
    with store.engine.begin() as conn:  # three runs with one started_at: the highest ids rank first
        same = [_insert_run(conn, job_id=d, started_at=NOW - dt.timedelta(days=30), status="Timeout", completed_at=NOW)
                for _ in range(3)]
    everything = set(young + old_a + failed_a + running_a + old_b + same)
    return everything, set(old_a + failed_a + [old_b[2], same[0]])


@pytest.mark.timeout(60)
def test_prune_runs_keeps_days_and_newest_per_job_in_batches(any_store):
    store = any_store
    everything, doomed = _fixture(store)
    assert store.count_prunable_runs(NOW, 10, 2) == len(doomed) == 8
    assert store.prune_runs(NOW, 10, 2, batch_size=3, max_batches=1) == 3  # one batch, one transaction
    assert store.count_prunable_runs(NOW, 10, 2) == 5
    assert store.prune_runs(NOW, 10, 2, batch_size=3) == 5  # the rest: a full batch, then a partial one
    assert _remaining(store) == everything - doomed
    assert store.prune_runs(NOW, 10, 2, batch_size=3) == 0
    # batch boundary: exactly a multiple of batch_size left
    assert store.prune_runs(NOW, 10, 1, batch_size=2) == 2  # job b's and job d's second-newest
    assert store.count_prunable_runs(NOW, 10, 1) == 0


@pytest.mark.timeout(60)
def test_prune_runs_keep_days_zero_keeps_everything_and_running_is_never_deleted(any_store):
    store = any_store
    everything, _ = _fixture(store)
    assert store.prune_runs(NOW, 0, 0, batch_size=2) == 0
    assert store.count_prunable_runs(NOW, 0, 0) == 0
    assert _remaining(store) == everything
    assert store.prune_runs(NOW, 0.5, 0, batch_size=4) == len(everything) - 1
    with store.engine.connect() as conn:
        assert list(conn.execute(sa.select(runs.c.status))) == [("Running",)]


@pytest.mark.timeout(30)
def test_supervisor_prunes_one_batch_per_step_then_waits_for_the_interval(store, db_url, caplog):
    """A real Supervisor and store; the pool is not started (no worker: nothing to dispatch)."""
    job = add_job(store, "old", "ok", now=NOW, next_run_at=NOW + dt.timedelta(days=3650))
    now = store.db_now()
    ids = _runs(store, job["id"], [10 + i for i in range(8)], now=now)  # 8 runs, 10..17 days old
    settings = Settings(database_url=db_url, plugins_dir=FIXTURE_PLUGINS, max_concurrent_jobs=1,
                        retention=Retention(keep_days=7, keep_min_per_job=1, prune_batch_size=3,
                                            prune_interval_s=600))
    pool = Pool(1, FIXTURE_PLUGINS)
    supervisor = Supervisor(settings, store, pool)
    caplog.set_level(logging.INFO, logger="mjsched.retention")
    try:
        left = []
        for _ in range(4):
            now, mono = supervisor.read_clock()
            wake = supervisor.step(now, mono)
            left.append(len(_remaining(store)))
            if len(left) < 3:
                assert (wake - now).total_seconds() < 0.01  # more to prune: the loop comes straight back
        assert left == [5, 2, 1, 1]  # 3, 3, then the last 1 of 7 (the newest is kept), then nothing
        assert _remaining(store) == {ids[0]}
        assert [r.getMessage() for r in caplog.records if "pruned" in r.getMessage()] == [
            "pruned 7 runs older than 7 days (keeping the newest 1 per job)"]
        assert supervisor.pruner.next_pass_at is not None and not supervisor.pruner.in_pass
        assert (supervisor.pruner.next_pass_at - now).total_seconds() == pytest.approx(600, abs=5)
    finally:
        supervisor.liveness.stop()
        pool.close()


@pytest.mark.timeout(60)
def test_cli_runs_prune_dry_run_flags_and_settings_defaults(store, db_url, tmp_path, capsys, monkeypatch):
    job = add_job(store, "j", "ok")
    now = store.db_now()
    _runs(store, job["id"], [1, 40, 41, 42], now=now)
    run = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS,
                                              "MJSCHED_RETENTION_KEEP_MIN_PER_JOB": "2"})

    def cli(*args: str, expect: int = 0):
        return run("runs", "prune", *args, expect=expect)

    assert json.loads(cli("--dry-run", "--json").stdout) == {"pruned": 2, "dry_run": True, "keep_days": 30.0,
                                                             "keep_min_per_job": 2, "notifications_pruned": 0}
    assert len(_remaining(store)) == 4
    assert cli("--keep-days", "0").stdout.startswith("keep_days is 0")
    assert len(_remaining(store)) == 4
    assert "error: --keep-min-per-job:" in cli("--keep-min-per-job", "-1", expect=2).stderr
    assert cli("--keep-min-per-job", "1").stdout.startswith("pruned 3 finished run(s) older than 30 days")
    assert len(_remaining(store)) == 1


@pytest.mark.timeout(60)
def test_prune_notifications_deletes_only_old_delivered_or_given_up_notices(any_store):
    from mjsched_isolated.store.schema import notifications

    def notice(age_days: float, status: str) -> int:
        with any_store.engine.begin() as conn:
            created = NOW - dt.timedelta(days=age_days)
            return conn.execute(notifications.insert().values(
                channel="log", event="Failure", job_name="a", subject="s", body="b", status=status,
                next_attempt_at=created, created_at=created)).inserted_primary_key[0]

    old = [notice(40, "Sent"), notice(50, "Failed"), notice(45, "Sent")]
    kept = [notice(40, "Pending"), notice(5, "Sent"), notice(1, "Failed")]
    assert any_store.prune_notifications(NOW, 0, batch_size=2) == 0  # keep_days 0 keeps everything
    assert any_store.count_prunable_notifications(NOW, 30) == 3
    assert any_store.prune_notifications(NOW, 30, batch_size=2) == 3  # two batches, the second short
    with any_store.engine.connect() as conn:
        assert set(conn.execute(sa.select(notifications.c.id)).scalars()) == set(kept)
    assert set(old).isdisjoint(kept)
