"""The supervisor's decisions, and what real processes are the point of.

The first part drives a real Supervisor on :class:`fakes.FakePool` (each plugin runs in this process
through the worker's own execution code; a run can be held until the test ends it) and an in-memory
store, often with time passed in (``Driver.timeline``): milliseconds a test. The second part ("end to
end") uses real spawned children, real signals and a real SQLite file, each test about what only a real
process shows: killing a process tree, a crash, a plugin hanging at import, leftover processes, state a
plugin leaves in a reused worker. Every wait is bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
from pathlib import Path

import psutil
import pytest
import sqlalchemy as sa
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS, Driver, add_job, wait_gone
from fakes import FakePool

from mjsched_isolated import ops
from mjsched_isolated.config import Settings
from mjsched_isolated.store import Store
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.supervisor.trouble import Trouble

YEARLY = "0 0 1 1 *"  # never due again within a test: each job runs once, when added


def _runs(store, name, status=None):
    return [r for r in store.list_runs(job_name=name, limit=1000) if status is None or r["status"] == status]


def _finished(store, name, n=1):
    return lambda: len([r for r in _runs(store, name) if r["status"] != "Running"]) >= n


def _ordered(store, name):
    return sorted(_runs(store, name), key=lambda r: r["started_at"])


# == decisions: fake pool, in-memory store =================================================================
def test_success_records_run_stats_and_releases_lease(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    job = add_job(store, "ok1", "ok", YEARLY)
    d.until(_finished(store, "ok1"))
    run = _runs(store, "ok1")[0]
    assert run["status"] == "Completed" and run["success"] is True
    assert run["scheduled_at"] == job["next_run_at"]
    assert run["completed_at"] >= run["started_at"]
    (request,) = d.pool.submitted
    assert (request.run_id, request.job_name, request.job_type) == (run["id"], "ok1", "ok")
    assert request.scheduled_at == job["next_run_at"].timestamp()
    after = store.get_job("ok1")
    assert (after["run_count"], after["success_count"], after["failure_count"]) == (1, 1, 0)
    assert after["lock_token"] is None and after["expected_completion_at"] is None
    assert after["next_run_at"] > job["next_run_at"] and after["last_duration_ms"] is not None
    assert d.supervisor.inflight == {}


def test_plugin_exception_and_failure_result_are_failed_runs(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    add_job(store, "boom1", "boom", YEARLY)
    add_job(store, "fail1", "fail", YEARLY)
    d.until(lambda: _finished(store, "boom1")() and _finished(store, "fail1")())
    boom = _runs(store, "boom1")[0]
    assert boom["status"] == "Failed" and "RuntimeError: kaboom" in boom["error_message"]
    assert "Traceback" in boom["details"]["traceback"]
    fail = _runs(store, "fail1")[0]
    assert fail["status"] == "Failed" and fail["error_message"] == "it did not work"
    assert fail["details"] == {"why": "test"}
    assert store.get_job("boom1")["failure_count"] == 1


def test_a_plugin_error_cannot_forge_a_log_line(mem_store, fake_factory, caplog):
    """The run keeps the plugin's text as it was; the supervisor's log line about it stays one line without
    control characters (a newline in it used to print a forged "run 99 finished ... Completed" line)."""
    store = mem_store
    d = fake_factory()
    add_job(store, "forger", "forge", YEARLY)
    d.until(_finished(store, "forger"))
    assert _runs(store, "forger")[0]["error_message"].startswith("oops\n2026-12-01")  # the record keeps the truth
    lines = [r.getMessage() for r in caplog.records if "forger" in r.getMessage()]
    assert any("finished" in line for line in lines)
    assert not [line for line in lines if "\n" in line or "\x1b" in line or "\r" in line]


def test_a_worker_dying_during_a_run_fails_that_run_only(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    d.pool.hold("segv1")
    add_job(store, "segv1", "ok", YEARLY)
    d.until(lambda: bool(d.pool.held))
    dead = next(w for w in d.pool.workers.values() if w is not None and w.run is not None)
    d.pool.crash(d.pool.held[0], exitcode=-11)
    add_job(store, "ok-after", "ok", YEARLY)
    d.until(lambda: _finished(store, "segv1")() and _finished(store, "ok-after")())
    run = _runs(store, "segv1")[0]
    assert run["status"] == "Failed"
    assert run["error_message"] == f"worker process {dead.pid} died during the run (killed by signal SIGSEGV)"
    assert store.get_job("segv1")["lock_token"] is None and store.get_job("segv1")["failure_count"] == 1
    assert _runs(store, "ok-after")[0]["status"] == "Completed"  # the scheduler goes on
    assert len(d.pool.idle_workers()) == 2 and dead not in d.pool.workers.values()  # slot refilled


def test_deadline_kills_the_run_records_timeout_and_other_jobs_stay_on_time(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.5, kill_grace_s=0)  # SIGKILL at once (the grace: tests/test_kills.py)
    d.pool.hold("hang1")
    add_job(store, "hang1", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    deadline = store.get_run(run_id)["deadline_at"]
    add_job(store, "ok-other", "ok", YEARLY, next_run_at=deadline + dt.timedelta(milliseconds=300))
    at(1.4)
    assert store.get_run(run_id)["status"] == "Running" and d.pool.killed == []
    at(1.6)  # past the deadline: killed, recorded at once
    run = store.get_run(run_id)
    assert run["status"] == "Timeout" and "deadline of 1.5 s" in run["error_message"]
    assert d.pool.killed == [run_id] and run_id not in d.supervisor.inflight
    assert store.get_job("hang1")["lock_token"] is None and store.get_job("hang1")["failure_count"] == 1
    at(1.9)  # the other job's due time: it runs on time on the refilled slot
    assert _runs(store, "ok-other")[0]["status"] == "Completed"
    assert len(d.pool.idle_workers()) == 2 and d.supervisor.inflight == {}


def test_never_more_than_the_cap_running(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    d.pool.hold()
    for i in range(6):
        add_job(store, f"s{i}", "ok", YEARLY)
    for finished in range(6):
        live = min(2, 6 - finished)
        d.until(lambda live=live: len(d.pool.held) == len(d.supervisor.inflight) == live)
        assert len(d.supervisor.inflight) == len(store.running_runs()) == len(d.pool.held) <= 2
        d.pool.finish(d.pool.held[0])
    d.until(lambda: all(_finished(store, f"s{i}")() for i in range(6)))
    assert d.max_inflight == 2 and len(d.pool.submitted) == 6
    assert all(_runs(store, f"s{i}")[0]["status"] == "Completed" for i in range(6))


def test_bad_job_rows_are_reported_and_skipped_and_the_scheduler_goes_on(mem_store, fake_factory, caplog):
    store = mem_store
    d = fake_factory()
    add_job(store, "bad-cron", "ok", "not a cron")
    add_job(store, "bad-type", "no_such_type", "* * * * * *")
    add_job(store, "bad-config", "picky", YEARLY, configuration=json.dumps({"seconds": -1}))
    add_job(store, "bad-json", "ok", YEARLY, configuration="{not json")
    add_job(store, "good", "ok", "* * * * * *")
    at = d.timeline()
    for step in range(1, 30):
        at(step * 0.5)
        if _finished(store, "good", 3)() and _finished(store, "bad-config")() and _finished(store, "bad-json")():
            break
    assert _runs(store, "bad-cron") == [] and _runs(store, "bad-type") == []
    # a job type no plugin here provides is left (not skipped) for a supervisor that has it, reported once
    assert store.get_job("bad-type")["skipped_count"] == 0
    assert caplog.text.count("job_type 'no_such_type' is not available on this supervisor") == 1
    assert "cron_expression" in caplog.text
    assert "configuration.seconds" in _runs(store, "bad-config")[0]["error_message"]
    assert "invalid JSON" in _runs(store, "bad-json")[0]["error_message"]
    assert len(_runs(store, "good")) >= 3 and all(r["status"] == "Completed" for r in _runs(store, "good"))


def test_heartbeats_extend_the_deadline_and_silence_does_not(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, heartbeat_interval_s=0.2, heartbeat_lease_s=1.0, kill_grace_s=0)
    d.pool.hold()
    add_job(store, "beats", "ok", YEARLY)
    add_job(store, "silent", "ok", YEARLY)
    at = d.timeline()
    at(0)
    beats, silent = (next(r["id"] for r in _runs(store, n)) for n in ("beats", "silent"))
    for t in (0.5, 0.6, 1.0, 1.5, 2.0):  # 0.6: within the 0.2 s throttle, not applied
        d.pool.beat(beats)
        at(t)
    flight = d.supervisor.inflight[beats]
    assert abs(flight.deadline - flight.started_at - dt.timedelta(seconds=3.0)) < dt.timedelta(seconds=0.1)
    assert store.get_run(beats)["deadline_at"] == flight.deadline
    d.pool.finish(beats)
    at(2.5)
    assert store.get_run(beats)["status"] == "Completed"
    assert store.get_run(silent)["status"] == "Timeout"


def test_first_heartbeat_counts_at_once_even_with_a_throttle(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, heartbeat_interval_s=2.9, heartbeat_lease_s=3.0, kill_grace_s=0)
    d.pool.hold()
    add_job(store, "beats", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    d.pool.beat(run_id)
    at(0.5)  # extended to 3.5 s
    d.pool.beat(run_id)
    at(3.0)  # the second beat is throttled: the deadline stays 3.5 s
    assert store.get_run(run_id)["status"] == "Running"
    at(3.6)
    assert store.get_run(run_id)["status"] == "Timeout"


def test_a_heartbeat_whose_lease_was_taken_does_not_extend(mem_store, fake_factory, caplog):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, heartbeat_interval_s=2.9, heartbeat_lease_s=3.0)
    d.pool.hold()
    add_job(store, "stolen", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    with store.engine.begin() as conn:  # another holder's token
        conn.execute(sa.text("UPDATE jobs SET lock_token = 'theirs' WHERE name = 'stolen'"))
    d.pool.beat(run_id)
    at(0.5)
    assert "heartbeat could not extend the lease" in caplog.text
    flight = d.supervisor.inflight[run_id]
    assert flight.deadline - flight.started_at == dt.timedelta(seconds=1)


def test_skip_mode_skips_occurrences_while_a_run_is_live(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    d.pool.hold()
    add_job(store, "slow", "ok", "* * * * * *")
    at = d.timeline()
    t0 = at(0)
    assert len(d.pool.held) == 1
    at(1.1)
    t2 = at(2.1)  # two (or three) occurrences came due while the run was live: each skipped, a free worker idle
    came_due = int(t2.timestamp()) - int(t0.timestamp())  # the whole seconds in (t0, t2]
    assert store.get_job("slow")["skipped_count"] == came_due and len(d.pool.held) == 1
    assert len(d.pool.idle_workers()) == 2
    d.pool.finish(d.pool.held[0])
    for step in range(22, 50):  # the result, then the next occurrence runs
        at(step / 10)
        if len(_runs(store, "slow")) == 2:
            break
    runs = _ordered(store, "slow")
    assert len(runs) == 2, runs
    assert runs[0]["status"] == "Completed" and runs[0]["completed_at"] <= runs[1]["started_at"], runs


def test_skip_is_decided_on_time_when_every_worker_is_busy(mem_store, fake_factory, caplog):
    """Issue 12: cap 1, a Skip job due every second whose runs take 3 s. The occurrences that come due while
    its run is live are skipped then (counted, logged), not run late as catch-ups after it."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    add_job(store, "slow", "ok", "* * * * * *")
    at = d.timeline()
    started: dict[int, float] = {}
    for step in range(0, 130):  # 13 s, every 0.1 s; each run is finished 3 s after it started
        t = step / 10
        for run_id, since in list(started.items()):
            if t - since >= 3 and run_id in d.pool.held:
                d.pool.finish(run_id)
        at(t)
        for run_id in d.pool.held:
            started.setdefault(run_id, t)
        if d.pool.held:  # busy: the loop still wakes at the live job's next occurrence, to skip it then
            assert d.supervisor.dispatcher.next_due_at() == store.get_job("slow")["next_run_at"]
    runs = [r for r in _ordered(store, "slow") if r["status"] != "Running"]
    assert len(runs) >= 3, runs
    for before, after in itertools.pairwise(runs):
        assert not before["started_at"] < after["scheduled_at"] <= before["completed_at"], (before, after)
        assert after["scheduled_at"] > before["completed_at"]
    job = store.get_job("slow")
    assert job["skipped_count"] >= 2 * len(runs), (job["skipped_count"], runs)
    assert f"on this supervisor ({d.settings.instance}) is still live (concurrency_mode Skip)" in caplog.text


