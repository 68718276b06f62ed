"""Store: the lease protocol, statistics, orphan recovery, due-job queries and schema, on real SQLite files."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import sqlalchemy as sa

from conftest import add_job
from mjsched_isolated import planner
from mjsched_isolated.errors import InputError, NotFoundError
from mjsched_isolated.schema import jobs, runs
from mjsched_isolated.store import Claim, Store

UTC = dt.timezone.utc
NOW = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
LONG = 600.0  # a lease that cannot expire during a test
LEASE_COLUMNS = ("lock_token", "locked_at", "locked_by_instance", "expected_completion_at")


def _claim(store: Store, job: dict, *, instance: str = "host-a:1", lease_s: float = LONG, take_lease: bool = True,
           next_run_at: dt.datetime | None = None, now: dt.datetime = NOW) -> Claim | None:
    """Claim ``job``'s occurrence, moving next_run_at one hour past it (or to ``next_run_at``)."""
    seen = job["next_run_at"]
    if next_run_at is None:
        next_run_at = (seen or now) + dt.timedelta(hours=1)
    return store.claim(job, now=now, next_run_at=next_run_at, instance=instance, lease_s=lease_s,
                       deadline_at=now + dt.timedelta(minutes=5), take_lease=take_lease, scheduled_at=seen)


def _finish(store: Store, claim: Claim, job_id: int, *, success: bool = True, duration_ms: float | None = 10.0,
            now: dt.datetime = NOW, status: str | None = None, token: str | None = "from-claim") -> bool:
    return store.finish_run(
        claim.run_id, job_id, claim.lock_token if token == "from-claim" else token,
        status=status or ("Completed" if success else "Failed"), success=success,
        error_message=None if success else "went wrong", details={"k": 1}, duration_ms=duration_ms, now=now)


def _wait_lease_expired(store: Store, job_name: str, timeout_s: float = 5.0) -> None:
    """Poll the database clock until it is past the job's expected_completion_at (bounded)."""
    expires = store.get_job(job_name)["expected_completion_at"]
    assert expires is not None
    give_up = time.monotonic() + timeout_s
    while store.db_now() <= expires:
        if time.monotonic() > give_up:
            pytest.fail(f"lease did not expire by the database clock within {timeout_s} s")


# -- claim ---------------------------------------------------------------------------------------------


def test_claim_takes_lease_and_inserts_running_run(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    before = store.db_now()
    claim = _claim(store, job, instance="host-a:42", lease_s=30)
    assert claim is not None and claim.lock_token
    row = store.get_job("j")
    assert row["lock_token"] == claim.lock_token
    assert row["locked_by_instance"] == "host-a:42"
    assert row["next_run_at"] == NOW + dt.timedelta(hours=1)
    # the lease is measured on the database clock: locked_at ~ db now, expiry ~ db now + 30 s
    assert row["locked_at"] >= before - dt.timedelta(seconds=1)
    assert dt.timedelta(seconds=29) <= row["expected_completion_at"] - row["locked_at"] <= dt.timedelta(seconds=31)
    run = store.get_run(claim.run_id)
    assert run["status"] == "Running"
    assert run["lock_token"] == claim.lock_token
    assert run["executed_by_instance"] == "host-a:42"
    assert run["scheduled_at"] == NOW
    assert run["job_name"] == "j"


def test_claim_wins_once_per_occurrence(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, job)
    assert first is not None
    assert store.release(job["id"], first.lock_token)  # the lease is free again: only the CAS can refuse
    assert _claim(store, job) is None  # same seen next_run_at -> already claimed
    assert len(store.list_runs(job_name="j")) == 1
    assert store.get_job("j")["lock_token"] is None


def test_claim_without_lease_is_still_once_per_occurrence(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    first = _claim(store, job, take_lease=False)
    assert first is not None and first.lock_token is None
    assert _claim(store, job, take_lease=False) is None
    assert store.get_job("j")["lock_token"] is None
    # a later occurrence can be claimed although the first run is still Running (no lease involved)
    second = _claim(store, store.get_job("j"), take_lease=False)
    assert second is not None
    assert len(store.running_runs()) == 2


def test_claim_refused_while_live_lease_is_held(store):
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, store.get_job("j"), instance="a", lease_s=LONG)
    assert first is not None
    fresh = store.get_job("j")  # new occurrence, but the lease is live
    assert _claim(store, fresh, instance="b") is None
    after = store.get_job("j")
    assert after["lock_token"] == first.lock_token
    assert after["locked_by_instance"] == "a"
    assert after["next_run_at"] == fresh["next_run_at"]  # the refused claim wrote nothing
    assert len(store.list_runs(job_name="j")) == 1


def test_claim_allowed_once_lease_expired_by_database_clock(store):
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, store.get_job("j"), instance="a", lease_s=0.05)
    assert first is not None
    _wait_lease_expired(store, "j")
    second = _claim(store, store.get_job("j"), instance="b", lease_s=LONG)
    assert second is not None
    assert second.lock_token != first.lock_token
    row = store.get_job("j")
    assert row["lock_token"] == second.lock_token
    assert row["locked_by_instance"] == "b"


