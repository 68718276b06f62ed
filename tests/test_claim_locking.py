"""Batched claims on PostgreSQL and MySQL/MariaDB lock the job rows first (``SELECT ... FOR UPDATE SKIP
LOCKED``, db-scheduler's lock-and-fetch; issue 11): a supervisor does not queue behind a row another one is
claiming, a row it skipped is neither won nor lost, and concurrent claimers never run an occurrence twice.
Real servers, real connections, threads; SQLite (one writer) keeps its path. The batch of results
(``finish_runs``; on PostgreSQL one UPDATE for the batch) is checked on all three databases."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from conftest import FIXTURE_PLUGINS, Driver, add_job, isolated_database
from fakes import FakePool

from mjsched_isolated.store import Store
from mjsched_isolated.store import leases as leases_mod
from mjsched_isolated.store.leases import ClaimRequest, Outcome
from mjsched_isolated.store.schema import jobs

UTC = dt.UTC
NOW = dt.datetime(2030, 1, 1, tzinfo=UTC)
DEADLINE = NOW + dt.timedelta(minutes=5)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["postgresql", "mysql"])
def server_url(request, tmp_path):
    with isolated_database(request.param, tmp_path) as url:
        yield url


def _request(job: dict) -> ClaimRequest:
    return ClaimRequest(job=job, next_run_at=job["next_run_at"] + dt.timedelta(seconds=1), lease_s=600.0,
                        deadline_at=DEADLINE, scheduled_at=job["next_run_at"])


def _close(conn: sa.Connection | None, engine: sa.Engine | None) -> None:
    """A test's teardown: its locking connection and that connection's engine, those it made."""
    if conn is not None:
        conn.close()
    if engine is not None:
        engine.dispose()


@contextlib.contextmanager
def _driven(url: str, workers: int) -> Iterator[tuple[Store, Driver]]:
    """A store on ``url`` and a started :class:`Driver` on it with ``workers`` fake workers, both closed after."""
    store = Store.open(url)
    try:
        d = Driver(store, url, pool=FakePool(workers, FIXTURE_PLUGINS), max_concurrent_jobs=workers,
                   plugins_dir=FIXTURE_PLUGINS).start()
        try:
            yield store, d
        finally:
            d.close()
    finally:
        store.close()


def _lock_rows(url: str, ids: list[int]) -> tuple[sa.Engine, sa.Connection]:
    """Another transaction holding the job rows ``ids`` (as another supervisor's claim in flight does)."""
    engine = sa.create_engine(url)
    conn = engine.connect()
    conn.begin()
    for job_id in ids:  # one primary key at a time: MariaDB locks every row a scan reads
        assert conn.execute(sa.select(jobs.c.id).where(jobs.c.id == job_id).with_for_update()).scalar() == job_id
    return engine, conn


def test_batched_claim_skips_rows_locked_elsewhere_without_waiting(server_url):
    store = Store.open(server_url)
    other = Store.open(server_url)
    engine = conn = None
    try:
        store.register_supervisor("sup-a", "host", 1, 3600.0)
        rows = [add_job(store, f"j{i}", "ok", now=NOW, next_run_at=NOW) for i in range(4)]
        engine, conn = _lock_rows(server_url, [rows[0]["id"], rows[2]["id"]])
        other.db_now()  # connected
        busy: set[int] = set()
        result: list = []
        claimer = threading.Thread(target=lambda: result.append(other.claim_many(
            [_request(r) for r in rows], now=NOW, instance="sup-a", busy=busy)), daemon=True)
        claimer.start()
        claimer.join(timeout=15)
        # decided while the other transaction still holds its rows: it did not wait for them
        assert not claimer.is_alive(), "the batched claim waited for rows another transaction holds"
        claims = result[0]
        assert busy == {0, 2}
        assert claims[0] is None and claims[2] is None
        assert claims[1] is not None and claims[3] is not None
        conn.rollback()
        # the skipped rows were neither claimed nor moved: the next poll claims them
        for i in (0, 2):
            assert store.get_job(f"j{i}")["next_run_at"] == NOW
            assert store.list_runs(job_name=f"j{i}") == []
        assert store.get_job("j1")["next_run_at"] == NOW + dt.timedelta(seconds=1)
        again: set[int] = set()
        claims = store.claim_many([_request(rows[0]), _request(rows[2])], now=NOW, instance="sup-a", busy=again,
                                    not_before=NOW)
        assert again == set() and all(c is not None for c in claims)
        assert claims[0].started_at == NOW  # not before the caller's instant (2030: ahead of the database clock)
    finally:
        _close(conn, engine)
        store.close()
        other.close()


def test_a_claim_without_busy_waits_for_the_row_as_before(server_url):
    """Single claims (manual runs, the API) keep the blocking judgement: the row is waited for and judged
    after the other transaction ends (here: it moved the occurrence, so the claim loses)."""
    store = Store.open(server_url)
    try:
        store.register_supervisor("sup-a", "host", 1, 3600.0)
        job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
        engine, conn = _lock_rows(server_url, [job["id"]])
        result: list = []
        started = threading.Event()

        def claim() -> None:
            started.set()
            result.append(store.claim_many([_request(job)], now=NOW, instance="sup-a"))

        claimer = threading.Thread(target=claim, daemon=True)
        claimer.start()
        started.wait(10)
        claimer.join(timeout=0.3)
        assert claimer.is_alive()  # waiting for the row lock
        conn.execute(jobs.update().where(jobs.c.id == job["id"]).values(next_run_at=NOW + dt.timedelta(hours=1)))
        conn.commit()
        claimer.join(timeout=15)
        assert not claimer.is_alive()
        assert result == [[None]]
        conn.close()
        engine.dispose()
    finally:
        store.close()


@pytest.mark.parametrize(("server_url", "pooled"), [("postgresql", False), ("mysql", False), ("postgresql", True)],
                         ids=["postgresql-batch", "mysql-batch", "postgresql-pool"], indirect=["server_url"])
def test_concurrent_batched_claimers_never_claim_an_occurrence_twice(server_url, pooled):
    """Two supervisors' stores poll and claim the same 12 due jobs in batches, concurrently, 5 occurrences
    each (claim, then finish to free the lease): every occurrence runs exactly once. ``pool``: PostgreSQL's
    contended claim, 4 taken from all 12 candidates (``Store.claim_pool``)."""
    store = Store.open(server_url)
    jobs_n, occurrences = 12, 5
    try:
        for name in ("sup-a", "sup-b"):
            store.register_supervisor(name, "host", 1, 3600.0)
        for i in range(jobs_n):
            add_job(store, f"j{i}", "ok", now=NOW, next_run_at=NOW)
        end = NOW + dt.timedelta(seconds=occurrences)
        barrier = threading.Barrier(2, timeout=20)
        errors: list[BaseException] = []
        stats = {"sup-a": [0, 0], "sup-b": [0, 0]}  # won, busy

        def claimer(instance: str) -> None:
            own = Store.open(server_url)
            try:
                own.db_now()
                barrier.wait()
                while True:
                    due = [j for j in own.due_jobs(end - dt.timedelta(microseconds=1), limit=12 if pooled else 4)]
                    if not due:
                        return
                    busy: set[int] = set()
                    if pooled:
                        claims = own.claim_pool([_request(j) for j in due], 4, instance=instance)
                        assert sum(c is not None for c in claims) <= 4
                    else:
                        claims = own.claim_many([_request(j) for j in due], now=NOW, instance=instance, busy=busy)
                    stats[instance][0] += sum(c is not None for c in claims)
                    stats[instance][1] += len(busy)
                    own.finish_runs([Outcome(run_id=c.run_id, job_id=j["id"], token=c.lock_token, status="Completed",
                                             success=True, duration_ms=1.0)
                                     for c, j in zip(claims, due, strict=True) if c is not None])
            except BaseException as exc:
                errors.append(exc)
            finally:
                own.close()

        threads = [threading.Thread(target=claimer, args=(n,), daemon=True) for n in stats]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=45)
        assert not any(t.is_alive() for t in threads), "a claimer did not finish"
        assert errors == []
        runs = [r for i in range(jobs_n) for r in store.list_runs(job_name=f"j{i}", limit=100)]
        keys = [(r["job_id"], r["scheduled_at"]) for r in runs]
        assert len(keys) == len(set(keys)) == jobs_n * occurrences  # each occurrence once, none missing
        assert stats["sup-a"][0] + stats["sup-b"][0] == jobs_n * occurrences
        assert {r["status"] for r in runs} == {"Completed"}
    finally:
        store.close()


