"""A reused worker child between runs: what one run leaves (processes, process state) never reaches the
next, and finding that nothing was left is cheap. Real worker children through the pool, real signals;
plugins written to a temporary folder; every wait bounded."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from worker_helpers import OneWorker

from mjsched_isolated import protocol

PLUGINS = '''
import io, json, os, signal, subprocess, sys, threading, time
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Ok(BaseScheduledJob):
    job_type = "ok"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})


class Escape(BaseScheduledJob):
    """A background process in a session of its own whose parent exits at once: re-parented, outside the
    worker's session and process group (what `setsid sleep 1000 &` in a shell job does)."""
    job_type = "escape"

    def execute(self, context):
        out = subprocess.run(["setsid", "sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True, timeout=10)
        return ScheduledJobResult(success=True, details={"pid": int(out.stdout)})


class Noticed(BaseScheduledJob):
    """Succeeds or fails (its configuration says which); counts its format_notification calls."""
    job_type = "noticed"
    formatted = 0

    def execute(self, context):
        return ScheduledJobResult(success=context.configuration == "ok", error_message="no",
                                  details={"formatted": Noticed.formatted})

    def format_notification(self, context, result):
        Noticed.formatted += 1
        return super().format_notification(context, result)


class Pollute(BaseScheduledJob):
    job_type = "pollute"

    def execute(self, context):
        signal.alarm(100)
        signal.setitimer(signal.ITIMER_VIRTUAL, 100)
        signal.signal(signal.SIGUSR1, lambda *a: None)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        sys.stdout.close()
        sys.stderr = io.StringIO()
        sys.stdin.close()
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})


class Report(BaseScheduledJob):
    job_type = "report"

    def execute(self, context):
        print("printing works", flush=True)
        print("to stderr too", file=sys.stderr, flush=True)
        handler = lambda s: getattr(signal.getsignal(s), "name", None) or signal.getsignal(s).__name__
        return ScheduledJobResult(success=True, details={
            "pid": os.getpid(), "alarm": signal.getitimer(signal.ITIMER_REAL)[0],
            "virtual": signal.getitimer(signal.ITIMER_VIRTUAL)[0], "usr1": handler(signal.SIGUSR1),
            "term": handler(signal.SIGTERM), "alrm": handler(signal.SIGALRM),
            "stderr": type(sys.stderr).__name__, "stdin_closed": sys.stdin.closed})


class BadDetails(BaseScheduledJob):
    job_type = "bad_details"

    def execute(self, context):
        kind = context.configuration
        if kind == "cyclic":
            details = {}
            details["self"] = details
        elif kind == "deep":
            details = cur = {}
            for _ in range(5000):
                cur["a"] = {}
                cur = cur["a"]
        elif kind == "deep_list":
            details = {"a": []}
            cur = details["a"]
            for _ in range(200):
                cur.append([])
                cur = cur[0]
        elif kind == "success_yes":
            return ScheduledJobResult(success="yes")
        elif kind == "error_number":
            return ScheduledJobResult(success=False, error_message=5)
        else:
            details = {"list": [1, 2], "str": "text"}[kind]
        return ScheduledJobResult(success=True, details=details)


