"""The worker child's entry and loop: a top-level function started with the *spawn* method, in its own
session.

It forks its watchdog (:mod:`~mjsched_isolated.worker.watchdog`), points fds 1 and 2 at the output capture
(:mod:`~mjsched_isolated.worker.output`: a plugin's ``print`` or a subprocess's output belongs to its run,
never to the supervisor's or the CLI's stdout), imports the plugins (the supervisor never does), says
:class:`~mjsched_isolated.protocol.Ready`, then serves one request at a time until ``Stop`` or end-of-pipe.
Each run goes through
:func:`~mjsched_isolated.worker.execute.run`; after it, :mod:`~mjsched_isolated.worker.hygiene` restores the
process state and kills what the run left running. It never touches the database.

This module is what the pool names as the spawn target, so the supervisor imports it: it stays light and
imports the plugin loader only inside :func:`main`.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from mjsched_isolated import cgroups, logs, proctree, protocol
from mjsched_isolated.worker import accounting, hygiene, limit_hints, limits, watchdog
from mjsched_isolated.worker.execute import run, scrub, validate, wait_for_start
from mjsched_isolated.worker.inbox import Inbox
from mjsched_isolated.worker.output import OutputCapture

__all__ = ["PipeSender", "main"]

log = logging.getLogger("mjsched.child")


def main(conn: Connection | protocol.Channel, plugins_dir: str | None, parent_pid: int, log_level: int = logging.INFO,
         import_timeout_s: float = 10.0, fence_at: Any = None, log_format: str = "text",
         skip_modules: dict[str, str] | None = None, max_run_output_bytes: int = 4 * 1024 * 1024,
         cgroup: cgroups.WorkerCgroup | None = None, terminating: Any = None, keep_dir: str | None = None) -> None:
    """Child entry point (picklable, plain arguments only). ``plugins_dir``: the local plugins folder
    (None: ``./plugins`` if it exists; the built-in plugins always load, see
    :func:`~mjsched_isolated.worker.loader.load_plugins`). ``fence_at``: a shared double holding the
    monotonic time after which the supervisor's lease can no longer be trusted (see
    :mod:`~mjsched_isolated.supervisor.liveness`). ``skip_modules``: plugin modules not to import (an
    earlier child died importing them) -> why. ``max_run_output_bytes``: what a run's output keeps (first
    and last halves; see :mod:`~mjsched_isolated.worker.output`). ``cgroup``: this worker's own cgroup
    (:mod:`~mjsched_isolated.cgroups`; the supervisor has moved it there already, joining again is a
    no-op), or None: cgroups are not used. ``terminating``: a shared byte the supervisor sets to 1 before
    it sends SIGTERM at the run's deadline (see :func:`_on_sigterm`). ``keep_dir``: the pool's folder of
    last good plugin copies (see :mod:`~mjsched_isolated.worker.loader`), or None."""
    global _terminating
    _terminating = terminating
    cgroup_error = None
    if cgroup is not None:
        try:
            cgroup.join()  # before the watchdog or anything else is forked: the whole tree is in it
        except OSError as exc:
            cgroup, cgroup_error = None, exc
    os.dup2(2, 1)  # stdout is the supervisor's (or the CLI's JSON output): plugin output goes to stderr
    os.setsid()  # own session and process group: the supervisor kills the group, grandchildren included
    # Shutdown is the supervisor's decision: a Ctrl-C or a SIGTERM sent to the whole process tree (systemd's
    # default KillMode=control-group) must not end a run the supervisor is draining. SIGTERM gets a no-op
    # handler rather than SIG_IGN, which plugin subprocesses would inherit across exec.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    subreaper = proctree.become_subreaper()  # orphans of a run stay ours: found cheaply, killed, reaped
    busy = multiprocessing.RawValue("b", 0)  # shared with the watchdog: 1 while a run executes
    cpu_budget = multiprocessing.RawArray("d", [0.0, math.inf])  # the run's cgroup CPU start and limit, s
    watchdog_pid = watchdog.start(parent_pid, busy, fence_at, cgroup, cpu_budget)  # before any thread or plugin
    sender = PipeSender(conn)
    global _capture
    capture = _capture = OutputCapture(sender.send, max_run_output_bytes)
    capture.install()  # after the watchdog's fork: it keeps the real stderr
    logs.configure(log_level, log_format, worker_pid=os.getpid())
    capture.route_logging()
    if cgroup_error is not None:
        log.warning("worker %d could not join its cgroup (%s); its runs' leftovers are found without it",
                    os.getpid(), cgroup_error)
    from mjsched_isolated.worker.loader import load_plugins  # noqa: PLC0415 - lazy: only children load plugins

    registry = load_plugins(plugins_dir, import_timeout_s, skip=skip_modules or {},  # failures travel in Ready
                            on_import=lambda module: sender.send(protocol.Importing(module=module)), keep_dir=keep_dir)
    baseline = hygiene.ProcessState.capture()
    sender.send(protocol.Ready(pid=os.getpid(), plugins=registry.infos, failures=registry.failures,
                               warnings=registry.warnings, fallbacks=registry.fallbacks))
    inbox = Inbox(conn)  # a run's deadline extensions are read by its plugin's thread (context.deadline_at)
    while True:
        try:
            message = inbox.next()
        except (EOFError, OSError):
            return
        if isinstance(message, protocol.Stop):
            return
        if isinstance(message, protocol.ValidateRequest):
            sender.send(protocol.ValidateReply(error=validate(registry, message.job_type, message.configuration)))
        elif isinstance(message, protocol.RunRequest):
            if terminating is not None:
                terminating.value = 0  # set for an earlier run that ended before its SIGTERM came
            busy.value = 1
            logs.current_run = (message.job_name, message.run_id)  # JSON log lines carry job and run_id
            capture.begin(message.run_id)
            applied = limits.apply(message.limits, cgroup, cpu_budget)
            if applied is not None and applied.errors:
                log.warning("run %d of job %s: limits not applied: %s", message.run_id, message.job_name,
                            "; ".join(applied.errors))
            meter = accounting.Meter(cgroup)
            global _in_run
            _in_run = True
            try:
                result = run(registry, message, sender, functools.partial(limits.describe, applied=applied),
                             deadline_updates=functools.partial(inbox.deadline_for, message.run_id),
                             before_start=functools.partial(_hold_until, parent_pid))
            finally:
                _in_run = False
            cpu_s, max_rss_mb = meter.stop()
            verdict = limits.memory_verdict(applied) or limits.cpu_verdict(applied, cpu_budget)
            if verdict is None and not result.success and applied is not None:  # a command's stderr names it
                verdict = limit_hints.guess(message.limits, result.details)
            if verdict is not None and not result.success:  # a command of the run hit a tree-wide limit
                result = msgspec.structs.replace(result, error_message=f"{verdict}; {result.error_message}"[:4000])
            retiring = limits.restore(applied)
            capture.end()  # the run's output is sent before its result
            busy.value = 0
            retiring = _after_run(baseline, message, meter.status) or retiring
            result = msgspec.structs.replace(result, retiring=retiring, cpu_s=cpu_s, max_rss_mb=max_rss_mb)
            try:
                try:
                    sender.send(result)
                except UnicodeEncodeError:  # a lone surrogate (a non-UTF-8 file name read by os.listdir, say)
                    result = msgspec.convert(scrub(msgspec.to_builtins(result)), protocol.RunFinished)
                    sender.send(result)  # the same result, each unencodable character as U+FFFD
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:  # unencodable plugin data
                sender.send(protocol.RunFinished(
                    run_id=result.run_id, success=result.success, error_message=scrub(result.error_message),
                    details={"encode_error": f"the result's details could not be sent: {type(exc).__name__}: {exc}"},
                    retiring=retiring, cpu_s=cpu_s, max_rss_mb=max_rss_mb))
            # after the result (its recording overlaps), before the next run
            hygiene.kill_leftovers(watchdog_pid, message.run_id, message.job_name, subreaper=subreaper,
                                   cgroup=cgroup)
            logs.current_run = None
            if retiring is not None:  # the pool gives this child no other run; left threads must not hold it
                logging.shutdown()
                os._exit(0)


def _hold_until(parent_pid: int, start_at: float | None) -> None:
    """A run claimed ahead of its instant (``claim_ahead_s``) starts its plugin at ``start_at``, never before
    (:func:`~mjsched_isolated.worker.execute.wait_for_start`). If the supervisor died meanwhile, the plugin
    never starts: this worker exits (its watchdog would end it anyway), and the run row is failed as
    abandoned, as any run of a dead supervisor is."""
    if start_at is None:
        return
    wait_for_start(start_at)
    if os.getppid() != parent_pid:
        logging.shutdown()
        os._exit(0)


def _after_run(baseline: hygiene.ProcessState, request: protocol.RunRequest, status: bytes | None) -> str | None:
    """Put back the process state the run changed (logged, naming it) and return why this worker must be
    replaced after the run (None: it serves the next one): threads the run left running could act in a
    later run (call ``os._exit``, hold locks) and cannot be stopped from outside. ``status``: the
    ``/proc/self/status`` text read after the run (:attr:`~mjsched_isolated.worker.accounting.Meter.status`)."""
    changed = baseline.restore(status)
    if changed:
        log.warning("run %d of job %s changed the worker's %s; restored", request.run_id, request.job_name,
                    ", ".join(changed))
    threads = baseline.new_threads()
    if threads:
        names = ", ".join(sorted(t.name for t in threads))[:200]
        log.warning("run %d of job %s left %d thread(s) running (%s); the worker is replaced after it",
                    request.run_id, request.job_name, len(threads), names)
        return f"run {request.run_id} left {len(threads)} thread(s) running ({names})"
    return None


class PipeSender:
    """Serialises sends from the main thread and plugin threads (heartbeats) on one pipe."""

    def __init__(self, conn: Connection | protocol.Channel) -> None:
        self._fd = protocol.write_fd(conn)
        self._lock = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        """Encode and send ``message``; raises ``OSError`` if the supervisor is gone."""
        with self._lock:
            protocol.send_fd(self._fd, message)


_capture: OutputCapture | None = None  # for the SIGTERM handler
_terminating: Any = None  # shared with the supervisor: 1 once it sent SIGTERM at the run's deadline
_in_run = False  # the plugin's execute is running


class Terminated(BaseException):
    """Raised in a plugin that installed no SIGTERM handler of its own when the supervisor sends SIGTERM at
    the run's deadline: the run ends at once instead of waiting ``kill_grace_s`` for SIGKILL (a
    ``BaseException``, as ``KeyboardInterrupt``: an ``except Exception`` in the plugin does not keep it)."""


def _on_sigterm(_signum: int, _frame: object) -> None:
    """SIGTERM in a worker. What the run wrote so far is sent now, so a killed run keeps it. From the
    supervisor at the run's deadline (``terminating`` set), to a plugin that installed no SIGTERM handler
    of its own (one that did has replaced this one), it raises :class:`Terminated` in the plugin: the run
    ends within the grace, as a process with the default SIGTERM action would. Otherwise (a Ctrl-C or a
    SIGTERM sent to the whole process tree, systemd's default ``KillMode=control-group``) the run goes on:
    shutdown is the supervisor's decision."""
    if _capture is not None:
        _capture.flush_now()
    if _in_run and _terminating is not None and _terminating.value:
        _terminating.value = 0
        raise Terminated("SIGTERM from the supervisor at the run's deadline")
