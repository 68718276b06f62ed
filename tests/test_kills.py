"""Runs past their deadline: SIGTERM to the process tree, ``kill_grace_s`` to end, then SIGKILL; the loop
never blocks on the grace, kills falling due together are done together, and the run's record says which
signal ended it. Decisions on the fake pool with time passed in; real signals where they are the point."""

from __future__ import annotations

import datetime as dt
import json

from conftest import add_job
from waiting import wait_gone

YEARLY = "0 0 1 1 *"


def test_sigterm_at_the_deadline_then_sigkill_after_the_grace(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, kill_grace_s=2.0)
    d.pool.hold("hung")
    add_job(store, "hung", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    at(1.1)  # past the deadline: SIGTERM only; the loop goes on and wakes at the end of the grace
    assert d.pool.terminated == [run_id] and d.pool.killed == []
    assert store.get_run(run_id)["status"] == "Running"
    assert d.supervisor.inflight[run_id].wake_at == d.supervisor.inflight[run_id].kill_at
    d.pool.beat(run_id)
    at(2.5)  # a heartbeat after the deadline does not save it
    assert d.pool.killed == [] and store.get_run(run_id)["status"] == "Running"
    at(3.2)
    run = store.get_run(run_id)
    assert run["status"] == "Timeout" and d.pool.killed == [run_id] and d.pool.terminated == [run_id]
    assert "sent SIGTERM, still running 2 s later (kill_grace_s): killed with SIGKILL" in run["error_message"]
    assert run_id not in d.supervisor.inflight and store.get_job("hung")["lock_token"] is None


def test_a_run_ending_within_the_grace_is_recorded_as_ended_by_sigterm(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, kill_grace_s=2.0)
    d.pool.hold("polite", "crashes")
    add_job(store, "polite", "ok", YEARLY)
    add_job(store, "crashes", "ok", YEARLY)
    at = d.timeline()
    at(0)
    polite, crashes = (r["id"] for n in ("polite", "crashes") for r in store.list_runs(job_name=n))
    at(1.1)
    assert sorted(d.pool.terminated) == sorted([polite, crashes])
    d.pool.finish(polite)  # its SIGTERM handler made the plugin return
    d.pool.crash(crashes, exitcode=-15)  # ended by the signal itself
    at(1.2)
    for run_id, how in ((polite, "its plugin returned"), (crashes, "the worker exited: killed by signal SIGTERM")):
        run = store.get_run(run_id)
        assert run["status"] == "Timeout", run
        assert f"sent SIGTERM: it ended within the grace ({how})" in run["error_message"]
    assert d.pool.killed == [] and d.supervisor.inflight == {}
    assert store.get_job("polite")["failure_count"] == 1


def test_kills_that_fall_due_together_are_done_in_one_pass(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, kill_grace_s=0.5, max_concurrent_jobs=4)
    d.pool.hold()
    for name in ("h1", "h2", "h3"):
        add_job(store, name, "ok", YEARLY)
    at = d.timeline()
    at(0)
    held = d.pool.held
    assert len(held) == 3
    at(1.1)
    assert sorted(d.pool.terminated) == sorted(held)
    at(1.7)
    assert [sorted(batch) for batch in d.pool.kill_batches] == [sorted(held)]  # one kill_all, all three
    assert all(r["status"] == "Timeout" for r in store.list_runs(limit=10))


def test_zero_grace_kills_at_once(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, kill_grace_s=0)
    d.pool.hold("hung")
    add_job(store, "hung", "ok", YEARLY)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    at(1.1)
    assert d.pool.terminated == [] and d.pool.killed == [run_id]
    assert store.get_run(run_id)["error_message"].endswith("process tree killed with SIGKILL")


def test_a_real_plugins_sigterm_handler_runs_and_its_commands_end(store, driver_factory, tmp_path):
    """A real worker: the plugin's SIGTERM handler runs (it writes a file and returns), the sleep command
    it started ends with the tree's SIGTERM, nothing is SIGKILLed."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "polite.py").write_text('''
import os, signal, subprocess, time
from pathlib import Path
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Polite(BaseScheduledJob):
    job_type = "polite"

    def execute(self, context):
        folder = Path(context.configuration["dir"])
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        child = subprocess.Popen(["sleep", "1000"])
        (folder / "child").write_text(str(child.pid))
        while not stop:
            time.sleep(0.05)
        (folder / "cleaned-up").write_text("yes")
        return ScheduledJobResult(success=True)
''')
    d = driver_factory(plugins_dir=str(tmp_path / "plugins"), lease_timeout_s=1.0, kill_grace_s=10)
    add_job(store, "polite", "polite", YEARLY, configuration=json.dumps({"dir": str(tmp_path)}))
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="polite")), 20)
    (run,) = store.list_runs(job_name="polite")
    assert run["status"] == "Timeout", run
    assert "sent SIGTERM: it ended within the grace (its plugin returned)" in run["error_message"]
    assert (tmp_path / "cleaned-up").read_text() == "yes"
    assert wait_gone([int((tmp_path / "child").read_text())]) == []
    assert run["completed_at"] - run["deadline_at"] < dt.timedelta(seconds=10)  # not the full grace


def test_a_real_plugin_without_a_sigterm_handler_ends_at_sigterm_not_after_the_grace(store, driver_factory):
    """Issue 14 (Low): the worker ignored SIGTERM, so a plugin with no handler of its own waited the whole
    grace for SIGKILL; SIGTERM from the supervisor at the deadline now ends it (as the default action
    would end a process), while a SIGTERM from anyone else still leaves the run alone."""
    d = driver_factory(lease_timeout_s=1.0, kill_grace_s=10)
    add_job(store, "sleeper", "sleep", YEARLY, configuration=json.dumps({"seconds": 1000}))
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="sleeper")), 20)
    (run,) = store.list_runs(job_name="sleeper")
    assert run["status"] == "Timeout", run
    assert "sent SIGTERM: it ended within the grace (its plugin returned)" in run["error_message"]
    assert run["completed_at"] - run["deadline_at"] < dt.timedelta(seconds=5)  # not the full grace


def test_a_worker_killed_by_the_kernel_is_reported_as_probably_out_of_memory(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    d.pool.hold()
    add_job(store, "oom", "ok", YEARLY, max_memory_mb=300)
    add_job(store, "xcpu", "ok", YEARLY)
    at = d.timeline()
    at(0)
    oom, xcpu = (r["id"] for n in ("oom", "xcpu") for r in store.list_runs(job_name=n))
    d.pool.crash(oom, exitcode=-9)
    d.pool.crash(xcpu, exitcode=-24)  # SIGXCPU
    at(0.1)
    assert store.get_run(oom)["error_message"].endswith(
        "(killed by signal SIGKILL): not sent by this supervisor: the kernel's out-of-memory killer (see the kernel "
        "log) or another process; the job's memory limit is 300 MB")  # no cgroup accounting: no evidence either way
    assert store.get_run(xcpu)["error_message"].endswith("its CPU time limit (max_cpu_s) was exceeded")
