"""PostgreSQL's one-statement batches (issue 11): a plain batch of results, and of claims, is written by ONE
statement in autocommit, with the same rows as the transaction each replaces (the path every other case
and every other database takes). Real PostgreSQL, a schema of its own per test."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from conftest import isolated_database

from mjsched_isolated.store import Store
from mjsched_isolated.store import leases as leases_mod
from mjsched_isolated.store.leases import ClaimRequest, Outcome

UTC = dt.UTC
NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
RUN_COLUMNS = ("status", "success", "error_message", "details", "duration_ms", "cpu_s", "max_rss_mb",
               "executed_by_instance", "scheduled_at", "attempt", "missed_count")
JOB_COLUMNS = ("run_count", "success_count", "failure_count", "consecutive_failures", "last_duration_ms",
               "avg_duration_ms", "lock_token", "locked_by_instance", "next_run_at", "missed_count", "skipped_count")


@pytest.fixture
def pg_store(tmp_path):
    with isolated_database("postgresql", tmp_path) as url:
        s = Store.open(url)
        s.register_supervisor("sup", "host", 1, 600)
        yield s
        s.close()


class Statements:
    """Statements sent on ``store``'s engine, and transactions begun, while counting."""

    def __init__(self, store: Store) -> None:
        self.sent: list[str] = []
        self.begun = 0
        sa.event.listen(store.engine, "before_cursor_execute", lambda *a: self.sent.append(a[2]))
        sa.event.listen(store.engine, "begin", self._begin)

    def _begin(self, conn) -> None:
        if conn.get_isolation_level() != "AUTOCOMMIT":
            self.begun += 1


def _jobs(store: Store, prefix: str, n: int) -> list[dict]:
    for i in range(n):
        store.add_job({"name": f"{prefix}{i}", "job_type": "ok", "cron_expression": "* * * * *", "status": "Active",
                       "next_run_at": NOW, "concurrency_mode": "Concurrent" if i == 3 else "Skip"}, NOW)
        if i == 1:  # history, so the averages and the failure streak have something to start from
            with store.engine.begin() as conn:
                conn.execute(sa.text("UPDATE jobs SET run_count = 2, avg_duration_ms = 10, consecutive_failures = 1 "
                                     "WHERE name = :n"), {"n": f"{prefix}{i}"})
    return [store.get_job(f"{prefix}{i}") for i in range(n)]


def _requests(jobs: list[dict]) -> list[ClaimRequest]:
    return [ClaimRequest(job, NOW + dt.timedelta(minutes=1), 300.0, NOW + dt.timedelta(minutes=5),
                         take_lease=job["concurrency_mode"] != "Concurrent", scheduled_at=NOW, missed=i % 2,
                         skipped=i % 3) for i, job in enumerate(jobs)]


def _outcomes(store: Store, prefix: str, n: int) -> list[Outcome]:
    jobs = _jobs(store, prefix, n)
    claims = store.claim_many(_requests(jobs), now=NOW, instance="sup")
    assert all(c is not None for c in claims)
    shapes = [dict(success=True, duration_ms=12.5, cpu_s=0.01, max_rss_mb=20.0, details={"k": [1, "é"]}),
              dict(success=False, duration_ms=30.0, error_message="boom\nsecond line"),
              dict(success=True, duration_ms=None, completed_at=None),
              dict(success=True, duration_ms=4.0),  # the run without a lease
              dict(success=None, duration_ms=1.0, status="Timeout", error_message="deadline")]
    out = []
    for i, (job, claim) in enumerate(zip(jobs, claims, strict=True)):
        shape = {"status": "Completed" if shapes[i]["success"] is not False else "Failed",
                 "completed_at": NOW + dt.timedelta(seconds=i), **shapes[i]}
        out.append(Outcome(claim.run_id, job["id"], claim.lock_token, **shape))
    return out


def _rows(store: Store, outcomes: list[Outcome]) -> list[tuple]:
    rows = []
    for o in outcomes:
        run = store.get_run(o.run_id)
        job = store.get_job_by_id(o.job_id)
        rows.append((tuple(run[c] for c in RUN_COLUMNS), run["completed_at"] is not None, run["lock_token"] is None,
                     tuple(job[c] for c in JOB_COLUMNS), job["last_run_at"] is not None))
    return rows


