"""The store's CONTRACT SUITE: the lease protocol, supervisor liveness, statistics, orphan recovery, due-job
queries and schema, each test on SQLite, PostgreSQL and MySQL/MariaDB (``any_store`` /
``shared_backend_url``: a migrated namespace emptied of rows for each test). Only SQLite-specific checks
(WAL mode) use the SQLite ``store``.

Lease model under test: a job lease is live only while its token is set, its ``expected_completion_at``
has not passed by the database clock, *and* its holder's ``supervisors`` row (``locked_by_instance``) has
``lease_expires_at`` in the future by the database clock. Every wait is a bounded poll of ``db_now``.
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import add_job
from waiting import wait_until

import mjsched_isolated.store
from mjsched_isolated import planner
from mjsched_isolated.errors import InputError, NotFoundError
from mjsched_isolated.protocol import MAX_TEXT_BYTES
from mjsched_isolated.store import (
    AbandonedRun,
    Claim,
    InflightRun,
    JobRow,
    NextDueJob,
    NotificationRow,
    OutboxRow,
    PluginReloadRow,
    RecentFailure,
    RunOutputRow,
    RunRow,
    RunView,
    Store,
    SupervisorRow,
    SupervisorStatus,
)
from mjsched_isolated.store.schema import jobs, notifications, plugin_reloads, run_output, runs, supervisors
from mjsched_isolated.store.text import fit_json, fit_text

UTC = dt.UTC
NOW = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)  # the caller's clock: far from the DB clock on purpose
LONG = 600.0  # a lease / supervisor TTL that cannot expire during a test
SHORT = 0.05  # one that expires quickly (waited for by polling the database clock). Never asserted live:
#               a lease is checked live while LONG, then shortened (extend / renew) and waited out.
LEASE_COLUMNS = ("lock_token", "locked_at", "locked_by_instance", "expected_completion_at")
HOLDER = "host-a:1"


def _register(store: Store, instance: str = HOLDER, ttl_s: float = LONG) -> dt.datetime:
    """Register ``instance`` as a live supervisor (its liveness lease lasts ``ttl_s``)."""
    return store.register_supervisor(instance, "test-host", 4242, ttl_s)


def _claim(store: Store, job: dict, *, instance: str = HOLDER, lease_s: float = LONG, take_lease: bool = True,
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
        error_message=None if success else "went wrong", details={"k": 1}, duration_ms=duration_ms)


def _wait_db_past(store: Store, when: dt.datetime, timeout_s: float = 5.0) -> dt.datetime:
    """Poll the database clock until it is strictly past ``when`` (bounded); return the DB time seen."""
    return wait_until(lambda: (now := store.db_now()) > when and now, timeout_s,
                      f"the database clock past {when}", interval_s=0.002)


def _wait_lease_expired(store: Store, job_name: str) -> None:
    """Until the database clock is past the job's expected_completion_at."""
    expires = store.get_job(job_name)["expected_completion_at"]
    assert expires is not None
    _wait_db_past(store, expires)


def _supervisor(store: Store, instance: str) -> SupervisorRow | None:
    return next((s for s in store.list_supervisors() if s["instance"] == instance), None)


def _wait_supervisor_expired(store: Store, instance: str) -> None:
    """Until the database clock is past ``instance``'s lease_expires_at."""
    row = _supervisor(store, instance)
    assert row is not None
    _wait_db_past(store, row["lease_expires_at"])


def _stop(store: Store, instance: str) -> None:
    """A clean stop: the supervisor is dead from that clock reading on (the boundary itself is tested on a
    frozen clock below)."""
    store.stop_supervisor(instance)


def _kill_holder(store: Store, how: str, instance: str) -> None:
    """Make the live supervisor ``instance`` dead: its row expires by the DB clock (after a last renewal with
    a SHORT ttl), is stopped or deleted; or it never was registered (then there is nothing to do)."""
    if how == "expired":
        assert store.renew_supervisor(instance, SHORT) is not None
        _wait_supervisor_expired(store, instance)
    elif how == "stopped":
        _stop(store, instance)
    elif how == "deleted":
        with store.engine.begin() as conn:
            conn.execute(supervisors.delete().where(supervisors.c.instance == instance))
    else:
        assert how == "never-registered"


DEAD_HOLDERS = ["expired", "stopped", "deleted", "never-registered"]


# -- claim ---------------------------------------------------------------------------------------------


def test_claim_takes_lease_and_inserts_running_run(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    before = store.db_now()
    claim = _claim(store, job, instance="host-a:42", lease_s=30)
    assert claim is not None and claim.lock_token
    row = store.get_job("j")
    assert row["lock_token"] == claim.lock_token
    assert row["locked_by_instance"] == "host-a:42"
    assert row["next_run_at"] == NOW + dt.timedelta(hours=1)
    # the lease is measured on the database clock: locked_at ~ db now, expiry ~ db now + 30 s
    assert before - dt.timedelta(seconds=1) <= row["locked_at"] <= store.db_now()
    assert dt.timedelta(seconds=29) <= row["expected_completion_at"] - row["locked_at"] <= dt.timedelta(seconds=31)
    run = store.get_run(claim.run_id)
    assert run["status"] == "Running"
    assert run["lock_token"] == claim.lock_token
    assert run["executed_by_instance"] == "host-a:42"
    assert run["scheduled_at"] == NOW
    assert before - dt.timedelta(seconds=1) <= run["started_at"] <= store.db_now()  # database clock
    assert run["deadline_at"] == NOW + dt.timedelta(minutes=5)
    assert run["job_name"] == "j"


def test_claim_wins_once_per_occurrence(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, job)
    assert first is not None
    assert store.release(job["id"], first.lock_token)  # the lease is free again: only the CAS can refuse
    assert _claim(store, job) is None  # same seen next_run_at -> already claimed
    assert len(store.list_runs(job_name="j")) == 1
    assert store.get_job("j")["lock_token"] is None


def test_claim_without_lease_is_still_once_per_occurrence(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    first = _claim(store, job, take_lease=False)
    assert first is not None and first.lock_token is None
    assert _claim(store, job, take_lease=False) is None
    assert store.get_job("j")["lock_token"] is None
    # a later occurrence can be claimed although the first run is still Running (no lease involved)
    second = _claim(store, store.get_job("j"), take_lease=False)
    assert second is not None
    assert len(store.running_runs()) == 2


def test_claim_refused_while_live_lease_is_held(any_store):
    store = any_store
    _register(store, "a")
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, store.get_job("j"), instance="a", lease_s=LONG)
    assert first is not None
    fresh = store.get_job("j")  # new occurrence, but the lease is live (token set, not expired, holder alive)
    assert _claim(store, fresh, instance="b") is None
    after = store.get_job("j")
    assert after["lock_token"] == first.lock_token
    assert after["locked_by_instance"] == "a"
    assert after["next_run_at"] == fresh["next_run_at"]  # the refused claim wrote nothing
    assert len(store.list_runs(job_name="j")) == 1


def test_claim_refused_while_holder_alive_even_after_renewals(any_store):
    """The holder renewing its supervisor row keeps the lease; its job lease itself is still long."""
    store = any_store
    _register(store, "a", ttl_s=SHORT)
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _claim(store, store.get_job("j"), instance="a") is not None
    for _ in range(3):
        assert store.renew_supervisor("a", LONG) is not None
        assert _claim(store, store.get_job("j"), instance="b") is None
    assert store.get_job("j")["locked_by_instance"] == "a"


def test_claim_allowed_once_lease_expired_by_database_clock(any_store):
    """The ``expected_completion_at < db_now`` path: the holder is alive, but its job lease ran out. Expiry is
    judged by the database clock, never the caller's ``now`` (which is far in the future, then far in the
    past, here)."""
    store = any_store
    _register(store, "a")
    _register(store, "b")
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, store.get_job("j"), instance="a", lease_s=LONG)
    assert first is not None
    # live by the DB clock, although the caller's clock (a year after NOW, 2030) is long past the expiry
    assert _claim(store, store.get_job("j"), instance="b", now=NOW + dt.timedelta(days=365)) is None
    assert store.extend(store.get_job("j")["id"], first.lock_token, SHORT, first.run_id, NOW)  # shortened
    _wait_lease_expired(store, "j")
    long_ago = dt.datetime(2000, 1, 1, tzinfo=UTC)  # the caller's clock far behind: irrelevant too
    second = _claim(store, store.get_job("j"), instance="b", lease_s=LONG, now=long_ago)
    assert second is not None
    assert second.lock_token != first.lock_token
    row = store.get_job("j")
    assert row["lock_token"] == second.lock_token
    assert row["locked_by_instance"] == "b"
    assert row["expected_completion_at"] > store.db_now() + dt.timedelta(seconds=LONG - 60)


