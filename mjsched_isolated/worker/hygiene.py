"""What one run may not leave to the next one in a reused worker: changed process state and live processes.

:class:`ProcessState` restores the working directory, environment and umask a plugin changed;
:func:`kill_leftovers` kills the processes a finished run left running (systemd's ``KillMode=control-group``
for a timer's service does the same). Process finding and signalling go through
:mod:`mjsched_isolated.proctree`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any

import psutil

from mjsched_isolated import cgroups, proctree

log = logging.getLogger("mjsched.child")

# the C functions under ``signal``: signal.getsignal converts to enums, 2 us a signal, 60 signals a run
_signal: Any = importlib.import_module("_signal")

LEFTOVER_REAP_TIMEOUT_S = 1.0


# ITIMER_REAL is the timer alarm() sets: ``alarm(0)`` in restore() has cancelled it (value and interval)
_TIMERS = (signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
# fds 0-2 checked in one call: poll() reports POLLNVAL for a closed descriptor (no events asked for)
_STD_FDS = select.poll()
for _fd in (0, 1, 2):
    _STD_FDS.register(_fd, 0)
# every signal whose handler Python can read and set (SIGKILL and SIGSTOP cannot be caught)
_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


class ProcessState:
    """Process state a plugin may change and the next run must not inherit: working directory,
    environment, umask, pending alarm and interval timers, signal handlers and the blocked-signal mask
    (main thread), ``sys.stdin``/``stdout``/
    ``stderr`` (and file descriptors 0-2 if a run closed them), and the threads that exist.

    A run that changed any of these gets a warning naming what was put back, so the cause is found at the
    run that caused it, not at the next one it would have broken."""

    def __init__(self, cwd: str, environ: dict[str, str], umask: int) -> None:
        self.cwd, self.environ, self.umask = cwd, environ, umask
        self.environ_data = _environ_data()
        self.handlers: dict[int, Any] = {}
        for signum in _SIGNALS:
            with contextlib.suppress(OSError, ValueError):
                self.handlers[signum] = _signal.getsignal(signum)
        # every handler read in one C-level pass and compared at once: the run changed none, most often
        self._signums = tuple(self.handlers)
        self._handler_values = tuple(self.handlers.values())
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        # the umask, and the blocked (main thread), ignored and caught signals, as /proc/self/status shows
        # them: a run whose status after it shows the same changed none of them at the kernel's level, and of
        # the Python handlers only those of caught signals can differ (see restore)
        self._status_umask = b"\nUmask:\t%04o\n" % umask
        self._status_signals, caught = _signal_lines()
        self._caught = tuple(s for s in self._signums if s in caught)
        self._caught_values = tuple(self.handlers[s] for s in self._caught)
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.fds = {fd: _dup(fd) for fd in (0, 1, 2)}
        self.threads = set(threading.enumerate())

    @classmethod
    def capture(cls) -> ProcessState:
        """The current state of this process."""
        umask = os.umask(0)
        os.umask(umask)
        return cls(os.getcwd(), dict(os.environ), umask)

    def restore(self, status: bytes | None = None) -> list[str]:
        """Put the captured state back; returns what had changed (``"signal handler SIGALRM"``, ...), empty
        for a run that changed nothing. A working directory that is gone is logged and left.

        ``status``: ``/proc/self/status`` read since the run ended (the worker's meter reads it for the
        peak memory): a umask and blocked-signal mask it shows unchanged are not read or set again (issue
        11: two syscalls a run fewer), and where it shows the same signals ignored and caught as at capture,
        only the Python handlers of the caught ones are compared (a handler set to ``SIG_DFL``, ``SIG_IGN``
        or a function, by ``signal.signal``, changes the kernel's disposition too, unless it replaced one
        function by another, which only a caught signal can have; issue 11: the 62 ``getsignal`` calls were
        5 % of a worker's instructions a run). Without it, or where it shows a change, all are compared."""
        changed: list[str] = []
        try:
            moved = os.getcwd() != self.cwd
        except OSError:  # the run removed the directory it moved to
            moved = True
        if moved:
            changed.append("working directory")
            try:
                os.chdir(self.cwd)
            except OSError:
                log.warning("could not return to %s after the run", self.cwd)
        if _environ_view() != self.environ_data:
            changed.append("environment")
            os.environ.clear()
            os.environ.update(self.environ)
        if (status is None or self._status_umask not in status) and os.umask(self.umask) != self.umask:
            changed.append("umask")
        if signal.alarm(0):
            changed.append("pending alarm")
        for timer in _TIMERS:
            if signal.getitimer(timer) != (0.0, 0.0):
                signal.setitimer(timer, 0)
                changed.append(f"interval timer {timer}")
        block = self._status_signals
        at = -1 if status is None or block is None else status.find(b"\nSigBlk:")
        signals_same = at >= 0 and status is not None and status[at + 1:at + 1 + len(block or b"")] == block
        same_handlers = False
        with contextlib.suppress(OSError, ValueError):
            same_handlers = (tuple(map(_signal.getsignal, self._caught)) == self._caught_values if signals_same
                             else tuple(map(_signal.getsignal, self._signums)) == self._handler_values)
        for signum, handler in () if same_handlers else self.handlers.items():
            if _signal.getsignal(signum) != handler:
                with contextlib.suppress(OSError, ValueError, TypeError):
                    _signal.signal(signum, handler)
                changed.append(f"signal handler {signal.Signals(signum).name}")
        if not signals_same and signal.pthread_sigmask(signal.SIG_SETMASK, self.mask) != self.mask:
            changed.append("blocked signals")
        changed += self._restore_streams()
        return changed

    def _restore_streams(self) -> list[str]:
        closed = {fd for fd, events in _STD_FDS.poll(0) if events & select.POLLNVAL}
        stdin, stdout, stderr = self.streams
        if (not closed and sys.stdin is stdin and sys.stdout is stdout and sys.stderr is stderr  # the common case
                and stdin is not None and stdout is not None and stderr is not None
                and not (stdin.closed or stdout.closed or stderr.closed)):
            return []  # nothing to put back (issue 11: a quarter of the time the loop below takes)
        changed = []
        for fd, saved in self.fds.items():
            if saved is not None and fd in closed:
                os.dup2(saved, fd)
                changed.append(f"file descriptor {fd}")
        names = ("stdin", "stdout", "stderr")
        originals = []
        for fd, (name, stream) in enumerate(zip(names, self.streams, strict=True)):
            if stream is None or stream.closed:  # the run closed the object itself: a new one on the same fd
                stream = open(fd, "r" if fd == 0 else "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                              errors="backslashreplace", closefd=False)
                changed.append(f"sys.{name} (closed)")
            elif getattr(sys, name) is not stream:
                changed.append(f"sys.{name}")
            originals.append(stream)
        sys.stdin, sys.stdout, sys.stderr = originals
        self.streams = (originals[0], originals[1], originals[2])
        return changed

    def new_threads(self) -> list[threading.Thread]:
        """Threads alive now that were not at capture time: a run's own threads it did not end. The worker's
        event loop's default executor threads (``asyncio_N``, reused by later async runs) do not count."""
        return [t for t in threading.enumerate()
                if t not in self.threads and t.is_alive() and not t.name.startswith("asyncio_")]


def _signal_lines() -> tuple[bytes | None, set[int]]:
    """The ``SigBlk``, ``SigIgn`` and ``SigCgt`` lines of ``/proc/self/status`` now (blocked signals of the
    main thread, ignored and caught ones of the process), and the caught signals' numbers (bit n-1 of
    ``SigCgt`` is signal n); ``(None, set())`` where ``/proc`` does not show them."""
    try:
        with open("/proc/self/status", "rb") as f:
            status = f.read()
        start = status.index(b"\nSigBlk:") + 1
        caught_at = status.index(b"SigCgt:", start)
        end = status.index(b"\n", caught_at) + 1
        mask = int(status[caught_at + 7:end].strip(), 16)
    except (OSError, ValueError):
        return None, set()
    if status.index(b"SigIgn:", start) > caught_at:  # not the three lines in the order expected
        return None, set()
    return status[start:end], {n for n in range(1, mask.bit_length() + 1) if mask >> (n - 1) & 1}


def _environ_view() -> Any:
    """The environment as ``os.environ`` keeps it, not copied: compared with the captured copy after each
    run (a copy of a hundred variables per run is not needed to tell that none changed)."""
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else dict(os.environ)


def _environ_data() -> dict[Any, Any]:
    """The environment as ``os.environ`` keeps it (bytes on POSIX): copied and compared in microseconds,
    where ``dict(os.environ)`` decodes every variable (80 us a run)."""
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else dict(os.environ)


def _dup(fd: int) -> int | None:
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    os.set_inheritable(copy, False)
    return copy


def kill_leftovers(watchdog_pid: int, run_id: int, job_name: str, *, subreaper: bool = False,
                   cgroup: cgroups.WorkerCgroup | None = None) -> list[int]:
    """Kill what a finished run left running: this worker's descendants and the members of its session
    (a daemonised subprocess re-parented to init stays in it, even in a process group of its own), except
    the watchdog. Zombies are reaped, not logged. Returns the pids found.

    ``subreaper``: this worker is a child subreaper (:func:`proctree.become_subreaper`, Linux), so every
    process a run started and left behind, even one that started its own session, is still below it; when
    the worker has no child but the watchdog (the common case) nothing was left and no process table is
    scanned (a few reads of ``/proc/self``). Without it, only a process that started its own session and
    was re-parented to init escapes.

    ``cgroup``: this worker's cgroup (:mod:`~mjsched_isolated.cgroups`): when something was left, every
    process in it but the worker and its watchdog is a leftover, wherever it moved in the process tree; one
    read of ``cgroup.procs`` finds them all, and they are killed together with those they fork meanwhile.
    That read also comes first: when the cgroup holds only the worker and its watchdog and no child waits
    to be reaped (one ``waitid`` with ``WNOWAIT``), nothing was left and nothing else is read (issue 11: 3
    syscalls a run instead of the 11 of the children files). A process the run moved out of the cgroup
    (which needs root) is not looked for there, as the kill below would not reach it either."""
    me = cgroups.own_pid()
    if cgroup is not None and cgroup.holds_only((me, watchdog_pid)) and not _zombie_child():
        return []  # the cgroup holds every process of the tree (the path below kills no other): one read
    if subreaper:  # everything the run started and left is still below this worker: nothing left, no scan
        children = proctree.own_children()
        if children is not None and not children - {watchdog_pid}:
            return []
    if cgroup is not None:
        left = sorted(cgroup.pids() - {me, watchdog_pid})
        for pid in left:
            _log_leftover(pid, run_id, job_name)
        if left:
            cgroup.kill(exclude={me, watchdog_pid})
        if subreaper:
            _reap_children(watchdog_pid)
        return left
    found: list[psutil.Process] = []
    for pid in sorted(proctree.session_and_descendants(me) - {watchdog_pid}):
        proc = _log_leftover(pid, run_id, job_name)
        if proc is not None:
            found.append(proc)
    proctree.signal_all(found)
    if subreaper:
        _reap_children(watchdog_pid)
    else:
        mine = [p for p in found if _ppid(p) == me]  # others are init's to reap: waiting on them would stall
        if mine:
            psutil.wait_procs(mine, timeout=LEFTOVER_REAP_TIMEOUT_S)  # no zombies pile up in the worker
    return [p.pid for p in found]


def _zombie_child() -> bool:
    """Whether a child of this process has ended and waits to be reaped (``waitid`` with ``WNOWAIT``: it
    is left to be reaped). A zombie is in no cgroup's ``cgroup.procs``; True where this cannot be asked."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # no child at all (not even the watchdog)
        return False
    except (OSError, AttributeError):  # no waitid on this platform
        return True


def _log_leftover(pid: int, run_id: int, job_name: str) -> psutil.Process | None:
    """Log that the run left ``pid`` running (not a zombie: it is already over, only not reaped); None if
    it is gone."""
    try:
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE:
            what = " ".join(proc.cmdline())[:120] or proc.name()
            log.warning("run %d of job %s left process %d running (%s); killed", run_id, job_name, pid, what)
    except psutil.Error:
        return None
    return proc


def _reap_children(watchdog_pid: int) -> None:
    """Reap every child but the watchdog, bounded by ``LEFTOVER_REAP_TIMEOUT_S``: the killed processes
    and the orphans of killed parents re-parented to this subreaper as their parents die."""
    give_up = time.monotonic() + LEFTOVER_REAP_TIMEOUT_S
    while True:
        children = (proctree.own_children() or set()) - {watchdog_pid}
        if not proctree.reap(children) and not (proctree.own_children() or set()) - {watchdog_pid}:
            return
        if time.monotonic() > give_up:
            log.warning("processes %s did not end within %.0f s of SIGKILL", sorted(children),
                        LEFTOVER_REAP_TIMEOUT_S)
            return
        time.sleep(0.002)  # SIGKILLed processes end within milliseconds: a bounded poll of the kernel


def _ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None