class LeaveThread(BaseScheduledJob):
    """Leaves a thread behind that would end the worker process once released (as one that calls
    os._exit at some later time would)."""
    job_type = "leave_thread"
    release = threading.Event()

    def execute(self, context):
        def later():
            LeaveThread.release.wait()
            os._exit(9)
        threading.Thread(target=later, name="plugin-leftover").start()
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})
'''


def _finished(messages: list) -> protocol.RunFinished:
    return messages[-1]


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "isolation.py").write_text(PLUGINS)
    return folder


def test_a_process_that_started_its_own_session_is_killed_and_reaped_after_the_run(plugins):
    with OneWorker(str(plugins)) as one:
        escaped = _finished(one.run("escape")).details["pid"]
        try:
            assert _finished(one.run("ok")).success  # the cleanup of the first run is done before this one
            assert not psutil.pid_exists(escaped)  # killed, and reaped by the worker (no zombie either)
        finally:
            if psutil.pid_exists(escaped):
                os.kill(escaped, 9)


def test_the_worker_link_is_two_one_way_pipes_not_a_socket_pair(plugins):
    """Reading a worker's result must not wake the worker waiting for its next request: a Unix socket pair
    has one wait queue for both directions (issue 11: one needless context switch into every idle worker
    per run, 3 voluntary switches a run instead of 2 under ``serve``). Pipes on both sides."""
    with OneWorker(str(plugins)) as one:
        assert _finished(one.run("ok")).success
        link = one.worker.conn
        assert all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (link.fileno(), link.writer.fileno()))
        kinds = []
        for fd in os.listdir(f"/proc/{one.worker.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # a descriptor closed meanwhile
                kinds.append(stat.S_IFMT(os.stat(f"/proc/{one.worker.pid}/fd/{fd}").st_mode))
        assert stat.S_IFIFO in kinds and stat.S_IFSOCK not in kinds
        assert _finished(one.run("ok")).success


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_the_plugin_formats_a_notice_only_for_an_outcome_that_is_notified(plugins, outcome):
    """Most runs notify no one (issue 11): the request says which outcomes are notified, and the worker
    calls ``format_notification`` only for those (an older supervisor's request, without the flags, gets
    every notice as before)."""
    with OneWorker(str(plugins)) as one:
        def run(**flags):
            one._next_run_id += 1
            request = protocol.RunRequest(run_id=one._next_run_id, job_id=1, job_name="n", job_type="noticed",
                                          configuration=json.dumps(outcome), **flags)
            one.pool.submit(one.worker, request)
            return one._until(lambda m: isinstance(m, protocol.RunFinished))[-1]

        skipped = run(notice_on_success=False, notice_on_failure=False)
        assert skipped.success is (outcome == "ok") and skipped.notification is None
        wanted = run(**{f"notice_on_{'success' if outcome == 'ok' else 'failure'}": True,
                        f"notice_on_{'failure' if outcome == 'ok' else 'success'}": False})
        assert wanted.notification is not None and wanted.notification.subject.startswith("Scheduled job 'n'")
        assert run().notification is not None  # the defaults: every outcome formatted
        assert run().details["formatted"] == 2  # formatted for the last two runs only


def test_a_run_that_left_nothing_does_not_scan_the_process_table():
    """With the worker a child subreaper, 'nothing left' is read from /proc/self alone; a left process is
    still found (through the full scan)."""
    script = textwrap.dedent('''
        import os, subprocess, sys
        from mjsched_isolated import proctree
        from mjsched_isolated.worker import hygiene
        assert proctree.become_subreaper()
        os.setsid()
        calls = []
        full_scan = proctree.session_and_descendants
        proctree.session_and_descendants = lambda leader: calls.append(leader) or full_scan(leader)
        watchdog = subprocess.Popen(["sleep", "100"])
        assert hygiene.kill_leftovers(watchdog.pid, 1, "j", subreaper=True) == [] and calls == []
        left = subprocess.Popen(["sleep", "100"])
        assert hygiene.kill_leftovers(watchdog.pid, 2, "j", subreaper=True) == [left.pid] and calls
        watchdog.kill(); watchdog.wait()
        print("ok")
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ok", out.stderr


def test_process_state_a_run_changed_is_restored_before_the_next_run(plugins):
    """Alarms, interval timers, signal handlers and sys.std* a run changed (or closed) do not reach the
    next run in the same worker (a pending alarm(2) used to kill the next runs with SIGALRM)."""
    with OneWorker(str(plugins)) as one:
        polluter = _finished(one.run("pollute"))
        report = _finished(one.run("report"))
    assert report.success, report
    facts = report.details
    assert facts["pid"] == polluter.details["pid"]  # the same worker, reused
    assert facts["alarm"] == 0 and facts["virtual"] == 0
    assert facts["usr1"] == "SIG_DFL" and facts["term"] == "_on_sigterm"
    assert facts["alrm"] == "SIG_DFL"
    assert facts["stderr"] != "StringIO" and facts["stdin_closed"] is False


