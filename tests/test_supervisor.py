"""End to end in this process: a real Supervisor, a real spawn pool, real plugins, a real SQLite file.

Each test drives the supervisor with ``Driver.until``, which waits on child pipes and sentinels with a
bound; nothing sleeps to synchronise.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import psutil
import sqlalchemy as sa

from conftest import add_job, wait_gone
from mjsched_isolated.config import Settings
from mjsched_isolated.supervisor.core import utcnow


def _runs(store, name, status=None):
    return [r for r in store.list_runs(job_name=name, limit=1000) if status is None or r["status"] == status]


def _finished(store, name, n=1):
    return lambda: len([r for r in _runs(store, name) if r["status"] != "Running"]) >= n


def test_success_records_run_stats_and_releases_lease(store, driver_factory):
    d = driver_factory()
    job = add_job(store, "ok1", "ok", "0 0 1 1 *")
    d.until(_finished(store, "ok1"))
    run = _runs(store, "ok1")[0]
    assert run["status"] == "Completed" and run["success"] is True
    assert run["scheduled_at"] == job["next_run_at"]
    assert run["completed_at"] >= run["started_at"]
    assert run["details"]["pid"] in {w.pid for w in d.pool.workers.values() if w}
    after = store.get_job("ok1")
    assert (after["run_count"], after["success_count"], after["failure_count"]) == (1, 1, 0)
    assert after["lock_token"] is None and after["expected_completion_at"] is None
    assert after["next_run_at"] > job["next_run_at"] and after["last_duration_ms"] is not None


def test_plugin_exception_and_failure_result_are_failed_runs(store, driver_factory):
    d = driver_factory()
    add_job(store, "boom1", "boom", "0 0 1 1 *")
    add_job(store, "fail1", "fail", "0 0 1 1 *")
    d.until(lambda: _finished(store, "boom1")() and _finished(store, "fail1")())
    boom = _runs(store, "boom1")[0]
    assert boom["status"] == "Failed" and "RuntimeError: kaboom" in boom["error_message"]
    assert "Traceback" in boom["details"]["traceback"]
    fail = _runs(store, "fail1")[0]
    assert fail["status"] == "Failed" and fail["error_message"] == "it did not work"
    assert fail["details"] == {"why": "test"}
    assert store.get_job("boom1")["failure_count"] == 1


def test_os_exit_and_segfault_cost_one_run_and_the_slot_is_refilled(store, driver_factory):
    d = driver_factory()
    pids_before = {w.pid for w in d.pool.workers.values()}
    add_job(store, "exit1", "exit", "0 0 1 1 *")
    add_job(store, "segv1", "segv", "0 0 1 1 *")
    d.until(lambda: _finished(store, "exit1")() and _finished(store, "segv1")())
    assert "exit code 3" in _runs(store, "exit1")[0]["error_message"]
    assert "SIGSEGV" in _runs(store, "segv1")[0]["error_message"]
    d.until(lambda: len(d.pool.idle_workers()) == 2)
    assert not pids_before & {w.pid for w in d.pool.workers.values()}  # both children replaced
    add_job(store, "ok-after", "ok", "0 0 1 1 *")  # the scheduler goes on
    d.until(_finished(store, "ok-after"))
    assert _runs(store, "ok-after")[0]["status"] == "Completed"


def test_hung_run_is_killed_with_its_grandchild_and_other_jobs_stay_on_time(store, driver_factory, tmp_path):
    d = driver_factory(lease_timeout_s=1.5)
    config = json.dumps({"marker_dir": str(tmp_path)})
    add_job(store, "hang1", "hang", "0 0 1 1 *", configuration=config)
    d.until(lambda: list(tmp_path.glob("hang1.*.started")))  # written after the grandchild's file
    grandchild = psutil.Process(int(next(tmp_path.glob("hang1.*.grandchild")).read_text()))
    hung_pid = int(next(tmp_path.glob("hang1.*.started")).read_text())
    # another job type comes due while the first one hangs, just after its deadline
    due = store.get_job("hang1")
    other_due = _runs(store, "hang1")[0]["deadline_at"] + dt.timedelta(milliseconds=300)
    add_job(store, "ok-other", "ok", "0 0 1 1 *", next_run_at=other_due)
    d.until(lambda: _finished(store, "hang1")() and _finished(store, "ok-other")())
    run = _runs(store, "hang1")[0]
    assert run["status"] == "Timeout" and "deadline" in run["error_message"]
    assert run["completed_at"] - run["deadline_at"] < dt.timedelta(seconds=1)
    assert wait_gone([grandchild.pid, hung_pid]) == []
    other = _runs(store, "ok-other")[0]
    assert other["status"] == "Completed"
    started = dt.datetime.fromtimestamp(other["details"]["plugin_started_at"], dt.timezone.utc)
    assert started - other["scheduled_at"] < dt.timedelta(seconds=1)
    d.until(lambda: len(d.pool.idle_workers()) == 2)  # slot refilled
    assert store.get_job("hang1")["lock_token"] is None and due["failure_count"] == 0
    assert store.get_job("hang1")["failure_count"] == 1
    assert run["id"] not in d.supervisor.inflight


def test_never_more_than_the_cap_running(store, driver_factory):
    d = driver_factory(max_concurrent_jobs=2)
    for i in range(6):
        add_job(store, f"s{i}", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 0.2}))
    d.until(lambda: all(_finished(store, f"s{i}")() for i in range(6)))
    assert d.max_inflight == 2
    spans = [(r["started_at"], r["completed_at"]) for i in range(6) for r in _runs(store, f"s{i}")]
    for start, _ in spans:
        overlapping = sum(1 for s, e in spans if s <= start < e)
        assert overlapping <= 2


def test_bad_job_rows_are_reported_and_skipped_and_the_scheduler_goes_on(store, driver_factory, caplog):
    d = driver_factory()
    add_job(store, "bad-cron", "ok", "not a cron")
    add_job(store, "bad-type", "no_such_type", "* * * * * *")
    add_job(store, "bad-config", "picky", "0 0 1 1 *", configuration=json.dumps({"seconds": -1}))
    add_job(store, "bad-json", "ok", "0 0 1 1 *", configuration="{not json")
    add_job(store, "good", "ok", "* * * * * *")
    d.until(lambda: _finished(store, "good", 3)() and store.get_job("bad-type")["skipped_count"] >= 2
            and _finished(store, "bad-config")() and _finished(store, "bad-json")())
    assert _runs(store, "bad-cron") == [] and _runs(store, "bad-type") == []
    assert "cron_expression" in caplog.text and "no_such_type" in caplog.text
    assert "configuration.seconds" in _runs(store, "bad-config")[0]["error_message"]
    assert "invalid JSON" in _runs(store, "bad-json")[0]["error_message"]
    assert all(r["status"] == "Completed" for r in _runs(store, "good"))


def test_heartbeats_extend_the_deadline_and_silence_does_not(store, driver_factory):
    d = driver_factory(lease_timeout_s=1.0, heartbeat_interval_s=0.2, heartbeat_lease_s=1.0)
    add_job(store, "beats", "beat", "0 0 1 1 *", configuration=json.dumps({"seconds": 2.5}))
    add_job(store, "silent", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 2.5}))
    d.until(lambda: _finished(store, "beats")() and _finished(store, "silent")())
    assert _runs(store, "beats")[0]["status"] == "Completed"
    assert _runs(store, "silent")[0]["status"] == "Timeout"


def test_skip_mode_skips_occurrences_while_a_run_is_live(store, driver_factory):
    d = driver_factory(max_concurrent_jobs=3)
    add_job(store, "slow", "sleep", "* * * * * *", configuration=json.dumps({"seconds": 1.6}))
    d.until(lambda: store.get_job("slow")["skipped_count"] >= 1 and _finished(store, "slow", 2)())
    runs = sorted(_runs(store, "slow"), key=lambda r: r["started_at"])
    for a, b in zip(runs, runs[1:]):
        assert a["completed_at"] is not None and a["completed_at"] <= b["started_at"]


def test_concurrent_mode_overlaps_runs(store, driver_factory):
    d = driver_factory(max_concurrent_jobs=3)
    add_job(store, "par", "sleep", "* * * * * *", configuration=json.dumps({"seconds": 1.5}),
            concurrency_mode="Concurrent")
    d.until(lambda: d.max_inflight >= 2 and _finished(store, "par", 2)())
    runs = _runs(store, "par")
    assert all(r["lock_token"] is None for r in runs)


def test_queue_mode_runs_the_pending_occurrence_when_the_live_run_ends(store, driver_factory):
    d = driver_factory(max_concurrent_jobs=3)
    add_job(store, "q", "sleep", "* * * * * *", configuration=json.dumps({"seconds": 1.5}), concurrency_mode="Queue")
    d.until(lambda: any(r["queued_at"] for r in _runs(store, "q") if r["status"] != "Running"))
    runs = sorted(_runs(store, "q"), key=lambda r: r["started_at"])
    for a, b in zip(runs, runs[1:]):
        assert a["completed_at"] is not None and a["completed_at"] <= b["started_at"]
    queued = next(r for r in runs if r["queued_at"])
    previous = runs[runs.index(queued) - 1]
    assert queued["started_at"] - previous["completed_at"] < dt.timedelta(seconds=1)
    assert store.get_job("q")["skipped_count"] == 0


def test_orphaned_run_of_a_dead_supervisor_is_abandoned(store, driver_factory, db_url):
    now = utcnow()
    job = add_job(store, "orphan", "ok", "0 0 1 1 *", next_run_at=now + dt.timedelta(days=1))
    claim = store.claim(job, now=now, next_run_at=job["next_run_at"], instance="deadhost-42", lease_s=0.001,
                        deadline_at=now, scheduled_at=None)
    d = driver_factory()
    d.until(lambda: store.get_run(claim.run_id)["status"] != "Running")
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed" and "deadhost-42" in run["error_message"] and "abandoned" in run["error_message"]
    assert store.get_job("orphan")["lock_token"] is None


def test_status_window_and_run_immediately(store, driver_factory):
    d = driver_factory(rescan_interval_s=0.2)
    now = utcnow()
    add_job(store, "paused", "ok", "* * * * * *", status="Paused")
    add_job(store, "later", "ok", "* * * * * *", start_at=now + dt.timedelta(days=1))
    add_job(store, "ended", "ok", "* * * * * *", end_at=now - dt.timedelta(seconds=1))
    store.add_job({"name": "fresh", "job_type": "ok", "cron_expression": "0 0 1 1 *", "status": "Active",
                   "run_immediately_if_never_run": True}, now)  # next_run_at unset: the sweep seeds it
    d.until(lambda: _finished(store, "fresh")() and store.get_job("ended")["status"] == "Expired")
    assert _runs(store, "paused") == [] and _runs(store, "later") == [] and _runs(store, "ended") == []
    assert store.get_job("fresh")["next_run_at"].year > now.year


def test_supervisor_memory_keeps_nothing_of_killed_runs(store, driver_factory, tmp_path):
    d = driver_factory(lease_timeout_s=0.5)
    add_job(store, "h", "hang", "0 0 1 1 *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
    d.until(_finished(store, "h"))
    assert d.supervisor.inflight == {}
    assert all(w is None or w.run is None for w in d.pool.workers.values())


def _plugins_dir(tmp_path, **modules: str) -> Path:
    """A plugins folder with the fixture behaviours (as fine.py) and ``modules`` (file stem -> source)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "fine.py").write_text((Path(__file__).parent / "fixture_plugins" / "behaviours.py").read_text())
    for stem, source in modules.items():
        (plugins / f"{stem}.py").write_text(source)
    return plugins


