"""Per-worker cgroups (mjsched_isolated/cgroups.py): every process a run starts, whatever its session, is
killed with the run or with its worker, also when the worker was killed from outside; the cgroups are
removed when workers are replaced, at shutdown and (stale ones) at the next start; where cgroups are off
or cannot be used, the fallback is said. Real worker children, real cgroups (skipped, saying why, where
this machine has none usable); each test's id names the mechanism it used."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from waiting import wait_until
from worker_helpers import OneWorker

from mjsched_isolated import cgroups, protocol
from mjsched_isolated.config import load_settings
from mjsched_isolated.ops import check

PLUGINS = '''
import os, pathlib, subprocess, time
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


def _escape():
    """`setsid sleep 1000 &`: a process in a session of its own whose parent exits at once."""
    out = subprocess.run(["setsid", "sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True, timeout=10)
    pid = int(out.stdout)
    with open(f"/proc/{pid}/cgroup") as f:
        return pid, f.read()


class Escape(BaseScheduledJob):
    job_type = "escape"

    def execute(self, context):
        pid, cgroup = _escape()
        return ScheduledJobResult(success=True, details={"pid": pid, "cgroup": cgroup})


class EscapeAndWait(BaseScheduledJob):
    """Leaves `setsid sleep 1000` and then blocks, having written the pid to the file it was given."""
    job_type = "escape_and_wait"

    def execute(self, context):
        pid, _ = _escape()
        target = pathlib.Path(context.configuration)
        target.with_suffix(".tmp").write_text(str(pid))
        target.with_suffix(".tmp").rename(target)
        time.sleep(1000)
        return ScheduledJobResult(success=True)


class Reserve(BaseScheduledJob):
    """Ages the worker: 1 GiB of address space reserved and kept (VmData grows, RSS does not)."""
    job_type = "reserve"
    kept = []

    def execute(self, context):
        import ctypes
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        Reserve.kept.append(libc.malloc(1 << 30))
        return ScheduledJobResult(success=Reserve.kept[-1] is not None)


class Command(BaseScheduledJob):
    """Runs the command in its configuration and waits for it."""
    job_type = "command"

    def execute(self, context):
        done = subprocess.run(context.configuration, capture_output=True, text=True, timeout=30)
        return ScheduledJobResult(success=done.returncode == 0, details={"returncode": done.returncode},
                                  error_message=f"command exited {done.returncode}: {done.stderr[-300:]}")


class Shared(BaseScheduledJob):
    """Writes 300 MB of shared anonymous memory: not data (RLIMIT_DATA does not see it), but charged to the
    cgroup: only the cgroup's limit stops it."""
    job_type = "shared"

    def execute(self, context):
        import mmap
        area = mmap.mmap(-1, 300 << 20)
        for offset in range(0, len(area), 4096):
            area[offset] = 1
        return ScheduledJobResult(success=True)


class Bomb(BaseScheduledJob):
    """A fork bomb, bounded even without a limit: 3 children a process, 4 levels, then the worker itself
    goes on forking, 200 more at most. Runs as root too: the cgroup's pids.max binds root."""
    job_type = "bomb"

    def execute(self, context):
        def bomb(depth):
            for _ in range(3):
                if os.fork() == 0:
                    try:
                        if depth < 3:
                            bomb(depth + 1)
                    except BaseException:
                        pass
                    time.sleep(30)
                    os._exit(0)

        bomb(0)
        for _ in range(200):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
        return ScheduledJobResult(success=True)


class Zombie(BaseScheduledJob):
    """Leaves a child that has ended and is not reaped: a zombie, listed in no cgroup.procs."""
    job_type = "zombie"

    def execute(self, context):
        child = subprocess.Popen(["true"])
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
        child.returncode = 0  # Popen's finaliser must not reap it either
        return ScheduledJobResult(success=True, details={"pid": child.pid})


class Ok(BaseScheduledJob):
    job_type = "ok"

    def execute(self, context):
        return ScheduledJobResult(success=True)
