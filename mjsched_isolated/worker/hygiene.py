"""What one run may not leave to the next one in a reused worker: changed process state and live processes.

:class:`ProcessState` restores the working directory, environment and umask a plugin changed;
:func:`kill_leftovers` kills the processes a finished run left running (systemd's ``KillMode=control-group``
for a timer's service does the same). Process finding and signalling go through
:mod:`mjsched_isolated.proctree`.
"""

from __future__ import annotations

import logging
import os
import time

import psutil

from mjsched_isolated import proctree

log = logging.getLogger("mjsched.child")

LEFTOVER_REAP_TIMEOUT_S = 1.0


class ProcessState:
    """Process state a plugin may change and the next run must not inherit: cwd, environment, umask."""

    def __init__(self, cwd: str, environ: dict[str, str], umask: int) -> None:
        self.cwd, self.environ, self.umask = cwd, environ, umask

    @classmethod
    def capture(cls) -> ProcessState:
        """The current state of this process."""
        umask = os.umask(0)
        os.umask(umask)
        return cls(os.getcwd(), dict(os.environ), umask)

    def restore(self) -> None:
        """Put the captured state back (a working directory that is gone is logged and left)."""
        try:
            os.chdir(self.cwd)
        except OSError:
            log.warning("could not return to %s after the run", self.cwd)
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.umask(self.umask)


def kill_leftovers(watchdog_pid: int, run_id: int, job_name: str, *, subreaper: bool = False) -> list[int]:
    """Kill what a finished run left running: this worker's descendants and the members of its session
    (a daemonised subprocess re-parented to init stays in it, even in a process group of its own), except
    the watchdog. Zombies are reaped, not logged. Returns the pids found.

    ``subreaper``: this worker is a child subreaper (:func:`proctree.become_subreaper`, Linux), so every
    process a run started and left behind, even one that started its own session, is still below it; when
    the worker has no child but the watchdog (the common case) nothing was left and no process table is
    scanned (a few reads of ``/proc/self``). Without it, only a process that started its own session and
    was re-parented to init escapes."""
    me = os.getpid()
    if subreaper:
        children = proctree.own_children()
        if children is not None and not children - {watchdog_pid}:
            return []
    found: list[psutil.Process] = []
    for pid in sorted(proctree.session_and_descendants(me) - {watchdog_pid}):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:  # a zombie is already over, only not reaped: reap it below
                what = " ".join(proc.cmdline())[:120] or proc.name()
                log.warning("run %d of job %s left process %d running (%s); killed", run_id, job_name, pid, what)
        except psutil.Error:
            continue
        found.append(proc)
    proctree.signal_all(found)
    if subreaper:
        _reap_children(watchdog_pid)
    else:
        mine = [p for p in found if _ppid(p) == me]  # others are init's to reap: waiting on them would stall
        if mine:
            psutil.wait_procs(mine, timeout=LEFTOVER_REAP_TIMEOUT_S)  # no zombies pile up in the worker
    return [p.pid for p in found]


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
