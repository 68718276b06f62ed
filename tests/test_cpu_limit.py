"""``max_cpu_s`` held by the supervisor too: a run whose code does not stop at SIGXCPU (a long call in C,
where Python's handler cannot run) is killed at max_cpu_s + 1.5 s of its process tree's CPU time, read
from the worker's cgroup or, without one, by psutil over the tree. Real workers, a real SQLite store,
real CPU time; every wait bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import add_job

from mjsched_isolated.config import Isolation
from mjsched_isolated.supervisor.metrics import Metrics

YEARLY = "0 0 1 1 *"

PLUGIN = '''
import os, subprocess, sys
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Spin(BaseScheduledJob):
    job_type = "spin"

    def execute(self, context):
        if context.configuration == "c":
            sum(range(10**12))  # one call in C: SIGXCPU's Python handler would run only when it returns
        elif context.configuration == "command":  # a command that ignores SIGXCPU (the worker only waits)
            subprocess.run([sys.executable, "-c", "import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN); "
                            "exec('while True: pass')"])
        else:
            while True:
                pass
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})


class Pid(BaseScheduledJob):
    job_type = "pid"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})
'''


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "spin.py").write_text(PLUGIN)
    return folder


class Kills(Metrics):
    """Counts ``mjsched_kills_total`` by reason, as the Prometheus metrics would."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def run_killed(self, reason: str) -> None:
        self.reasons.append(reason)


def _finished(store, name: str) -> dict | None:
    """The job's one run once it has ended, else None."""
    runs = store.list_runs(job_name=name)
    return runs[0] if runs and runs[0]["status"] != "Running" else None


@pytest.mark.parametrize(("cgroups", "what"), [("auto", "c"), ("off", "c"), ("off", "command")])
def test_a_long_call_in_c_that_ignores_sigxcpu_is_killed_by_the_supervisor(store, driver_factory, plugins, cgroups,
                                                                             what):
    """``c``: the worker itself in one long call in C; ``command``: a command that ignores SIGXCPU (its CPU
    read from the worker's tree in /proc when there is no cgroup)."""
    d = driver_factory(plugins_dir=str(plugins), max_concurrent_jobs=1, isolation=Isolation(cgroups=cgroups))
    d.supervisor.guard.metrics = kills = Kills()
    counted = d.pool.cgroups is not None and d.pool.cgroups.active and d.pool.cgroups.version == 2
    add_job(store, "c-call", "spin", YEARLY, configuration=json.dumps(what), max_cpu_s=1)
    d.until(lambda: _finished(store, "c-call"), 30)
    run = _finished(store, "c-call")
    assert run["status"] == "Failed", run
    assert run["error_message"].startswith("CPU time limit 1 s exceeded: its process tree used "), run
    assert "did not stop at SIGXCPU" in run["error_message"]
    used = float(run["error_message"].split("used ")[1].split(" s")[0])
    assert 2.5 <= used < 4.5, (used, "cgroup" if counted else "psutil")
    assert kills.reasons == ["cpu"]
    add_job(store, "after", "pid", YEARLY)  # the slot was refilled: the next run is unaffected
    d.until(lambda: _finished(store, "after"), 30)
    assert _finished(store, "after")["status"] == "Completed"


def test_python_code_stops_at_sigxcpu_and_the_supervisor_leaves_it_alone(store, driver_factory, plugins):
    d = driver_factory(plugins_dir=str(plugins), max_concurrent_jobs=1)
    d.supervisor.guard.metrics = kills = Kills()
    (worker,) = d.pool.idle_workers()
    add_job(store, "loop", "spin", YEARLY, configuration=json.dumps("python"), max_cpu_s=1)
    d.until(lambda: _finished(store, "loop"), 30)
    run = _finished(store, "loop")
    assert run["status"] == "Failed" and run["error_message"] == "CPU time limit 1 s exceeded", run
    assert kills.reasons == []
    assert d.pool.idle_workers() == [worker]  # the worker's RLIMIT_CPU stopped it: nothing was killed


def test_the_supervisor_reads_the_cpu_time_only_when_due_and_kills_past_the_margin(mem_store, fake_factory):
    """The decision on the fake pool, time passed in: the first read falls due when the tree could have used
    max_cpu_s + 1.5 s on every CPU; the loop wakes for it; below the margin the run goes on."""
    from mjsched_isolated.supervisor.limits import next_cpu_check_s

    store = mem_store
    d = fake_factory(lease_timeout_s=600.0)
    d.pool.hold()
    d.pool.cpu_s = 10.0  # the worker's CPU before the run: not the run's
    add_job(store, "busy", "ok", YEARLY, max_cpu_s=2)
    add_job(store, "free", "ok", YEARLY)  # no max_cpu_s: never read
    at = d.timeline()
    start = at(0)
    busy, free = (store.list_runs(job_name=n)[0]["id"] for n in ("busy", "free"))
    flight = d.supervisor.inflight[busy]
    first_s = next_cpu_check_s(3.5)
    assert flight.cpu_check_at is not None and d.supervisor.inflight[free].cpu_check_at is None
    assert abs((flight.cpu_check_at - start).total_seconds() - first_s) < 0.01 and flight.wake_at == flight.cpu_check_at
    d.pool.cpu_s = 13.0  # 3 s used: 0.5 s short of the kill point
    at(first_s + 0.01)
    assert store.get_run(busy)["status"] == "Running" and d.pool.killed == []
    d.pool.cpu_s = 13.6
    at(first_s + next_cpu_check_s(0.5) + 0.02)
    run = store.get_run(busy)
    assert run["status"] == "Failed" and d.pool.killed == [busy], run
    assert run["error_message"].startswith("CPU time limit 2 s exceeded: its process tree used 3.6 s of CPU")
    assert store.get_run(free)["status"] == "Running"
