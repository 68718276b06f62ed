"""Overlap policies beyond Skip, Queue and Concurrent (issue 12 point 7): Replace (Kubernetes'
``concurrencyPolicy: Replace``, Temporal's TerminateOther) and QueueAll (Temporal's BufferAll, bounded by
``max_queued``).

The rules are tested as pure decisions (``planner``), then on the supervisor with the in-memory store and
FakePool (one supervisor, and two sharing a database), the store's bookkeeping on all three databases, and
once end to end with real worker processes whose process trees must be gone when they are replaced.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time
from pathlib import Path

import pytest
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS, add_job
from waiting import wait_gone

from mjsched_isolated import ops, planner
from mjsched_isolated.client import Client
from mjsched_isolated.enums import ConcurrencyMode
from mjsched_isolated.errors import InputError
from mjsched_isolated.jobspec import JobSpec, check
from mjsched_isolated.supervisor import utcnow

UTC = dt.UTC
T0 = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)
EVERY_SECOND = "* * * * * *"
YEARLY = "0 0 1 1 *"
LONG = 600.0
RENEW = {"lease_ttl_s": 2.0, "lease_renew_interval_s": 0.2, "rescan_interval_s": 0.2}


def _s(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _job(**values) -> dict:
    return {"name": "j", "cron_expression": EVERY_SECOND, "timezone": "UTC", "next_run_at": T0, **values}


def _runs(store, name):
    return sorted(store.list_runs(job_name=name, limit=1000), key=lambda r: r["id"])


# == pure decisions ===========================================================================================
def test_queue_all_runs_the_occurrences_that_waited_oldest_first_one_claim_each():
    job = _job(concurrency_mode="QueueAll", last_run_at=_s(3.5))  # T0..T3 came due while a run was live
    assert planner.queue_all_next(job, _s(3.6)) == planner.Overlap(scheduled_at=T0, next_run_at=_s(1))
    assert planner.queue_all_next({**job, "next_run_at": _s(3)}, _s(3.6)) == planner.Overlap(_s(3), _s(4))


def test_queue_all_beyond_max_queued_keeps_the_newest_waiting_occurrences():
    job = _job(concurrency_mode="QueueAll", max_queued=2, last_run_at=_s(5.5))  # T0..T5 waited: 6 > 2
    assert planner.queue_all_next(job, _s(5.6)) == planner.Overlap(scheduled_at=_s(4), next_run_at=_s(5))
    # only what came due before the live run ended waited; exactly max_queued waiting: none dropped
    assert planner.queue_all_next({**job, "last_run_at": _s(1.5)}, _s(5.6)) == planner.Overlap(T0, _s(1))
    assert planner.queue_all_next({**job, "max_queued": 1}, _s(5.6)) == planner.Overlap(_s(5), _s(6))


def test_queue_all_leaves_an_occurrence_that_did_not_wait_to_the_missed_run_policy():
    assert planner.queue_all_next(_job(concurrency_mode="QueueAll", last_run_at=None), _s(5)) is None
    assert planner.queue_all_next(_job(concurrency_mode="QueueAll", last_run_at=_s(-0.5)), _s(5)) is None
    assert planner.queue_all_next(_job(concurrency_mode="Queue", last_run_at=_s(3.5)), _s(5)) is None
    assert planner.queued_at(_job(concurrency_mode="QueueAll", last_run_at=_s(3.5)), T0) == T0


def test_replace_runs_the_newest_due_occurrence():
    job = _job(concurrency_mode="Replace")
    assert planner.newest_due(job, _s(3.5)) == _s(3)
    assert planner.newest_due(job, _s(0.5)) is None  # next_run_at is the newest
    assert planner.newest_due(job, _s(-1)) is None  # not due
    assert planner.newest_due({**job, "cron_expression": "*/10 * * * * *"}, _s(25)) == _s(20)
    by = planner.replaced_by(_s(3))
    assert by == "replaced by occurrence 2030-06-01T12:00:03Z (concurrency_mode Replace)"
    assert planner.is_replacement(by) and not planner.is_replacement("alice@laptop")
    assert not planner.is_replacement(None)


def test_max_queued_is_checked():
    spec = JobSpec(name="q", job_type="ok", cron_expression=EVERY_SECOND, concurrency_mode="QueueAll", max_queued=3)
    assert check(spec).max_queued == 3
    for bad in (0, -1, planner.MAX_QUEUED + 1):
        with pytest.raises(InputError, match=r"^max_queued: must be between 1 and 1000, got "):
            check(JobSpec(name="q", job_type="ok", cron_expression=EVERY_SECOND, max_queued=bad))
    with pytest.raises(InputError, match=r"^concurrency_mode: must be one of Skip, Queue, Concurrent, Replace, "
                                         r"QueueAll, got 'BufferAll'$"):
        check(JobSpec(name="q", job_type="ok", cron_expression=EVERY_SECOND, concurrency_mode="BufferAll"))


def test_cli_and_client_set_the_new_modes_and_refuse_a_bad_bound(db_url, tmp_path, capsys, monkeypatch):
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})
    result = cli("jobs", "add", "q", "--type", "ok", "--cron", YEARLY, "--concurrency-mode", "QueueAll",
                 "--max-queued", "0", expect=2)
    assert error_line(result) == "error: max_queued: must be between 1 and 1000, got 0" and result.stdout == ""
    cli("jobs", "add", "q", "--type", "ok", "--cron", YEARLY, "--concurrency-mode", "QueueAll", "--max-queued", "3")
    cli("jobs", "update", "q", "--concurrency-mode", "Replace")
    shown = json.loads(cli("jobs", "show", "q", "--json").stdout)
    assert (shown["concurrency_mode"], shown["max_queued"]) == ("Replace", 3)
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        job = client.add_job("c", job_type="ok", cron_expression=YEARLY, concurrency_mode="QueueAll", max_queued=5)
        assert (job.concurrency_mode, job.max_queued) == (ConcurrencyMode.QUEUE_ALL, 5)
        with pytest.raises(InputError, match=r"^max_queued: "):
            client.update_job("c", max_queued=1001)


# == one supervisor, FakePool and the in-memory store ==========================================================
def _whole_second(when: dt.datetime) -> dt.datetime:
    return when.replace(microsecond=0)


def _occurrences_due(first: dt.datetime, until: dt.datetime) -> int:
    """The occurrences of an every-second job whose first occurrence is ``first``, before ``until``."""
    return 1 + sum(1 for s in range(1, 1000) if _whole_second(first) + dt.timedelta(seconds=s) < until)


def _check_replaced(store, d, name: str, min_replaced: int) -> list[dict]:
    """Every Cancelled run of ``name`` was replaced by a later occurrence (never retried), its worker killed;
    every occurrence is accounted for (run rows + skipped + missed). Returns the runs."""
    runs = _runs(store, name)
    cancelled = [r for r in runs if r["status"] == "Cancelled"]
    assert len(cancelled) >= min_replaced, runs
    for run in cancelled:
        by = run["cancel_requested_by"]
        assert planner.is_replacement(by) and run["error_message"] == by, run
        replacing = dt.datetime.fromisoformat(by.split()[3].replace("Z", "+00:00"))
        assert replacing > run["scheduled_at"], run
    assert all(r["attempt"] == 1 for r in runs)  # replaced runs are never retried, whatever retry_on says
    job = store.get_job(name)
    live = runs[-1]["status"] == "Running"
    assert job["retry_at"] is None and job["run_count"] == len(runs) - len(cancelled) - live
    due = _occurrences_due(runs[0]["scheduled_at"], job["next_run_at"])
    assert due == len(runs) + job["skipped_count"] + job["missed_count"], (due, runs, job)
    return runs


def test_replace_cancels_the_live_run_when_the_next_occurrence_comes_due_even_with_every_worker_busy(
        mem_store, fake_factory):
    """Cap 1, a Replace job due every second whose runs never end: at each occurrence the live run is killed
    and recorded Cancelled ("replaced by occurrence X"), the freed slot runs X; never two Running rows, and
    the Running one is always the newest due occurrence."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace", max_retries=3, retry_on="Cancelled",
            retry_backoff_s=0.0, next_run_at=_whole_second(utcnow()) + dt.timedelta(seconds=1))
    at = d.timeline()
    for step in range(55):  # 5.5 s, a step every 0.1 s
        now = at(step / 10)
        running = [r for r in _runs(store, "r") if r["status"] == "Running"]
        if not running and not _runs(store, "r"):
            continue  # the first occurrence is not due yet
        assert len(running) == 1, running
        assert running[0]["scheduled_at"] >= _whole_second(now), (now, running)  # none newer is due
        if d.pool.held:  # busy: the loop wakes at the next occurrence, to replace the run on time
            assert d.supervisor.dispatcher.next_due_at() == store.get_job("r")["next_run_at"]
    runs = _check_replaced(store, d, "r", 3)
    assert d.pool.killed == [r["id"] for r in runs if r["status"] == "Cancelled"]
    assert store.get_job("r")["skipped_count"] == 0  # each occurrence came due and ran: nothing superseded