def test_a_worker_whose_run_left_a_thread_is_replaced_and_the_next_run_is_not_blamed(plugins):
    with OneWorker(str(plugins)) as one:
        old = one.worker
        first = _finished(one.run("leave_thread"))
        assert first.success and first.retiring and "plugin-leftover" in first.retiring
        # the pool does not give the old child another run (OneWorker fails the test on a death event)
        after = _finished(one.run("ok"))
        assert after.success and after.details["pid"] != first.details["pid"]
        old.process.join(10)
        assert old.process.exitcode == 0  # it exited by itself, cleanly, its thread never released


@pytest.mark.parametrize(("kind", "why"), [
    ("list", "details must be a JSON object (a dict), got list"),
    ("str", "details must be a JSON object (a dict), got str"),
    ("cyclic", "without reference cycles"),
    ("deep", "nested at most 64 levels"),
    ("deep_list", "nested at most 64 levels"),
])
def test_bad_details_are_a_failed_run_not_a_dead_worker(plugins, kind, why):
    with OneWorker(str(plugins)) as one:
        pid = one.worker.pid
        finished = _finished(one.run("bad_details", json.dumps(kind)))
        assert not finished.success and finished.details is None
        assert finished.error_message.startswith("plugin returned bad details: ") and why in finished.error_message
        after = _finished(one.run("ok"))  # the same worker goes on (OneWorker fails the test on a death)
        assert after.success and after.details["pid"] == pid


@pytest.mark.parametrize(("kind", "message"), [
    ("success_yes", "plugin returned bad success: success must be True or False, got 'yes' (str)"),
    ("error_number", "plugin returned bad error_message: error_message must be a string or None, got int"),
])
def test_a_result_field_of_the_wrong_type_is_a_failed_run_naming_the_field(plugins, kind, message):
    """ScheduledJobResult(success="yes") gave a Failed run with an empty error_message."""
    with OneWorker(str(plugins)) as one:
        finished = _finished(one.run("bad_details", json.dumps(kind)))
        assert not finished.success and finished.error_message.startswith(message), finished.error_message
        assert _finished(one.run("ok")).success  # the same worker goes on


def test_signals_a_run_blocked_are_unblocked_for_the_next_run(plugins):
    (plugins / "blocker.py").write_text(
        "import os, signal\nfrom mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult\n\n\n"
        "class Block(BaseScheduledJob):\n    job_type = 'block'\n\n    def execute(self, context):\n"
        "        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])\n"
        "        return ScheduledJobResult(success=True)\n\n\n"
        "class Mask(BaseScheduledJob):\n    job_type = 'mask'\n\n    def execute(self, context):\n"
        "        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])\n"
        "        return ScheduledJobResult(success=True, details={'blocked': sorted(s.name for s in blocked)})\n")
    with OneWorker(str(plugins)) as one:
        one.run("block")
        assert "SIGUSR2" not in _finished(one.run("mask")).details["blocked"]


def test_a_umask_a_run_set_is_put_back_for_the_next_run(plugins):
    (plugins / "umasker.py").write_text(
        "import os\nfrom mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult\n\n\n"
        "class Umask(BaseScheduledJob):\n    job_type = 'umask'\n\n    def execute(self, context):\n"
        "        before = os.umask(0o077)\n"
        "        return ScheduledJobResult(success=True, details={'before': before})\n")
    with OneWorker(str(plugins)) as one:
        first = _finished(one.run("umask")).details["before"]
        assert _finished(one.run("umask")).details["before"] == first != 0o077