def test_supervisor_leaves_a_skip_job_whose_row_is_busy_due_not_skipped(server_url):
    """A Skip job whose row another transaction holds (say its result being recorded) is not counted
    skipped: the poll leaves it due, and the next poll runs it."""
    engine = conn = None
    with _driven(server_url, 2) as (store, d):
        try:
            at = d.timeline()
            real_now = store.db_now()
            job = add_job(store, "skipper", "ok", "0 0 1 1 *", now=real_now,
                          next_run_at=real_now - dt.timedelta(days=1), concurrency_mode="Skip",
                          missed_run_policy="RunOnce")
            engine, conn = _lock_rows(server_url, [job["id"]])
            assert d.supervisor.dispatcher.contended_until is None
            at(0.0)
            row = store.get_job("skipper")
            assert row["skipped_count"] == 0 and row["next_run_at"] == job["next_run_at"]
            assert d.supervisor.dispatcher.contended_until is not None  # its due reads now pass over held rows
            assert store.list_runs(job_name="skipper") == []
            conn.rollback()
            at(0.1)
            assert len(store.list_runs(job_name="skipper")) == 1
            assert store.get_job("skipper")["skipped_count"] == 0
        finally:
            _close(conn, engine)


def test_a_batch_of_results_is_judged_row_by_row_on_every_database(any_store):
    """``finish_runs`` of a batch (on PostgreSQL one UPDATE ... FROM unnest RETURNING): each result lands
    only on its Running run claimed with its token; the others write nothing; values as one by one."""
    store = any_store
    store.register_supervisor("sup-a", "host", 1, 3600.0)
    rows = [add_job(store, f"j{i}", "ok", now=NOW, next_run_at=NOW,
                    concurrency_mode="Concurrent" if i == 2 else "Skip") for i in range(5)]
    claims = store.claim_many([ClaimRequest(job=r, next_run_at=NOW + dt.timedelta(seconds=1), lease_s=600.0,
                                            deadline_at=DEADLINE, scheduled_at=NOW, take_lease=i != 2)
                               for i, r in enumerate(rows)], now=NOW, instance="sup-a")
    assert all(claims) and claims[2].lock_token is None
    ended = NOW + dt.timedelta(seconds=3, microseconds=250)
    assert store.finish_runs([Outcome(run_id=claims[4].run_id, job_id=rows[4]["id"], token=claims[4].lock_token,
                                      status="Completed", success=True)]) == [True]
    outcomes = [
        Outcome(run_id=claims[0].run_id, job_id=rows[0]["id"], token=claims[0].lock_token, status="Completed",
                success=True, details={"x": 1}, duration_ms=2.5, completed_at=ended, cpu_s=0.25, max_rss_mb=7.0),
        Outcome(run_id=claims[1].run_id, job_id=rows[1]["id"], token="not-its-token", status="Failed",
                success=False, error_message="boom"),
        Outcome(run_id=claims[2].run_id, job_id=rows[2]["id"], token=None, status="Failed", success=False,
                error_message="no lease"),
        Outcome(run_id=claims[3].run_id, job_id=rows[3]["id"], token=None, status="Failed", success=False),
        Outcome(run_id=claims[4].run_id, job_id=rows[4]["id"], token=claims[4].lock_token, status="Failed",
                success=False),  # already finished
    ]
    assert store.finish_runs(outcomes) == [True, False, True, False, False]
    by_job = {r["job_name"]: r for i in range(5) for r in store.list_runs(job_name=f"j{i}")}
    assert (by_job["j0"]["status"], by_job["j0"]["success"], by_job["j0"]["completed_at"]) == ("Completed", True, ended)
    assert by_job["j0"]["details"] == {"x": 1}
    assert (by_job["j0"]["duration_ms"], by_job["j0"]["cpu_s"], by_job["j0"]["max_rss_mb"]) == (2.5, 0.25, 7.0)
    assert by_job["j1"]["status"] == "Running" and by_job["j3"]["status"] == "Running"
    assert (by_job["j2"]["status"], by_job["j2"]["error_message"]) == ("Failed", "no lease")
    assert by_job["j2"]["completed_at"] is not None  # the database's now
    assert by_job["j4"]["status"] == "Completed"
    assert store.get_job("j0")["lock_token"] is None and store.get_job("j1")["lock_token"] == claims[1].lock_token
    assert store.get_job("j0")["success_count"] == 1 and store.get_job("j1")["run_count"] == 0
    j0, j2 = store.get_job("j0"), store.get_job("j2")  # the statistics, batched on PostgreSQL
    assert (j0["run_count"], j0["avg_duration_ms"], j0["last_duration_ms"], j0["last_run_at"]) == (1, 2.5, 2.5, ended)
    assert (j0["failure_count"], j0["consecutive_failures"]) == (0, 0)
    assert (j2["run_count"], j2["success_count"], j2["failure_count"], j2["consecutive_failures"]) == (1, 0, 1, 1)
    assert j2["avg_duration_ms"] is None and j2["last_run_at"] is not None
    # a second batch: the running average and the failures in a row move on from the stored values
    second = NOW + dt.timedelta(seconds=1)
    again = store.claim_many([ClaimRequest(job=store.get_job(n), next_run_at=second + dt.timedelta(seconds=1),
                                           lease_s=600.0, deadline_at=DEADLINE, scheduled_at=second,
                                           take_lease=n != "j2") for n in ("j0", "j2")], now=NOW, instance="sup-a")
    assert store.finish_runs([
        Outcome(run_id=again[0].run_id, job_id=rows[0]["id"], token=again[0].lock_token, status="Failed",
                success=False, duration_ms=4.5),
        Outcome(run_id=again[1].run_id, job_id=rows[2]["id"], token=None, status="Failed", success=False,
                duration_ms=1.0)]) == [True, True]
    j0, j2 = store.get_job("j0"), store.get_job("j2")
    assert (j0["run_count"], j0["avg_duration_ms"], j0["last_duration_ms"], j0["failure_count"]) == (2, 3.5, 4.5, 1)
    assert j0["consecutive_failures"] == 1 and j0["lock_token"] is None
    assert (j2["run_count"], j2["avg_duration_ms"], j2["failure_count"], j2["consecutive_failures"]) == (2, 1.0, 2, 2)