def test_replace_after_a_late_poll_runs_the_newest_occurrence_and_counts_the_older_ones_skipped(
        mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace")
    at = d.timeline()
    at(0)
    now = at(3.5)  # a poll 3.5 s late (a slow machine): three occurrences came due, the newest replaces
    runs = _runs(store, "r")
    assert [r["status"] for r in runs] == ["Cancelled", "Running"]
    assert runs[1]["scheduled_at"] == _whole_second(now)
    assert runs[0]["cancel_requested_by"] == planner.replaced_by(_whole_second(now))
    came_due = int(now.timestamp()) - int(runs[0]["scheduled_at"].timestamp())  # whole seconds after the first
    assert came_due >= 3 and store.get_job("r")["skipped_count"] == came_due - 1  # never started: superseded
    _check_replaced(store, d, "r", 1)


def test_replace_runs_the_newest_occurrence_when_a_newer_one_came_due_before_the_freed_slot_was_ready(
        mem_store, fake_factory):
    """The replaced run's worker is respawned slowly (a loaded machine): a newer occurrence comes due before
    the new run can start. The newest runs, the one that replaced the run is counted skipped (superseded),
    not folded into a catch-up of the older occurrence."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    first = _whole_second(utcnow()) + dt.timedelta(seconds=1)
    add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace", next_run_at=first)
    at = d.timeline()
    t0 = at(0)

    def at_abs(when: dt.datetime) -> None:
        at((when - t0).total_seconds())

    at_abs(first + dt.timedelta(milliseconds=50))
    d.pool.refill = False  # the killed worker's slot stays empty for a while
    at_abs(first + dt.timedelta(seconds=1, milliseconds=50))
    assert [r["status"] for r in _runs(store, "r")] == ["Cancelled"]
    at_abs(first + dt.timedelta(seconds=2, milliseconds=50))  # a newer occurrence came due meanwhile
    d.pool.refill = True
    d.pool._spawn(0)
    at_abs(first + dt.timedelta(seconds=2, milliseconds=100))
    runs = _runs(store, "r")
    assert [(r["status"], r["scheduled_at"]) for r in runs] == [("Cancelled", first),
                                                                ("Running", first + dt.timedelta(seconds=2))]
    job = store.get_job("r")
    assert (job["skipped_count"], job["missed_count"]) == (1, 0) and runs[1]["missed_count"] == 0


def test_queue_all_runs_what_came_due_during_the_live_run_in_order_up_to_max_queued(mem_store, fake_factory):
    """max_queued 2; a run lasts about 4.5 s: four occurrences come due meanwhile. The oldest two are skipped
    (counted), the newest two run one after the other (``queued_at`` set), then the job is on time again."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    d.pool.hold()
    add_job(store, "qa", "ok", EVERY_SECOND, concurrency_mode="QueueAll", max_queued=2)
    at = d.timeline()
    at(0)
    first = _runs(store, "qa")[0]
    t = 0.0
    while _whole_second(first["scheduled_at"]) + dt.timedelta(seconds=4, milliseconds=200) > at(t):
        t += 0.1
        assert len(d.pool.held) == 1  # QueueAll waits for the live run: one worker stays idle
    waiting = store.get_job("qa")["next_run_at"]
    assert waiting == _whole_second(first["scheduled_at"]) + dt.timedelta(seconds=1)
    for _ in range(3):  # the live run ends; the two newest waiting occurrences run in turn
        d.pool.finish(d.pool.held[0])
        for _ in range(2):  # its result is read, then the next waiting occurrence is claimed
            t += 0.01
            at(t)
    runs = _runs(store, "qa")
    assert [r["scheduled_at"] for r in runs[1:3]] == [waiting + dt.timedelta(seconds=2),
                                                       waiting + dt.timedelta(seconds=3)]
    assert [r["queued_at"] for r in runs[1:3]] == [r["scheduled_at"] for r in runs[1:3]]
    job = store.get_job("qa")
    assert job["skipped_count"] == 2 and job["missed_count"] == 0
    assert job["next_run_at"] == waiting + dt.timedelta(seconds=4)  # came due after the last run ended: on time
    assert _occurrences_due(first["scheduled_at"], job["next_run_at"]) == len(runs) + 2


def test_a_replace_request_from_another_supervisor_cancels_the_run_without_a_retry(mem_store, fake_factory):
    """The holder sees, at its next renewal, a cancel request that says "replaced by occurrence X": recorded
    Cancelled with that reason and never retried, though the job retries Cancelled runs."""
    store = mem_store
    d = fake_factory(**RENEW)
    d.pool.hold()
    add_job(store, "r", "ok", YEARLY, concurrency_mode="Replace", max_retries=2, retry_on="Cancelled")
    d.until(lambda: bool(store.running_runs()))
    (run,) = store.running_runs()
    job = store.get_job("r")
    by = planner.replaced_by(T0)
    assert store.request_replace(job["id"], job["lock_token"], by) == 1
    assert store.request_replace(job["id"], job["lock_token"], planner.replaced_by(_s(1))) == 0  # asked once
    d.until(lambda: store.get_run(run["id"])["status"] != "Running", 5)
    done = store.get_run(run["id"])
    assert (done["status"], done["error_message"], done["cancel_requested_by"]) == ("Cancelled", by, by)
    job = store.get_job("r")
    assert job["retry_at"] is None and job["lock_token"] is None and d.pool.killed == [run["id"]]


def test_a_replace_job_whose_run_another_live_supervisor_holds_is_asked_not_claimed(mem_store, fake_factory):
    """Supervisor ``other`` (alive) holds the run; this one, at its rescan, supersedes the older due
    occurrences and writes the replace request on that run row, and claims nothing: the holder kills the run
    and releases the lease first."""
    store = mem_store
    store.register_supervisor("other-1", "elsewhere", 4242, LONG)
    now = utcnow()
    job = add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace",
                  next_run_at=_whole_second(now) - dt.timedelta(seconds=4))
    claim = store.claim(job, now=now, next_run_at=_whole_second(now) - dt.timedelta(seconds=3), instance="other-1",
                        lease_s=LONG, deadline_at=now + dt.timedelta(minutes=5), scheduled_at=job["next_run_at"])
    assert claim is not None
    d = fake_factory(**RENEW)
    d.until(lambda: store.get_run(claim.run_id)["cancel_requested_by"] is not None, 5)
    run, job = store.get_run(claim.run_id), store.get_job("r")
    assert run["status"] == "Running" and run["cancel_requested_by"] == planner.replaced_by(job["next_run_at"])
    assert job["next_run_at"] >= _whole_second(now) and job["skipped_count"] >= 3  # the newest waits
    assert job["locked_by_instance"] == "other-1" and d.pool.submitted == []