LIMITS_PLUGIN = '''
import os
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Hog(BaseScheduledJob):
    job_type = "hog"

    def execute(self, context):
        what = context.configuration["what"]
        if what == "memory":
            block = bytearray(context.configuration["mb"] * 1024 * 1024)
            return ScheduledJobResult(success=True, details={"allocated_mb": len(block) // 2**20})
        if what == "cpu":
            while True:
                pass
        if what == "files":
            return ScheduledJobResult(success=True, details={"n": len([open(os.devnull) for _ in range(200)])})
        return ScheduledJobResult(success=True, details={"nice": os.getpriority(os.PRIO_PROCESS, 0)})
'''


def _run_limited(one: OneWorker, config: dict, limits: protocol.RunLimits | None) -> protocol.RunFinished:
    one._next_run_id += 1
    request = protocol.RunRequest(run_id=one._next_run_id, job_id=1, job_name="limited", job_type="hog",
                                  configuration=json.dumps(config), limits=limits)
    one.pool.submit(one.worker, request)
    return one._until(lambda m: isinstance(m, protocol.RunFinished) and m.run_id == request.run_id)[-1]


def test_a_run_over_its_memory_limit_fails_naming_it_and_the_next_run_is_unaffected(plugins):
    (plugins / "hog.py").write_text(LIMITS_PLUGIN)
    with OneWorker(str(plugins)) as one:
        pid = one.worker.pid
        over = _run_limited(one, {"what": "memory", "mb": 1024}, protocol.RunLimits(max_memory_mb=200))
        assert not over.success and over.error_message == "memory limit 200 MB exceeded", over
        within = _run_limited(one, {"what": "memory", "mb": 50}, protocol.RunLimits(max_memory_mb=200))
        assert within.success, within
        after = _run_limited(one, {"what": "memory", "mb": 300}, None)  # the same worker, no limit any more
        assert after.success and after.details["allocated_mb"] == 300
        assert one.worker.pid == pid


def test_cpu_open_files_and_nice_limits_apply_to_one_run_only(plugins):
    (plugins / "hog.py").write_text(LIMITS_PLUGIN)
    with OneWorker(str(plugins)) as one:
        cpu = _run_limited(one, {"what": "cpu"}, protocol.RunLimits(max_cpu_s=1))
        assert not cpu.success and cpu.error_message == "CPU time limit 1 s exceeded", cpu
        files = _run_limited(one, {"what": "files"}, protocol.RunLimits(max_open_files=50))
        assert not files.success and files.error_message.startswith("open files limit 50 exceeded"), files
        assert _run_limited(one, {"what": "files"}, None).details["n"] == 200
        usual = _run_limited(one, {"what": "nice"}, None).details["nice"]
        niced = _run_limited(one, {"what": "nice"}, protocol.RunLimits(nice=19))
        assert niced.details["nice"] == 19 != usual
        if os.geteuid() == 0:  # root may lower it back: the worker is kept
            assert niced.retiring is None
            assert _run_limited(one, {"what": "nice"}, None).details["nice"] == usual
        else:  # it cannot: the worker is replaced, and the next run has the usual priority
            assert niced.retiring and "nice" in niced.retiring


BOMB_PLUGIN = '''
import os, time
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Bomb(BaseScheduledJob):
    """A fork bomb, bounded even without a limit: 3 children a process, 5 levels (363), then the worker
    itself goes on forking, 400 more at most."""
    job_type = "bomb"

    def execute(self, context):
        if os.getuid() == 0:  # RLIMIT_NPROC does not hold for root: never run it there
            return ScheduledJobResult(success=False, error_message="refusing to run as root")

        def bomb(depth):
            for _ in range(3):
                if os.fork() == 0:
                    try:
                        if depth < 4:
                            bomb(depth + 1)
                    except BaseException:
                        pass
                    time.sleep(30)
                    os._exit(0)

        bomb(0)
        for _ in range(400):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
        return ScheduledJobResult(success=True)
'''

