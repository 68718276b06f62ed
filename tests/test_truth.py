"""The records tell the truth (issue 12, "Defects found"): an abandoned run keeps the true result its own
supervisor reports later, a watchdog's kill is recorded as a fence, and ``context.deadline_at`` follows a
heartbeat's extension."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import time

import pytest
from conftest import FIXTURE_PLUGINS, add_job, isolated_database, serial
from procs import Serve
from waiting import wait_gone, wait_until

from mjsched_isolated import notices
from mjsched_isolated.client import Client
from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import Outcome

NOW = dt.datetime(2026, 6, 1, 12, 0, tzinfo=dt.UTC)
YEARLY = "0 0 1 1 *"


# -- 1. an abandoned run keeps its true, late result -----------------------------------------------------
def _abandoned_run(store: Store, instance: str = "cut-off:1") -> tuple[dict, object]:
    """A run of ``instance`` (never registered: dead to the others) abandoned by a sweep."""
    job = add_job(store, "nightly", "ok", YEARLY, now=NOW, next_run_at=NOW)
    claim = store.claim(job, now=NOW, next_run_at=NOW + dt.timedelta(days=365), instance=instance, lease_s=600,
                        deadline_at=NOW + dt.timedelta(minutes=10), scheduled_at=job["next_run_at"])
    assert claim is not None
    assert [r["id"] for r in store.abandon_orphaned_runs()] == [claim.run_id]
    return job, claim


def test_a_late_result_is_kept_beside_the_abandonment_without_unfencing(any_store, shared_backend_url):
    """On all three databases: the late outcome lands in the ``late_*`` columns of the run its supervisor
    claimed (id, token and instance); the run stays Failed (abandoned), the job's statistics and lease are
    left as the abandonment set them; only once, only by that supervisor, only over an abandonment. The
    Python API's ``Run`` carries it."""
    store = any_store
    job, claim = _abandoned_run(store)
    before_run, before_job = store.get_run(claim.run_id), store.get_job("nightly")
    ended = NOW + dt.timedelta(seconds=42, microseconds=5000)
    late = Outcome(claim.run_id, job["id"], claim.lock_token, "Completed", True, None, {"rows": 12}, 1.0,
                   completed_at=ended)
    assert store.keep_late_result(late, "someone-else:2") is None  # not its run
    assert store.keep_late_result(Outcome(claim.run_id, job["id"], "other-token", "Completed", True),
                                  "cut-off:1") is None  # not the lease it ran under
    asked = []
    kept = store.keep_late_result(late, "cut-off:1", notices_for=lambda r: asked.append(r) or [])
    assert kept is not None and asked == [kept]
    assert (kept["late_status"], kept["late_completed_at"], kept["job_name"]) == ("Completed", ended, "nightly")
    assert kept["completed_at"] == before_run["completed_at"] and kept["error_message"].startswith("abandoned: ")
    run = store.get_run(claim.run_id)
    assert (run["status"], run["success"], run["error_message"], run["completed_at"], run["duration_ms"]) == (
        "Failed", False, before_run["error_message"], before_run["completed_at"], before_run["duration_ms"])
    assert (run["late_status"], run["late_completed_at"], run["late_details"], run["late_error_message"]) == (
        "Completed", ended, {"rows": 12}, None)
    row = store.get_job("nightly")
    assert {k: row[k] for k in ("run_count", "success_count", "failure_count", "lock_token", "last_run_at")} == {
        k: before_job[k] for k in ("run_count", "success_count", "failure_count", "lock_token", "last_run_at")}
    assert store.keep_late_result(late, "cut-off:1") is None  # kept once
    with Client(shared_backend_url) as client:
        seen = client.get_run(claim.run_id)
    assert (seen.status, seen.late_status, seen.late_completed_at, seen.late_details) == (
        "Failed", "Completed", ended, {"rows": 12})


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_the_dashboards_run_page_shows_the_late_result(store, db_url):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from mjsched_isolated.config import build_settings
    from mjsched_isolated.dashboard.app import create_app

    job, claim = _abandoned_run(store)
    store.keep_late_result(Outcome(claim.run_id, job["id"], claim.lock_token, "Completed", True,
                                   completed_at=NOW + dt.timedelta(seconds=42)), "cut-off:1")
    settings = build_settings({"database_url": db_url, "plugins_dir": FIXTURE_PLUGINS})
    with TestClient(create_app(settings, store, poll_s=0.05), base_url="http://127.0.0.1") as client:
        page = client.get(f"/runs/{claim.run_id}")
    assert page.status_code == 200
    assert "its supervisor later reported" in page.text and "Completed" in page.text