def test_each_claim_gets_a_fresh_random_token(store):
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    tokens = []
    for _ in range(5):
        claim = _claim(store, store.get_job("j"))
        assert claim is not None
        tokens.append(claim.lock_token)
        assert store.release(store.get_job("j")["id"], claim.lock_token)
    assert len(set(tokens)) == 5
    for token in tokens:
        assert len(token) <= 36  # fits the lock_token column
        int(token, 16)  # hex


# -- release / extend ----------------------------------------------------------------------------------


def test_release_refuses_wrong_token_and_is_idempotent(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.release(job["id"], "not-the-token") is False
    held = store.get_job("j")
    assert held["lock_token"] == claim.lock_token and held["expected_completion_at"] is not None
    assert store.release(job["id"], claim.lock_token) is True
    freed = store.get_job("j")
    assert all(freed[c] is None for c in LEASE_COLUMNS)
    assert store.release(job["id"], claim.lock_token) is False  # second call: nothing to release


def test_extend_refuses_wrong_token_and_writes_nothing(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=5)
    before_job = store.get_job("j")
    before_run = store.get_run(claim.run_id)
    later = NOW + dt.timedelta(hours=2)
    assert store.extend(job["id"], "not-the-token", LONG, claim.run_id, later) is False
    assert store.get_job("j")["expected_completion_at"] == before_job["expected_completion_at"]
    assert store.get_run(claim.run_id)["deadline_at"] == before_run["deadline_at"]


def test_extend_with_right_token_moves_lease_and_deadline(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=5)
    before = store.get_job("j")["expected_completion_at"]
    later = NOW + dt.timedelta(hours=2)
    assert store.extend(job["id"], claim.lock_token, LONG, claim.run_id, later) is True
    after = store.get_job("j")
    assert after["expected_completion_at"] >= before + dt.timedelta(seconds=LONG - 10)
    assert after["lock_token"] == claim.lock_token
    assert store.get_run(claim.run_id)["deadline_at"] == later


def test_extend_without_token_moves_only_the_deadline(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    claim = _claim(store, job, take_lease=False)
    later = NOW + dt.timedelta(hours=3)
    assert store.extend(job["id"], None, LONG, claim.run_id, later) is True
    assert store.get_run(claim.run_id)["deadline_at"] == later
    assert store.get_job("j")["expected_completion_at"] is None


def test_extend_after_release_returns_false(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.release(job["id"], claim.lock_token)
    assert store.extend(job["id"], claim.lock_token, LONG, claim.run_id, NOW + dt.timedelta(hours=1)) is False
    assert store.get_job("j")["lock_token"] is None


# -- finish_run ----------------------------------------------------------------------------------------


def test_finish_run_records_terminal_state_and_releases_lease(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    done_at = NOW + dt.timedelta(seconds=2)
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                            error_message="went wrong", details={"why": ["x", 1]}, duration_ms=1234.5,
                            now=done_at) is True
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed"
    assert run["success"] is False
    assert run["error_message"] == "went wrong"
    assert run["details"] == {"why": ["x", 1]}
    assert run["duration_ms"] == 1234.5
    assert run["completed_at"] == done_at
    row = store.get_job("j")
    assert all(row[c] is None for c in LEASE_COLUMNS)
    assert (row["run_count"], row["success_count"], row["failure_count"]) == (1, 0, 1)
    assert row["last_run_at"] == done_at
    assert row["last_duration_ms"] == 1234.5
    assert row["avg_duration_ms"] == 1234.5


def test_finish_run_statistics_over_three_runs(store):
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    outcomes = [(True, 100.0), (False, 200.0), (True, 600.0)]
    for i, (success, duration) in enumerate(outcomes):
        job = store.get_job("j")
        claim = _claim(store, job)
        assert claim is not None
        assert _finish(store, claim, job["id"], success=success, duration_ms=duration,
                       now=NOW + dt.timedelta(minutes=i)) is True
    row = store.get_job("j")
    assert row["run_count"] == 3
    assert row["success_count"] == 2
    assert row["failure_count"] == 1
    assert row["last_run_at"] == NOW + dt.timedelta(minutes=2)
    assert row["last_duration_ms"] == 600.0
    assert row["avg_duration_ms"] == pytest.approx(300.0)
    assert row["lock_token"] is None
    assert [r["status"] for r in store.list_runs(job_name="j")] == ["Completed", "Failed", "Completed"]


def test_finish_run_without_duration_keeps_average(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _finish(store, _claim(store, job), job["id"], duration_ms=50.0)
    assert _finish(store, _claim(store, store.get_job("j")), job["id"], duration_ms=None)
    row = store.get_job("j")
    assert row["run_count"] == 2
    assert row["avg_duration_ms"] == 50.0
    assert row["last_duration_ms"] == 50.0


def test_finish_run_count_false_leaves_statistics(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Cancelled", success=None,
                            error_message="cancelled", details=None, duration_ms=5.0, now=NOW, count=False)
    row = store.get_job("j")
    assert (row["run_count"], row["success_count"], row["failure_count"]) == (0, 0, 0)
    assert row["last_run_at"] is None and row["avg_duration_ms"] is None
    assert row["lock_token"] is None  # still released
    assert store.get_run(claim.run_id)["status"] == "Cancelled"


def test_finish_run_on_non_running_run_returns_false_and_touches_nothing(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert _finish(store, claim, job["id"], duration_ms=100.0) is True
    snapshot = store.get_job("j")
    run_snapshot = store.get_run(claim.run_id)
    assert _finish(store, claim, job["id"], success=False, duration_ms=900.0) is False
    assert store.get_job("j") == snapshot
    assert store.get_run(claim.run_id) == run_snapshot


def test_finish_again_after_another_claim_leaves_new_holders_lease(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    a = _claim(store, job, instance="a")
    assert _finish(store, a, job["id"]) is True
    b = _claim(store, store.get_job("j"), instance="b")
    assert b is not None
    held = store.get_job("j")
    assert _finish(store, a, job["id"]) is False
    after = store.get_job("j")
    assert {c: after[c] for c in LEASE_COLUMNS} == {c: held[c] for c in LEASE_COLUMNS}
    assert after["lock_token"] == b.lock_token
    assert after["run_count"] == 1


def test_finish_of_running_run_whose_lease_was_taken_over_keeps_other_holders_lease(store):
    """A's lease expires, B claims; A's run (still Running) then finishes: recorded, counted, but B's lease
    must survive both the statistics update and the token-checked release."""
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    a = _claim(store, job, instance="a", lease_s=0.05)
    _wait_lease_expired(store, "j")
    b = _claim(store, store.get_job("j"), instance="b", lease_s=LONG)
    assert b is not None
    held = store.get_job("j")
    assert _finish(store, a, job["id"], duration_ms=70.0) is True
    after = store.get_job("j")
    assert {c: after[c] for c in LEASE_COLUMNS} == {c: held[c] for c in LEASE_COLUMNS}
    assert after["lock_token"] == b.lock_token
    assert after["run_count"] == 1 and after["last_duration_ms"] == 70.0
    assert store.get_run(a.run_id)["status"] == "Completed"
    assert store.get_run(b.run_id)["status"] == "Running"


# -- abandon_orphaned_runs -----------------------------------------------------------------------------


def test_abandon_orphaned_runs_fails_run_whose_lease_expired(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, instance="gone-host:777", lease_s=0.05)
    _wait_lease_expired(store, "j")
    assert store.abandon_orphaned_runs(NOW, exclude_run_ids={claim.run_id}) == []
    assert store.get_run(claim.run_id)["status"] == "Running"

    later = NOW + dt.timedelta(seconds=3)
    abandoned = store.abandon_orphaned_runs(later)
    assert [r["id"] for r in abandoned] == [claim.run_id]
    assert "gone-host:777" in abandoned[0]["error_message"]
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed"
    assert run["success"] is False
    assert run["completed_at"] == later
    assert "gone-host:777" in run["error_message"]
    row = store.get_job("j")
    assert all(row[c] is None for c in LEASE_COLUMNS)
    assert (row["run_count"], row["failure_count"]) == (1, 1)
    # the late finish of the abandoned run is refused
    assert _finish(store, claim, job["id"]) is False
    assert store.abandon_orphaned_runs(later) == []


def test_abandon_run_whose_lease_was_taken_over_keeps_new_holders_lease(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    a = _claim(store, job, instance="a:1", lease_s=0.05)
    _wait_lease_expired(store, "j")
    b = _claim(store, store.get_job("j"), instance="b:2", lease_s=LONG)
    held = store.get_job("j")
    # B's supervisor sweeps, excluding its own run: A's run (lease lost) is abandoned, B's lease untouched
    abandoned = store.abandon_orphaned_runs(NOW + dt.timedelta(seconds=1), exclude_run_ids={b.run_id})
    assert [r["id"] for r in abandoned] == [a.run_id]
    assert "a:1" in abandoned[0]["error_message"]
    after = store.get_job("j")
    assert {c: after[c] for c in LEASE_COLUMNS} == {c: held[c] for c in LEASE_COLUMNS}
    assert after["failure_count"] == 1
    assert store.get_run(b.run_id)["status"] == "Running"


def test_abandon_orphaned_runs_spares_live_leases(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=LONG)
    assert store.abandon_orphaned_runs(NOW + dt.timedelta(days=1)) == []
    assert store.get_run(claim.run_id)["status"] == "Running"
    assert store.get_job("j")["lock_token"] == claim.lock_token


def test_abandon_orphaned_runs_leaseless_runs_by_deadline(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    claim = _claim(store, job, take_lease=False, instance="x:1")  # deadline NOW + 5 min
    assert store.abandon_orphaned_runs(NOW + dt.timedelta(minutes=4)) == []
    abandoned = store.abandon_orphaned_runs(NOW + dt.timedelta(minutes=6))
    assert [r["id"] for r in abandoned] == [claim.run_id]
    assert store.get_run(claim.run_id)["status"] == "Failed"


# -- due_jobs / next_due_at ----------------------------------------------------------------------------


def test_due_jobs_only_active(store):
    past = NOW - dt.timedelta(minutes=1)
    for status in ("Pending", "Active", "Paused", "Disabled", "Expired"):
        add_job(store, status.lower(), "ok", now=NOW, next_run_at=past, status=status)
    assert [j["name"] for j in store.due_jobs(NOW, 10)] == ["active"]
    assert store.next_due_at() == past


def test_due_jobs_ordering_limit_exclude_and_future(store):
    a = add_job(store, "a", "ok", now=NOW, next_run_at=NOW - dt.timedelta(minutes=2))
    b = add_job(store, "b", "ok", now=NOW, next_run_at=NOW - dt.timedelta(minutes=5))
    add_job(store, "later", "ok", now=NOW, next_run_at=NOW + dt.timedelta(minutes=5))
    add_job(store, "unscheduled", "ok", now=NOW, next_run_at=NOW)
    store.set_next_run_at(store.get_job("unscheduled")["id"], NOW, None, NOW)
    assert [j["name"] for j in store.due_jobs(NOW, 10)] == ["b", "a"]
    assert [j["name"] for j in store.due_jobs(NOW, 1)] == ["b"]
    assert [j["name"] for j in store.due_jobs(NOW, 10, exclude={b["id"]})] == ["a"]
    assert store.next_due_at() == NOW - dt.timedelta(minutes=5)
    assert store.next_due_at(exclude={a["id"], b["id"]}) == NOW + dt.timedelta(minutes=5)
    assert [j["name"] for j in store.unscheduled_active_jobs()] == ["unscheduled"]


def test_job_scheduled_by_the_planner_is_never_due_before_start_at(store):
    """Writers keep next_run_at >= start_at (planner.initial_next_run_at); the store then never reports the
    job due before start_at. (The supervisor separately re-plans rows edited outside the CLI.)"""
    start = NOW + dt.timedelta(hours=1, minutes=7)
    values = {"cron_expression": "*/15 * * * *", "timezone": "UTC", "start_at": start}
    first = planner.initial_next_run_at(values, NOW)
    assert first == NOW + dt.timedelta(hours=1, minutes=15)
    add_job(store, "j", "ok", cron="*/15 * * * *", now=NOW, next_run_at=first, start_at=start)
    assert store.due_jobs(NOW, 10) == []
    assert store.due_jobs(start, 10) == []
    assert store.due_jobs(first - dt.timedelta(microseconds=1), 10) == []
    assert [j["name"] for j in store.due_jobs(first, 10)] == ["j"]
    assert store.next_due_at() == first


def test_next_due_at_none_when_nothing_scheduled(store):
    assert store.next_due_at() is None
    add_job(store, "p", "ok", now=NOW, next_run_at=NOW, status="Paused")
    assert store.next_due_at() is None


def test_queue_job_with_live_lease_is_not_due(store):
    q = add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    s = add_job(store, "s", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Skip")
    qc = _claim(store, q, next_run_at=NOW + dt.timedelta(seconds=1))
    assert _claim(store, s, next_run_at=NOW + dt.timedelta(seconds=1)) is not None
    at = NOW + dt.timedelta(minutes=1)
    # the Skip job is due (the supervisor will skip its occurrence); the Queue job waits for its lease
    assert [j["name"] for j in store.due_jobs(at, 10)] == ["s"]
    assert store.next_due_at() == NOW + dt.timedelta(seconds=1)
    assert store.next_due_at(exclude={s["id"]}) is None
    assert store.release(q["id"], qc.lock_token)
    assert [j["name"] for j in store.due_jobs(at, 10)] == ["q", "s"]


def test_queue_job_due_again_once_lease_expired(store):
    q = add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    _claim(store, q, next_run_at=NOW + dt.timedelta(seconds=1), lease_s=0.05)
    _wait_lease_expired(store, "q")
    assert [j["name"] for j in store.due_jobs(NOW + dt.timedelta(minutes=1), 10)] == ["q"]


# -- set_next_run_at -----------------------------------------------------------------------------------


def test_set_next_run_at_is_compare_and_set(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    t1 = NOW + dt.timedelta(hours=1)
    assert store.set_next_run_at(job["id"], NOW - dt.timedelta(seconds=1), t1, NOW) is False
    assert store.set_next_run_at(job["id"], None, t1, NOW) is False
    assert store.get_job("j")["next_run_at"] == NOW
    assert store.set_next_run_at(job["id"], NOW, t1, NOW) is True
    assert store.get_job("j")["next_run_at"] == t1
    assert store.set_next_run_at(job["id"], NOW, t1 + dt.timedelta(hours=1), NOW) is False  # stale seen
    assert store.get_job("j")["skipped_count"] == 0


def test_set_next_run_at_counts_skips_and_sets_status(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    t1, t2 = NOW + dt.timedelta(hours=1), NOW + dt.timedelta(hours=2)
    assert store.set_next_run_at(job["id"], NOW, t1, NOW, skipped=True)
    assert store.set_next_run_at(job["id"], t1, t2, NOW, skipped=True)
    assert store.set_next_run_at(job["id"], NOW, t2, NOW, skipped=True) is False  # lost CAS: not counted
    assert store.get_job("j")["skipped_count"] == 2
    assert store.set_next_run_at(job["id"], t2, None, NOW, status="Expired")
    row = store.get_job("j")
    assert row["status"] == "Expired" and row["next_run_at"] is None
    assert store.set_next_run_at(job["id"], None, t1, NOW, status="Active")  # seen None matches NULL
    assert store.get_job("j")["next_run_at"] == t1


# -- races between processes' stores -------------------------------------------------------------------


@pytest.mark.parametrize("take_lease", [True, False])
def test_racing_claims_from_separate_stores_exactly_one_wins(store, db_url, take_lease):
    add_job(store, "race", "ok", now=NOW, next_run_at=NOW,
            concurrency_mode="Skip" if take_lease else "Concurrent")
    job = store.get_job("race")
    n = 8
    barrier = threading.Barrier(n, timeout=20)
    results: list = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        own = Store.open(db_url)
        try:
            barrier.wait()
            results[i] = _claim(own, job, instance=f"inst-{i}", take_lease=take_lease)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a claiming thread did not finish"
    assert errors == []
    winners = [(i, r) for i, r in enumerate(results) if r is not None]
    assert len(winners) == 1
    i, claim = winners[0]
    assert len(store.list_runs(job_name="race")) == 1
    row = store.get_job("race")
    assert row["next_run_at"] == NOW + dt.timedelta(hours=1)
    if take_lease:
        assert row["lock_token"] == claim.lock_token
        assert row["locked_by_instance"] == f"inst-{i}"


# -- schema and job management -------------------------------------------------------------------------


def test_schema_creates_indexes(store):
    inspector = sa.inspect(store.engine)
    assert set(inspector.get_table_names()) >= {"jobs", "runs"}
    job_indexes = {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("jobs")}
    run_indexes = {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("runs")}
    assert job_indexes["ix_jobs_status_next_run_at"] == ["status", "next_run_at"]
    assert run_indexes["ix_runs_job_id_started_at"] == ["job_id", "started_at"]
    assert run_indexes["ix_runs_status"] == ["status"]
    # the unique job name is enforced by the schema
    uniques = [u["column_names"] for u in inspector.get_unique_constraints("jobs")]
    assert ["name"] in uniques


def test_sqlite_file_is_in_wal_mode(store, db_url):
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar().lower() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    # WAL is persistent: a second store on the same file sees it too
    other = Store.open(db_url)
    try:
        with other.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar().lower() == "wal"
    finally:
        other.close()


def test_schema_check_constraints_reject_bad_status(store):
    """The CHECK constraint itself (raw SQL, bypassing Store.add_job)."""
    with pytest.raises(sa.exc.IntegrityError):
        with store.engine.begin() as conn:
            conn.execute(jobs.insert().values(name="bad", job_type="ok", cron_expression="* * * * *",
                                              status="Bogus", created_at=NOW, updated_at=NOW))


@pytest.mark.parametrize("values", [
    {"status": "Bogus"},
    {"concurrency_mode": "Sometimes"},
])
def test_add_job_constraint_violation_is_not_reported_as_duplicate_name(store, values):
    with pytest.raises(Exception) as info:
        store.add_job({"name": "fresh", "job_type": "ok", "cron_expression": "* * * * *", **values}, NOW)
    assert store.list_jobs() == []
    assert "already exists" not in str(info.value), f"misleading error: {info.value}"


def test_add_job_duplicate_name_raises_input_error(store):
    add_job(store, "dup", "ok", now=NOW)
    with pytest.raises(InputError) as info:
        add_job(store, "dup", "fail", now=NOW)
    assert info.value.field == "name"
    assert "dup" in str(info.value)
    assert len(store.list_jobs()) == 1


def test_add_job_serialises_configuration_and_defaults(store):
    store.add_job({"name": "c", "job_type": "ok", "cron_expression": "* * * * *",
                   "configuration": {"seconds": 1.5}}, NOW)
    row = store.get_job("c")
    assert row["configuration"] == '{"seconds": 1.5}'
    assert row["status"] == "Pending"
    assert row["timezone"] == "UTC"
    assert row["concurrency_mode"] == "Skip"
    assert (row["run_count"], row["skipped_count"]) == (0, 0)
    assert row["created_at"] == NOW and row["updated_at"] == NOW
    assert row["created_at"].tzinfo is not None


def test_store_rejects_naive_datetimes(store):
    with pytest.raises(sa.exc.StatementError):
        store.add_job({"name": "n", "job_type": "ok", "cron_expression": "* * * * *",
                       "next_run_at": dt.datetime(2030, 1, 1)}, NOW)


def test_missing_job_and_run_raise_not_found(store):
    with pytest.raises(NotFoundError) as info:
        store.get_job("nope")
    assert info.value.field == "name"
    assert isinstance(info.value, LookupError)
    with pytest.raises(NotFoundError):
        store.update_job("nope", {"description": "x"}, NOW)
    with pytest.raises(NotFoundError):
        store.remove_job("nope")
    with pytest.raises(NotFoundError):
        store.list_runs(job_name="nope")
    with pytest.raises(NotFoundError) as run_info:
        store.get_run(12345)
    assert run_info.value.field == "id"
    assert store.get_job_by_id(12345) is None


def test_remove_job_deletes_its_runs(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    _finish(store, claim, job["id"])
    store.remove_job("j")
    assert store.list_jobs() == []
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 0


def test_db_now_is_aware_utc_and_close_to_wall_clock(store):
    now = store.db_now()
    assert now.tzinfo is not None and now.utcoffset() == dt.timedelta(0)
    assert abs((now - dt.datetime.now(UTC)).total_seconds()) < 5