@pytest.mark.parametrize("how", DEAD_HOLDERS)
def test_claim_allowed_once_holder_supervisor_is_dead(any_store, how):
    """A job lease (long, unexpired) is free as soon as its holder's supervisor row expired by the DB
    clock, was stopped, is missing, or never existed."""
    store = any_store
    if how != "never-registered":
        _register(store, "a")
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, store.get_job("j"), instance="a", lease_s=LONG)
    assert first is not None
    if how != "never-registered":  # while the holder is alive, nobody else may take the lease
        assert _claim(store, store.get_job("j"), instance="b") is None
    _kill_holder(store, how, "a")
    assert store.db_now() < store.get_job("j")["expected_completion_at"]  # the job lease itself is unexpired
    second = _claim(store, store.get_job("j"), instance="b")
    assert second is not None
    row = store.get_job("j")
    assert (row["lock_token"], row["locked_by_instance"]) == (second.lock_token, "b")
    assert len(store.list_runs(job_name="j")) == 2


def test_claim_refused_again_once_the_new_holder_is_alive(any_store):
    """After a takeover from a dead holder, the new holder's live lease is respected in turn."""
    store = any_store
    _register(store, "b")
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _claim(store, store.get_job("j"), instance="a") is not None  # "a" is not registered: dead
    assert _claim(store, store.get_job("j"), instance="b") is not None
    assert _claim(store, store.get_job("j"), instance="a") is None
    assert store.get_job("j")["locked_by_instance"] == "b"


def test_each_claim_gets_a_fresh_random_token(any_store):
    store = any_store
    _register(store)
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


# -- the unique occurrence index -----------------------------------------------------------------------


def test_second_claim_of_same_occurrence_around_the_cas_is_refused_by_unique_index(any_store):
    """Even when next_run_at is put back (so the compare-and-set matches again), the unique index on
    runs(job_id, scheduled_at) refuses a second run of the occurrence: claim returns None and writes nothing."""
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, job)
    assert first is not None
    assert _finish(store, first, job["id"])  # lease free again
    assert store.set_next_run_at(job["id"], NOW + dt.timedelta(hours=1), NOW, NOW)  # back to the occurrence
    stale = store.get_job("j")
    assert stale["next_run_at"] == NOW and stale["lock_token"] is None
    assert _claim(store, stale, instance="b") is None
    after = store.get_job("j")
    assert after["next_run_at"] == NOW  # the job update was rolled back with the refused insert
    assert all(after[c] is None for c in LEASE_COLUMNS)
    assert [r["id"] for r in store.list_runs(job_name="j")] == [first.run_id]
    # the same for a claim without a lease
    assert _claim(store, stale, instance="b", take_lease=False) is None
    assert store.get_job("j")["next_run_at"] == NOW
    assert len(store.list_runs(job_name="j")) == 1
    # a different occurrence is fine
    assert store.set_next_run_at(job["id"], NOW, NOW + dt.timedelta(minutes=1), NOW)
    assert _claim(store, store.get_job("j"), instance="b") is not None


def test_manual_insert_of_a_second_run_for_an_occurrence_is_an_integrity_error(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _claim(store, job, take_lease=False) is not None
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=job["id"], scheduled_at=NOW, started_at=NOW, status="Running",
                                          executed_by_instance="rogue"))
    assert len(store.list_runs(job_name="j")) == 1


def test_manual_runs_without_scheduled_at_may_repeat(any_store):
    """Manual runs have no scheduled_at: the unique index does not limit them (NULLs are distinct)."""
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW + dt.timedelta(hours=1), concurrency_mode="Concurrent")
    ids = []
    for _ in range(3):
        seen = store.get_job("j")
        claim = store.claim(seen, now=NOW, next_run_at=seen["next_run_at"], instance=HOLDER, lease_s=LONG,
                            deadline_at=NOW + dt.timedelta(minutes=5), take_lease=False, scheduled_at=None)
        assert claim is not None
        ids.append(claim.run_id)
    assert len(set(ids)) == 3
    assert all(store.get_run(i)["scheduled_at"] is None for i in ids)
    assert store.get_job("j")["next_run_at"] == job["next_run_at"]  # a manual run leaves the schedule alone
    with store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=job["id"], scheduled_at=None, started_at=NOW, status="Running"))
    assert len(store.running_runs()) == 4


# -- release / extend ----------------------------------------------------------------------------------


def test_release_refuses_wrong_token_and_is_idempotent(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.release(job["id"], "not-the-token") is False
    assert store.release(job["id"] + 1000, claim.lock_token) is False  # another (missing) job
    held = store.get_job("j")
    assert held["lock_token"] == claim.lock_token and held["expected_completion_at"] is not None
    assert store.release(job["id"], claim.lock_token) is True
    freed = store.get_job("j")
    assert all(freed[c] is None for c in LEASE_COLUMNS)
    assert store.release(job["id"], claim.lock_token) is False  # second call: nothing to release


def test_release_with_old_token_leaves_new_holders_lease(any_store):
    store = any_store
    _register(store, "b")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    old = _claim(store, job, instance="a")  # "a" is dead: its lease is free for "b"
    new = _claim(store, store.get_job("j"), instance="b")
    assert new is not None
    held = store.get_job("j")
    assert store.release(job["id"], old.lock_token) is False
    assert store.extend(job["id"], old.lock_token, LONG, old.run_id, NOW + dt.timedelta(hours=1)) is False
    after = store.get_job("j")
    assert {c: after[c] for c in LEASE_COLUMNS} == {c: held[c] for c in LEASE_COLUMNS}


def test_extend_refuses_wrong_token_and_writes_nothing(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=5)
    before_job = store.get_job("j")
    before_run = store.get_run(claim.run_id)
    later = NOW + dt.timedelta(hours=2)
    assert store.extend(job["id"], "not-the-token", LONG, claim.run_id, later) is False
    assert store.get_job("j") == before_job
    assert store.get_run(claim.run_id)["deadline_at"] == before_run["deadline_at"]


def test_extend_with_right_token_moves_lease_and_deadline(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=5)
    before = store.get_job("j")["expected_completion_at"]
    later = NOW + dt.timedelta(hours=2)
    assert store.extend(job["id"], claim.lock_token, LONG, claim.run_id, later) is True
    after = store.get_job("j")
    assert after["expected_completion_at"] >= before + dt.timedelta(seconds=LONG - 10)
    assert after["lock_token"] == claim.lock_token
    assert store.get_run(claim.run_id)["deadline_at"] == later


def test_extend_revives_an_expired_lease_still_carrying_the_token(any_store):
    """Extension is judged by the token only, on the database clock: a lease that ran out but was not taken
    over is extended to DB-now + lease_s."""
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, lease_s=SHORT)
    _wait_lease_expired(store, "j")
    assert store.extend(job["id"], claim.lock_token, LONG, claim.run_id, NOW) is True
    assert store.get_job("j")["expected_completion_at"] > store.db_now() + dt.timedelta(seconds=LONG - 60)
    assert _claim(store, store.get_job("j"), instance="b") is None


