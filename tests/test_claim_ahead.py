"""``claim_ahead_s`` (issue 11, idle dispatch): an idle supervisor claims a plain occurrence shortly before its
instant and hands it over; the worker starts the plugin at the instant by its own clock, never before. The
decisions on the in-process fake pool; the start at the instant (and never before) with real workers."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time

import pytest
from conftest import Driver, add_job

from mjsched_isolated import ops
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import InputError
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.worker import main as worker_main
from mjsched_isolated.worker.execute import wait_for_start

YEARLY = "0 0 1 1 *"  # never due again within a test


def _steps(d):
    """(start, ``at(instant)``): :meth:`Driver.timeline` by database instants instead of seconds."""
    seconds = d.timeline()
    start = seconds(0)
    return start, lambda instant: seconds((instant - start).total_seconds())


def test_an_occurrence_is_claimed_ahead_as_if_at_its_instant_and_handed_over_with_it(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3, lease_timeout_s=60)
    d.pool.hold()
    start, at = _steps(d)
    instant = start + dt.timedelta(seconds=1)
    for name in ("a", "b", "c"):
        add_job(store, name, "ok", YEARLY, next_run_at=instant)
    at(instant - dt.timedelta(milliseconds=120))  # more than claim_ahead_s (100 ms) before it: not yet
    assert d.pool.submitted == []
    now = at(instant - dt.timedelta(milliseconds=40))
    assert sorted(r.job_name for r in d.pool.submitted) == ["a", "b", "c"]
    epoch = d.supervisor.dispatcher.local_epoch(instant)
    assert abs(epoch - instant.timestamp()) < 0.01  # the same clock here
    assert {r.start_at for r in d.pool.submitted} == {epoch}  # each worker starts it at the instant
    assert {r.deadline_at for r in d.pool.submitted} == {(instant + dt.timedelta(seconds=60)).timestamp()}
    for request in d.pool.submitted:
        run = store.get_run(request.run_id)
        assert run["scheduled_at"] == instant and run["started_at"] == instant  # never recorded as early
    # the loop sleeps until claim_ahead_s before the next occurrence (a year away), not until this one
    assert d.supervisor.dispatcher.next_due_at(now) is None or d.supervisor.dispatcher.next_due_at(now) > instant


def test_a_job_whose_run_is_live_is_neither_claimed_nor_skipped_ahead_of_its_instant(mem_store, fake_factory):
    """A Skip job's next occurrence comes due while its run is live: the run may end before the instant, so
    the occurrence is judged at its instant, as without claim_ahead_s (skipped then); the loop wakes at the
    instant, not in a loop before it."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    d.pool.hold("s")
    add_job(store, "s", "ok", "* * * * * *", concurrency_mode="Skip")
    _, at = _steps(d)
    assert [r.job_name for r in d.pool.submitted] == ["s"]  # its run, live
    instant = store.get_job("s")["next_run_at"]
    now = at(instant - dt.timedelta(milliseconds=30))
    assert len(d.pool.submitted) == 1 and store.get_job("s")["skipped_count"] == 0
    assert d.supervisor.dispatcher.next_due_at(now) == instant
    at(instant + dt.timedelta(milliseconds=1))
    assert store.get_job("s")["skipped_count"] == 1 and len(d.pool.submitted) == 1