def test_two_supervisors_never_run_two_replace_runs_and_the_newest_wins(mem_store, fake_factory):
    """Two supervisors on one database, each with one worker, stepping in turn (each also sees, at its
    rescans, the other's live Replace run come due): at every moment at most one Running row, and after both
    stepped, the Running one is the newest due occurrence."""
    store = mem_store
    drivers = [fake_factory(max_concurrent_jobs=1, instance=f"s{i}-x", rescan_interval_s=0.2) for i in (1, 2)]
    for d in drivers:
        d.pool.hold()
    add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace",
            next_run_at=_whole_second(utcnow()) + dt.timedelta(seconds=1))
    timelines = [d.timeline() for d in drivers]
    for step in range(50):
        nows = []
        for at in timelines:
            nows.append(at(step / 10))
            running = [r for r in _runs(store, "r") if r["status"] == "Running"]
            assert len(running) <= 1, running
        if not _runs(store, "r"):
            continue  # the first occurrence is not due yet
        # the holder replaced its run at its own step (the two timelines are a few ms apart)
        assert running and running[0]["scheduled_at"] >= _whole_second(min(nows)), (nows, running)
    _check_replaced(store, drivers[0], "r", 3)


# == the store's bookkeeping, on all three databases ===========================================================
def _claim(store, job, instance="host-a:1"):
    seen = job["next_run_at"]
    return store.claim(job, now=seen, next_run_at=seen + dt.timedelta(hours=1), instance=instance, lease_s=LONG,
                       deadline_at=seen + dt.timedelta(minutes=5), scheduled_at=seen)


