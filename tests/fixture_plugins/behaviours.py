"""Test plugins with known behaviours: succeed, fail, raise, crash the child, hang, sleep."""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from mjsched_isolated import BaseScheduledJob, NotificationContent, ScheduledJobResult
from mjsched_isolated.errors import ConfigurationError


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    marker_dir: str | None = None  # a file <run_id>.started is written there when execute begins
    seconds: float = 0.0
    exit_code: int = 3


def _write_atomically(path: Path, text: str) -> None:
    """Readers (tests) never see a half-written marker file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _mark(context) -> None:
    cfg = context.configuration
    if cfg.marker_dir:
        _write_atomically(Path(cfg.marker_dir, f"{context.job_name}.{context.run_id}.started"), str(os.getpid()))


class Ok(BaseScheduledJob):
    job_type = "ok"
    configuration_type = Config
    description = "succeeds at once and reports when execute began"

    def execute(self, context):
        started = time.time()
        _mark(context)
        return ScheduledJobResult(success=True, details={"plugin_started_at": started, "pid": os.getpid()})


class Fail(BaseScheduledJob):
    job_type = "fail"
    configuration_type = Config

    def execute(self, context):
        return ScheduledJobResult(success=False, error_message="it did not work", details={"why": "test"})


class Forge(BaseScheduledJob):
    """Fails with an error that tries to forge a supervisor log line and repaint the terminal."""

    job_type = "forge"

    def execute(self, context):
        return ScheduledJobResult(success=False, error_message=FORGED)


FORGED = ("oops\n2026-12-01 22:49:51,684 INFO mjsched.supervisor: run 99 finished: job forged Completed in 1 ms"
          "\x1b[31mRED\x1b[0m\rCR")


class Boom(BaseScheduledJob):
    job_type = "boom"
    configuration_type = Config

    def execute(self, context):
        raise RuntimeError("kaboom")


class Exit(BaseScheduledJob):
    job_type = "exit"
    configuration_type = Config

    def execute(self, context):
        os._exit(context.configuration.exit_code)


class Segv(BaseScheduledJob):
    job_type = "segv"
    configuration_type = Config

    def execute(self, context):
        ctypes.string_at(0)  # a real segmentation fault
        return ScheduledJobResult(success=True)


class Sleep(BaseScheduledJob):
    job_type = "sleep"
    configuration_type = Config

    def execute(self, context):
        _mark(context)
        time.sleep(context.configuration.seconds)
        return ScheduledJobResult(success=True)


class Beat(BaseScheduledJob):
    """Sleeps ``seconds`` in small steps, calling heartbeat() each step."""

    job_type = "beat"
    configuration_type = Config

    def execute(self, context):
        _mark(context)
        end = time.monotonic() + context.configuration.seconds
        while time.monotonic() < end:
            context.heartbeat()
            time.sleep(0.05)
        return ScheduledJobResult(success=True)


class SleepThenMark(BaseScheduledJob):
    """Sleeps ``seconds``, then writes <marker_dir>/<job>.<run>.finished just before it returns."""

    job_type = "sleep_then_mark"
    configuration_type = Config

    def execute(self, context):
        _mark(context)
        time.sleep(context.configuration.seconds)
        cfg = context.configuration
        if cfg.marker_dir:
            _write_atomically(Path(cfg.marker_dir, f"{context.job_name}.{context.run_id}.finished"), "done")
        return ScheduledJobResult(success=True, details={"slept_s": cfg.seconds})


class WatchDeadline(BaseScheduledJob):
    """Heartbeats once, then watches ``context.deadline_at`` for at most ``seconds`` until it moves; reports
    the deadline it started with and the last one it saw (epoch seconds)."""

    job_type = "watch_deadline"
    configuration_type = Config

    def execute(self, context):
        first = context.deadline_at
        context.heartbeat()
        end = time.monotonic() + context.configuration.seconds
        while context.deadline_at == first and time.monotonic() < end:
            time.sleep(0.005)  # the plugin's own polling, bounded by ``seconds``
        return ScheduledJobResult(success=True, details={"first": first.timestamp(),
                                                         "last": context.deadline_at.timestamp()})


class Hang(BaseScheduledJob):
    """Starts a grandchild that sleeps forever (its pid in <marker_dir>/<job>.<run>.grandchild), then hangs."""

    job_type = "hang"
    configuration_type = Config

    def execute(self, context):
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
        cfg = context.configuration
        if cfg.marker_dir:
            _write_atomically(Path(cfg.marker_dir, f"{context.job_name}.{context.run_id}.grandchild"),
                              str(grandchild.pid))
        _mark(context)
        # a run's own output is captured with the run (worker/output.py); the tests that wait for this line
        # read the supervisor's log, where only the worker's own logger still writes
        logging.getLogger("mjsched.child").warning("hang: run %d grandchild %d", context.run_id, grandchild.pid)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # only SIGKILL will do
        while True:
            time.sleep(3600)


class Picky(BaseScheduledJob):
    """Rejects configurations whose seconds is negative (validate_configuration)."""

    job_type = "picky"
    configuration_type = Config

    def validate_configuration(self, configuration):
        if configuration.seconds < 0:
            raise ConfigurationError("configuration.seconds: must be >= 0")

    def execute(self, context):
        return ScheduledJobResult(success=True)


class Pollute(BaseScheduledJob):
    """Changes process state a worker must restore: cwd, PATH, umask."""

    job_type = "pollute"
    configuration_type = Config

    def execute(self, context):
        os.chdir("/")
        os.environ["PATH"] = "/nonexistent"
        os.umask(0o777)
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})


class ReportState(BaseScheduledJob):
    job_type = "report_state"
    configuration_type = Config

    def execute(self, context):
        umask = os.umask(0)
        os.umask(umask)
        return ScheduledJobResult(success=True, details={"pid": os.getpid(), "cwd": os.getcwd(),
                                                         "path": os.environ.get("PATH"), "umask": umask})


class BigDetails(BaseScheduledJob):
    job_type = "big_details"
    configuration_type = Config

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"x": "z" * 10_000_000})


class GilHog(BaseScheduledJob):
    """Starts a grandchild, then holds the GIL in one C call for a very long time (catastrophic regex)."""

    job_type = "gil_hog"
    configuration_type = Config

    def execute(self, context):
        import re

        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
        # to the supervisor's log (the worker's own logger): the run's own output is stored with the run
        logging.getLogger("mjsched.child").warning("gil_hog: run %d grandchild %d", context.run_id, grandchild.pid)
        re.match(r"(a*)*b", "a" * 64)
        return ScheduledJobResult(success=True)


class LeakConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mb: int = 10  # MiB kept alive after each run
    seconds: float = 0.0  # then sleep this long before returning


_LEAKED: list[bytes] = []


class Leak(BaseScheduledJob):
    """Leaks ``mb`` MiB per run (module-level list, pages touched) and reports its pid and resident MiB."""

    job_type = "leak"
    configuration_type = LeakConfig

    def execute(self, context):
        import psutil

        _LEAKED.append(b"\x01" * (context.configuration.mb * 1024 * 1024))
        time.sleep(context.configuration.seconds)
        rss_mb = psutil.Process().memory_info().rss / (1024 * 1024)
        return ScheduledJobResult(success=True, details={"pid": os.getpid(), "rss_mb": rss_mb})

class FancyNotice(BaseScheduledJob):
    job_type = "fancy_notice"
    configuration_type = Config
    description = "succeeds or fails (seconds > 0: fails) with its own notification text"

    def execute(self, context):
        ok = context.configuration.seconds <= 0
        return ScheduledJobResult(success=ok, error_message=None if ok else "fancy failure")

    def format_notification(self, context, result):
        from mjsched_isolated.api import NotificationContent

        return NotificationContent(subject=f"fancy {context.job_name} {'ok' if result.success else 'bad'}",
                                   body="custom body", priority="Low", metadata={"custom": 1})


class BadNotice(BaseScheduledJob):
    job_type = "bad_notice"
    configuration_type = Config
    description = "succeeds, but its format_notification raises"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"kept": True})

    def format_notification(self, context, result):
        raise RuntimeError("formatter broke")


class AwkwardConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    succeed: bool = False


class Awkward(BaseScheduledJob):
    """Reports what databases and the pipe dislike: NUL bytes in its error and notice, a subject with a
    CR/LF header injection, and integers beyond 64 bits in its details and notice metadata."""

    job_type = "awkward"
    configuration_type = AwkwardConfig

    def execute(self, context):
        return ScheduledJobResult(success=context.configuration.succeed, details={"big": 10**30, "nul": "a\x00b"},
                                  error_message=None if context.configuration.succeed else "bad\x00byte")

    def format_notification(self, context, result):
        return NotificationContent(subject="line1\r\nBcc: evil@example.org", body="body\x00with nul",
                                   priority="High", metadata={"big": 10**30})


class LeaveBehind(BaseScheduledJob):
    """Succeeds, leaving a child process and a daemonised one (re-parented to init, still in the worker's
    process group) running; their pids are returned in details."""

    job_type = "leave_behind"

    def execute(self, context):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100000)"])
        daemon = subprocess.run(  # the intermediate process exits at once: the sleeper is re-parented
            [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(100000)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "print(p.pid)"], capture_output=True, text=True, check=True)
        grouped = subprocess.run(  # the same, but the sleeper moves to a process group of its own
            [sys.executable, "-c", "import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(100000)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, "
             "process_group=0); print(p.pid)"], capture_output=True, text=True, check=True)
        return ScheduledJobResult(success=True, details={"pids": [child.pid, int(daemon.stdout), int(grouped.stdout)]})


class BurnConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    cpu_s: float = 0.0  # CPU seconds to burn in the worker
    alloc_mb: int = 0  # MiB the worker touches (then frees)
    child_cpu_s: float = 0.0  # CPU seconds a waited-for child command burns
    child_alloc_mb: int = 0  # MiB that child touches


_BURN = ("import resource, sys, time\n"
         "b = bytearray({mb} * 1024 * 1024)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "del b\n"
         "cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])\n"
         "start = cpu()\n"
         "while cpu() - start < {cpu_s}: sum(range(10000))\n")


class Burn(BaseScheduledJob):
    """Uses a known amount of CPU time and memory, in the worker and in a child command it waits for."""

    job_type = "burn"
    configuration_type = BurnConfig

    def execute(self, context):
        cfg = context.configuration
        exec(_BURN.format(mb=cfg.alloc_mb, cpu_s=cfg.cpu_s), {})  # the same code as the child runs
        if cfg.child_cpu_s or cfg.child_alloc_mb:
            subprocess.run([sys.executable, "-c", _BURN.format(mb=cfg.child_alloc_mb, cpu_s=cfg.child_cpu_s)],
                           check=True)
        return ScheduledJobResult(success=True)


class FlakyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    counter_dir: str
    fail_times: int = 2


class Flaky(BaseScheduledJob):
    """Fails its first ``fail_times`` runs, then succeeds: counts its runs in ``<counter_dir>/<job>.count``
    (one line per run: the wall-clock time it began and the run id)."""

    job_type = "flaky"
    configuration_type = FlakyConfig

    def execute(self, context):
        path = Path(context.configuration.counter_dir, f"{context.job_name}.count")
        with path.open("a") as f:
            f.write(f"{time.time()} {context.run_id}\n")
        runs = len(path.read_text().splitlines())
        if runs <= context.configuration.fail_times:
            return ScheduledJobResult(success=False, error_message=f"flaky failure {runs}")
        return ScheduledJobResult(success=True, details={"runs": runs})