def test_a_jobs_last_occurrence_is_claimed_at_its_instant(mem_store, fake_factory):
    """The claim of a last occurrence also expires the job (its status and updated_at written): not ahead."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    start, at = _steps(d)
    instant = start + dt.timedelta(seconds=1)
    add_job(store, "last", "ok", YEARLY, next_run_at=instant, end_at=instant + dt.timedelta(days=1))
    now = at(instant - dt.timedelta(milliseconds=30))
    assert d.pool.submitted == [] and d.supervisor.dispatcher.next_due_at(now) == instant
    at(instant)
    assert [(r.job_name, r.start_at) for r in d.pool.submitted] == [("last", None)]
    assert store.get_job("last")["status"] == "Expired"


def test_claim_ahead_s_0_claims_at_the_instant(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1, claim_ahead_s=0)
    start, at = _steps(d)
    instant = start + dt.timedelta(seconds=1)
    add_job(store, "plain", "ok", YEARLY, next_run_at=instant)
    now = at(instant - dt.timedelta(milliseconds=30))
    assert d.pool.submitted == [] and d.supervisor.dispatcher.next_due_at(now) == instant
    at(instant)
    assert [(r.job_name, r.start_at) for r in d.pool.submitted] == [("plain", None)]


def test_runs_claimed_ahead_start_at_their_instant_never_before(store, driver_factory):
    """Real workers: the runs are handed over before their instant (claim_ahead_s 0.5 s here, so a loaded
    machine cannot make the claim late) and each plugin begins at the instant, not when its request came."""
    d = driver_factory(max_concurrent_jobs=3, claim_ahead_s=0.5)
    d.until(lambda: len(d.pool.idle_workers()) == 3)
    handed: dict[int, float] = {}
    submit = d.pool.submit

    def timed_submit(worker, request):
        handed[request.run_id] = time.time()
        submit(worker, request)

    d.pool.submit = timed_submit
    instant = utcnow() + dt.timedelta(seconds=0.8)
    for name in ("a", "b", "c"):
        add_job(store, name, "ok", YEARLY, next_run_at=instant)
    d.until(lambda: len(handed) == 3 and all(r["status"] == "Completed" for r in store.list_runs(limit=10)))
    runs = store.list_runs(limit=10)
    assert len(runs) == 3
    for run in runs:
        assert handed[run["id"]] < instant.timestamp()  # claimed and handed over ahead
        assert run["started_at"] == instant
        began = run["details"]["plugin_started_at"]
        assert instant.timestamp() <= began < instant.timestamp() + 0.5  # at the instant, never before


def test_wait_for_start_never_returns_before_its_instant_and_gives_up_on_a_clock_stepped_back():
    start_at = time.time() + 0.03
    wait_for_start(start_at)
    assert time.time() >= start_at
    before = time.monotonic()
    wait_for_start(time.time() + 3600, max_wait_s=0.02)  # a wall clock an hour behind: not held an hour
    assert time.monotonic() - before < 1.0
    wait_for_start(None)


def test_a_worker_whose_supervisor_died_while_its_run_waited_never_starts_the_plugin():
    """``_hold_until`` in a child whose parent is not the supervisor it was given: it exits (status 0)
    instead of returning into the plugin's call (status 3)."""
    for supervisor_pid, expected in ((os.getpid(), 3), (os.getpid() + 1_000_000, 0)):
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            try:
                worker_main._hold_until(supervisor_pid, time.time() + 0.01)
            finally:
                os._exit(3)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == expected


@pytest.mark.parametrize("value", [-0.01, 1.5, float("nan")])
def test_claim_ahead_s_is_bounded(value):
    with pytest.raises(InputError, match="claim_ahead_s"):
        Settings(claim_ahead_s=value)


def _handed_ahead(d, on_hand_over):
    """Wrap ``d.pool.submit``: ``on_hand_over(worker, request)`` right after each run is handed to its worker."""
    submit = d.pool.submit

    def wrapped(worker, request):
        submit(worker, request)
        on_hand_over(worker, request)

    d.pool.submit = wrapped


def _waiting_ahead(make_driver, store):
    """A driver (cap 1, claim_ahead_s 1) whose job "a" is due 1.5 s from now and whose run for that instant has
    been claimed ahead and handed to its worker, which waits for the instant. Returns (driver, the ids of the
    runs handed over so far, the instant)."""
    d = make_driver(max_concurrent_jobs=1, claim_ahead_s=1.0)
    handed: list[int] = []
    _handed_ahead(d, lambda worker, request: handed.append(request.run_id))
    instant = utcnow() + dt.timedelta(seconds=1.5)
    add_job(store, "a", "ok", YEARLY, next_run_at=instant)
    d.until(lambda: len(handed) == 1)
    return d, handed, instant