def test_a_holder_that_renews_between_the_locking_read_and_the_update_keeps_its_lease(tmp_path, monkeypatch):
    """PostgreSQL's claim transaction (claims that are not plain; a plain batch is one statement, judged and
    written on one snapshot, with no moment in between) judges the leases in the locking read; the holder's
    ``supervisors`` row is not locked, so a holder judged dead may renew before the UPDATE. The UPDATE's own
    row count catches it: the batch is judged again row by row and the claim loses (the renewal is injected
    at that very moment, on a connection of its own)."""
    monkeypatch.setattr(leases_mod, "_plain_claims", lambda requests: False)
    with isolated_database("postgresql", tmp_path) as url:
        store = Store.open(url)
        other = sa.create_engine(url)
        try:
            store.register_supervisor("old", "host", 1, 3600.0)
            store.register_supervisor("new", "host", 2, 3600.0)
            job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
            held = store.claim_many([_request(job)], now=NOW, instance="old")[0]
            assert held is not None
            with other.begin() as conn:  # the holder looks dead now
                conn.exec_driver_sql("UPDATE supervisors SET lease_expires_at = lease_expires_at - interval '2 hours' "
                                     "WHERE instance = 'old'")
            renewed: list[str] = []

            def renew_first(_conn, _cursor, statement, _params, _context, _many) -> None:
                if statement.startswith("UPDATE jobs") and not renewed:
                    renewed.append(statement)
                    with other.begin() as conn:
                        conn.exec_driver_sql("UPDATE supervisors SET lease_expires_at = lease_expires_at "
                                             "+ interval '4 hours' WHERE instance = 'old'")

            sa.event.listen(store.engine, "before_cursor_execute", renew_first)
            busy: set[int] = set()
            claims = store.claim_many([_request(store.get_job("j"))], now=NOW, instance="new", busy=busy)
            sa.event.remove(store.engine, "before_cursor_execute", renew_first)
            assert renewed  # the renewal happened between the locking read and the UPDATE
            assert claims == [None] and busy == set()
            row = store.get_job("j")
            assert (row["locked_by_instance"], row["lock_token"]) == ("old", held.lock_token)
            assert len(store.list_runs(job_name="j")) == 1
        finally:
            other.dispose()
            store.close()