BOMB_SCRIPT = """
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from worker_helpers import OneWorker
from mjsched_isolated import protocol
import psutil
with OneWorker(sys.argv[1]) as one:
    request = protocol.RunRequest(run_id=1, job_id=1, job_name="bomb", job_type="bomb", configuration=None,
                                  limits=protocol.RunLimits(max_processes=int(sys.argv[3])))
    one.pool.submit(one.worker, request)
    bombed = one._until(lambda m: isinstance(m, protocol.RunFinished))[-1]
    after = one.run("ok")[-1]  # the bomb's processes are killed before this run starts
    # the worker's own tree only (not every process of uid nobody); on a loaded machine the last of some
    # 400 killed processes can end (and be reaped by the worker) a little after the worker's 1 s bound:
    # poll, bounded, for the tree to be down to the watchdog
    give_up = time.monotonic() + 15
    while True:
        left = [p.pid for p in psutil.Process(one.worker.pid).children(recursive=True)]
        if len(left) <= 1 or time.monotonic() > give_up:
            break
        time.sleep(0.05)
    print(json.dumps({"error": bombed.error_message, "after": after.success, "left": len(left)}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to run a worker under an unprivileged real uid")
def test_a_fork_bomb_under_a_process_limit_is_contained_and_cleaned_up(plugins):
    """RLIMIT_NPROC counts the processes of the real uid and exempts root and CAP_SYS_RESOURCE: the worker
    runs with real uid nobody (effective root, to read the interpreter) and without those capabilities."""
    (plugins / "bomb.py").write_text(BOMB_PLUGIN)
    limit = 30 + sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534)
    cmd = ["setpriv", "--ruid=65534", "--bounding-set=-sys_resource,-sys_admin", sys.executable, "-c", BOMB_SCRIPT,
           str(plugins), str(Path(__file__).parent), str(limit)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["error"].startswith(f"process limit {limit} exceeded"), facts
    assert facts["after"] is True and facts["left"] == 1  # the watchdog only: the bomb was killed and reaped


@pytest.mark.parametrize("where", ["raise", "error_message", "details"])
def test_a_lone_surrogate_in_a_result_is_sent_as_u_fffd_not_a_dead_worker(plugins, where):
    """A non-UTF-8 file name read by os.listdir holds a lone surrogate ('bad\\udcffname'); in an exception,
    an error message or details it used to kill the worker ("worker died (exit code 1)") and lose the
    real error. The result now arrives with U+FFFD in its place, from the same worker."""
    (plugins / "surrogate.py").write_text(
        "from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult\n\n\n"
        "class Surrogate(BaseScheduledJob):\n    job_type = 'surrogate'\n\n    def execute(self, context):\n"
        "        name = 'bad\\udcffname'\n        where = context.configuration['where']\n"
        "        if where == 'raise':\n            raise ValueError(f'bad file {name}')\n"
        "        if where == 'error_message':\n"
        "            return ScheduledJobResult(success=False, error_message=f'cannot process {name}')\n"
        "        return ScheduledJobResult(success=True, details={'file': name, name: [name]})\n")
    with OneWorker(str(plugins)) as one:
        pid = one.worker.pid
        finished = _finished(one.run("surrogate", json.dumps({"where": where})))
        if where == "details":
            clean = "bad\ufffdname"
            assert finished.success and finished.details == {"file": clean, clean: [clean]}
        else:
            assert not finished.success and "bad\ufffdname" in finished.error_message
        after = _finished(one.run("ok"))  # the same worker goes on (OneWorker fails the test on a death)
        assert after.success and after.details["pid"] == pid


def test_restore_finds_a_closed_standard_descriptor_and_a_real_timer_in_few_calls(monkeypatch):
    """In process: a closed fd 0 is found by one poll() (POLLNVAL) and put back; a periodic ITIMER_REAL
    (what alarm() sets) is reported as the pending alarm and cancelled by alarm(0), no getitimer of it."""
    import signal

    from mjsched_isolated.worker import hygiene

    state = hygiene.ProcessState.capture()
    timers_read: list[int] = []
    real_getitimer = signal.getitimer
    monkeypatch.setattr(signal, "getitimer", lambda which: timers_read.append(which) or real_getitimer(which))
    monkeypatch.setattr(os, "get_blocking", lambda fd: pytest.fail("one poll, not a call per descriptor"))
    saved = os.dup(0)
    try:
        os.close(0)
        signal.setitimer(signal.ITIMER_REAL, 50, 50)
        changed = state.restore()
        assert "file descriptor 0" in changed and "pending alarm" in changed
        assert not any(c.startswith("interval timer") for c in changed)
        assert real_getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert os.get_inheritable(0) is not None  # open again
        assert state.restore() == []  # nothing changed since
        assert signal.ITIMER_REAL not in timers_read
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.dup2(saved, 0)
        os.close(saved)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_restore_reads_the_umask_and_signal_mask_from_the_status_it_is_given(monkeypatch):
    """In process: given ``/proc/self/status`` read after the run, an unchanged umask and blocked-signal mask
    cost no syscall; a changed one is still found and put back."""
    import signal

    from mjsched_isolated.worker import hygiene

    state = hygiene.ProcessState.capture()
    with open("/proc/self/status", "rb") as f:
        unchanged = f.read()
    real_umask, real_mask = os.umask, signal.pthread_sigmask
    monkeypatch.setattr(os, "umask", lambda *a: pytest.fail("umask read though the status showed it"))
    monkeypatch.setattr(signal, "pthread_sigmask", lambda *a: pytest.fail("mask set though the status showed it"))
    assert [c for c in state.restore(unchanged) if c != "pending alarm"] == []  # pytest-timeout's alarm
    monkeypatch.setattr(os, "umask", real_umask)
    monkeypatch.setattr(signal, "pthread_sigmask", real_mask)
    old_umask = os.umask(0o077)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        with open("/proc/self/status", "rb") as f:
            changed = f.read()
        assert [c for c in state.restore(changed) if c != "pending alarm"] == ["umask", "blocked signals"]
        assert os.umask(old_umask) == old_umask and signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        os.umask(old_umask)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_restore_given_the_status_still_finds_every_kind_of_handler_change(monkeypatch):
    """In process, given ``/proc/self/status`` after the change: a caught signal's function replaced by
    another (the kernel sees no change), an uncaught signal given a function, and one given ``SIG_IGN`` are
    each found and put back; with nothing changed only the caught signals' handlers are read."""
    import signal

    from mjsched_isolated.worker import hygiene

    def status() -> bytes:
        with open("/proc/self/status", "rb") as f:
            return f.read()

    def other(_signum: int, _frame: object) -> None:
        pass

    signal.signal(signal.SIGUSR1, other)  # caught at capture
    try:
        state = hygiene.ProcessState.capture()
        assert signal.SIGUSR1 in state._caught and signal.SIGUSR2 not in state._caught
        for signum, handler in ((signal.SIGUSR1, lambda *_: None), (signal.SIGUSR2, other),
                                (signal.SIGUSR2, signal.SIG_IGN)):
            signal.signal(signum, handler)
            changed = [c for c in state.restore(status()) if c != "pending alarm"]  # pytest-timeout's alarm
            assert changed == [f"signal handler {signal.Signals(signum).name}"]
            assert signal.getsignal(signal.SIGUSR1) is other and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        read: list[int] = []
        real = hygiene._signal.getsignal
        monkeypatch.setattr(hygiene._signal, "getsignal", lambda s: read.append(s) or real(s))
        assert [c for c in state.restore(status()) if c != "pending alarm"] == []
        assert sorted(read) == sorted(state._caught)
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