def test_queue_all_and_replace_jobs_wait_while_their_lease_is_live(any_store):
    """A QueueAll or Replace job whose lease is live is not due (its occurrence waits for the lease, so the
    poll does not spin on it); a busy supervisor finds the due Replace ones with a live run in one query;
    the replace request lands once, only on the run claimed with the job's lease token."""
    store = any_store
    store.register_supervisor("host-a:1", "test-host", 4242, LONG)
    jobs = {mode: add_job(store, mode.lower(), "ok", now=T0, next_run_at=T0, concurrency_mode=mode)
            for mode in ("QueueAll", "Replace", "Skip")}
    claims = {mode: _claim(store, job) for mode, job in jobs.items()}
    assert all(claims.values())
    later = T0 + dt.timedelta(hours=2)
    assert [j["name"] for j in store.due_jobs(later, 10)] == ["skip"]
    assert store.next_due_at(exclude={jobs["Skip"]["id"]}) is None
    assert [j["name"] for j in store.due_live_skip_jobs(later, 10, mode="Replace")] == ["replace"]
    assert [j["name"] for j in store.due_live_skip_jobs(later, 10)] == ["skip"]
    replace = store.get_job("replace")
    assert store.request_replace(replace["id"], "not-its-token", planner.replaced_by(later)) == 0
    assert store.request_replace(replace["id"], replace["lock_token"], planner.replaced_by(later)) == 1
    assert store.request_replace(replace["id"], replace["lock_token"], planner.replaced_by(_s(1))) == 0
    run = store.get_run(claims["Replace"].run_id)
    assert run["cancel_requested_by"] == planner.replaced_by(later) and run["cancel_requested_at"] is not None
    for mode in ("QueueAll", "Replace"):
        assert store.release(jobs[mode]["id"], claims[mode].lock_token)
    assert [j["name"] for j in store.due_jobs(later, 10)] == ["queueall", "replace", "skip"]
    assert store.get_job("queueall")["max_queued"] == 10