@pytest.fixture
def any_driver(any_store, shared_backend_url):
    """``driver_factory`` on each database (real workers)."""
    made = []

    def make(**settings):
        made.append(Driver(any_store, shared_backend_url, **settings).start())
        return made[-1]

    yield make
    for d in made:
        d.close()


def test_a_run_whose_worker_dies_before_its_instant_never_started_and_its_occurrence_runs_at_the_instant(
        any_store, any_driver):
    """Real workers: the worker of a run claimed ahead is killed before the instant. The run is recorded as
    never started (Cancelled, no duration, not counted, said so); attempt 2 of the occurrence is the job's
    pending retry at the instant, and runs then (never before), although the job has no retries."""
    store = any_store
    d = any_driver(max_concurrent_jobs=1, claim_ahead_s=1.0)
    handed = []

    def kill(worker, request):
        handed.append((request.run_id, time.time()))
        if len(handed) == 1:
            os.kill(worker.pid, signal.SIGKILL)

    _handed_ahead(d, kill)
    instant = utcnow() + dt.timedelta(seconds=1.5)
    add_job(store, "a", "ok", YEARLY, next_run_at=instant)
    d.until(lambda: len(handed) == 1 and store.get_run(handed[0][0])["status"] != "Running")
    first = store.get_run(handed[0][0])
    assert handed[0][1] < instant.timestamp()  # handed over ahead ... and dead before the instant
    assert first["status"] == "Cancelled" and first["duration_ms"] is None and first["details"] is None
    assert first["error_message"].startswith("never started: worker process ")
    assert "attempt 2 of occurrence" in first["error_message"]
    job = store.get_job("a")
    assert (job["retry_at"], job["retry_attempt"], job["next_run_at"]) == (instant, 2, instant)
    assert job["run_count"] == 0 and job["failure_count"] == 0  # not counted
    d.until(lambda: len(handed) == 2 and store.get_run(handed[1][0])["status"] == "Completed")
    second = store.get_run(handed[1][0])
    assert (second["scheduled_at"], second["attempt"]) == (instant, 2)
    assert second["details"]["plugin_started_at"] >= instant.timestamp()  # at its instant, never before
    job = store.get_job("a")
    assert job["retry_at"] is None and job["next_run_at"] > instant  # the regular schedule goes on


def test_a_run_claimed_ahead_and_stopped_by_a_shutdown_before_its_instant_is_run_again(store, driver_factory):
    """A second signal (cancel_all) before the instant: never started, its occurrence pending as attempt 2."""
    d, handed, instant = _waiting_ahead(driver_factory, store)
    d.supervisor.cancel_all(d.supervisor.read_clock()[0], "interrupted by shutdown (second signal)")
    if d.pool.reaped_at >= instant.timestamp() - 0.01:
        pytest.skip("the machine was too loaded: the kill came after the instant (the run may have started)")
    run = store.get_run(handed[0])
    assert run["status"] == "Cancelled" and run["duration_ms"] is None
    assert run["error_message"].startswith("never started: interrupted by shutdown (second signal)")
    job = store.get_job("a")
    assert (job["retry_at"], job["retry_attempt"]) == (instant, 2)


def test_a_shutdown_withdraws_a_run_claimed_ahead_before_its_instant(store, driver_factory):
    """Shutting down starts no new run: a run claimed ahead whose instant has not come is withdrawn at once
    (never started, its occurrence run again), not left to start during the drain."""
    d, handed, instant = _waiting_ahead(driver_factory, store)
    d.supervisor.begin_shutdown(d.supervisor.read_clock()[0])
    if d.supervisor.inflight or d.pool.reaped_at >= instant.timestamp() - 0.01:
        pytest.skip("the machine was too loaded: the shutdown came too near the instant to withdraw the run")
    run = store.get_run(handed[0])
    assert run["status"] == "Cancelled" and run["error_message"].startswith("never started: supervisor ")
    assert store.get_job("a")["retry_attempt"] == 2
    d.until(lambda: d.supervisor.done)