def test_a_plain_batch_of_results_is_one_statement_with_the_rows_of_the_transaction(pg_store, monkeypatch):
    plain, other = _outcomes(pg_store, "a", 5), _outcomes(pg_store, "b", 5)
    # one result already written: in both batches it is judged again and not written twice
    assert pg_store.finish_runs([plain[4]]) == [True]
    with monkeypatch.context() as m:
        m.setattr(leases_mod, "_plain", lambda outcomes: False)
        assert pg_store.finish_runs([other[4]]) == [True]
    counted = Statements(pg_store)
    assert pg_store.finish_runs(plain) == [True, True, True, True, False]
    assert len(counted.sent) == 1 and counted.begun == 0  # one statement, no transaction round trips
    with monkeypatch.context() as m:
        m.setattr(leases_mod, "_plain", lambda outcomes: False)
        assert pg_store.finish_runs(other) == [True, True, True, True, False]
    assert _rows(pg_store, plain) == _rows(pg_store, other)
    job = pg_store.get_job("a1")
    assert (job["run_count"], job["failure_count"], job["consecutive_failures"], job["avg_duration_ms"]) == (
        3, 1, 2, pytest.approx(50 / 3))
    assert pg_store.get_job("a0")["lock_token"] is None and pg_store.get_run(plain[0].run_id)["details"] == {
        "k": [1, "é"]}


def test_results_that_are_not_plain_take_the_transaction(pg_store):
    outcomes = _outcomes(pg_store, "a", 2)
    outcomes[1].notices = [{"channel": "log", "event": "Failure", "job_id": outcomes[1].job_id, "job_name": "a1",
                            "run_id": outcomes[1].run_id, "subject": "s", "body": "b", "priority": "Normal",
                            "recipients": None, "details": None}]
    counted = Statements(pg_store)
    assert pg_store.finish_runs(outcomes) == [True, True]
    assert counted.begun == 1 and len(counted.sent) > 1
    assert pg_store.get_job("a1")["failure_count"] == 1


def test_a_plain_batch_the_database_refuses_writes_nothing_and_is_judged_permanent(pg_store):
    from mjsched_isolated.store import is_permanent_error
    outcomes = _outcomes(pg_store, "a", 2)
    outcomes[1].error_message = "refused\x00text"  # PostgreSQL stores no NUL in text
    with pytest.raises(sa.exc.DBAPIError) as refused:
        pg_store.finish_runs(outcomes)
    assert is_permanent_error(refused.value)
    assert [pg_store.get_run(o.run_id)["status"] for o in outcomes] == ["Running", "Running"]
    assert pg_store.get_job("a0")["run_count"] == 0 and pg_store.get_job("a0")["lock_token"] is not None


def _claim_batch(store: Store, prefix: str) -> list[ClaimRequest]:
    jobs: list = [*_jobs(store, prefix, 3), None]
    store.add_job({"name": f"{prefix}3", "job_type": "ok", "cron_expression": "* * * * *", "status": "Active",
                   "next_run_at": NOW}, NOW)
    with store.engine.begin() as conn:  # 1: held by a live supervisor; 3: held by one never registered
        conn.execute(sa.text("UPDATE jobs SET lock_token = 'held', locked_by_instance = :who, locked_at = now(), "
                             "expected_completion_at = now() + interval '1 hour' WHERE name = :n"),
                     [{"who": "sup", "n": f"{prefix}1"}, {"who": "ghost", "n": f"{prefix}3"}])
    jobs[3] = store.get_job(f"{prefix}3")
    jobs[1] = store.get_job(f"{prefix}1")
    jobs[2] = {**jobs[2], "next_run_at": NOW - dt.timedelta(minutes=1)}  # 2: the occurrence seen has moved on
    return [ClaimRequest(job, NOW + dt.timedelta(minutes=1), 300.0, NOW + dt.timedelta(minutes=5), scheduled_at=NOW,
                         missed=i % 2, skipped=1) for i, job in enumerate(jobs)]