# == end to end: real worker processes =========================================================================
@pytest.mark.timeout(90)
def test_replace_end_to_end_kills_each_replaced_process_tree_and_never_runs_two(store, driver_factory, tmp_path):
    """A real pool with one worker; a Replace job due every second whose runs never end (each leaves a
    grandchild that ignores SIGTERM). At every moment at most one Running row; each run is the newest
    occurrence due when it started and starts after the run it replaced ended; each replaced run is Cancelled
    "replaced by occurrence X" and its whole process tree, grandchild included, is gone."""
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "r", "hang", EVERY_SECOND, concurrency_mode="Replace",
            configuration=json.dumps({"marker_dir": str(tmp_path)}))
    peak = 0

    def replaced_three() -> bool:
        nonlocal peak
        runs = _runs(store, "r")
        peak = max(peak, sum(r["status"] == "Running" for r in runs))
        return sum(r["status"] == "Cancelled" for r in runs) >= 3

    started = time.monotonic()
    d.until(replaced_three, 60)
    assert peak == 1 and d.max_inflight == 1
    runs = _check_replaced(store, d, "r", 3)
    for before, after in itertools.pairwise(runs):
        assert before["status"] == "Cancelled" and before["completed_at"] <= after["started_at"], (before, after)
        # the newest occurrence when it was claimed (started_at is the claim's database time, a moment later)
        assert after["scheduled_at"] >= _whole_second(after["started_at"] - dt.timedelta(milliseconds=100)), after
    grandchildren = [int(p.read_text()) for p in Path(tmp_path).glob("r.*.grandchild")
                     if int(p.name.split(".")[1]) in {r["id"] for r in runs if r["status"] == "Cancelled"}]
    assert grandchildren and wait_gone(grandchildren, timeout_s=5) == []
    assert time.monotonic() - started < 30