def test_runs_cancel_of_a_run_waiting_for_its_instant_stops_it_before_its_plugin_starts(store, driver_factory):
    """`runs cancel` while a run claimed ahead waits: its supervisor reads the request just before the instant
    (not at its next lease renewal, 10 s away) and kills the worker first: recorded never started, not run
    again (it was cancelled), and the plugin never ran."""
    d, handed, instant = _waiting_ahead(driver_factory, store)
    ops.cancel_run(store, handed[0], requested_by="alice@host")
    d.until(lambda: store.get_run(handed[0])["status"] != "Running")
    run = store.get_run(handed[0])
    if not (run["error_message"] or "").startswith("never started") and d.pool.reaped_at >= instant.timestamp():
        pytest.skip("the machine was too loaded: the loop woke after the instant (the run may have started)")
    assert run["status"] == "Cancelled" and run["details"] is None and run["duration_ms"] is None
    assert run["error_message"].startswith("never started: cancelled by alice@host (runs cancel)")
    job = store.get_job("a")
    assert job["retry_attempt"] is None and job["next_run_at"] > instant  # cancelled: not run again


# -- a pause (disable, remove, an edit of the schedule) before the instant: the run claimed ahead never starts --
def _claimed_ahead(store, d, name, cron=YEARLY):
    """A job due 1 s after a simulated start, claimed ahead (claim_ahead_s 0.1 s) and held by the fake pool:
    (at, instant, run id)."""
    start, at = _steps(d)
    instant = start + dt.timedelta(seconds=1)
    add_job(store, name, "ok", cron, next_run_at=instant)
    at(instant - dt.timedelta(milliseconds=90))
    assert [r.job_name for r in d.pool.submitted] == [name]
    return at, instant, d.pool.submitted[0].run_id


def test_a_pause_before_the_check_withdraws_the_run_claimed_ahead(mem_store, fake_factory):
    """`jobs pause` after the claim, before the check 50 ms ahead of the instant: withdrawn then (its worker
    killed, never started, not run again), the job stays Paused with nothing pending."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    at, instant, run_id = _claimed_ahead(store, d, "p")
    ops.pause_job(store, "p", utcnow())
    at(instant - dt.timedelta(milliseconds=49))
    run = store.get_run(run_id)
    assert run["status"] == "Cancelled" and run["duration_ms"] is None
    assert run["error_message"].startswith("never started: its job became Paused before its instant")
    assert not d.supervisor.inflight
    job = store.get_job("p")
    assert (job["status"], job["next_run_at"], job["retry_attempt"], job["run_count"]) == ("Paused", None, None, 0)
    at(instant + dt.timedelta(seconds=2))
    assert len(d.pool.submitted) == 1  # not run again


@pytest.mark.parametrize("status", ["Disabled", "Expired"])
def test_a_job_made_not_active_before_the_check_withdraws_the_run_claimed_ahead(mem_store, fake_factory, status):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    at, instant, run_id = _claimed_ahead(store, d, "p")
    store.update_job("p", {"status": status, "next_run_at": None}, utcnow())
    at(instant - dt.timedelta(milliseconds=49))
    assert store.get_run(run_id)["error_message"].startswith(f"never started: its job became {status} before")


def test_a_pause_after_the_check_lets_the_run_go_on(mem_store, fake_factory):
    """A pause committed after the check (here 20 ms before the instant) is the documented race: the run
    starts and goes on (a pause does not interrupt a run), and no further run starts."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    at, instant, run_id = _claimed_ahead(store, d, "p")
    at(instant - dt.timedelta(milliseconds=49))
    ops.pause_job(store, "p", utcnow())
    at(instant - dt.timedelta(milliseconds=20))
    assert store.get_run(run_id)["status"] == "Running" and run_id in d.supervisor.inflight