def _claimed_rows(store: Store, prefix: str) -> list[tuple]:
    out = []
    for i in range(4):
        job = store.get_job(f"{prefix}{i}")
        job_runs = store.list_runs(job_name=f"{prefix}{i}")
        out.append((tuple(job[c] for c in JOB_COLUMNS if c != "lock_token"), job["lock_token"] is None,
                    [tuple(r[c] for c in RUN_COLUMNS) for r in job_runs]))
    return out


def test_a_plain_batch_of_claims_is_one_statement_with_the_rows_of_the_transaction(pg_store, monkeypatch):
    plain, other = _claim_batch(pg_store, "a"), _claim_batch(pg_store, "b")
    counted = Statements(pg_store)
    busy: set[int] = set()
    won = pg_store.claim_many(plain, now=NOW, instance="sup", not_before=NOW, busy=busy)
    assert len(counted.sent) == 1 and counted.begun == 0  # one statement, no transaction round trips
    # the occurrence that moved on since it was read: a peer's claim just committed, so contention (busy),
    # which the transaction only sees while the peer holds the row
    assert busy == {2}
    busy_too: set[int] = set()
    with monkeypatch.context() as m:
        m.setattr(leases_mod, "_plain_claims", lambda requests: False)
        won_too = pg_store.claim_many(other, now=NOW, instance="sup", not_before=NOW, busy=busy_too)
    assert busy_too == set()
    assert [c is not None for c in won] == [c is not None for c in won_too] == [True, False, False, True]
    assert _claimed_rows(pg_store, "a") == _claimed_rows(pg_store, "b")
    job = pg_store.get_job("a3")
    assert (job["lock_token"], job["locked_by_instance"]) == (won[3].lock_token, "sup")
    assert won[0].started_at >= NOW and pg_store.get_run(won[0].run_id)["started_at"] == won[0].started_at
    # the same occurrence again: lost, nothing written (the occurrence moved on)
    assert pg_store.claim_many([plain[0]], now=NOW, instance="sup") == [None]
    assert len(pg_store.list_runs(job_name="a0")) == 1


@pytest.mark.parametrize("path", ["plain", "transaction"])
def test_results_lock_their_job_rows_in_id_order_as_claims_do(pg_store, monkeypatch, path):
    """A peer holds job row 1 and then wants row 2 (id order, as claims lock): a result batch for jobs 2
    and 1 (in that order) waits for row 1 without holding row 2, so the peer gets row 2 and nobody deadlocks."""
    import threading

    from waiting import wait_until
    if path == "transaction":
        monkeypatch.setattr(leases_mod, "_plain", lambda outcomes: False)
    outcomes = _outcomes(pg_store, "a", 3)[1:3]  # jobs a1 and a2
    first, second = sorted(o.job_id for o in outcomes)
    with pg_store.engine.begin() as conn:  # row 1's live version now lies after row 2's: a scan meets 2 first
        conn.execute(sa.text("UPDATE jobs SET description = 'moved' WHERE id = :i"), {"i": first})
    peer = sa.create_engine(pg_store.engine.url)
    try:
        with peer.connect() as conn:
            conn.execute(sa.text("SELECT id FROM jobs WHERE id = :i FOR UPDATE"), {"i": first})
            xid = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
            result: list = []
            writer = threading.Thread(target=lambda: result.append(pg_store.finish_runs(outcomes[::-1])), daemon=True)
            writer.start()

            def waiting() -> bool:
                with peer.connect() as look:
                    return bool(look.execute(sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted AND "
                                                     "transactionid::text::bigint = :x"), {"x": xid}).scalar_one())

            wait_until(waiting, 10, "the result batch waiting for row 1", interval_s=0.01)
            conn.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
            conn.execute(sa.text("SELECT id FROM jobs WHERE id = :i FOR UPDATE"), {"i": second})  # not held by it
            conn.commit()
        writer.join(10)
        assert result == [[True, True]]
    finally:
        peer.dispose()