def test_jobs_run_of_a_replace_job_with_a_live_run_is_refused_naming_the_run(db_url, tmp_path, capsys, monkeypatch):
    """`jobs run` does not replace a live run (that is the schedule's doing, at an occurrence): it refuses,
    naming the live run and how to cancel it; nothing is written."""
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})
    cli("db", "upgrade")
    with Client(db_url) as client:
        store = client._store
        job = add_job(store, "r", "ok", YEARLY, concurrency_mode="Replace")
        store.register_supervisor("otherhost-9", "otherhost", 9, ttl_s=600)
        now = store.db_now()
        claim = store.claim(job, now=now, next_run_at=job["next_run_at"], instance="otherhost-9", lease_s=600,
                            deadline_at=now + dt.timedelta(minutes=10), scheduled_at=job["next_run_at"])
        assert claim is not None
    result = cli("jobs", "run", "r", expect=1)
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # the fixture plugins log
    assert f"run {claim.run_id} holds the lease, taken by supervisor otherhost-9" in line, line
    assert f"cancel it first (`mjsched runs cancel {claim.run_id}`)" in line, line
    with Client(db_url) as client:
        assert [r.id for r in client.runs(job="r")] == [claim.run_id]  # no second run


def _replace_job_with_a_live_run(store, d):
    """Cap 1, a Replace job whose first run is live (held); returns (timeline, the next occurrence)."""
    d.pool.hold()
    first = _whole_second(utcnow()) + dt.timedelta(seconds=1)
    add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace", next_run_at=first)
    at = d.timeline()
    t0 = at(0)
    at((first - t0).total_seconds() + 0.05)
    assert [r["status"] for r in _runs(store, "r")] == ["Running"]
    second = first + dt.timedelta(seconds=1)
    return lambda when: at((when - t0).total_seconds()), second


def test_a_replace_job_paused_just_after_its_run_was_replaced_keeps_the_replacement(mem_store, fake_factory):
    """The pause comes right after the supervisor replaced the live run (the slot's new worker starting): the
    replacement was claimed before the kill, so it runs; a pause stops NEW runs only. It was killed and its
    replacement lost (the job paused before the freed slot could claim it)."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    at, second = _replace_job_with_a_live_run(store, d)
    def pause_after(kill):
        def kill_then_pause(*args):
            kill(*args)
            ops.pause_job(store, "r", utcnow())  # the user pauses just after the instant
        return kill_then_pause

    for name in ("cancel_flight", "kill_replaced"):  # the kill of the live run, before and after the fix
        setattr(d.supervisor.dispatcher, name, pause_after(getattr(d.supervisor.dispatcher, name)))
    at(second + dt.timedelta(milliseconds=50))
    at(second + dt.timedelta(milliseconds=100))
    runs = _runs(store, "r")
    assert [(r["status"], r["scheduled_at"]) for r in runs] == [("Cancelled", second - dt.timedelta(seconds=1)),
                                                                ("Running", second)], runs
    assert runs[0]["error_message"] == planner.replaced_by(second)
    assert store.get_job("r")["status"] == "Paused" and len(d.pool.held) == 1


def test_a_replace_job_paused_before_its_run_is_replaced_keeps_its_live_run(mem_store, fake_factory):
    """The pause lands between the supervisor's read of the due job and the replacement: nothing new may
    start, so the live run is not killed (it goes on until it ends or the user cancels it)."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    at, second = _replace_job_with_a_live_run(store, d)
    supersede = d.supervisor.dispatcher._supersede

    def supersede_then_pause(job, now):
        occurrence = supersede(job, now)
        ops.pause_job(store, "r", utcnow())
        return occurrence

    d.supervisor.dispatcher._supersede = supersede_then_pause
    at(second + dt.timedelta(milliseconds=50))
    at(second + dt.timedelta(milliseconds=100))
    runs = _runs(store, "r")
    assert [r["status"] for r in runs] == ["Running"] and d.pool.killed == [], runs
    assert store.get_job("r")["status"] == "Paused"