def test_a_result_over_a_verdict_that_is_not_an_abandonment_is_not_kept(any_store):
    store = any_store
    job = add_job(store, "nightly", "ok", YEARLY, now=NOW, next_run_at=NOW)
    claim = store.claim(job, now=NOW, next_run_at=NOW + dt.timedelta(days=1), instance="me:1", lease_s=600,
                        deadline_at=NOW + dt.timedelta(minutes=10), scheduled_at=job["next_run_at"])
    assert store.finish_runs([Outcome(claim.run_id, job["id"], claim.lock_token, "Failed", False, "boom")]) == [True]
    assert store.keep_late_result(Outcome(claim.run_id, job["id"], claim.lock_token, "Completed", True),
                                  "me:1") is None
    assert store.get_run(claim.run_id)["late_status"] is None


def test_a_supervisor_back_with_the_result_of_a_run_another_abandoned_keeps_it_and_says_so(mem_store, fake_factory,
                                                                                          caplog):
    """The supervisor was cut off longer than its TTL; meanwhile another supervisor's sweep recorded its run
    Failed (abandoned) with a failure notice. Its plugin really completed: the result it brings back is kept
    on the run, logged as "run N was abandoned at ...; its supervisor ... later reported Completed at ...",
    and the failure notice's audience gets a notice saying so. Before: only "result not recorded" in its log."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    add_job(store, "nightly", "ok", YEARLY)
    d.until(lambda: bool(d.pool.held))
    (run_id,) = d.pool.held
    store.stop_supervisor(d.settings.instance)  # its lease as the others see it: gone
    (abandoned,) = store.abandon_orphaned_runs(notices_for=lambda run: notices.outbox_rows(
        notices.for_abandoned(run), ["log"]))
    d.pool.finish(run_id)  # the plugin completed meanwhile; its result reaches the supervisor now
    caplog.set_level(logging.WARNING, "mjsched.supervisor")
    d.until(lambda: store.get_run(run_id)["late_status"] is not None, 10)
    run = store.get_run(run_id)
    assert (run["status"], run["late_status"]) == ("Failed", "Completed")
    assert run["error_message"] == abandoned["error_message"]
    assert run["late_completed_at"] >= run["started_at"] and run["late_details"]["pid"]
    line = (f"run {run_id} was abandoned at {run['completed_at'].isoformat().replace('+00:00', 'Z')}; its "
            f"supervisor {d.settings.instance} later reported Completed at ")
    assert line in caplog.text and "not recorded" not in caplog.text
    sent = [(n["event"], n["subject"]) for n in store.list_notifications() if n["run_id"] == run_id]
    assert sent[0][0] == "Failure" and sent[1:] == [
        ("Success", f"Scheduled job 'nightly': abandoned run {run_id} really ended Completed")]
    job = store.get_job("nightly")
    assert (job["success_count"], job["failure_count"]) == (0, 1)  # the abandonment's accounting stands


@serial
@pytest.mark.timeout(60)
def test_a_frozen_supervisor_that_was_abandoned_keeps_its_runs_true_result(tmp_path):
    """Real processes: serve is frozen (SIGSTOP) while its run's plugin finishes; meanwhile its lease is
    taken for dead and the run abandoned (as another supervisor's sweep does). Woken (SIGCONT), it reads
    the result its worker sent: kept on the run as its late result, logged, the run still Failed."""
    with isolated_database("sqlite", tmp_path) as url:
        store = Store.open(url)
        add_job(store, "nightly", "sleep_then_mark", YEARLY,
                configuration=json.dumps({"marker_dir": str(tmp_path), "seconds": 0.3}))
        s = Serve(url, "--lease-ttl-s", "30", "--lease-renew-interval-s", "10", "--max-concurrent-jobs", "1")
        try:
            run_id = int(s.wait_for(r"run (\d+) started: job nightly").group(1))
            os.kill(s.proc.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: (tmp_path / f"nightly.{run_id}.finished").exists(), 10, "the plugin finished")
                (instance,) = [r["instance"] for r in store.list_supervisors()]
                store.stop_supervisor(instance)  # taken for dead ...
                assert [r["id"] for r in store.abandon_orphaned_runs()] == [run_id]  # ... and its run abandoned
            finally:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.wait_for(rf"run {run_id} was abandoned at \S+; its supervisor {instance} later reported Completed at "
                       r"\S+; kept on the run as its late result", timeout_s=15)
            run = store.get_run(run_id)
            assert (run["status"], run["late_status"], run["late_details"]) == ("Failed", "Completed", {"slept_s": 0.3})
            assert run["error_message"].startswith("abandoned: ") and run["late_completed_at"] > run["started_at"]
        finally:
            s.stop()
            store.close()


def test_a_fenced_result_is_not_kept_as_a_late_one(mem_store, fake_factory):
    """A run the supervisor itself killed because its lease was lost has no true result to keep."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1)
    d.pool.hold()
    add_job(store, "nightly", "ok", YEARLY)
    d.until(lambda: bool(d.pool.held))
    (run_id,) = d.pool.held
    store.stop_supervisor(d.settings.instance)
    store.abandon_orphaned_runs()
    flight = d.supervisor.inflight[run_id]
    d.supervisor.guard.fence(flight, store.get_run(run_id)["completed_at"], "its lease was lost")
    assert store.get_run(run_id)["late_status"] is None


def test_the_late_result_notice_text():
    result = {"id": 7, "job_id": 1, "job_name": "j", "executed_by_instance": "h-1-ab", "started_at": NOW,
              "completed_at": NOW + dt.timedelta(seconds=30), "error_message": "abandoned: ...",
              "late_status": "Failed", "late_completed_at": NOW + dt.timedelta(seconds=40),
              "late_error_message": "disk full", "notify_on_failure": True, "notify_recipients": json.dumps(["a@b"])}
    notice = notices.for_late_result(result)
    assert notice is not None and (notice.event, notice.recipients) == ("Failure", ["a@b"])
    assert ("run 7 was abandoned at 2026-06-01T12:00:30Z; its supervisor h-1-ab later reported Failed at "
            "2026-06-01T12:00:40Z") in notice.body and "disk full" in notice.body
    assert notices.for_late_result({**result, "notify_on_failure": False}) is None



# -- 3. a watchdog's kill is a fence ------------------------------------------------------------------------
def test_a_sigkill_while_the_lease_lapsed_is_recorded_fenced_not_as_a_dead_worker(mem_store, fake_factory):
    """The supervisor was frozen past 0.8 x TTL: its busy worker's watchdog killed the run (SIGKILL). On
    waking, the renewal comes first and then the death: it is recorded fenced (the watchdog acted for the
    supervisor), not "died (killed by signal SIGKILL): ... out-of-memory killer". A SIGKILL with no lapse
    still reads as the kernel's."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2, lease_ttl_s=3.0, lease_renew_interval_s=1.0)
    d.pool.hold()
    add_job(store, "frozen", "ok", YEARLY)
    d.until(lambda: len(d.pool.held) == 1)
    (frozen,) = d.pool.held
    lease = d.supervisor.liveness
    lease.valid_until = time.monotonic() - 1.0  # frozen: its lease is past its local validity...
    d.pool.crash(frozen, exitcode=-signal.SIGKILL)  # ... so the worker's watchdog killed the run
    lease.next_renew = float("-inf")  # it wakes: the renewal is due at once and comes first
    d.until(lambda: store.get_run(frozen)["status"] != "Running", 10)
    run = store.get_run(frozen)
    assert run["status"] == "Failed" and run["error_message"].startswith(
        "fenced: its worker's watchdog killed it: this supervisor's liveness lease was not renewed for 2.4 s"), \
        run["error_message"]
    add_job(store, "later", "ok", YEARLY)
    d.until(lambda: len(d.pool.held) == 1 and d.pool.held[0] != frozen)
    (later,) = d.pool.held  # started after the lapse: a SIGKILL now is not the watchdog's
    d.pool.crash(later, exitcode=-signal.SIGKILL)
    d.until(lambda: store.get_run(later)["status"] != "Running", 10)
    assert "out-of-memory killer" in store.get_run(later)["error_message"]


@serial
@pytest.mark.timeout(60)
def test_a_frozen_supervisors_run_killed_by_its_watchdog_is_recorded_fenced(tmp_path):
    """Real processes: SIGSTOP freezes serve while a run hangs; the worker's watchdog kills the run's tree
    at 0.8 x TTL; SIGCONT before the TTL (nobody abandons it): the run is recorded Failed "fenced: its
    worker's watchdog killed it ...", not "worker died (SIGKILL)"."""
    ttl_s = 4.0
    with isolated_database("sqlite", tmp_path) as url:
        store = Store.open(url)
        add_job(store, "long", "hang", YEARLY, configuration=json.dumps({"marker_dir": str(tmp_path)}))
        s = Serve(url, "--lease-ttl-s", str(ttl_s), "--lease-renew-interval-s", "1", "--rescan-interval-s", "0.5",
                  "--max-concurrent-jobs", "1")
        try:
            run_id = int(s.wait_for(r"run (\d+) started: job long").group(1))
            grandchild = int(s.wait_for(r"hang: run \d+ grandchild (\d+)", seen=True).group(1))
            worker = int((tmp_path / f"long.{run_id}.started").read_text())
            os.kill(s.proc.pid, signal.SIGSTOP)
            try:
                assert wait_gone([worker, grandchild], timeout_s=ttl_s) == []  # the watchdog's kill
            finally:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.wait_for(rf"run {run_id} of job long fenced: its worker's watchdog killed it", timeout_s=15)
            wait_until(lambda: store.get_run(run_id)["status"] != "Running", 10, "the fenced run recorded")
            run = store.get_run(run_id)
            assert run["status"] == "Failed" and run["error_message"].startswith("fenced: its worker's watchdog")
            assert run["duration_ms"] is not None
        finally:
            s.stop()
            store.close()


# -- 4. context.deadline_at follows a heartbeat's extension ------------------------------------------------
def test_the_extended_deadline_is_sent_to_the_run_and_its_context_shows_it(mem_store, fake_factory):
    """A heartbeat that extends the deadline: the supervisor sends the new deadline to the run's worker,
    and the plugin's ``context.deadline_at`` is that deadline (the run row's), not the one it started with."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1, lease_timeout_s=30, heartbeat_interval_s=100, heartbeat_lease_s=120)
    d.pool.hold()
    add_job(store, "watch", "watch_deadline", YEARLY)
    d.until(lambda: bool(d.pool.held))
    (run_id,) = d.pool.held
    started_with = store.get_run(run_id)["deadline_at"]
    d.pool.beat(run_id)
    d.until(lambda: store.get_run(run_id)["deadline_at"] != started_with, 10)
    extended = store.get_run(run_id)["deadline_at"]
    assert extended - started_with > dt.timedelta(seconds=60)
    d.pool.finish(run_id)
    d.until(lambda: store.get_run(run_id)["status"] == "Completed", 10)
    assert d.pool.submitted[0].deadline_at == pytest.approx(started_with.timestamp(), abs=1e-3)
    assert store.get_run(run_id)["details"]["last"] == pytest.approx(extended.timestamp(), abs=1e-3)


@pytest.mark.timeout(60)
def test_a_real_plugin_sees_its_deadline_move_after_a_heartbeat(store, driver_factory):
    """Real worker: the plugin reads ``context.deadline_at``, heartbeats, and sees the extended deadline
    arrive over its pipe (within its 10 s bound: in practice milliseconds), equal to the run row's."""
    d = driver_factory(max_concurrent_jobs=1, lease_timeout_s=30, heartbeat_interval_s=100, heartbeat_lease_s=120)
    add_job(store, "watch", "watch_deadline", YEARLY, configuration=json.dumps({"seconds": 10}))
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="watch")), 30)
    (run,) = store.list_runs(job_name="watch")
    assert run["status"] == "Completed", run["error_message"]
    first, last = run["details"]["first"], run["details"]["last"]
    assert last - first > 60  # 30 s from the start, then 120 s from the heartbeat
    assert last == pytest.approx(run["deadline_at"].timestamp(), abs=1e-3)
