"""The supervisor's hot path (issue 11): a poll's claims in one transaction, results that arrive together
recorded in one transaction, ``completed_at`` as the instant a run ended, fair order among due jobs, and
no run recorded as started before its scheduled instant (the database clock's offset measured without
bias). Supervisor decisions on the in-memory store and the fake pool; the offset on a real SQLite file."""

from __future__ import annotations

import datetime as dt
import time

import sqlalchemy as sa
from conftest import add_job

from mjsched_isolated.store import Store
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.supervisor.liveness import Liveness

YEARLY = "0 0 1 1 *"  # never due again within a test


class Transactions:
    """The statements of every committed transaction on ``engine``, in order (first words of each)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.committed: list[list[str]] = []
        self._current: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", self._execute)
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "rollback", self._rollback)

    def _execute(self, _conn, _cursor, statement: str, *_args) -> None:
        self._current.append(" ".join(statement.split()[:3]))

    def _commit(self, _conn) -> None:
        self.committed.append(self._current)
        self._current = []

    def _rollback(self, _conn) -> None:
        self._current = []

    def with_statement(self, start: str) -> list[list[str]]:
        """The committed transactions that ran a statement starting with ``start``."""
        return [t for t in self.committed if any(s.startswith(start) for s in t)]


def test_a_poll_claims_every_due_job_in_one_transaction_and_results_that_arrive_together_are_one_too(
        mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=5)
    d.pool.hold()
    for i in range(5):
        add_job(store, f"j{i}", "ok", YEARLY)
    at = d.timeline()
    seen = Transactions(store.engine)
    at(0)
    assert len(d.pool.held) == 5
    (claims,) = seen.with_statement("INSERT INTO runs")
    assert sum(s.startswith("INSERT INTO runs") for s in claims) == 5
    for run_id in list(d.pool.held):
        d.pool.finish(run_id)
    at(1)  # the five results come in one wait
    (recorded,) = seen.with_statement("UPDATE runs SET")
    assert sum(s.startswith("UPDATE runs SET") for s in recorded) == 5
    runs = store.list_runs(limit=10)
    assert len(runs) == 5 and {r["status"] for r in runs} == {"Completed"}
    assert all(store.get_job(f"j{i}")["run_count"] == 1 and store.get_job(f"j{i}")["lock_token"] is None
               for i in range(5))


def test_completed_at_is_the_instant_the_result_arrived_not_the_write(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    d.pool.hold()
    add_job(store, "late", "ok", YEARLY)
    at = d.timeline()
    start = at(0)
    (run_id,) = d.pool.held
    d.pool.finish(run_id)
    ended = at(3)  # 3 s ahead of the database's own clock: a write at its now would say otherwise
    run = store.get_run(run_id)
    assert run["started_at"] >= start
    assert run["completed_at"] == ended
    expected_ms = (run["completed_at"] - run["started_at"]).total_seconds() * 1000
    assert abs(run["duration_ms"] - expected_ms) < 0.001
    job = store.get_job("late")
    assert job["last_run_at"] == ended and abs(job["last_duration_ms"] - expected_ms) < 0.001


def test_no_run_is_recorded_as_started_before_its_scheduled_instant(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    at = d.timeline()
    first = at(0)
    for i in range(3):  # every second, the first occurrence a little after the timeline's start
        add_job(store, f"s{i}", "ok", "* * * * * *", next_run_at=first + dt.timedelta(milliseconds=300 + 100 * i))
    for step in range(1, 17):  # the timeline runs ahead of the database's clock
        at(step * 0.25)
    runs = store.list_runs(limit=100)
    assert len(runs) >= 9
    assert all(r["started_at"] >= r["scheduled_at"] for r in runs), [
        (r["scheduled_at"], r["started_at"]) for r in runs if r["started_at"] < r["scheduled_at"]]


def test_when_more_jobs_are_due_than_slots_the_oldest_occurrence_then_the_least_recently_run_goes_first(
        mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    now = utcnow()
    due = now - dt.timedelta(seconds=5)
    add_job(store, "a-recent", "ok", YEARLY, next_run_at=due, last_run_at=now - dt.timedelta(minutes=1))
    add_job(store, "b-never", "ok", YEARLY, next_run_at=due)
    add_job(store, "c-long-ago", "ok", YEARLY, next_run_at=due, last_run_at=now - dt.timedelta(days=1))
    add_job(store, "d-oldest-due", "ok", YEARLY, next_run_at=due - dt.timedelta(seconds=1),
            last_run_at=now - dt.timedelta(seconds=10))
    at = d.timeline()
    for step in range(12):  # a step claims into the slot its previous result freed
        at(step * 0.1)
        for run_id in d.pool.held:
            d.pool.finish(run_id)
    assert [r.job_name for r in d.pool.submitted] == ["d-oldest-due", "b-never", "c-long-ago", "a-recent"]


class SlowStore(Store):
    """A real store whose renewal answers ``delay_s`` after the database read its clock."""

    delay_s = 0.0

    def renew_supervisor(self, instance: str, ttl_s: float, **owner):
        db_now = super().renew_supervisor(instance, ttl_s, **owner)
        time.sleep(self.delay_s)  # latency of the answer, not synchronisation
        return db_now

    def register_supervisor(self, instance: str, hostname: str, pid: int, ttl_s: float, **labels):
        db_now = super().register_supervisor(instance, hostname, pid, ttl_s, **labels)
        time.sleep(self.delay_s)
        return db_now


def test_a_database_on_this_machines_clock_measures_offset_zero_however_slow_the_round_trip(tmp_path):
    store = SlowStore.open(f"sqlite:///{tmp_path / 'l.db'}")
    store.delay_s = 0.2  # a midpoint estimate would say the database runs ~100 ms ahead: runs claimed early
    lease = Liveness(store, "host-1", ttl_s=30, renew_interval_s=0.0, local_clock=utcnow)
    try:
        assert lease.maintain(time.monotonic())
        assert lease.db_offset == dt.timedelta(0)
        assert lease.maintain(time.monotonic())
        assert lease.db_offset == dt.timedelta(0)
    finally:
        store.close()


def test_a_clock_that_differs_is_measured_to_within_the_round_trip(tmp_path):
    store = SlowStore.open(f"sqlite:///{tmp_path / 'l.db'}")
    lease = Liveness(store, "host-1", ttl_s=30, renew_interval_s=0.0,
                     local_clock=lambda: utcnow() - dt.timedelta(seconds=40))  # this machine 40 s behind
    try:
        started = time.monotonic()
        assert lease.maintain(time.monotonic())
        round_trip = dt.timedelta(seconds=time.monotonic() - started) + dt.timedelta(milliseconds=1)
        assert abs(lease.db_offset - dt.timedelta(seconds=40)) <= round_trip
    finally:
        store.close()


def test_results_waiting_for_the_database_still_count_under_the_cap(mem_store, fake_factory, monkeypatch):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    d.pool.hold()
    add_job(store, "first", "ok", YEARLY)
    at = d.timeline()
    start = at(0)
    (run_id,) = d.pool.held
    for name in ("second", "third"):
        add_job(store, name, "ok", YEARLY, next_run_at=start)

    def unreachable(_outcomes):
        raise sa.exc.OperationalError("UPDATE runs", {}, Exception("database is unreachable"))

    with monkeypatch.context() as m:  # the database refuses every result: "first" stays unrecorded
        m.setattr(store.leases, "finish_runs", unreachable)
        d.pool.finish(run_id)
        at(0.1)  # the result arrives and cannot be written; "second" takes the one free slot
        at(0.2)  # two workers are idle, but one slot still belongs to the unrecorded result
        assert len(d.supervisor.pending) == 1
        assert len(d.supervisor.inflight) == 1 and len(d.pool.submitted) == 2
    at(1.5)  # the database is back (the retry comes within a second): recorded, and the slot is free
    assert d.supervisor.pending == [] and store.get_run(run_id)["status"] == "Completed"
    at(1.6)
    assert len(d.pool.submitted) == 3


def test_the_unreadable_next_run_at_sweep_reads_a_few_ids_per_rescan_and_covers_every_job(
        mem_store, fake_factory, caplog, monkeypatch):
    from mjsched_isolated.supervisor import dispatch
    monkeypatch.setattr(dispatch, "UNREADABLE_SWEEP_ROWS", 2)
    store = mem_store
    later = utcnow() + dt.timedelta(days=1)
    for i in range(7):
        add_job(store, f"j{i}", "ok", YEARLY, next_run_at=later)
    tomorrow = later.strftime("%Y-%m-%dT%H:%M:%SZ")  # sorts after every real due time: never due by SQL
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET next_run_at = :raw WHERE name IN ('j1', 'j6')"), {"raw": tomorrow})
    d = fake_factory(rescan_interval_s=0.1)
    seen = Transactions(store.engine)
    at = d.timeline()
    at(0)  # ids 1-2: j1 found
    assert "job j1: its next_run_at could not be read" in caplog.text and "job j6" not in caplog.text
    for step in range(1, 4):  # ids 3-4, 5-6, 7: j6 found at the third rescan
        at(step * 0.2)
        assert ("job j6: its next_run_at could not be read" in caplog.text) == (step == 3)
    assert store.get_job("j1")["next_run_at"] is not None and store.get_job("j6")["next_run_at"] is not None
    assert seen.committed  # the repairs were written


def test_active_schedules_are_counted_without_reading_every_job(any_store):
    store = any_store
    later = utcnow() + dt.timedelta(days=1)
    for i in range(3):
        add_job(store, f"m{i}", "ok", "* * * * *", next_run_at=later)
    add_job(store, "h", "ok", "0 * * * *", next_run_at=later)
    add_job(store, "paused", "ok", "* * * * *", next_run_at=later)
    store.update_job("paused", {"status": "Paused"}, utcnow())
    assert sorted(store.active_schedules_named(2)) == [("* * * * *", "UTC", 3, ["m0", "m1"]),
                                                       ("0 * * * *", "UTC", 1, ["h"])]


def test_sqlite_transactions_in_a_row_reuse_the_connection_returned_last(tmp_path):
    """A SQLite connection drops its page cache whenever another connection committed: the pool must not
    rotate through its idle connections (FIFO) once a second one joined it (a thread's), or every
    transaction re-reads the pages it needs (issue 11)."""
    from mjsched_isolated.store.schema import connect

    engine = connect(f"sqlite:///{tmp_path / 'lifo.db'}")
    try:
        with engine.connect() as a, engine.connect() as b:  # two at once (the loop and a thread): both pooled
            a.exec_driver_sql("select 1")
            b.exec_driver_sql("select 1")
        used = []
        for _ in range(4):
            with engine.begin() as conn:
                conn.exec_driver_sql("select 1")
                used.append(id(conn.connection.dbapi_connection))
        assert len(set(used)) == 1
    finally:
        engine.dispose()