def test_a_resume_before_the_check_keeps_the_run_claimed_ahead(mem_store, fake_factory):
    """Paused and resumed before the check: Active, its next run time re-planned to this very instant: kept."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    at, instant, run_id = _claimed_ahead(store, d, "p", cron="* * * * * *")
    store.update_job("p", {"status": "Paused", "next_run_at": None}, utcnow())
    store.update_job("p", {"status": "Active", "next_run_at": instant}, utcnow())
    at(instant - dt.timedelta(milliseconds=49))
    assert store.get_run(run_id)["status"] == "Running" and run_id in d.supervisor.inflight


def test_an_edit_of_the_schedule_before_the_check_withdraws_the_run_only_if_its_instant_is_gone(
        mem_store, fake_factory):
    """An edit re-plans the job from before the instant: next_run_at this instant (still an occurrence): the
    run stays; a later time other than the one the claim wrote (not an occurrence any more): withdrawn. A
    pending retry's time is no re-plan."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    d.pool.hold()
    start, at = _steps(d)
    instant = start + dt.timedelta(seconds=1)
    for name in ("kept", "moved", "retry"):
        add_job(store, name, "ok", "* * * * * *", next_run_at=instant)
    at(instant - dt.timedelta(milliseconds=90))
    run_of = {r.job_name: r.run_id for r in d.pool.submitted}
    assert sorted(run_of) == ["kept", "moved", "retry"]
    later = instant + dt.timedelta(minutes=7)
    store.update_job("kept", {"cron_expression": "*/2 * * * * *", "next_run_at": instant}, utcnow())
    store.update_job("moved", {"cron_expression": "0 0 * * * *", "next_run_at": later}, utcnow())
    store.update_job("retry", {"retry_at": later, "retry_attempt": 2, "next_run_at": later}, utcnow())
    at(instant - dt.timedelta(milliseconds=49))
    assert store.get_run(run_of["kept"])["status"] == "Running"
    assert store.get_run(run_of["retry"])["status"] == "Running"
    moved = store.get_run(run_of["moved"])
    assert moved["status"] == "Cancelled" and moved["error_message"].startswith(
        "never started: its job's schedule was changed before its instant (next run ")
    assert store.get_job("moved")["next_run_at"] == later and store.get_job("moved")["retry_attempt"] is None


def test_a_job_removed_before_the_check_has_its_run_claimed_ahead_killed_before_its_instant(
        mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    at, instant, _ = _claimed_ahead(store, d, "p")
    ops.remove_job(store, "p")
    at(instant - dt.timedelta(milliseconds=49))
    assert not d.supervisor.inflight and store.list_runs(limit=5) == []


def test_jobs_pause_of_a_run_waiting_for_its_instant_stops_it_before_its_plugin_starts(any_store, any_driver):
    """Real workers on each database: `jobs pause` while a run claimed ahead waits for its instant; the
    supervisor reads the job's status 50 ms before the instant and kills the worker first: never started,
    not run again, the plugin never ran (no details), the job Paused with nothing pending."""
    store = any_store
    d, handed, instant = _waiting_ahead(any_driver, store)
    read_at: list[float] = []  # when the supervisor had read the job's status before the instant
    held_before_start = d.supervisor.store.held_before_start

    reads: list[tuple[float, float, object]] = []  # (began, ended, what it read), for the failure's message

    def timed(*args, **kwargs):
        began, held = time.time(), None
        try:
            held = held_before_start(*args, **kwargs)
            return held
        finally:
            read_at.append(time.time())
            reads.append((began - instant.timestamp(), read_at[-1] - instant.timestamp(), held))

    d.supervisor.store.held_before_start = timed
    ops.pause_job(store, "a", utcnow())
    d.until(lambda: store.get_run(handed[0])["status"] != "Running")
    run = store.get_run(handed[0])
    assert read_at, "the supervisor never read the job's status before starting the run"
    if read_at[0] >= instant.timestamp() - 0.005:
        pytest.skip("the machine was too loaded: the check's read ended at the instant (the run started)")
    assert run["status"] == "Cancelled" and run["details"] is None and run["duration_ms"] is None, (run, reads)
    assert run["error_message"].startswith("never started: its job became Paused before its instant")
    assert d.pool.reaped_at < instant.timestamp()  # the worker was dead before the instant
    job = store.get_job("a")
    assert (job["status"], job["next_run_at"], job["retry_attempt"]) == ("Paused", None, None)
    assert [r["id"] for r in store.list_runs(limit=5)] == handed  # no other run
