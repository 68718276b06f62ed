"""``python -m mjsched_isolated serve`` as a real process: signals, drain, cancel, supervisor death.

The tests read the server's log through its stderr pipe and wait for lines, with a bound; no sleeps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import add_job, serial
from procs import serves
from waiting import LogLines, wait_gone, wait_until


@pytest.fixture
def serve(db_url):
    """``serve(*args)`` on the test's database, with one worker unless the test asks for more (each spawned
    worker costs a loaded machine a second or more); all stopped after the test."""
    with serves() as start:
        def one_worker(*args: str, **kw):
            if "--max-concurrent-jobs" not in args:
                args = ("--max-concurrent-jobs", "1", *args)
            return start(db_url, *args, **kw)

        yield one_worker


def test_sigterm_drains_the_running_job_then_exits_0(store, serve):
    add_job(store, "slow", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 1.0}))
    s = serve()
    run_id = int(s.wait_for(r"run (\d+) started: job slow").group(1))
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(r"shutting down")
    assert s.proc.wait(20) == 0
    assert store.get_run(run_id)["status"] == "Completed"


def test_shutdown_timeout_cancels_what_is_left(store, serve, tmp_path):
    add_job(store, "stuck", "hang", "0 0 1 1 *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
    s = serve("--shutdown-timeout-s", "0.5")
    run_id = int(s.wait_for(r"run (\d+) started: job stuck").group(1))
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(r"run \d+ finished: job stuck Cancelled")
    assert s.proc.wait(20) == 0
    run = store.get_run(run_id)
    assert run["status"] == "Cancelled" and run["error_message"] == "interrupted by shutdown"
    job = store.get_job("stuck")
    assert job["lock_token"] is None and job["run_count"] == 0
    grandchildren = [int(p.read_text()) for p in tmp_path.glob("*.grandchild")]
    assert wait_gone(grandchildren) == []


@serial  # a 1.5 s lease renewed in time: one timing test at a time (conftest)
def test_the_liveness_lease_is_renewed_while_draining(store, serve):
    """A drain longer than the lease TTL: the supervisor must keep renewing, or the workers' watchdogs
    fence (SIGKILL) runs that the shutdown timeout allows to finish."""
    add_job(store, "long", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 3.0}))  # 2 x TTL
    s = serve("--lease-ttl-s", "1.5", "--lease-renew-interval-s", "0.4", "--shutdown-timeout-s", "60")
    run_id = int(s.wait_for(r"run (\d+) started: job long").group(1))
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(r"shutting down")
    assert s.proc.wait(30) == 0
    run = store.get_run(run_id)
    assert (run["status"], run["error_message"]) == ("Completed", None), "".join(s.output[-20:])


def test_sigterm_to_the_whole_process_tree_still_drains(store, serve):
    """systemd's default KillMode=control-group sends SIGTERM to every process of the service: workers
    must leave the decision to the supervisor, which lets the run finish."""
    add_job(store, "slow", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 1.0}))
    s = serve("--shutdown-timeout-s", "60")
    run_id = int(s.wait_for(r"run (\d+) started: job slow").group(1))
    tree = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
    for proc in tree:
        proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    run = store.get_run(run_id)
    assert (run["status"], run["error_message"]) == ("Completed", None), "".join(s.output[-20:])


def test_second_signal_kills_at_once(store, serve, tmp_path):
    add_job(store, "stuck", "hang", "0 0 1 1 *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
    s = serve("--shutdown-timeout-s", "300")
    run_id = int(s.wait_for(r"run (\d+) started: job stuck").group(1))
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(r"shutting down")
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(20) == 0
    assert store.get_run(run_id)["status"] == "Cancelled"


def test_run_for_stops_by_itself(store, serve):
    add_job(store, "tick", "ok", "* * * * * *")
    s = serve("--run-for", "4")  # long enough for a loaded machine to spawn its one worker
    s.wait_for(r"run \d+ finished: job tick Completed", timeout_s=30)
    assert s.proc.wait(30) == 0
    assert store.get_job("tick")["success_count"] >= 1


def test_killed_supervisor_takes_its_children_and_grandchildren_down(store, serve, tmp_path):
    add_job(store, "stuck", "hang", "0 0 1 1 *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
    s = serve("--max-concurrent-jobs", "2")
    grandchild = int(s.wait_for(r"hang: run \d+ grandchild (\d+)", seen=True).group(1))
    workers = [p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)]
    assert len(workers) >= 3 and grandchild in workers  # 2 workers + the plugin's grandchild
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    assert wait_gone(workers, timeout_s=5) == []


def test_fresh_serve_runs_the_sample_jobs(tmp_path):
    """The README's promise: in a fresh directory with the shipped plugins, `serve` syncs jobs.toml and
    runs the sample jobs (the backup and shell ones need nothing from the network)."""
    plugins = Path(__file__).resolve().parent.parent / "plugins"
    proc = subprocess.Popen([sys.executable, "-m", "mjsched_isolated", "serve", "--plugins", str(plugins)],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("MJSCHED_")})
    try:
        log = LogLines(proc.stderr)
        samples = {"backup-scheduler-db", "prune-old-backups", "disk-usage"}

        def finished() -> set[str]:  # every run of the sample jobs is logged when it finishes
            return {m.group(1) for line in list(log.output)
                    if (m := re.search(r"run \d+ finished: job (\S+) Completed in \d+ ms", line))}

        wait_until(lambda: samples <= finished(), 45, f"runs of {sorted(samples)} Completed", interval_s=0.1,
                   diagnostic=log.tail)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert list((tmp_path / "backups").glob("mjsched-*.db"))


def test_killed_supervisor_takes_down_a_worker_stuck_holding_the_gil(store, serve):
    """The worker's watchdog is a process of its own: a plugin holding the GIL cannot keep it from acting."""
    add_job(store, "hog", "gil_hog", "0 0 1 1 *")
    s = serve()
    grandchild = int(s.wait_for(r"gil_hog: run \d+ grandchild (\d+)", seen=True).group(1))
    tree = [p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)]
    assert grandchild in tree
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    assert wait_gone(tree, timeout_s=1.5) == []