def test_claim_replacement_takes_the_lease_over_only_from_the_replaced_run_of_an_active_job(any_store):
    from mjsched_isolated.store.leases import ClaimRequest, Outcome

    store = any_store
    now = _whole_second(utcnow())
    job = add_job(store, "r", "ok", EVERY_SECOND, concurrency_mode="Replace", next_run_at=now)
    first = store.claim(job, now=now, next_run_at=now + dt.timedelta(seconds=1), instance="me", lease_s=60,
                        deadline_at=now + dt.timedelta(seconds=30), scheduled_at=now)
    assert first is not None
    job = store.get_job("r")
    later = now + dt.timedelta(seconds=1)

    def request(row):
        return ClaimRequest(row, later + dt.timedelta(seconds=1), 60, later + dt.timedelta(seconds=30),
                            scheduled_at=later)

    def replaced(claim, token=None):
        return Outcome(claim.run_id, job["id"], token or claim.lock_token, "Cancelled", False,
                       planner.replaced_by(later), count=False, completed_at=later)

    assert store.claim_replacement(request(job), replaced(first, "not-the-runs"), now=later, instance="me") is None
    assert store.get_run(first.run_id)["status"] == "Running"  # nothing written
    second = store.claim_replacement(request(job), replaced(first), now=later, instance="me")
    assert second is not None and second.lock_token != first.lock_token and second.started_at >= later
    row = store.get_job("r")  # the lease taken over (the replaced run's release left it alone)
    assert (row["lock_token"], row["next_run_at"]) == (second.lock_token, later + dt.timedelta(seconds=1))
    assert store.get_run(second.run_id)["scheduled_at"] == later
    old = store.get_run(first.run_id)  # recorded in the same transaction: never two Running rows
    assert (old["status"], old["cancel_requested_by"], old["completed_at"]) == (
        "Cancelled", planner.replaced_by(later), later)
    assert row["run_count"] == 0  # a replaced run is not counted
    ops.pause_job(store, "r", utcnow())  # paused: nothing is claimed over the live run
    assert store.claim_replacement(request(store.get_job("r")), replaced(second), now=later, instance="me") is None
    assert store.get_run(second.run_id)["status"] == "Running"


def test_a_replace_request_for_a_job_paused_since_leaves_the_live_run_alone(mem_store, fake_factory):
    """Another supervisor asked the holder to replace the run, then the job was paused: no new run can start,
    so the holder does not kill the live one at its renewal (it goes on)."""
    store = mem_store
    d = fake_factory(**RENEW)
    d.pool.hold()
    add_job(store, "r", "ok", YEARLY, concurrency_mode="Replace")
    d.until(lambda: bool(store.running_runs()))
    (run,) = store.running_runs()
    job = store.get_job("r")
    assert store.request_replace(job["id"], job["lock_token"], planner.replaced_by(T0)) == 1
    ops.pause_job(store, "r", utcnow())
    d.until(lambda: d.supervisor.guard._replace_declined == {run["id"]}, 5)  # seen at a renewal, declined
    assert store.get_run(run["id"])["status"] == "Running" and d.pool.killed == []