def test_concurrent_mode_overlaps_runs(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    d.pool.hold()
    add_job(store, "par", "ok", "* * * * * *", concurrency_mode="Concurrent")
    at = d.timeline()
    at(0)
    at(1.1)
    assert len(d.pool.held) == 2 and d.max_inflight == 2 and store.get_job("par")["skipped_count"] == 0
    assert all(r["lock_token"] is None and r["status"] == "Running" for r in _runs(store, "par"))


def test_queue_mode_runs_the_pending_occurrence_when_the_live_run_ends(mem_store, fake_factory):
    """On the real clocks: ``queued_at`` compares the occurrence with the live run's completion (DB time)."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    d.pool.hold()
    add_job(store, "q", "ok", "* * * * * *", concurrency_mode="Queue")
    d.until(lambda: len(d.pool.held) == 1)
    waiting = store.get_job("q")["next_run_at"]
    d.until(lambda: d.supervisor.read_clock()[0] > waiting + dt.timedelta(milliseconds=100))
    assert len(d.pool.held) == 1 and store.get_job("q")["next_run_at"] == waiting  # it waits, not skipped
    d.pool.finish(d.pool.held[0])
    d.until(lambda: len(d.pool.held) == 1)  # the waiting occurrence runs as soon as the result is in
    runs = _ordered(store, "q")
    assert runs[1]["scheduled_at"] == waiting and runs[1]["queued_at"] == waiting
    assert runs[0]["status"] == "Completed" and runs[0]["completed_at"] <= runs[1]["started_at"]
    # Queue waits for one occurrence; a later one that came due meanwhile (a slow machine) is dropped and
    # counted: as many as whole seconds passed between the waiting occurrence and the claim
    later = int((runs[1]["started_at"] - waiting).total_seconds())
    assert store.get_job("q")["skipped_count"] in {max(0, later - 1), later}


def test_orphaned_run_of_a_dead_supervisor_is_abandoned(mem_store, fake_factory):
    store = mem_store
    now = utcnow()
    job = add_job(store, "orphan", "ok", YEARLY, next_run_at=now + dt.timedelta(days=1))
    claim = store.claim(job, now=now, next_run_at=job["next_run_at"], instance="deadhost-42", lease_s=0.001,
                        deadline_at=now, scheduled_at=None)
    d = fake_factory()
    d.until(lambda: store.get_run(claim.run_id)["status"] != "Running")
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed" and "deadhost-42" in run["error_message"] and "abandoned" in run["error_message"]
    assert store.get_job("orphan")["lock_token"] is None
    # its duration is completed_at - started_at, as for every other run (it had none)
    assert run["duration_ms"] == pytest.approx((run["completed_at"] - run["started_at"]).total_seconds() * 1000)


def test_status_window_and_run_immediately(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(rescan_interval_s=0.2)
    now = utcnow()
    add_job(store, "paused", "ok", "* * * * * *", status="Paused")
    add_job(store, "later", "ok", "* * * * * *", start_at=now + dt.timedelta(days=1))
    add_job(store, "ended", "ok", "* * * * * *", end_at=now - dt.timedelta(seconds=1))
    store.add_job({"name": "fresh", "job_type": "ok", "cron_expression": YEARLY, "status": "Active",
                   "run_immediately_if_never_run": True}, now)  # next_run_at unset: the sweep seeds it
    d.until(lambda: _finished(store, "fresh")() and store.get_job("ended")["status"] == "Expired")
    assert _runs(store, "paused") == [] and _runs(store, "later") == [] and _runs(store, "ended") == []
    assert store.get_job("fresh")["next_run_at"].year > now.year


def test_unreadable_next_run_at_is_repaired_not_fatal_to_the_poll(mem_store, fake_factory, caplog):
    """A SQLite file edited by hand: a number, ISO text with a T and Z, or a timestamp without microseconds
    (which the compare-and-set could never match) in next_run_at. Each is logged and rescheduled; the
    other jobs keep running."""
    store = mem_store
    add_job(store, "good", "ok", "* * * * * *")
    tomorrow = (utcnow() + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")  # sorts after every real due time
    bad = (("number", 1700000000), ("iso", "2026-11-29T10:00:00Z"), ("short", "2020-01-01 10:00:00"),
           ("garbage", "garbage"), ("future_iso", tomorrow))
    for name, raw in bad:
        job = add_job(store, name, "ok", "* * * * * *")
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET next_run_at = :raw WHERE id = :id"), {"raw": raw, "id": job["id"]})
    d = fake_factory(max_concurrent_jobs=1)
    names = ["good"] + [name for name, _ in bad]
    at = d.timeline()
    for step in range(1, 60):
        at(step * 0.25)
        if all(store.get_job(n)["success_count"] >= 1 for n in names):
            break
    assert all(store.get_job(n)["success_count"] >= 1 for n in names)
    for name, _ in bad:
        assert f"job {name}: its next_run_at could not be read" in caplog.text
    assert "poll failed" not in caplog.text


def test_huge_details_are_replaced_by_a_preview(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    add_job(store, "big", "big_details", YEARLY)
    d.until(_finished(store, "big"))
    details = _runs(store, "big")[0]["details"]
    assert details["truncated"] is True and details["size_bytes"] > 5_000_000 and len(details["preview"]) <= 2000


def test_row_edited_to_run_before_its_start_at_is_rescheduled_not_run(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    now = utcnow()
    start = now + dt.timedelta(days=1)
    add_job(store, "early", "ok", "*/15 * * * *", next_run_at=now, start_at=start)  # a hand-edited row
    add_job(store, "marker", "ok", YEARLY)
    d.until(lambda: store.get_job("early")["next_run_at"] >= start and _finished(store, "marker")())
    assert _runs(store, "early") == []


def test_absurd_max_runtime_in_a_row_is_set_aside_and_does_not_stop_the_poll(mem_store, fake_factory, caplog):
    store = mem_store
    d = fake_factory()
    add_job(store, "absurd", "ok", YEARLY, max_runtime_minutes=2**62)
    add_job(store, "normal", "ok", YEARLY)
    d.until(_finished(store, "normal"))
    assert _runs(store, "absurd") == [] and "job absurd skipped until it is fixed: max_runtime_minutes" in caplog.text


BAD_NUMBERS = [("max_runtime_minutes", "abc"), ("max_jitter_s", "abc"), ("missed_run_grace_s", "abc"),
               ("max_memory_mb", -3), ("max_runtime_minutes", -5), ("max_jitter_s", -5), ("max_jitter_s", 1e300),
               ("retry_backoff_s", -1), ("retry_backoff_factor", "x"), ("max_queued", 0), ("nice", 99)]


@pytest.mark.parametrize(("field", "raw"), BAD_NUMBERS)
def test_a_number_edited_by_hand_sets_that_job_aside_naming_the_field(mem_store, fake_factory, caplog, field, raw):
    """SQLite keeps text in a number column, and any database keeps an out-of-range number written around the
    CLI: that job alone is reported (job and field) and skipped; the others run, the poll never fails."""
    store = mem_store
    bad = add_job(store, "bad", "ok", "* * * * * *")
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE jobs SET {field} = :raw WHERE id = :id"), {"raw": raw, "id": bad["id"]})
    add_job(store, "good", "ok", "* * * * * *")
    d = fake_factory()
    d.until(_finished(store, "good", 2))
    assert _runs(store, "bad") == []
    assert f"job bad skipped until it is fixed: {field}: " in caplog.text
    assert caplog.text.count("job bad skipped until it is fixed") == 1  # said once, not at every poll
    assert "poll failed" not in caplog.text


def test_a_start_at_edited_by_hand_into_garbage_sets_that_job_aside(mem_store, fake_factory, caplog):
    """SQLite keeps 'garbage' in a timestamp column, which reads as unset: the job would run outside its
    window. It is reported (job and field) and skipped; the others run."""
    store = mem_store
    for name, column in (("bad-start", "start_at"), ("bad-end", "end_at")):
        job = add_job(store, name, "ok", "* * * * * *")
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE jobs SET {column} = 'garbage' WHERE id = :id"), {"id": job["id"]})
    add_job(store, "good", "ok", "* * * * * *")
    d = fake_factory()
    d.until(_finished(store, "good", 2))
    assert _runs(store, "bad-start") == [] and _runs(store, "bad-end") == []
    assert "job bad-start skipped until it is fixed: start_at: 'garbage'" in caplog.text
    assert "job bad-end skipped until it is fixed: end_at: 'garbage'" in caplog.text


def test_an_impossible_timestamp_edited_by_hand_never_fails_the_poll_or_status(mem_store, fake_factory, caplog):
    """New-user review: text in a timestamp's shape but no date (month 99, February 30) in a job's or a
    run's timestamps failed every poll ("month must be in 1..12") and `status`. It reads as unset, like any
    other text that is not a timestamp: the other jobs run, the orphaned run is abandoned, status answers."""
    store = mem_store
    bad = add_job(store, "bad", "ok", "0 0 1 1 *")
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET last_run_at = '2026-99-99 99:99:99', retry_at = '2026-13-45 25:61:00', "
                             "created_at = '2026-13-45 25:61:00' WHERE id = :id"), {"id": bad["id"]})
        conn.execute(sa.text("INSERT INTO runs (job_id, status, started_at, scheduled_at, attempt, missed_count) "
                             "VALUES (:id, 'Running', '2026-02-30 00:00:00', '2026-02-30 00:00:00', 1, 0)"),
                     {"id": bad["id"]})
    assert ops.status(store)["in_flight"][0]["running_for_s"] is None
    assert store.get_job("bad")["last_run_at"] is None
    add_job(store, "good", "ok", "* * * * * *")
    d = fake_factory()
    d.until(_finished(store, "good", 2))
    assert "poll failed" not in caplog.text
    orphan = min(store.list_runs(job_name="bad", limit=5), key=lambda r: r["id"])  # the one edited in
    assert orphan["status"] == "Failed" and orphan["error_message"].startswith("abandoned: ")


@pytest.mark.parametrize(("field", "raw"), [("max_memory_mb", -3), ("max_runtime_minutes", -5),
                                            ("max_jitter_s", -5), ("retry_backoff_s", -1)])
def test_an_out_of_range_number_sets_that_job_aside_on_every_database(any_store, shared_backend_url, caplog,
                                                                       field, raw):
    """PostgreSQL and MariaDB refuse text in a number column, but keep an out-of-range number written around
    the CLI: set aside, named, the others run."""
    store = any_store
    bad = add_job(store, "bad", "ok", "* * * * * *")
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE jobs SET {field} = :raw WHERE id = :id"), {"raw": raw, "id": bad["id"]})
    add_job(store, "good", "ok", "* * * * * *")
    d = Driver(store, shared_backend_url, pool=FakePool(2, FIXTURE_PLUGINS), plugins_dir=FIXTURE_PLUGINS,
               max_concurrent_jobs=2).start()
    try:
        d.until(_finished(store, "good", 2))
    finally:
        d.close()
    assert _runs(store, "bad") == [] and f"job bad skipped until it is fixed: {field}: {raw}" in caplog.text


def test_jobs_changed_outside_the_supervisor_are_seen_within_one_poll(mem_store, fake_factory):
    """Activated with no next_run_at (the reference's known bug: it never fires), paused, resumed."""
    store = mem_store
    d = fake_factory(rescan_interval_s=0.2)
    now = utcnow()
    store.add_job({"name": "late", "job_type": "ok", "cron_expression": "* * * * * *", "status": "Pending"}, now)
    d.until(lambda: d.pool.idle_workers() and d.supervisor.next_rescan_at is not None)
    store.update_job("late", {"status": "Active"}, utcnow())  # next_run_at stays NULL
    d.until(_finished(store, "late"), timeout_s=5)
    store.update_job("late", {"status": "Paused", "next_run_at": None}, utcnow())
    d.until(lambda: not d.supervisor.inflight)
    count = len(_runs(store, "late"))
    add_job(store, "marker", "ok", YEARLY, next_run_at=utcnow() + dt.timedelta(seconds=0.5))
    d.until(_finished(store, "marker"))
    assert len(_runs(store, "late")) == count  # nothing ran while paused


def test_shutdown_drains_in_flight_runs_then_cancels_them_at_its_bound(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(shutdown_timeout_s=2.0)
    d.pool.hold()
    add_job(store, "finishes", "ok", YEARLY)
    add_job(store, "outlasts", "ok", YEARLY)
    at = d.timeline()
    now = at(0)
    finishes, outlasts = (next(r["id"] for r in _runs(store, n)) for n in ("finishes", "outlasts"))
    d.supervisor.begin_shutdown(now)
    add_job(store, "too-late", "ok", YEARLY)
    d.pool.finish(finishes)
    at(1.0)
    assert store.get_run(finishes)["status"] == "Completed" and not d.supervisor.done
    assert _runs(store, "too-late") == []  # nothing new starts while draining
    at(2.1)
    run = store.get_run(outlasts)
    assert (run["status"], run["error_message"]) == ("Cancelled", "interrupted by shutdown")
    assert store.get_job("outlasts")["run_count"] == 0 and store.get_job("outlasts")["lock_token"] is None
    assert d.pool.killed == [outlasts] and d.supervisor.done and not d.pool.refill


def test_a_stolen_lease_fences_the_run_at_the_next_renewal(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_renew_interval_s=0.5)
    d.pool.hold()
    add_job(store, "fenced", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET lock_token = 'theirs' WHERE name = 'fenced'"))
    at(0.2)
    assert store.get_run(run_id)["status"] == "Running"  # checked at renewals only
    at(0.6)
    run = store.get_run(run_id)
    assert run["status"] == "Failed" and run["error_message"].startswith("fenced: run killed because its lease")
    assert d.pool.killed == [run_id]


# == end to end: real children, real signals, a real SQLite file ===========================================
def test_os_exit_and_segfault_cost_one_run_and_the_slot_is_refilled(store, driver_factory):
    d = driver_factory()
    pids_before = {w.pid for w in d.pool.workers.values()}
    add_job(store, "exit1", "exit", YEARLY)
    add_job(store, "segv1", "segv", YEARLY)
    d.until(lambda: _finished(store, "exit1")() and _finished(store, "segv1")())
    assert "exit code 3" in _runs(store, "exit1")[0]["error_message"]
    assert "SIGSEGV" in _runs(store, "segv1")[0]["error_message"]
    d.until(lambda: len(d.pool.idle_workers()) == 2)
    assert not pids_before & {w.pid for w in d.pool.workers.values()}  # both children replaced
    add_job(store, "ok-after", "ok", YEARLY)  # the scheduler goes on
    d.until(_finished(store, "ok-after"))
    after = _runs(store, "ok-after")[0]
    assert after["status"] == "Completed"
    assert after["details"]["pid"] in {w.pid for w in d.pool.workers.values() if w}  # ran in a worker child


def test_hung_run_is_killed_with_its_grandchild_and_other_jobs_stay_on_time(store, driver_factory, tmp_path):
    d = driver_factory(lease_timeout_s=1.5, kill_grace_s=0.2)  # the plugin blocks SIGTERM: SIGKILL after 0.2 s
    config = json.dumps({"marker_dir": str(tmp_path)})
    add_job(store, "hang1", "hang", YEARLY, configuration=config)
    d.until(lambda: list(tmp_path.glob("hang1.*.started")))  # written after the grandchild's file
    grandchild = psutil.Process(int(next(tmp_path.glob("hang1.*.grandchild")).read_text()))
    hung_pid = int(next(tmp_path.glob("hang1.*.started")).read_text())
    # another job type comes due while the first one hangs, just after its deadline
    other_due = _runs(store, "hang1")[0]["deadline_at"] + dt.timedelta(milliseconds=300)
    add_job(store, "ok-other", "ok", YEARLY, next_run_at=other_due)
    d.until(lambda: _finished(store, "hang1")() and _finished(store, "ok-other")())
    run = _runs(store, "hang1")[0]
    assert run["status"] == "Timeout" and "deadline" in run["error_message"]
    assert "still running 0.2 s later (kill_grace_s): killed with SIGKILL" in run["error_message"]
    assert run["completed_at"] - run["deadline_at"] < dt.timedelta(seconds=1.2)
    assert wait_gone([grandchild.pid, hung_pid]) == []
    other = _runs(store, "ok-other")[0]
    assert other["status"] == "Completed"
    started = dt.datetime.fromtimestamp(other["details"]["plugin_started_at"], dt.UTC)
    assert started - other["scheduled_at"] < dt.timedelta(seconds=1)
    d.until(lambda: len(d.pool.idle_workers()) == 2)  # slot refilled
    assert store.get_job("hang1")["lock_token"] is None and store.get_job("hang1")["failure_count"] == 1
    assert run["id"] not in d.supervisor.inflight and d.supervisor.inflight == {}
    assert all(w is None or w.run is None for w in d.pool.workers.values())  # nothing kept of the killed run


def test_heartbeats_of_a_real_plugin_reach_the_supervisor(store, driver_factory):
    """context.heartbeat() in a child, over the pipe: the first beat counts at once (default throttle)."""
    d = driver_factory(lease_timeout_s=1.0, heartbeat_interval_s=2.9, heartbeat_lease_s=3.0)
    add_job(store, "beats", "beat", YEARLY, configuration=json.dumps({"seconds": 1.3}))
    d.until(_finished(store, "beats"))
    assert _runs(store, "beats")[0]["status"] == "Completed"


def _plugins_dir(tmp_path, **modules: str) -> Path:
    """A plugins folder with the fixture behaviours (as fine.py) and ``modules`` (file stem -> source)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "fine.py").write_text((Path(__file__).parent / "fixture_plugins" / "behaviours.py").read_text())
    for stem, source in modules.items():
        (plugins / f"{stem}.py").write_text(source)
    return plugins


def _fine_job_runs(store, d) -> None:
    add_job(store, "fine-job", "ok", YEARLY)
    d.until(_finished(store, "fine-job"))
    assert _runs(store, "fine-job")[0]["status"] == "Completed"


def test_plugin_hanging_at_import_costs_only_its_own_job_types(store, db_url, tmp_path):
    from conftest import Driver
    plugins = _plugins_dir(tmp_path, stuck="import time\nwhile True:\n    time.sleep(1)\n",
                           spin="while True:\n    pass\n")  # spin holds the GIL as much as it can
    d = Driver(store, db_url, plugins_dir=str(plugins), plugin_import_timeout_s=0.5, max_concurrent_jobs=1)
    try:
        d.start()
        failures = {f.module: f.error for f in d.pool.last_ready.failures}
        assert set(failures) == {"stuck.py", "spin.py"} and "did not finish within 0.5 s" in failures["stuck.py"]
        _fine_job_runs(store, d)
    finally:
        d.close()


def test_plugin_ending_the_worker_at_import_costs_only_its_own_job_types(store, db_url, tmp_path, caplog):
    """os._exit or a segfault at import ends the whole worker process, not just one import: the worker
    announced the module first, so the pool leaves it out of the next worker and the other types run."""
    from conftest import Driver
    plugins = _plugins_dir(tmp_path, exits="import os\nos._exit(7)\n",
                           segv="import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    d = Driver(store, db_url, plugins_dir=str(plugins), max_concurrent_jobs=2)
    try:
        d.start()
        failures = {f.module: f.error for f in d.pool.last_ready.failures}
        assert set(failures) == {"exits.py", "segv.py"}
        assert "ended the worker process (exit code 7)" in failures["exits.py"]
        assert "killed by signal SIGSEGV" in failures["segv.py"]
        assert "plugin module exits.py: importing it ended the worker process" in caplog.text
        _fine_job_runs(store, d)
    finally:
        d.close()


def test_processes_a_run_leaves_behind_are_killed_when_it_ends(store, driver_factory, caplog):
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "leaver", "leave_behind", YEARLY)
    d.until(_finished(store, "leaver"))
    run = _runs(store, "leaver")[0]
    assert run["status"] == "Completed"
    assert wait_gone(run["details"]["pids"]) == []
    add_job(store, "after", "ok", YEARLY)  # the same worker serves the next run
    d.until(_finished(store, "after"))
    assert _runs(store, "after")[0]["status"] == "Completed"


GIL_FOREVER = "import collections, itertools\ncollections.deque(itertools.repeat(1), maxlen=0)\n"  # one C call


def test_import_holding_the_gil_past_the_ready_timeout_costs_only_its_own_types(store, db_url, tmp_path):
    """The import thread's timeout cannot fire while a C call holds the GIL: the pool kills the worker at
    its ready timeout, blames the module it was importing, and the next workers load without it (two
    workers timing out together each get exactly one replacement)."""
    from conftest import Driver

    from mjsched_isolated.supervisor.inspection import inspect_plugins
    plugins = _plugins_dir(tmp_path, gil=GIL_FOREVER)
    # the CLI's checks: answered by a second worker
    report = inspect_plugins(Settings(plugins_dir=str(plugins)), timeout_s=2)
    assert "ok" in {p.job_type for p in report.plugins} and [f.module for f in report.failures] == ["gil.py"]
    d = Driver(store, db_url, plugins_dir=str(plugins), worker_ready_timeout_s=2, max_concurrent_jobs=2)
    try:
        d.start()
        failures = {f.module: f.error for f in d.pool.last_ready.failures}
        assert "had not finished after 2 s" in failures["gil.py"]
        workers = [w for w in d.pool.workers.values() if w is not None]
        assert len(workers) == 2 and all(w.process.is_alive() for w in workers)
        _fine_job_runs(store, d)
    finally:
        d.close()


def test_an_import_that_timed_out_is_not_tried_again_by_later_workers(store, db_url, tmp_path):
    """The import thread was given up, but it goes on and later ends the worker: its replacement must not
    import that module again (it would lose another timeout, and die again)."""
    from conftest import Driver
    plugins = _plugins_dir(tmp_path, late_exit="import os, time\ntime.sleep(2)\nos._exit(5)\n")
    d = Driver(store, db_url, plugins_dir=str(plugins), plugin_import_timeout_s=0.3, max_concurrent_jobs=1)
    try:
        d.start()
        first = d.pool.workers[0]
        d.until(lambda: d.pool.workers[0] is not first and d.pool.workers[0] is not None
                and d.pool.workers[0].ready is not None, 20)  # the first worker died (exit 5), replaced
        failures = {f.module: f.error for f in d.pool.workers[0].ready.failures}
        assert "left out of later workers" in failures["late_exit.py"]
        _fine_job_runs(store, d)
    finally:
        d.close()


def test_worker_state_changed_by_a_plugin_does_not_leak_into_the_next_run(store, driver_factory, tmp_path):
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "polluter", "pollute", YEARLY)
    d.until(_finished(store, "polluter"))
    add_job(store, "checker", "report_state", YEARLY)
    d.until(_finished(store, "checker"))
    first, second = _runs(store, "polluter")[0], _runs(store, "checker")[0]
    assert first["details"]["pid"] == second["details"]["pid"]  # same worker, reused
    assert second["details"]["cwd"] != "/" and second["details"]["path"] != "/nonexistent"
    assert second["details"]["umask"] != 0o777


def test_a_manual_run_runs_only_that_job_and_leaves_its_schedule(mem_store, fake_factory):
    """``jobs run``: the same cycle as serve, with nothing else dispatched; a live Skip run refuses it."""
    store = mem_store
    d = fake_factory()
    d.pool.close()  # run_now starts the pool itself
    job = add_job(store, "manual", "ok", YEARLY, next_run_at=utcnow() + dt.timedelta(days=1))
    add_job(store, "scheduled", "ok", YEARLY)  # due now, but a manual-run supervisor dispatches nothing
    run_id = d.supervisor.run_now(job, ready_timeout_s=5)
    run = store.get_run(run_id)
    assert (run["status"], run["scheduled_at"]) == ("Completed", None)
    assert store.get_job("manual")["next_run_at"] == job["next_run_at"] and _runs(store, "scheduled") == []
    assert [r.job_name for r in d.pool.submitted] == ["manual"]
    live = store.claim(job, now=utcnow(), next_run_at=job["next_run_at"], instance="other", lease_s=600,
                       deadline_at=utcnow() + dt.timedelta(minutes=10))
    assert live is not None
    store.register_supervisor("other", "host", 1, 600)
    assert d.supervisor.run_now(store.get_job("manual"), ready_timeout_s=5) is None


def test_a_manual_run_that_takes_over_a_dead_supervisors_lease_records_its_run_failed(mem_store, fake_factory):
    """`jobs run` may take the lease of a supervisor that died; that supervisor's run must not stay Running."""
    store = mem_store
    d = fake_factory()
    d.pool.close()  # run_now starts the pool itself
    job = add_job(store, "manual", "ok", YEARLY, next_run_at=utcnow() + dt.timedelta(days=1))
    dead = store.claim(job, now=utcnow(), next_run_at=job["next_run_at"], instance="crashed-1", lease_s=600,
                       deadline_at=utcnow() + dt.timedelta(minutes=10))  # "crashed-1" is not registered: dead
    assert dead is not None
    run_id = d.supervisor.run_now(store.get_job("manual"), ready_timeout_s=5)
    assert run_id is not None and store.get_run(run_id)["status"] == "Completed"
    old = store.get_run(dead.run_id)
    assert old["status"] == "Failed" and "abandoned" in old["error_message"] and "crashed-1" in old["error_message"]
    assert store.running_runs() == []


def test_a_job_type_this_supervisor_lacks_is_left_to_one_that_has_it(mem_store, fake_factory, tmp_path, caplog):
    """A rolling deploy: supervisor A lacks the plugin of job type ``ok`` (its plugins folder is empty), B has
    it. A neither runs nor skips the occurrences: it says so once and B runs them."""
    store = mem_store
    (tmp_path / "empty").mkdir()
    a = fake_factory(plugins_dir=str(tmp_path / "empty"), rescan_interval_s=0.25)
    job = add_job(store, "j", "ok", "* * * * * *")
    at = a.timeline()
    for step in range(1, 9):
        at(step * 0.25)
    row = store.get_job("j")
    assert (row["skipped_count"], row["next_run_at"], _runs(store, "j")) == (0, job["next_run_at"], [])
    assert caplog.text.count("job_type 'ok' is not available on this supervisor") == 1
    b = fake_factory()
    b.until(_finished(store, "j"))
    assert _runs(store, "j")[0]["executed_by_instance"] == b.settings.instance


def test_serve_refuses_a_plugins_folder_that_does_not_exist(tmp_path, capsys, monkeypatch):
    cli = Cli(capsys, monkeypatch, tmp_path)
    result = cli("serve", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--plugins", str(tmp_path / "nope"),
                 "--run-for", "1", expect=2)
    missing = str(tmp_path / "nope")
    assert error_line(result) == f"error: plugins_dir: plugins folder {missing!r} does not exist or is not a folder"
    assert not (tmp_path / "m.db").exists()  # nothing written


def test_a_skip_names_the_supervisor_holding_the_lease(mem_store, fake_factory, caplog):
    """After a crash and restart, the dead supervisor's lease lives until its liveness lease lapses: the
    skip must not claim that a run is live on its own, but say who holds the lease and why it may."""
    store = mem_store
    d = fake_factory(rescan_interval_s=0.25)
    store.register_supervisor("crashed-1", "host", 1, 600)  # looks alive for now
    job = add_job(store, "s", "ok", "* * * * * *")
    assert store.claim(job, now=utcnow(), next_run_at=job["next_run_at"] + dt.timedelta(seconds=1),
                       instance="crashed-1", lease_s=600, deadline_at=utcnow() + dt.timedelta(minutes=10),
                       scheduled_at=job["next_run_at"]) is not None
    d.until(lambda: store.get_job("s")["skipped_count"] >= 1, 10)
    assert ("the job's lease is held by supervisor crashed-1 (concurrency_mode Skip): its run is live, or that "
            "supervisor died and its liveness lease has not lapsed yet") in caplog.text


def test_a_failing_poll_is_logged_once_then_counted(mem_store, fake_factory, caplog):
    """The database refuses every poll (here: the jobs table is gone) for eight steps: one line, then one
    line when polls work again, with the count; /healthz's source (the metrics hook) sees each failure."""
    store = mem_store
    d = fake_factory(rescan_interval_s=0.25)
    at = d.timeline()
    at(0)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE jobs RENAME TO jobs_away")
    for step in range(1, 9):
        at(step * 0.25)
    assert caplog.text.count("poll failed") == 1 and "no such table: jobs" in caplog.text
    assert d.supervisor.poll_trouble.count == 8
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE jobs_away RENAME TO jobs")
    at(3)
    assert "poll works again after 8 failure(s) over 2.8 s" in caplog.text
    assert not d.supervisor.poll_trouble.failing


def test_trouble_reminds_with_the_count_at_most_every_remind_s_and_when_the_reason_changes(caplog):
    trouble = Trouble(logging.getLogger("test.trouble"), "poll", remind_s=60)
    with caplog.at_level(logging.WARNING, "test.trouble"):
        for second in range(0, 130):
            trouble.failed("connection refused", float(second))
        trouble.failed("server closed the connection", 130.0)
        trouble.recovered(131.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "poll failed (connection refused); repeats are counted and logged at most every 60 s",
        "poll still failing: 61 failure(s) in 60 s (60 since the last report); latest: connection refused",
        "poll still failing: 121 failure(s) in 120 s (60 since the last report); latest: connection refused",
        "poll still failing: 131 failure(s) in 130 s (10 since the last report); latest: server closed the connection",
        "poll works again after 131 failure(s) over 131.0 s"]


def test_a_sqlite_file_deleted_under_the_supervisor_stops_dispatch_and_is_reported(tmp_path, caplog):
    """SQLite keeps writing to a deleted file through its open descriptor: the supervisor must notice,
    dispatch nothing more, and say so once."""
    path = tmp_path / "m.db"
    store = Store.open(f"sqlite:///{path}")
    d = Driver(store, f"sqlite:///{path}", pool=FakePool(1, FIXTURE_PLUGINS), max_concurrent_jobs=1,
               rescan_interval_s=0.25).start()
    try:
        at = d.timeline()
        add_job(store, "later", "ok", YEARLY, next_run_at=at(0) + dt.timedelta(seconds=1))
        for p in tmp_path.glob("m.db*"):
            p.unlink()
        for step in range(1, 13):
            at(step * 0.25)
        assert _runs(store, "later") == []  # due at 1 s, never dispatched
        assert caplog.text.count("poll failed") == 1 and f"database file {path} was deleted" in caplog.text
        assert d.supervisor.poll_trouble.count >= 11
    finally:
        d.close()
        store.close()