def _fine_job_runs(store, d) -> None:
    add_job(store, "fine-job", "ok", "0 0 1 1 *")
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


def test_unreadable_next_run_at_is_repaired_not_fatal_to_the_poll(store, driver_factory, caplog):
    """A SQLite file edited by hand: a number, ISO text with a T and Z, or a timestamp without microseconds
    (which the compare-and-set could never match) in next_run_at. Each is logged and rescheduled; the
    other jobs keep running."""
    add_job(store, "good", "ok", "* * * * * *")
    tomorrow = (utcnow() + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")  # sorts after every real due time
    bad = (("number", 1700000000), ("iso", "2026-11-29T10:00:00Z"), ("short", "2020-01-01 10:00:00"),
           ("garbage", "garbage"), ("future_iso", tomorrow))
    for name, raw in bad:
        job = add_job(store, name, "ok", "* * * * * *")
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET next_run_at = :raw WHERE id = :id"), {"raw": raw, "id": job["id"]})
    d = driver_factory(max_concurrent_jobs=1)
    names = ["good"] + [name for name, _ in bad]
    d.until(lambda: all(store.get_job(n)["success_count"] >= 1 for n in names), 30)
    for name, _ in bad:
        assert f"job {name}: its next_run_at could not be read" in caplog.text
    assert "poll failed" not in caplog.text


def test_processes_a_run_leaves_behind_are_killed_when_it_ends(store, driver_factory, caplog):
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "leaver", "leave_behind", "0 0 1 1 *")
    d.until(_finished(store, "leaver"))
    run = _runs(store, "leaver")[0]
    assert run["status"] == "Completed"
    assert wait_gone(run["details"]["pids"]) == []
    add_job(store, "after", "ok", "0 0 1 1 *")  # the same worker serves the next run
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
    report = inspect_plugins(Settings(plugins_dir=str(plugins)), timeout_s=2)  # the CLI's checks: answered by a second worker
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
    add_job(store, "polluter", "pollute", "0 0 1 1 *")
    d.until(_finished(store, "polluter"))
    add_job(store, "checker", "report_state", "0 0 1 1 *")
    d.until(_finished(store, "checker"))
    first, second = _runs(store, "polluter")[0], _runs(store, "checker")[0]
    assert first["details"]["pid"] == second["details"]["pid"]  # same worker, reused
    assert second["details"]["cwd"] != "/" and second["details"]["path"] != "/nonexistent"
    assert second["details"]["umask"] != 0o777