'''

MECHANISMS = [pytest.param("v2", id="cgroup-v2"), pytest.param("v1", id="cgroup-v1-freezer")]


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "escape.py").write_text(PLUGINS)
    return folder


def _usable(mode: str) -> str:
    """What the pool will use for ``mode``; skips the test (saying why) where this machine cannot."""
    described = cgroups.probe(mode)
    if described.startswith("cgroups are not used"):
        pytest.skip(f"cgroup {mode} not usable here: {described}")
    return described


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill(pid: int) -> None:
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_a_setsid_process_a_run_left_is_killed_through_the_workers_cgroup(plugins, mode):
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        group = one.worker.cgroup
        assert group is not None and group.version == int(mode[1])
        assert f"; cgroup {mode} per worker under " in one.pool.containment()
        finished = one.run("escape")[-1]
        escaped = finished.details["pid"]
        try:
            # the escaped process was in the worker's cgroup although it left the worker's session
            assert os.path.basename(group.kill_dir) in finished.details["cgroup"]
            assert one.run("ok")[-1].success  # the first run's cleanup is done before the next run
            assert _gone(escaped)
            assert group.pids() == {one.worker.pid, *(p.pid for p in psutil.Process(one.worker.pid).children())}
        finally:
            _kill(escaped)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_a_zombie_a_run_left_is_reaped_although_its_cgroup_no_longer_lists_it(plugins, mode):
    """After a run, a cgroup holding only the worker and its watchdog means nothing was left, unless a
    child waits to be reaped: zombies are in no cgroup.procs, and the worker must not collect them."""
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        zombie = one.run("zombie")[-1].details["pid"]
        assert one.run("ok")[-1].success  # the first run's cleanup is done before the next run
        assert not psutil.pid_exists(zombie)
        children = psutil.Process(one.worker.pid).children()
        assert len(children) == 1 and children[0].status() != psutil.STATUS_ZOMBIE  # its watchdog only


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_a_worker_killed_from_outside_leaves_nothing_of_its_run(plugins, tmp_path, mode):
    """Issue 14: a worker SIGKILLed by someone else left its run's `setsid` commands running (its child
    subreaper was gone with it); the supervisor kills the dead worker's cgroup and removes it."""
    _usable(mode)
    pid_file = tmp_path / "escaped.pid"
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        worker = one.worker
        group = worker.cgroup
        assert group is not None
        one.pool.submit(worker, protocol.RunRequest(run_id=1, job_id=1, job_name="j", job_type="escape_and_wait",
                                                    configuration=json.dumps(str(pid_file))))
        escaped = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), 20, "the plugin's pid file"))
        try:
            os.kill(worker.pid, signal.SIGKILL)  # from outside: not through the pool
            died = []
            wait_until(lambda: died.extend(e for e in one.pool.wait(0.5)[0] if e.died) or died, 10,
                       "the pool seeing its worker die")
            assert died[0].exitcode == -signal.SIGKILL and died[0].run is not None
            wait_until(lambda: _gone(escaped), 5, "the escaped process killed")
            wait_until(lambda: (one.pool.wait(0.05), not os.path.exists(group.kill_dir))[1], 5,
                       "the dead worker's cgroup removed")
        finally:
            _kill(escaped)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_worker_cgroups_are_removed_when_workers_are_replaced_and_at_shutdown(plugins, mode):
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode, max_tasks_per_child=1) as one:
        first = one.worker.cgroup
        assert first is not None
        assert one.run("ok")[-1].success  # the worker is recycled after this run
        wait_until(lambda: (one.pool.wait(0.05), not os.path.exists(first.kill_dir))[1], 15,
                   "the replaced worker's cgroup removed")
        one.ready = one._until(lambda m: isinstance(m, protocol.Ready))[-1]
        second = one.worker.cgroup
        assert second is not None and second.kill_dir != first.kill_dir and os.path.isdir(second.kill_dir)
        parent = os.path.dirname(second.kill_dir)
    assert not os.path.exists(parent)  # close(): every worker cgroup and the pool's own removed
    if second.memory_dir is not None:
        assert not os.path.exists(os.path.dirname(second.memory_dir))


STALE = """
import subprocess, sys
from mjsched_isolated import cgroups
parent = cgroups.Parent.open(sys.argv[1])
group = parent.create(0)
sleeper = subprocess.Popen(["setsid", "sleep", "1000"])
group.join(sleeper.pid)
print(group.kill_dir, sleeper.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_the_cgroups_of_a_sigkilled_supervisor_are_cleaned_at_the_next_start(mode):
    _usable(mode)
    proc = subprocess.Popen([sys.executable, "-c", STALE, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    path, pid = proc.stdout.readline().split()
    sleeper = int(pid)
    try:
        proc.kill()
        proc.wait(10)
        assert os.path.isdir(path) and not _gone(sleeper)  # what a SIGKILLed supervisor leaves
        parent = cgroups.Parent.open(mode)  # the next start
        try:
            assert not os.path.exists(os.path.dirname(path))
            wait_until(lambda: _gone(sleeper), 5, "the stale cgroup's process killed")
        finally:
            parent.close()
    finally:
        _kill(sleeper)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MECHANISMS)
def test_pool_cgroups_of_another_pid_namespace_are_removed_only_once_empty(mode, monkeypatch):
    """A supervisor of another pid namespace (a container's PID 1 killed with its container) cannot be
    checked by pid: its cgroups are removed once nothing runs in them, never while something does."""
    _usable(mode)
    monkeypatch.setattr(cgroups, "STALE_EMPTY_AFTER_S", 0.0)
    first = cgroups.Parent.open(mode)
    root = os.path.dirname(first.kill_dir)
    empty, busy = os.path.join(root, "1.1.1.0"), os.path.join(root, "2.1.1.0")
    for path in (empty, busy, os.path.join(empty, "w0-0"), os.path.join(busy, "w0-0")):
        os.mkdir(path)
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        cgroups.WorkerCgroup(os.path.join(busy, "w0-0"), int(mode[1])).join(sleeper.pid)
        second = cgroups.Parent.open(mode)
        assert not os.path.exists(empty) and os.path.isdir(busy) and sleeper.poll() is None
        second.close()
    finally:
        sleeper.kill()
        sleeper.wait()
        first.close()
        cgroups.WorkerCgroup(os.path.join(busy, "w0-0"), int(mode[1])).remove()
        os.rmdir(busy)


@pytest.mark.timeout(30)
def test_with_cgroups_off_the_fallback_is_said_at_start_and_in_check(plugins, monkeypatch, tmp_path):
    monkeypatch.setenv("MJSCHED_ISOLATION_CGROUPS", "off")
    settings = load_settings(flags={"database_url": f"sqlite:///{tmp_path / 'none.db'}", "plugins_dir": str(plugins)})
    notes = [n for n in check(settings).notes if n.startswith("isolation:")]
    assert len(notes) == 1 and 'cgroups are not used (turned off in the settings ([isolation] cgroups = "off"))' \
        in notes[0] and "child subreapers" in notes[0], notes
    with OneWorker(str(plugins), cgroups_mode="off") as one:
        assert one.worker.cgroup is None
        assert "cgroups are not used (turned off" in one.pool.containment()
        assert one.run("ok")[-1].success


@pytest.mark.timeout(30)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to try as an unprivileged user")
def test_an_unprivileged_supervisor_says_why_cgroups_are_not_used():
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                          "from mjsched_isolated import cgroups; print(cgroups.probe('auto'))"],
                         capture_output=True, text=True, timeout=20, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stderr
    said = out.stdout.strip()
    assert said.startswith("cgroups are not used (") and "not root?" in said, said


def _run(one: OneWorker, job_type: str, configuration: object = None, **limits: int) -> protocol.RunFinished:
    one._next_run_id += 1
    request = protocol.RunRequest(run_id=one._next_run_id, job_id=1, job_name="j", job_type=job_type,
                                  configuration=json.dumps(configuration), limits=protocol.RunLimits(**limits))
    one.pool.submit(one.worker, request)
    return one._until(lambda m: isinstance(m, protocol.RunFinished) and m.run_id == request.run_id)[-1]


ALLOCATE_250_MB = [sys.executable, "-c", "b = bytearray(250 << 20); print(len(b))"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [pytest.param("auto", id="cgroup-memory")])
def test_a_memory_limit_means_the_same_for_a_command_of_an_old_worker(plugins, mode):
    """Issue 14: a command inherits the worker's RLIMIT_DATA, set to what the worker had plus the limit, so
    on a worker holding 1 GiB a command could allocate 1 GiB more than the job's limit. The cgroup's limit
    holds for the whole tree from what it holds when the run starts: the command is killed at it."""
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        group = one.worker.cgroup
        if group is None or group.memory_dir is None:
            pytest.skip(f"no memory cgroup here: {one.pool.containment()}")
        assert _run(one, "reserve").success  # the worker is now "old": 1 GiB more VmData
        finished = _run(one, "command", ALLOCATE_250_MB, max_memory_mb=100)
        assert not finished.success and finished.details["returncode"] == -signal.SIGKILL, finished
        assert finished.error_message.startswith("memory limit 100 MB exceeded: the kernel killed 1 process(es) of "
                                                 "the run at its cgroup's memory limit; command exited -9")
        assert _run(one, "command", ALLOCATE_250_MB).success  # the limit was lifted after the run


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [pytest.param("v2", id="cgroup-v2-cpu")])
def test_a_cpu_limit_holds_for_the_runs_processes_together(plugins, mode):
    """A command inherits the worker's RLIMIT_CPU, set at the worker's CPU time so far plus the limit, so
    the older the worker the more CPU its commands got; the watchdog counts the whole tree from the
    cgroup's CPU time and ends the run's processes at max_cpu_s."""
    _usable(mode)
    spin = [sys.executable, "-c", "while True: pass"]
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        finished = _run(one, "command", spin, max_cpu_s=1)
        assert not finished.success and finished.details["returncode"] == -signal.SIGXCPU, finished
        assert finished.error_message.startswith("CPU time limit 1 s exceeded by the run's processes together")
        assert 0.9 < finished.cpu_s < 3, finished.cpu_s  # the command's CPU, counted through the cgroup
        assert _run(one, "ok").success


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [pytest.param("auto", id="cgroup-memory")])
def test_a_worker_the_kernel_killed_at_the_cgroup_memory_limit_is_recorded_as_the_memory_limit(plugins, mode):
    """An out-of-memory kill was a bare SIGKILL ("most likely the kernel's out-of-memory killer"); the
    worker's cgroup counts it, so the run says which limit ended it."""
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        if one.worker.cgroup is None or one.worker.cgroup.memory_dir is None:
            pytest.skip(f"no memory cgroup here: {one.pool.containment()}")
        worker = one.worker
        request = protocol.RunRequest(run_id=1, job_id=1, job_name="j", job_type="shared", configuration=None,
                                      limits=protocol.RunLimits(max_memory_mb=100))
        one.pool.submit(worker, request)
        died = []
        wait_until(lambda: died.extend(e for e in one.pool.wait(0.5)[0] if e.died) or died, 20, "the worker's death")
        assert died[0].exitcode == -signal.SIGKILL and died[0].oom_killed

        recorded = _recorded_death(one.pool, died[0])
        assert recorded["error_message"].startswith(
            f"memory limit 100 MB exceeded: the kernel's out-of-memory killer ended worker process {worker.pid} at "
            "its cgroup's memory limit (killed by signal SIGKILL)"), recorded


def _recorded_death(pool, event) -> dict:
    """The fields :class:`RunGuard` records for run 1 when its worker's death ``event`` comes in."""
    from mjsched_isolated.supervisor.guard import RunGuard

    recorded: dict = {}

    class Recorder:
        def record(self, flight, now, **fields):
            recorded.update(fields)

    class Flight:
        run_id, job = 1, {}
        kill_at = None

        def unstarted(self, now, at=None) -> bool:  # a run that had started (not one claimed ahead)
            return False
    RunGuard(None, None, pool, None, Recorder(), {1: Flight()}).on_death(event, None)
    return recorded


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [pytest.param("auto", id="cgroup-memory")])
def test_a_worker_killed_from_outside_is_not_blamed_on_memory_when_its_cgroup_counted_no_oom_kill(
        plugins, mode, tmp_path):
    """New-user review L5: a ``kill -9`` from outside was recorded "most likely the kernel's out-of-memory
    killer" although the worker's cgroup accounting showed no out-of-memory kill."""
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        if one.worker.cgroup is None or one.worker.cgroup.memory_dir is None:
            pytest.skip(f"no memory cgroup here: {one.pool.containment()}")
        worker, started = one.worker, tmp_path / "started"
        request = protocol.RunRequest(run_id=1, job_id=1, job_name="j", job_type="escape_and_wait",
                                      configuration=json.dumps(str(started)),
                                      limits=protocol.RunLimits(max_memory_mb=500))
        one.pool.submit(worker, request)
        wait_until(started.exists, 20, "the run's start")
        os.kill(worker.pid, signal.SIGKILL)  # an operator's kill -9, not the kernel's
        died = []
        wait_until(lambda: died.extend(e for e in one.pool.wait(0.5)[0] if e.died) or died, 20, "the worker's death")
        assert (died[0].exitcode, died[0].oom_killed, died[0].oom_evidence) == (-signal.SIGKILL, False, False)

        recorded = _recorded_death(one.pool, died[0])
        assert recorded["error_message"].endswith(
            "(killed by signal SIGKILL): not sent by this supervisor, nor by the kernel's out-of-memory killer (the "
            "worker's cgroup counted no out-of-memory kill): another process or a person killed it"), recorded
        assert "probably" not in recorded["error_message"] and "most likely" not in recorded["error_message"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [pytest.param("auto", id="cgroup-pids")])
def test_a_fork_bomb_under_a_process_limit_is_contained_also_as_root(plugins, mode):
    """RLIMIT_NPROC does not bind root (the existing fork-bomb test needs an unprivileged uid); the
    cgroup's pids.max does, and the cleanup after the run kills the whole tree."""
    _usable(mode)
    with OneWorker(str(plugins), cgroups_mode=mode) as one:
        group = one.worker.cgroup
        if group is None or group.pids_dir is None:
            pytest.skip(f"no pids cgroup here: {one.pool.containment()}")
        bombed = _run(one, "bomb", max_processes=30)
        assert not bombed.success and bombed.error_message.startswith("process limit 30 exceeded"), bombed
        assert _run(one, "ok").success  # the bomb's processes were killed before this run
        assert group.pids() == {one.worker.pid, *(p.pid for p in psutil.Process(one.worker.pid).children())}
        assert len(group.pids()) == 2  # the worker and its watchdog
        assert group.pids_now() is not None and group.pids_now() < 30