def test_the_poll_passes_over_jobs_a_peer_is_claiming_on_postgresql(tmp_path):
    """PostgreSQL's due read with ``skip_locked`` (the dispatcher's while it meets contention) skips job
    rows another transaction holds (a peer's claim in flight), so a second supervisor polling at the same
    moment gets the next due jobs, not the same ones."""
    with isolated_database("postgresql", tmp_path) as url:
        store = Store.open(url)
        engine = conn = None
        try:
            for i in range(4):
                add_job(store, f"j{i}", "ok", now=NOW, next_run_at=NOW + dt.timedelta(seconds=i))
            assert [j["name"] for j in store.due_jobs(NOW + dt.timedelta(seconds=9), 2)] == ["j0", "j1"]
            engine, conn = _lock_rows(url, [store.get_job("j0")["id"], store.get_job("j1")["id"]])
            later = NOW + dt.timedelta(seconds=9)
            assert [j["name"] for j in store.due_jobs(later, 2, skip_locked=True)] == ["j2", "j3"]
            assert [j["name"] for j in store.due_jobs(later, 2)] == ["j0", "j1"]  # the plain read (one supervisor)
            conn.rollback()
            assert [j["name"] for j in store.due_jobs(later, 2, skip_locked=True)] == ["j0", "j1"]
        finally:
            _close(conn, engine)
            store.close()