def test_huge_details_are_replaced_by_a_preview(store, driver_factory):
    d = driver_factory()
    add_job(store, "big", "big_details", "0 0 1 1 *")
    d.until(_finished(store, "big"))
    details = _runs(store, "big")[0]["details"]
    assert details["truncated"] is True and details["size_bytes"] > 5_000_000 and len(details["preview"]) <= 2000


def test_row_edited_to_run_before_its_start_at_is_rescheduled_not_run(store, driver_factory):
    d = driver_factory()
    now = utcnow()
    start = now + dt.timedelta(days=1)
    add_job(store, "early", "ok", "*/15 * * * *", next_run_at=now, start_at=start)  # a hand-edited row
    add_job(store, "marker", "ok", "0 0 1 1 *")
    d.until(lambda: store.get_job("early")["next_run_at"] >= start and _finished(store, "marker")())
    assert _runs(store, "early") == []


def test_first_heartbeat_counts_at_once_even_with_the_default_throttle(store, driver_factory):
    d = driver_factory(lease_timeout_s=1.0, heartbeat_lease_s=3.0)  # heartbeat_interval_s stays 300 s
    add_job(store, "beats", "beat", "0 0 1 1 *", configuration=json.dumps({"seconds": 1.8}))
    d.until(_finished(store, "beats"))
    assert _runs(store, "beats")[0]["status"] == "Completed"