def test_extend_without_token_moves_only_the_deadline(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    claim = _claim(store, job, take_lease=False)
    later = NOW + dt.timedelta(hours=3)
    assert store.extend(job["id"], None, LONG, claim.run_id, later) is True
    assert store.get_run(claim.run_id)["deadline_at"] == later
    assert store.get_job("j")["expected_completion_at"] is None


def test_extend_after_release_returns_false(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.release(job["id"], claim.lock_token)
    assert store.extend(job["id"], claim.lock_token, LONG, claim.run_id, NOW + dt.timedelta(hours=1)) is False
    assert store.get_job("j")["lock_token"] is None
    assert store.get_run(claim.run_id)["deadline_at"] == NOW + dt.timedelta(minutes=5)


# -- finish_run ----------------------------------------------------------------------------------------


def test_finish_run_records_terminal_state_and_releases_lease(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                            error_message="went wrong", details={"why": ["x", 1]}, duration_ms=1234.5,
                            ) is True
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed"
    assert run["success"] is False
    assert run["error_message"] == "went wrong"
    assert run["details"] == {"why": ["x", 1]}
    assert run["duration_ms"] == 1234.5
    assert abs(run["completed_at"] - store.db_now()) < dt.timedelta(seconds=5)  # database clock
    row = store.get_job("j")
    assert all(row[c] is None for c in LEASE_COLUMNS)
    assert (row["run_count"], row["success_count"], row["failure_count"]) == (1, 0, 1)
    assert row["last_run_at"] is not None and abs(row["last_run_at"] - store.db_now()) < dt.timedelta(seconds=5)
    assert row["last_duration_ms"] == 1234.5
    assert row["avg_duration_ms"] == 1234.5


def test_finish_run_statistics_over_three_runs(any_store):
    store = any_store
    _register(store)
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
    last_run = store.list_runs(job_name="j", limit=1)[0]
    assert row["last_run_at"] is not None
    assert abs(row["last_run_at"] - last_run["completed_at"]) < dt.timedelta(seconds=1)
    assert row["last_duration_ms"] == 600.0
    assert row["avg_duration_ms"] == pytest.approx(300.0)
    assert row["lock_token"] is None
    assert [r["status"] for r in store.list_runs(job_name="j")] == ["Completed", "Failed", "Completed"]


def test_finish_run_without_duration_keeps_average(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _finish(store, _claim(store, job), job["id"], duration_ms=50.0)
    assert _finish(store, _claim(store, store.get_job("j")), job["id"], duration_ms=None)
    row = store.get_job("j")
    assert row["run_count"] == 2
    assert row["avg_duration_ms"] == 50.0
    assert row["last_duration_ms"] == 50.0


def test_finish_run_count_false_leaves_statistics(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Cancelled", success=None,
                            error_message="cancelled", details=None, duration_ms=5.0, count=False)
    row = store.get_job("j")
    assert (row["run_count"], row["success_count"], row["failure_count"]) == (0, 0, 0)
    assert row["last_run_at"] is None and row["avg_duration_ms"] is None
    assert row["lock_token"] is None  # still released
    assert store.get_run(claim.run_id)["status"] == "Cancelled"


def test_finish_run_on_non_running_run_returns_false_and_touches_nothing(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert _finish(store, claim, job["id"], duration_ms=100.0) is True
    snapshot = store.get_job("j")
    run_snapshot = store.get_run(claim.run_id)
    assert _finish(store, claim, job["id"], success=False, duration_ms=900.0) is False
    assert store.get_job("j") == snapshot
    assert store.get_run(claim.run_id) == run_snapshot


def test_finish_again_after_another_claim_leaves_new_holders_lease(any_store):
    store = any_store
    _register(store, "a")
    _register(store, "b")
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


def test_finish_of_running_run_whose_lease_was_taken_over_keeps_other_holders_lease(any_store):
    """A's lease expires (A alive), B claims; A's run (still Running) then finishes: recorded, counted, but
    B's lease must survive both the statistics update and the token-checked release."""
    store = any_store
    _register(store, "a")
    _register(store, "b")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    a = _claim(store, job, instance="a", lease_s=SHORT)
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


# -- abandon_orphaned_runs: a run is orphaned exactly when its supervisor is dead -------------------------


@pytest.mark.parametrize("how", DEAD_HOLDERS)
def test_abandon_orphaned_runs_fails_runs_of_a_dead_supervisor(any_store, how):
    """Dead supervisor -> its Running runs are Failed, counted and their lease freed, however long the job
    lease and run deadline still are. Excluded run ids are spared."""
    store = any_store
    instance = "gone-host:777"
    if how != "never-registered":
        _register(store, instance)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, instance=instance, lease_s=LONG)  # deadline NOW + 5 min, lease 10 min
    _kill_holder(store, how, instance)
    assert store.abandon_orphaned_runs(exclude_run_ids={claim.run_id}) == []
    assert store.get_run(claim.run_id)["status"] == "Running"
    assert store.get_job("j")["lock_token"] == claim.lock_token

    abandoned = store.abandon_orphaned_runs()
    assert [r["id"] for r in abandoned] == [claim.run_id]
    assert instance in abandoned[0]["error_message"]
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed"
    assert run["success"] is False
    assert abs(run["completed_at"] - store.db_now()) < dt.timedelta(seconds=5)  # database clock
    assert instance in run["error_message"]
    row = store.get_job("j")
    assert all(row[c] is None for c in LEASE_COLUMNS)
    assert (row["run_count"], row["success_count"], row["failure_count"]) == (1, 0, 1)
    assert abs(row["last_run_at"] - run["completed_at"]) < dt.timedelta(seconds=1)
    # the duration is measured on the database clock, from the run's start to its abandonment
    assert row["last_duration_ms"] == pytest.approx((run["completed_at"] - run["started_at"]).total_seconds() * 1000,
                                                    abs=50)
    # the late finish of the abandoned run is refused, and a second sweep finds nothing
    assert _finish(store, claim, job["id"]) is False
    assert store.abandon_orphaned_runs() == []
    assert store.get_job("j")["failure_count"] == 1


def test_abandon_orphaned_runs_leaseless_run_of_dead_supervisor(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    claim = _claim(store, job, take_lease=False, instance="x:1")  # deadline NOW + 5 min, far ahead
    abandoned = store.abandon_orphaned_runs()
    assert [r["id"] for r in abandoned] == [claim.run_id]
    assert "x:1" in abandoned[0]["error_message"]
    assert store.get_run(claim.run_id)["status"] == "Failed"
    row = store.get_job("j")
    assert row["failure_count"] == 1 and row["lock_token"] is None


def test_abandon_orphaned_runs_spares_runs_of_a_live_supervisor(any_store):
    """Live supervisor -> spared, whatever the caller's now, the run's deadline or its job lease's expiry."""
    store = any_store
    _register(store, "alive:1")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    expired = _claim(store, job, instance="alive:1", lease_s=SHORT)  # job lease will run out
    conc = add_job(store, "c", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    leaseless = _claim(store, conc, instance="alive:1", take_lease=False)  # deadline NOW + 5 min
    _wait_lease_expired(store, "j")
    assert store.abandon_orphaned_runs() == []  # deadlines long past by `now`
    assert store.get_run(expired.run_id)["status"] == "Running"
    assert store.get_run(leaseless.run_id)["status"] == "Running"
    assert store.get_job("j")["lock_token"] == expired.lock_token
    assert store.get_job("j")["failure_count"] == 0
    # the very same runs are abandoned once their supervisor stops
    _stop(store, "alive:1")
    abandoned = store.abandon_orphaned_runs()
    assert sorted(r["id"] for r in abandoned) == sorted([expired.run_id, leaseless.run_id])


def test_abandon_orphaned_runs_spares_runs_once_supervisor_renewed(any_store):
    """A supervisor whose row expired but which renews (or re-registers) before the sweep is alive again."""
    store = any_store
    _register(store, "s:1", ttl_s=SHORT)
    claim = _claim(store, add_job(store, "j", "ok", now=NOW, next_run_at=NOW), instance="s:1")
    _wait_supervisor_expired(store, "s:1")
    assert store.renew_supervisor("s:1", LONG) is not None
    assert store.abandon_orphaned_runs() == []
    assert store.get_run(claim.run_id)["status"] == "Running"


def test_abandon_only_dead_supervisors_runs_among_many(any_store):
    store = any_store
    _register(store, "alive:1")
    _register(store, "stopped:2")
    _stop(store, "stopped:2")
    claims = {}
    for inst in ("alive:1", "stopped:2", "unknown:3"):
        job = add_job(store, f"j-{inst}", "ok", now=NOW, next_run_at=NOW)
        claims[inst] = _claim(store, job, instance=inst)
    abandoned = store.abandon_orphaned_runs(exclude_run_ids={claims["unknown:3"].run_id})
    assert [r["id"] for r in abandoned] == [claims["stopped:2"].run_id]
    assert {r["executed_by_instance"] for r in store.running_runs()} == {"alive:1", "unknown:3"}
    assert store.running_runs("alive:1")[0]["id"] == claims["alive:1"].run_id


def test_abandon_run_whose_lease_was_taken_over_keeps_new_holders_lease(any_store):
    store = any_store
    _register(store, "a:1")
    _register(store, "b:2")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    a = _claim(store, job, instance="a:1", lease_s=LONG)
    _stop(store, "a:1")  # A dies; its lease is free
    b = _claim(store, store.get_job("j"), instance="b:2", lease_s=LONG)
    assert b is not None
    held = store.get_job("j")
    # a sweep (even without excluding B's run): A's run is abandoned, B's run and lease are untouched
    abandoned = store.abandon_orphaned_runs()
    assert [r["id"] for r in abandoned] == [a.run_id]
    assert "a:1" in abandoned[0]["error_message"]
    after = store.get_job("j")
    assert {c: after[c] for c in LEASE_COLUMNS} == {c: held[c] for c in LEASE_COLUMNS}
    assert after["failure_count"] == 1
    assert store.get_run(b.run_id)["status"] == "Running"


# -- boundaries, on a frozen database clock --------------------------------------------------------------


def _frozen_clock_store(backend_url: str, at: dt.datetime) -> Store:
    """Another Store on the same namespace whose *database* clock - the one every lease decision reads
    (SQLite ``strftime(.., 'now', ..)``, PostgreSQL ``clock_timestamp()``, MySQL ``UTC_TIMESTAMP(6)``) -
    stands still at ``at`` (ms-aligned, aware UTC), so "the same clock reading" is deterministic."""
    store = Store.open(backend_url)
    naive = at.astimezone(UTC).replace(tzinfo=None)
    if store.dialect == "sqlite":
        def strftime(fmt: str, when: str, modifier: str) -> str:
            assert (fmt, when) == ("%Y-%m-%d %H:%M:%f", "now"), (fmt, when)
            t = naive + dt.timedelta(seconds=float(modifier.split()[0]))
            return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"

        def on_connect(dbapi_conn, _record) -> None:  # an application function overrides the built-in
            dbapi_conn.create_function("strftime", 3, strftime)
    elif store.dialect == "postgresql":
        with store.engine.begin() as conn:
            namespace = conn.exec_driver_sql("SELECT current_schema()").scalar()
            conn.exec_driver_sql(f"CREATE FUNCTION clock_timestamp() RETURNS timestamptz LANGUAGE sql STABLE "
                                 f"AS $$ SELECT '{naive.isoformat()}+00'::timestamptz $$")

        def on_connect(dbapi_conn, _record) -> None:  # pg_catalog after the namespace: its function wins
            with dbapi_conn.cursor() as cursor:
                cursor.execute(f"SET search_path TO {namespace}, pg_catalog")
            dbapi_conn.commit()
    else:
        def on_connect(dbapi_conn, _record) -> None:
            with dbapi_conn.cursor() as cursor:
                cursor.execute(f"SET TIMESTAMP = {at.timestamp():.6f}")
    sa.event.listen(store.engine, "connect", on_connect)
    store.engine.dispose()  # connections opened before the listener (schema creation) are dropped
    assert store.db_now() == at and store.db_now() == at
    return store


@pytest.fixture
def frozen(any_store, shared_backend_url):
    """(the normal store, a store whose database clock stands still at a ms-aligned 'now')."""
    real_now = any_store.db_now()
    at = real_now.replace(microsecond=real_now.microsecond // 1000 * 1000)
    still = _frozen_clock_store(shared_backend_url, at)
    yield any_store, still
    still.close()
    if any_store.dialect == "postgresql":  # the namespace is shared (conftest.shared_backend_url): put it back
        with any_store.engine.begin() as conn:
            namespace = conn.exec_driver_sql("SELECT current_schema()").scalar()
            conn.exec_driver_sql(f"DROP FUNCTION {namespace}.clock_timestamp()")


def test_job_lease_is_live_up_to_and_including_its_expiry_instant(frozen):
    """``expected_completion_at`` "has not passed" while it equals the database's now: the lease is live."""
    _, store = frozen
    _register(store, "a")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    claim = _claim(store, job, instance="a")
    assert store.extend(job["id"], claim.lock_token, 0, claim.run_id, NOW)  # expires exactly now
    row = store.get_job("j")
    assert row["expected_completion_at"] == store.db_now()
    assert _claim(store, row, instance="b") is None
    assert store.due_jobs(NOW + dt.timedelta(days=1), 10) == []  # the Queue job still waits for the lease


def test_supervisor_is_alive_while_its_lease_is_in_the_future(frozen):
    _, store = frozen
    store.register_supervisor("a", "h", 1, 0.001)  # expires 1 ms after the (frozen) now
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job, instance="a")
    assert _claim(store, store.get_job("j"), instance="b") is None
    assert store.abandon_orphaned_runs() == []
    assert store.held_runs({claim.run_id: claim.lock_token}, "a") == {claim.run_id: None}


@pytest.mark.parametrize("then", ["sweep", "claim"])
def test_stopped_supervisor_is_dead_at_the_same_clock_reading(frozen, then):
    """stop_supervisor "ends the lease at once": with the database clock standing still, a sweep (or a claim)
    right after the stop must already treat the supervisor as dead."""
    _, store = frozen
    _register(store, "a")
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, job, instance="a")
    store.stop_supervisor("a")
    row = _supervisor(store, "a")
    assert row["stopped_at"] is not None
    assert row["lease_expires_at"] == store.db_now()  # the same clock reading
    if then == "sweep":
        assert [r["id"] for r in store.abandon_orphaned_runs()] == [first.run_id]
    else:
        assert _claim(store, store.get_job("j"), instance="b") is not None


# -- supervisors: register / renew / stop / list -------------------------------------------------------


def test_register_supervisor_sets_a_lease_on_the_database_clock(any_store):
    store = any_store
    before = store.db_now()
    registered_at = store.register_supervisor("h:1", "host-h", 1234, 30)
    after = store.db_now()
    assert before <= registered_at <= after
    [row] = store.list_supervisors()
    assert (row["instance"], row["hostname"], row["pid"], row["stopped_at"]) == ("h:1", "host-h", 1234, None)
    assert row["heartbeat_at"] == registered_at
    # (PostgreSQL's clock_timestamp() moves between the columns of one statement: microseconds apart)
    assert abs(row["started_at"] - row["heartbeat_at"]) < dt.timedelta(milliseconds=100)
    assert row["heartbeat_at"].tzinfo is not None and row["heartbeat_at"].utcoffset() == dt.timedelta(0)
    assert abs(row["lease_expires_at"] - (row["heartbeat_at"] + dt.timedelta(seconds=30))) < dt.timedelta(seconds=1)


def test_renew_supervisor_moves_lease_forward_by_database_clock(any_store):
    store = any_store
    registered_at = _register(store, "h:1", ttl_s=SHORT)
    first = _supervisor(store, "h:1")
    _wait_db_past(store, registered_at)  # the DB clock has moved on
    before = store.db_now()
    renewed_at = store.renew_supervisor("h:1", SHORT)  # the same ttl: the expiry still moves forward
    after = store.db_now()
    assert renewed_at is not None and before <= renewed_at <= after
    row = _supervisor(store, "h:1")
    assert row["heartbeat_at"] == renewed_at
    assert row["lease_expires_at"] > first["lease_expires_at"]
    assert abs(row["lease_expires_at"] - (renewed_at + dt.timedelta(seconds=SHORT))) < dt.timedelta(milliseconds=100)
    assert row["started_at"] == first["started_at"] and row["stopped_at"] is None
    # a longer ttl moves it much further; the DB clock, not the caller's, is the base
    assert store.renew_supervisor("h:1", LONG) is not None
    assert _supervisor(store, "h:1")["lease_expires_at"] > store.db_now() + dt.timedelta(seconds=LONG - 60)


def test_renew_supervisor_after_expiry_revives_it(any_store):
    """Renewal is one statement on the row: an expired (but not stopped) row is renewed, and its leases are
    live again."""
    store = any_store
    _register(store, "h:1", ttl_s=SHORT)
    add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    assert _claim(store, store.get_job("j"), instance="h:1") is not None
    _wait_supervisor_expired(store, "h:1")
    assert store.renew_supervisor("h:1", LONG) is not None
    assert _claim(store, store.get_job("j"), instance="b") is None


def test_renew_supervisor_returns_none_for_unknown_or_stopped(any_store):
    store = any_store
    assert store.renew_supervisor("nobody:1", LONG) is None
    assert store.list_supervisors() == []  # renewal never creates a row
    _register(store, "h:1")
    store.stop_supervisor("h:1")
    stopped = _supervisor(store, "h:1")
    assert stopped["stopped_at"] is not None
    assert stopped["lease_expires_at"] <= store.db_now()
    assert store.renew_supervisor("h:1", LONG) is None
    assert _supervisor(store, "h:1") == stopped  # nothing written
    # registering again resets the row: live, renewable
    _register(store, "h:1", ttl_s=LONG)
    again = _supervisor(store, "h:1")
    assert again["stopped_at"] is None and again["lease_expires_at"] > store.db_now()
    assert store.renew_supervisor("h:1", LONG) is not None
    assert len(store.list_supervisors()) == 1


def test_stop_supervisor_of_unknown_instance_is_a_no_op(any_store):
    store = any_store
    store.stop_supervisor("nobody:1")
    assert store.list_supervisors() == []


def test_list_supervisors_newest_heartbeat_first(any_store):
    store = any_store
    _register(store, "a:1")
    b_at = _register(store, "b:2")
    _wait_db_past(store, b_at)
    store.renew_supervisor("a:1", LONG)
    listed = store.list_supervisors()
    assert [s["instance"] for s in listed] == ["a:1", "b:2"]
    assert set(listed[0]) == {"instance", "hostname", "pid", "started_at", "heartbeat_at", "lease_expires_at",
                              "stopped_at", "max_concurrent_jobs", "version"}


# -- held_runs -----------------------------------------------------------------------------------------


def test_held_runs_keeps_only_running_runs_still_carrying_their_lease(any_store):
    store = any_store
    _register(store, "me:1")
    _register(store, "old:2")
    held = _claim(store, add_job(store, "held", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    leaseless = _claim(store, add_job(store, "conc", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent"),
                       instance="me:1", take_lease=False)
    orphan = _claim(store, add_job(store, "orphan", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    taken = _claim(store, add_job(store, "taken", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    released = _claim(store, add_job(store, "released", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    finished = _claim(store, add_job(store, "finished", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    claims = (held, leaseless, orphan, taken, released, finished)
    everything = {c.run_id: c.lock_token for c in claims}
    assert store.held_runs(everything, "me:1") == dict.fromkeys(everything)
    assert store.held_runs({**everything, 987654: None}, "me:1") == dict.fromkeys(everything)  # unknown: dropped
    assert store.held_runs(everything, "old:2") == {}  # another instance's runs are not its own

    with store.engine.begin() as conn:  # the orphan's row now says another (dead) supervisor ran it
        conn.execute(runs.update().where(runs.c.id == orphan.run_id)
                     .values(executed_by_instance="dead:3"))
    assert [r["id"] for r in store.abandon_orphaned_runs()] == [orphan.run_id]  # dead:3 never registered
    _stop(store, "me:1")
    _register(store, "old:2")
    assert _claim(store, store.get_job("taken"), instance="old:2") is not None  # token changed
    _register(store, "me:1")
    assert store.release(store.get_job("released")["id"], released.lock_token)  # token cleared
    assert _finish(store, finished, store.get_job("finished")["id"])
    assert store.held_runs(everything, "me:1") == {held.run_id: None, leaseless.run_id: None}
    assert store.held_runs({held.run_id: "another token"}, "me:1") == {}  # a run row is matched by its token
    assert store.held_runs({leaseless.run_id: held.lock_token}, "me:1") == {}
    assert store.held_runs({}, "me:1") == {}


def test_cancel_request_is_reported_by_held_runs_and_kept_once(any_store):
    store = any_store
    _register(store, "me:1")
    claim = _claim(store, add_job(store, "j", "ok", now=NOW, next_run_at=NOW), instance="me:1")
    first = store.request_cancel(claim.run_id, "alice@host")
    assert first is not None and first["cancel_requested_by"] == "alice@host"
    assert first["cancel_requested_at"] is not None and first["status"] == "Running"
    again = store.request_cancel(claim.run_id, "bob@host")  # the first request stands
    assert again is not None and (again["cancel_requested_by"], again["cancel_requested_at"]) == (
        "alice@host", first["cancel_requested_at"])
    assert store.held_runs({claim.run_id: claim.lock_token}, "me:1") == {claim.run_id: "alice@host"}
    assert store.request_cancel(987654, "alice@host") is None
    assert _finish(store, claim, store.get_job("j")["id"])
    done = store.request_cancel(claim.run_id, "carol@host")  # finished: nothing written
    assert done is not None and done["status"] == "Completed" and done["cancel_requested_by"] == "alice@host"


# -- due_jobs / next_due_at / queue_now ----------------------------------------------------------------


def test_due_jobs_only_active(any_store):
    store = any_store
    past = NOW - dt.timedelta(minutes=1)
    for status in ("Pending", "Active", "Paused", "Disabled", "Expired"):
        add_job(store, status.lower(), "ok", now=NOW, next_run_at=past, status=status)
    assert [j["name"] for j in store.due_jobs(NOW, 10)] == ["active"]
    assert store.next_due_at() == past


def test_due_jobs_ordering_limit_exclude_and_future(any_store):
    store = any_store
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
    assert {j["name"] for j in store.active_jobs()} == {"a", "b", "later", "unscheduled"}


def test_job_scheduled_by_the_planner_is_never_due_before_start_at(any_store):
    """Writers keep next_run_at >= start_at (planner.initial_next_run_at); the store then never reports the
    job due before start_at. (The supervisor separately re-plans rows edited outside the CLI.)"""
    store = any_store
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


def test_next_due_at_none_when_nothing_scheduled(any_store):
    store = any_store
    assert store.next_due_at() is None
    add_job(store, "p", "ok", now=NOW, next_run_at=NOW, status="Paused")
    assert store.next_due_at() is None


def test_queue_job_with_live_lease_is_not_due(any_store):
    store = any_store
    _register(store)
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
    assert store.next_due_at(exclude={s["id"]}) == NOW + dt.timedelta(seconds=1)


def test_due_live_skip_jobs_are_the_due_skip_jobs_whose_lease_is_live(any_store):
    """What a busy supervisor reads to skip on time (issue 12): due Skip jobs (not RunAll) whose lease is
    held by a live supervisor, oldest first, limited; not a free lease, a Queue job, a future occurrence."""
    store = any_store
    _register(store)
    _register(store, "q:1")
    later = NOW + dt.timedelta(seconds=1)
    held = {name: add_job(store, name, "ok", now=NOW, next_run_at=NOW, **values) for name, values in [
        ("s2", {}), ("s1", {}), ("q", {"concurrency_mode": "Queue"}), ("all", {"missed_run_policy": "RunAll"}),
        ("dead", {})]}
    add_job(store, "free", "ok", now=NOW, next_run_at=NOW)
    for name, job in held.items():
        _claim(store, job, next_run_at=later if name != "s1" else NOW + dt.timedelta(milliseconds=500),
               instance="q:1" if name == "dead" else HOLDER, lease_s=LONG)
    _kill_holder(store, "expired", "q:1")
    at = NOW + dt.timedelta(minutes=1)
    assert [j["name"] for j in store.due_live_skip_jobs(at, 10)] == ["s1", "s2"]
    assert [j["name"] for j in store.due_live_skip_jobs(at, 1)] == ["s1"]
    assert [j["name"] for j in store.due_live_skip_jobs(at, 10, exclude={held["s1"]["id"]})] == ["s2"]
    assert store.due_live_skip_jobs(NOW + dt.timedelta(milliseconds=999), 10)[0]["name"] == "s1"
    assert store.due_live_skip_jobs(NOW, 10) == []


def test_queue_job_due_again_once_lease_expired(any_store):
    store = any_store
    _register(store)
    q = add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    claim = _claim(store, q, next_run_at=NOW + dt.timedelta(seconds=1), lease_s=LONG)
    assert store.due_jobs(NOW + dt.timedelta(minutes=1), 10) == []
    assert store.extend(q["id"], claim.lock_token, SHORT, claim.run_id, NOW)
    _wait_lease_expired(store, "q")
    assert [j["name"] for j in store.due_jobs(NOW + dt.timedelta(minutes=1), 10)] == ["q"]


def test_queue_job_due_again_once_holder_supervisor_dies(any_store):
    store = any_store
    _register(store, "q:1")
    q = add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    _claim(store, q, instance="q:1", next_run_at=NOW + dt.timedelta(seconds=1), lease_s=LONG)
    assert store.due_jobs(NOW + dt.timedelta(minutes=1), 10) == []
    assert store.next_due_at() is None
    _kill_holder(store, "expired", "q:1")
    assert [j["name"] for j in store.due_jobs(NOW + dt.timedelta(minutes=1), 10)] == ["q"]
    assert store.next_due_at() == NOW + dt.timedelta(seconds=1)


def test_queue_now_makes_the_pending_occurrence_due_now(any_store):
    store = any_store
    later = NOW + dt.timedelta(hours=1)
    q = add_job(store, "q", "ok", now=NOW, next_run_at=later, concurrency_mode="Queue")
    stale = store.get_job("q")
    assert store.due_jobs(NOW, 10) == []
    at = NOW + dt.timedelta(seconds=5)
    assert store.queue_now(q["id"], at) is True
    row = store.get_job("q")
    assert row["next_run_at"] == at and row["updated_at"] != at  # scheduling progress is not an edit
    assert [j["name"] for j in store.due_jobs(at, 10)] == ["q"]
    assert store.queue_now(q["id"], at) is False  # already due: nothing written
    assert store.queue_now(q["id"], at + dt.timedelta(seconds=1)) is False
    assert store.get_job("q")["next_run_at"] == at
    # a claim that read next_run_at before queue_now loses the compare-and-set
    assert _claim(store, stale) is None
    assert _claim(store, store.get_job("q"), next_run_at=later) is not None


def test_queue_now_on_unscheduled_or_missing_job(any_store):
    store = any_store
    add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    job_id = store.get_job("q")["id"]
    assert store.set_next_run_at(job_id, NOW, None, NOW)
    assert store.queue_now(job_id, NOW) is True
    assert store.get_job("q")["next_run_at"] == NOW
    assert store.queue_now(job_id + 1000, NOW) is False


def test_queue_now_while_lease_is_live_waits_for_the_lease(any_store):
    store = any_store
    _register(store)
    q = add_job(store, "q", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Queue")
    claim = _claim(store, q)
    assert store.queue_now(q["id"], NOW + dt.timedelta(seconds=1)) is True
    assert store.due_jobs(NOW + dt.timedelta(minutes=1), 10) == []  # queued behind the live lease
    assert _finish(store, claim, q["id"])
    assert [j["name"] for j in store.due_jobs(NOW + dt.timedelta(minutes=1), 10)] == ["q"]


# -- set_next_run_at -----------------------------------------------------------------------------------


def test_set_next_run_at_is_compare_and_set(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    t1 = NOW + dt.timedelta(hours=1)
    assert store.set_next_run_at(job["id"], NOW - dt.timedelta(seconds=1), t1, NOW) is False
    assert store.set_next_run_at(job["id"], None, t1, NOW) is False
    assert store.get_job("j")["next_run_at"] == NOW
    assert store.set_next_run_at(job["id"], NOW, t1, NOW) is True
    assert store.get_job("j")["next_run_at"] == t1
    assert store.set_next_run_at(job["id"], NOW, t1 + dt.timedelta(hours=1), NOW) is False  # stale seen
    assert store.get_job("j")["skipped_count"] == 0


def test_set_next_run_at_counts_skips_and_sets_status(any_store):
    store = any_store
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


def test_microsecond_datetimes_round_trip(any_store):
    store = any_store
    t = NOW + dt.timedelta(microseconds=123457)
    add_job(store, "j", "ok", now=NOW, next_run_at=t)
    assert store.get_job("j")["next_run_at"] == t
    assert store.due_jobs(t - dt.timedelta(microseconds=1), 10) == []
    assert [j["name"] for j in store.due_jobs(t, 10)] == ["j"]


# -- races between processes' stores -------------------------------------------------------------------


@pytest.mark.parametrize("take_lease", [True, False])
def test_racing_claims_from_separate_stores_exactly_one_wins(any_store, shared_backend_url, take_lease):
    store = any_store
    add_job(store, "race", "ok", now=NOW, next_run_at=NOW,
            concurrency_mode="Skip" if take_lease else "Concurrent")
    job = store.get_job("race")
    n = 8
    for i in range(n):
        _register(store, f"inst-{i}")
    barrier = threading.Barrier(n, timeout=20)
    results: list = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        own = Store.open(shared_backend_url)
        try:
            own.db_now()  # connect before the barrier, so the claims really race
            barrier.wait()
            results[i] = _claim(own, job, instance=f"inst-{i}", take_lease=take_lease)
        except BaseException as exc:
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
    assert [r["id"] for r in store.list_runs(job_name="race")] == [claim.run_id]
    row = store.get_job("race")
    assert row["next_run_at"] == NOW + dt.timedelta(hours=1)
    if take_lease:
        assert row["lock_token"] == claim.lock_token
        assert row["locked_by_instance"] == f"inst-{i}"
    else:
        assert row["lock_token"] is None


def test_racing_claims_of_a_new_occurrence_while_lease_is_live_all_lose(any_store, shared_backend_url):
    """N stores race for the next occurrence of a job whose lease a live supervisor holds: none wins."""
    store = any_store
    _register(store, "holder:0")
    add_job(store, "race", "ok", now=NOW, next_run_at=NOW)
    assert _claim(store, store.get_job("race"), instance="holder:0") is not None
    job = store.get_job("race")
    n = 6
    barrier = threading.Barrier(n, timeout=20)
    results: list = ["not run"] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        own = Store.open(shared_backend_url)
        try:
            own.db_now()
            barrier.wait()
            results[i] = _claim(own, job, instance=f"inst-{i}")
        except BaseException as exc:
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
    assert results == [None] * n
    assert store.get_job("race")["locked_by_instance"] == "holder:0"
    assert len(store.list_runs(job_name="race")) == 1


# -- schema and job management -------------------------------------------------------------------------


def test_schema_creates_tables_and_indexes(any_store):
    store = any_store
    inspector = sa.inspect(store.engine)
    assert set(inspector.get_table_names()) >= {"jobs", "runs", "supervisors"}
    job_indexes = {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("jobs")}
    run_indexes = {ix["name"]: ix["column_names"] for ix in inspector.get_indexes("runs")}
    assert job_indexes["ix_jobs_status_next_run_at"] == ["status", "next_run_at"]
    assert run_indexes["ix_runs_job_id_started_at"] == ["job_id", "started_at"]
    assert run_indexes["ix_runs_status"] == ["status"]
    # the unique job name and the unique occurrence are enforced by the schema
    assert ["name"] in [u["column_names"] for u in inspector.get_unique_constraints("jobs")]
    run_uniques = {u["name"]: u["column_names"] for u in inspector.get_unique_constraints("runs")}
    run_uniques.update({ix["name"]: ix["column_names"] for ix in inspector.get_indexes("runs") if ix["unique"]})
    assert run_uniques["uq_runs_job_id_scheduled_at_attempt"] == ["job_id", "scheduled_at", "attempt"]
    assert inspector.get_pk_constraint("supervisors")["constrained_columns"] == ["instance"]


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


def test_schema_creation_is_idempotent(any_store, shared_backend_url):
    store = any_store
    add_job(store, "kept", "ok", now=NOW)
    again = Store.open(shared_backend_url)  # create_all on an existing schema
    try:
        assert [j["name"] for j in again.list_jobs()] == ["kept"]
    finally:
        again.close()


def test_schema_check_constraints_reject_bad_status(any_store):
    """The CHECK constraint itself (raw SQL, bypassing Store.add_job). PyMySQL reports MariaDB's CHECK
    violations (error 4025) as OperationalError, the others as IntegrityError."""
    store = any_store
    with (pytest.raises((sa.exc.IntegrityError, sa.exc.OperationalError), match="ck_status"),
          store.engine.begin() as conn):
        conn.execute(jobs.insert().values(name="bad", job_type="ok", cron_expression="* * * * *",
                                          status="Bogus", created_at=NOW, updated_at=NOW))
    assert store.list_jobs() == []


def test_runs_foreign_key_is_enforced(any_store):
    store = any_store
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=424242, scheduled_at=NOW, started_at=NOW, status="Running"))


@pytest.mark.parametrize("values", [
    {"status": "Bogus"},
    {"concurrency_mode": "Sometimes"},
])
def test_add_job_constraint_violation_is_not_reported_as_duplicate_name(any_store, values):
    store = any_store
    with pytest.raises(Exception) as info:
        store.add_job({"name": "fresh", "job_type": "ok", "cron_expression": "* * * * *", **values}, NOW)
    assert store.list_jobs() == []
    assert "already exists" not in str(info.value), f"misleading error: {info.value}"


@pytest.mark.parametrize("values", [
    {"status": "Bogus"},
    {"concurrency_mode": "Sometimes"},
])
def test_add_job_constraint_violation_is_an_input_error_on_every_backend(any_store, values):
    store = any_store
    with pytest.raises(InputError) as info:
        store.add_job({"name": "fresh", "job_type": "ok", "cron_expression": "* * * * *", **values}, NOW)
    assert info.value.field == "job"
    assert store.list_jobs() == []


def test_add_job_duplicate_name_raises_input_error(any_store):
    store = any_store
    add_job(store, "dup", "ok", now=NOW)
    with pytest.raises(InputError) as info:
        add_job(store, "dup", "fail", now=NOW)
    assert info.value.field == "name"
    assert "dup" in str(info.value)
    assert len(store.list_jobs()) == 1


def test_add_job_serialises_configuration_and_defaults(any_store):
    store = any_store
    store.add_job({"name": "c", "job_type": "ok", "cron_expression": "* * * * *",
                   "configuration": {"seconds": 1.5}}, NOW)
    row = store.get_job("c")
    assert row["configuration"] == '{"seconds": 1.5}'
    assert row["status"] == "Pending"
    assert row["timezone"] == "UTC"
    assert row["concurrency_mode"] == "Skip"
    assert (row["run_count"], row["skipped_count"]) == (0, 0)
    assert row["run_immediately_if_never_run"] is False and row["notify_on_failure"] is True
    assert row["created_at"] == NOW and row["updated_at"] == NOW
    assert row["created_at"].tzinfo is not None


def test_update_job_changes_columns_and_updated_at(any_store):
    store = any_store
    add_job(store, "u", "ok", now=NOW)
    later = NOW + dt.timedelta(minutes=1)
    store.update_job("u", {"description": "new", "configuration": {"a": 1}}, later)
    row = store.get_job("u")
    assert (row["description"], row["configuration"], row["updated_at"]) == ("new", '{"a": 1}', later)
    assert row["created_at"] == NOW


def test_store_rejects_naive_datetimes(any_store):
    with pytest.raises(sa.exc.StatementError):
        any_store.add_job({"name": "n", "job_type": "ok", "cron_expression": "* * * * *",
                           "next_run_at": dt.datetime(2030, 1, 1)}, NOW)


def test_missing_job_and_run_raise_not_found(any_store):
    store = any_store
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


def test_remove_job_deletes_its_runs(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    _finish(store, claim, job["id"])
    _claim(store, store.get_job("j"), take_lease=False)  # and a Running one
    store.remove_job("j")
    assert store.list_jobs() == []
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 0


def test_list_runs_newest_first_filtered_and_limited(any_store):
    store = any_store
    a = add_job(store, "a", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    b = add_job(store, "b", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    ra1 = _claim(store, a, take_lease=False)
    rb = _claim(store, b, take_lease=False)
    ra2 = _claim(store, store.get_job("a"), take_lease=False)
    assert _finish(store, ra1, a["id"])
    assert [r["id"] for r in store.list_runs()] == [ra2.run_id, rb.run_id, ra1.run_id]
    assert [r["id"] for r in store.list_runs(job_name="a")] == [ra2.run_id, ra1.run_id]
    assert [r["id"] for r in store.list_runs(status="Running")] == [ra2.run_id, rb.run_id]
    assert [r["id"] for r in store.list_runs(limit=1)] == [ra2.run_id]
    assert {r["job_name"] for r in store.list_runs()} == {"a", "b"}


def test_db_now_is_aware_utc_close_to_wall_clock_and_advancing(any_store):
    store = any_store
    now = store.db_now()
    assert now.tzinfo is not None and now.utcoffset() == dt.timedelta(0)
    assert abs((now - dt.datetime.now(UTC)).total_seconds()) < 5
    assert _wait_db_past(store, now) > now  # not frozen (e.g. at a transaction's start)


# -- typed rows: every row the facade returns has exactly the keys its TypedDict declares ----------------


def _keys(row_type: type) -> set[str]:
    return set(row_type.__required_keys__ | row_type.__optional_keys__)  # type: ignore[attr-defined]


def test_column_rows_declare_exactly_their_tables_columns():
    for row_type, table in ((JobRow, jobs), (RunRow, runs), (SupervisorRow, supervisors),
                            (NotificationRow, notifications), (RunOutputRow, run_output),
                            (PluginReloadRow, plugin_reloads)):
        assert _keys(row_type) == set(table.c.keys()), row_type.__name__
    assert _keys(OutboxRow) == set(notifications.c.keys()) - {
        "id", "status", "attempts", "next_attempt_at", "claimed_by", "claimed_until", "last_error", "created_at",
        "sent_at"}


def test_rows_returned_have_exactly_their_typed_keys(any_store):
    store = any_store
    _register(store)
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, concurrency_mode="Concurrent")
    assert set(job) == _keys(JobRow)
    assert [set(r) for r in store.list_jobs() + store.due_jobs(NOW, 10) + store.active_jobs()] == [_keys(JobRow)] * 3
    failed = _claim(store, job, take_lease=False)
    notice = {"channel": "log", "event": "Failure", "job_id": job["id"], "job_name": "j", "run_id": failed.run_id,
              "subject": "s", "body": "b", "priority": "High", "recipients": None, "details": None}
    assert store.finish_run(failed.run_id, job["id"], None, status="Failed", success=False, error_message="e",
                            details={"k": 1}, duration_ms=1.0, notices=[notice])
    running = _claim(store, store.get_job("j"), take_lease=False)
    assert set(store.get_run(failed.run_id)) == _keys(RunView)
    assert [set(r) for r in store.list_runs()] == [_keys(RunView)] * 2
    assert [set(r) for r in store.running_runs()] == [_keys(RunRow)]
    assert [set(r) for r in store.list_supervisors()] == [_keys(SupervisorRow)]
    assert [set(r) for r in store.status_supervisors()] == [_keys(SupervisorStatus)]
    assert [set(r) for r in store.inflight_runs()] == [_keys(InflightRun)]
    assert [set(r) for r in store.next_due_jobs()] == [_keys(NextDueJob)]
    assert [set(r) for r in store.recent_failures()] == [_keys(RecentFailure)]
    assert [set(r) for r in store.list_notifications()] == [_keys(NotificationRow)]
    claimed = store.claim_notification(store.due_notification_ids(10)[0], "sender", LONG)
    assert claimed is not None and set(claimed) == _keys(NotificationRow)
    _kill_holder(store, "stopped", HOLDER)
    abandoned = store.abandon_orphaned_runs()
    assert [r["id"] for r in abandoned] == [running.run_id]
    assert set(abandoned[0]) == _keys(AbandonedRun)


# -- the store records facts; the caller formats the notices of abandoned runs ------------------------------


def _outbox_row(run: AbandonedRun) -> OutboxRow:
    return {"channel": "log", "event": "Failure", "job_id": run["job_id"], "job_name": run["job_name"],
            "run_id": run["id"], "subject": f"run {run['id']} abandoned", "body": run["error_message"] or "",
            "priority": "High", "recipients": None, "details": None}


def test_abandon_writes_the_callers_notices_in_the_runs_transaction(any_store):
    """``notices_for`` is asked for each abandoned run's outbox rows; they are written in the transaction
    that fails the run: when building them raises, nothing of that run's abandonment is written."""
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW, notify_on_failure=False)
    claim = _claim(store, job, instance="gone:1")  # never registered: dead from the start

    def broken(run: AbandonedRun) -> list[OutboxRow]:
        raise RuntimeError("cannot format")

    with pytest.raises(RuntimeError, match="cannot format"):
        store.abandon_orphaned_runs(notices_for=broken)
    assert store.get_run(claim.run_id)["status"] == "Running"
    row = store.get_job("j")
    assert row["lock_token"] == claim.lock_token and row["failure_count"] == 0
    assert store.list_notifications() == []

    asked: list[AbandonedRun] = []
    abandoned = store.abandon_orphaned_runs(notices_for=lambda run: asked.append(run) or [_outbox_row(run)])
    assert [r["id"] for r in asked] == [r["id"] for r in abandoned] == [claim.run_id]
    assert asked[0]["notify_on_failure"] is False  # the caller decides; the store passes the job's settings
    assert "gone:1" in asked[0]["error_message"]
    assert [(n["run_id"], n["status"], n["subject"]) for n in store.list_notifications()] == [
        (claim.run_id, "Pending", f"run {claim.run_id} abandoned")]
    assert store.get_run(claim.run_id)["status"] == "Failed"
    assert store.abandon_orphaned_runs(notices_for=lambda run: pytest.fail("nothing left to abandon")) == []


def test_store_package_never_imports_notices():
    """Statically (no module under store/ names it) and at run time (importing the store loads it not)."""
    package = Path(mjsched_isolated.store.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("mjsched_isolated.notices")]
    assert offenders == []
    code = "import sys, mjsched_isolated.store; print('mjsched_isolated.notices' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert result.stdout.strip() == "False"


# -- text: one cap (protocol.MAX_TEXT_BYTES) for what is written to TEXT columns ----------------------------


def test_fit_text_cuts_on_a_character_boundary_within_the_protocol_cap():
    assert fit_text(None) is None
    small = "é" * (MAX_TEXT_BYTES // 2)  # exactly the cap in UTF-8
    assert fit_text(small) == small
    cut = fit_text("é" * MAX_TEXT_BYTES)
    assert cut is not None and len(cut.encode()) <= MAX_TEXT_BYTES
    assert cut.endswith(f" [... cut: {2 * MAX_TEXT_BYTES} bytes in all]") and cut.startswith("é" * 1000)
    assert len(fit_text("€" * 500, 100).encode()) <= 100  # type: ignore[union-attr]  # 3-byte characters


def test_fit_json_keeps_small_details_and_previews_large_ones():
    assert fit_json(None) is None
    assert json.loads(fit_json({"k": [1, 2]}) or "") == {"k": [1, 2]}
    preview = json.loads(fit_json({"blob": "x" * MAX_TEXT_BYTES}) or "")
    assert preview["truncated"] is True and preview["size_bytes"] > MAX_TEXT_BYTES
    assert len(preview["preview"]) == 2000


def test_finish_run_fits_oversized_text_into_every_backend(any_store):
    """MySQL/MariaDB's TEXT holds 65,535 bytes: an error message and details far larger are stored cut."""
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                            error_message="é" * 100_000, details={"blob": "ü" * 100_000}, duration_ms=1.0)
    run = store.get_run(claim.run_id)
    assert len(run["error_message"].encode()) <= MAX_TEXT_BYTES and "cut: 200000 bytes" in run["error_message"]
    assert run["details"]["truncated"] is True


# -- run ids ----------------------------------------------------------------------------------------------


def test_sqlite_never_reuses_a_run_id(store):
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    first = _claim(store, job)
    store.remove_job("j")
    second = _claim(store, add_job(store, "j", "ok", now=NOW, next_run_at=NOW))
    assert second.run_id != first.run_id
    assert store.get_job("j")["id"] != job["id"]  # nor a job id


def test_a_result_is_matched_by_run_id_and_token(any_store):
    """A result carrying another lease token (a run of a removed job whose id came back, or a fenced run)
    never lands on the run row, and its heartbeat moves no deadline."""
    store = any_store
    job = add_job(store, "j", "ok", now=NOW, next_run_at=NOW)
    claim = _claim(store, job)
    assert not store.finish_run(claim.run_id, job["id"], "another token", status="Completed", success=True,
                                error_message=None, details=None, duration_ms=1.0)
    assert not store.finish_run(claim.run_id, job["id"], None, status="Completed", success=True,
                                error_message=None, details=None, duration_ms=1.0)
    store.extend(job["id"], None, 60, claim.run_id, NOW + dt.timedelta(days=1))  # a leaseless run's heartbeat
    run = store.get_run(claim.run_id)
    assert run["status"] == "Running" and run["deadline_at"] == NOW + dt.timedelta(minutes=5)
    assert _finish(store, claim, job["id"])