def test_two_runs_of_one_concurrent_job_in_a_batch_both_count(any_store):
    """Two results of the same (Concurrent) job recorded together both count (PostgreSQL's one-statement
    statistics join each job once, so such a batch keeps one UPDATE per run)."""
    store = any_store
    store.register_supervisor("sup-a", "host", 1, 3600.0)
    job = add_job(store, "c", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    first = store.claim_many([ClaimRequest(
        job=job, next_run_at=NOW + dt.timedelta(seconds=1), lease_s=600.0, deadline_at=DEADLINE, scheduled_at=NOW,
        take_lease=False)], now=NOW, instance="sup-a")[0]
    job = store.get_job("c")
    second = store.claim_many([ClaimRequest(
        job=job, next_run_at=NOW + dt.timedelta(seconds=2), lease_s=600.0, deadline_at=DEADLINE,
        scheduled_at=job["next_run_at"], take_lease=False)], now=NOW, instance="sup-a")[0]
    assert first is not None and second is not None
    assert store.finish_runs([
        Outcome(run_id=first.run_id, job_id=job["id"], token=None, status="Completed", success=True, duration_ms=2.0),
        Outcome(run_id=second.run_id, job_id=job["id"], token=None, status="Failed", success=False,
                duration_ms=4.0)]) == [True, True]
    row = store.get_job("c")
    assert (row["run_count"], row["success_count"], row["failure_count"], row["avg_duration_ms"]) == (2, 1, 1, 3.0)


def test_a_contended_poll_on_postgresql_takes_the_next_due_job_when_a_peer_holds_the_first(tmp_path):
    """While contended (peers polling the same due rows), a PostgreSQL poll claims its free slots from more
    candidates than slots in one statement (``Store.claim_pool``): the first due job's row held by a peer
    makes way for the next one, instead of a lost claim and an idle worker; the held one stays due."""
    engine = conn = None
    with isolated_database("postgresql", tmp_path) as url, _driven(url, 1) as (store, d):
        try:
            at = d.timeline()
            real_now = store.db_now()
            first, second = (add_job(store, name, "ok", "0 0 1 1 *", now=real_now,
                                     next_run_at=real_now - dt.timedelta(seconds=s), concurrency_mode="Skip")
                             for name, s in (("first", 20), ("second", 10)))
            engine = sa.create_engine(url)
            conn = engine.connect()  # as a result being written holds it (a due read's key-share lock passes)
            conn.execute(sa.select(jobs.c.id).where(jobs.c.id == first["id"]).with_for_update(key_share=True))
            d.supervisor.dispatcher.contended_until = real_now + dt.timedelta(hours=1)
            at(0.0)
            assert store.list_runs(job_name="first") == []
            assert [r["scheduled_at"] for r in store.list_runs(job_name="second")] == [second["next_run_at"]]
            row = store.get_job("first")
            assert row["skipped_count"] == 0 and row["next_run_at"] == first["next_run_at"]  # still due
        finally:
            _close(conn, engine)


def test_a_contended_poll_on_postgresql_still_skips_a_skip_job_whose_run_is_live(tmp_path):
    """Only plain candidates go to the pooled claim: a Skip job whose lease a live peer holds (as read) is
    claimed as before, loses, and its occurrence is skipped; a plain one beside it runs."""
    with isolated_database("postgresql", tmp_path) as url, _driven(url, 2) as (store, d):
        at = d.timeline()
        real_now = store.db_now()
        store.register_supervisor("peer", "host", 1, 3600.0)
        held, free = (add_job(store, name, "ok", "0 0 1 1 *", now=real_now,
                              next_run_at=real_now - dt.timedelta(seconds=s), concurrency_mode="Skip")
                      for name, s in (("held", 20), ("free", 10)))
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET lock_token = 'peer-token', locked_by_instance = 'peer', "
                                 "locked_at = now(), expected_completion_at = now() + interval '1 hour' "
                                 "WHERE id = :i"), {"i": held["id"]})
        d.supervisor.dispatcher.contended_until = real_now + dt.timedelta(hours=1)
        at(0.0)
        row = store.get_job("held")
        assert store.list_runs(job_name="held") == [] and row["skipped_count"] == 1
        assert row["next_run_at"] > held["next_run_at"]
        assert [r["scheduled_at"] for r in store.list_runs(job_name="free")] == [free["next_run_at"]]