def test_a_pooled_claim_takes_the_first_candidates_a_peer_does_not_hold_in_one_statement(pg_store, monkeypatch):
    """A contended poll's candidates (``Store.claim_pool``): the first ``limit`` whose row is free to lock and
    whose occurrence and lease still hold are claimed, with the rows the transaction writes; a held lease, a
    moved occurrence or a row a peer has locked makes way for the next candidate."""
    pooled, other = _claim_batch(pg_store, "a"), _claim_batch(pg_store, "b")
    with monkeypatch.context() as m:
        m.setattr(leases_mod, "_plain_claims", lambda requests: False)
        assert [c is not None for c in pg_store.claim_many(other, now=NOW, instance="sup", not_before=NOW)] == [
            True, False, False, True]
    # a1 (lease live) and a2 (moved on) make way: a3 is claimed as the second
    counted = Statements(pg_store)
    won = pg_store.claim_pool(pooled, 2, instance="sup", not_before=NOW)
    assert len(counted.sent) == 1 and counted.begun == 0
    assert [c is not None for c in won] == [True, False, False, True]
    assert _claimed_rows(pg_store, "a") == _claimed_rows(pg_store, "b")
    assert won[0].started_at >= NOW and pg_store.get_run(won[0].run_id)["lock_token"] == won[0].lock_token
    # taken once only: the same candidates again find nothing to claim
    assert pg_store.claim_pool(pooled, 4, instance="sup", not_before=NOW) == [None] * 4

    fresh = _jobs(pg_store, "c", 3)
    requests = [ClaimRequest(job, NOW + dt.timedelta(minutes=1), 300.0, NOW + dt.timedelta(minutes=5),
                             scheduled_at=NOW) for job in fresh]
    peer = sa.create_engine(pg_store.engine.url)
    try:
        with peer.connect() as conn:  # a peer's claim holds c0: not waited for, c1 taken instead; c2 not needed
            conn.execute(sa.text("SELECT id FROM jobs WHERE id = :i FOR UPDATE"), {"i": fresh[0]["id"]})
            assert [c is not None for c in pg_store.claim_pool(requests, 1, instance="sup")] == [False, True, False]
            conn.rollback()
    finally:
        peer.dispose()
    assert [c is not None for c in pg_store.claim_pool(requests, 5, instance="sup")] == [True, False, True]
    assert [len(pg_store.list_runs(job_name=f"c{i}")) for i in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="plain"):  # a retry, a status change...: not a candidate
        pg_store.claim_pool([ClaimRequest(fresh[0], None, 1.0, NOW, scheduled_at=NOW, status="Expired")], 1,
                            instance="sup")


def _plan(store: Store, prepared, params: dict) -> tuple[set[str], set[str]]:
    """(tables scanned sequentially, indexes used) in the plan PostgreSQL chooses for ``prepared``."""
    seq: set[str] = set()
    indexes: set[str] = set()

    def walk(node: dict) -> None:
        if node["Node Type"] == "Seq Scan":
            seq.add(node["Relation Name"])
        if "Index Name" in node:
            indexes.add(node["Index Name"])
        for child in node.get("Plans", ()):
            walk(child)

    with store.engine.connect() as conn:
        cursor = conn.connection.cursor()
        cursor.execute("EXPLAIN (FORMAT JSON) " + prepared.sql, prepared._bind(params))
        walk(cursor.fetchone()[0][0]["Plan"])
    return seq, indexes