def test_absurd_max_runtime_in_a_row_is_clamped_and_does_not_stop_the_poll(store, driver_factory):
    d = driver_factory()
    add_job(store, "absurd", "ok", "0 0 1 1 *", max_runtime_minutes=2**62)
    add_job(store, "normal", "ok", "0 0 1 1 *")
    d.until(lambda: _finished(store, "absurd")() and _finished(store, "normal")())
    assert {r["status"] for r in _runs(store, "absurd") + _runs(store, "normal")} == {"Completed"}


def test_jobs_changed_outside_the_supervisor_are_seen_within_one_poll(store, driver_factory):
    """Activated with no next_run_at (the reference's known bug: it never fires), paused, resumed."""
    d = driver_factory(rescan_interval_s=0.2)
    now = utcnow()
    store.add_job({"name": "late", "job_type": "ok", "cron_expression": "* * * * * *", "status": "Pending"}, now)
    d.until(lambda: d.pool.idle_workers() and d.supervisor.next_rescan_at is not None)
    store.update_job("late", {"status": "Active"}, utcnow())  # next_run_at stays NULL
    d.until(_finished(store, "late"), timeout_s=5)
    store.update_job("late", {"status": "Paused", "next_run_at": None}, utcnow())
    d.until(lambda: not d.supervisor.inflight)
    count = len(_runs(store, "late"))
    add_job(store, "marker", "ok", "0 0 1 1 *", next_run_at=utcnow() + dt.timedelta(seconds=1.5))
    d.until(_finished(store, "marker"))
    assert len(_runs(store, "late")) == count  # nothing ran while paused