def test_the_one_statement_batches_reach_their_rows_by_key_not_by_a_scan_of_the_table(pg_store):
    """Issue 11, a deep backlog on PostgreSQL: the requests' rows (``json_to_recordset``, which the planner
    takes for 100 rows whatever they are) must reach jobs and runs by primary key. Joined on them alone, the
    planner scanned the whole jobs table twice per claim (its cost grew with the number of jobs: 3,000 jobs
    due every second ran at half the rate of 1,000), and a result went through every Running entry of
    ``ix_runs_status`` not yet vacuumed."""
    template = _jobs(pg_store, "t", 1)[0]
    columns = [c["name"] for c in sa.inspect(pg_store.engine).get_columns("jobs") if c["name"] not in ("id", "name")]
    with pg_store.engine.begin() as conn:  # thousands of jobs and finished runs, with fresh statistics
        cols = ", ".join(columns)
        conn.execute(sa.text(f"INSERT INTO jobs (name, {cols}) SELECT 'bulk' || g, {cols} FROM jobs, "
                             "generate_series(1, 3000) AS g WHERE jobs.id = :t"), {"t": template["id"]})
        conn.execute(sa.text("INSERT INTO runs (job_id, scheduled_at, started_at, status, executed_by_instance, "
                             "attempt, missed_count) SELECT id, :at, :at, 'Completed', 'sup', 1, 0 FROM jobs"),
                     {"at": NOW.replace(tzinfo=None)})
        conn.execute(sa.text("ANALYZE jobs"))
        conn.execute(sa.text("ANALYZE runs"))
    jobs = _jobs(pg_store, "a", 5)
    requests = [ClaimRequest(job, NOW + dt.timedelta(minutes=1), 300.0, NOW + dt.timedelta(minutes=5),
                             scheduled_at=NOW) for job in jobs]
    payload = leases_mod._claim_payload(requests, [f"t{i}" for i in range(len(requests))])
    leases = pg_store.leases
    claim = {"p_payload": payload, "p_instance": "sup", "p_not_before": NOW}
    for prepared, params in ((leases._claim_plain_pg, claim), (leases._claim_plain_skip_pg, claim),
                             (leases._claim_pool_pg, {**claim, "p_limit": 3})):
        assert _plan(pg_store, prepared, params) == (set(), {"jobs_pkey", "supervisors_pkey"})
    outcomes = [o for o in _outcomes(pg_store, "b", 4) if o.token is not None]
    assert _plan(pg_store, leases._finish_plain_pg, {"p_payload": leases_mod._finish_payload(outcomes)}) == (
        set(), {"jobs_pkey", "runs_pkey"})


def _bulk_jobs(store: Store, n: int, next_run_at_sql: str) -> None:
    """``n`` more Active jobs like a template, ``next_run_at`` from ``next_run_at_sql`` (``g``: 1..n), analyzed."""
    template = _jobs(store, "t", 1)[0]
    columns = [c["name"] for c in sa.inspect(store.engine).get_columns("jobs")
               if c["name"] not in ("id", "name", "next_run_at")]
    cols = ", ".join(columns)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO jobs (name, next_run_at, {cols}) SELECT 'bulk' || g, {next_run_at_sql}, "
                             f"{cols} FROM jobs, generate_series(1, {n}) AS g WHERE jobs.id = :t"),
                     {"t": template["id"], "at": NOW.replace(tzinfo=None)})
        conn.execute(sa.text("ANALYZE jobs"))


def test_the_due_read_sorts_the_first_due_rows_not_the_whole_backlog(pg_store):
    """Issue 11, a deep backlog on PostgreSQL: with 3,000 jobs overdue at 3,000 instants, a poll for 10 reads
    the rows due by the 10th earliest instant (an ordered index walk), not every overdue row to sort them."""
    # statistics taken while none was due (as after `jobs sync`): the planner expects no due row at all
    _bulk_jobs(pg_store, 3000, "CAST(:at AS timestamp) + make_interval(secs => g)")
    with pg_store.engine.begin() as conn:  # then all of them fall due, one second apart
        conn.execute(sa.text("UPDATE jobs SET next_run_at = next_run_at - make_interval(secs => 2 * "
                             "CAST(substr(name, 5) AS integer)) WHERE name LIKE 'bulk%'"))
    due = pg_store.due_jobs(NOW, 10)
    assert [j["name"] for j in due] == [f"bulk{g}" for g in range(3000, 2990, -1)]
    prepared = pg_store.jobs._due_prepared
    with pg_store.engine.connect() as conn:
        cursor = conn.connection.cursor()
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + prepared.sql, prepared._bind({"p_now": NOW, "p_limit": 10}))
        plan = cursor.fetchone()[0][0]["Plan"]

    def rows_read(node: dict) -> int:
        own = node["Actual Rows"] * node["Actual Loops"] if node.get("Relation Name") == "jobs" else 0
        return own + sum(rows_read(child) for child in node.get("Plans", ()))

    assert rows_read(plan) <= 40, plan
