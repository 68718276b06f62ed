"""The worker child: a top-level entry point started with the *spawn* method, in its own session.

It imports the plugins (the supervisor never does), says :class:`Ready`, then serves one request at a
time until :class:`Stop` or end-of-pipe. It never touches the database. Between runs it restores the
working directory, environment and umask a plugin may have changed.

A watchdog *process* (forked before any plugin code runs, so a plugin holding the GIL cannot stall it)
kills the worker's whole tree and process group as soon as the supervisor is gone, and exits by itself
when the worker exits.
"""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import psutil

from mjsched_isolated import logs
from mjsched_isolated import protocol
from mjsched_isolated.api import BaseScheduledJob, JobContext, NotificationContent, ScheduledJobResult
from mjsched_isolated.errors import ConfigurationError
from mjsched_isolated.worker.loader import Registry, load_plugins

log = logging.getLogger("mjsched.child")

PARENT_CHECK_INTERVAL_S = 0.1
HEARTBEAT_MIN_GAP_S = 0.25  # the child never floods the pipe; the supervisor throttles for real
MAX_DETAILS_BYTES = 64 * 1024  # larger details are replaced by a preview: the run row stays small
MAX_ERROR_CHARS = 4000


def main(conn: Connection, plugins_dir: str | None, parent_pid: int, log_level: int = logging.INFO,
         import_timeout_s: float = 10.0, fence_at=None, log_format: str = "text",
         skip_modules: dict[str, str] | None = None) -> None:
    """Child entry point (picklable, plain arguments only). ``fence_at``: a shared double holding the
    monotonic time after which the supervisor's lease can no longer be trusted (see :mod:`liveness`).
    ``skip_modules``: plugin files not to import (an earlier child died importing them) -> why."""
    os.setsid()  # own session and process group: the supervisor kills the group, grandchildren included
    # Shutdown is the supervisor's decision: a Ctrl-C or a SIGTERM sent to the whole process tree (systemd's
    # default KillMode=control-group) must not end a run the supervisor is draining. SIGTERM gets a no-op
    # handler rather than SIG_IGN, which plugin subprocesses would inherit across exec.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignore_signal)
    busy = multiprocessing.RawValue("b", 0)  # shared with the watchdog: 1 while a run executes
    watchdog_pid = _start_watchdog(parent_pid, busy, fence_at)  # before any thread or plugin exists
    logs.configure(log_level, log_format, worker_pid=os.getpid())
    sender = _Sender(conn)
    registry = load_plugins(plugins_dir, import_timeout_s, skip=skip_modules or {},  # failures travel in Ready
                            on_import=lambda module: sender.send(protocol.Importing(module=module)))
    baseline = _State.capture()
    sender.send(protocol.Ready(pid=os.getpid(), plugins=registry.infos, failures=registry.failures,
                               warnings=registry.warnings))
    while True:
        try:
            message = protocol.decode_to_child(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if isinstance(message, protocol.Stop):
            return
        if isinstance(message, protocol.ValidateRequest):
            sender.send(protocol.ValidateReply(error=validate(registry, message.job_type, message.configuration)))
        elif isinstance(message, protocol.RunRequest):
            busy.value = 1
            logs.current_run = (message.job_name, message.run_id)  # JSON log lines carry job and run_id
            result = run(registry, message, sender)
            busy.value = 0
            baseline.restore()
            try:
                sender.send(result)
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:  # unencodable plugin data
                sender.send(protocol.RunFinished(
                    run_id=result.run_id, success=result.success, error_message=result.error_message,
                    details={"encode_error": f"the result's details could not be sent: {type(exc).__name__}: {exc}"}))
            _kill_leftovers(watchdog_pid, message)  # after the result (its recording overlaps), before the next run
            logs.current_run = None


def validate(registry: Registry, job_type: str, configuration: str | None) -> str | None:
    """None if ``configuration`` is valid for ``job_type``, else a one-line error naming the field."""
    cls = registry.classes.get(job_type)
    if cls is None:
        known = ", ".join(sorted(registry.classes)) or "none"
        return f"job_type: unknown job type {job_type!r} (available: {known})"
    try:
        cls().validate_configuration(cls.parse_configuration(configuration))
    except ConfigurationError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a buggy validator is a plugin error, reported as such
        return f"configuration: validator of {job_type!r} raised {type(exc).__name__}: {exc}"
    return None


def run(registry: Registry, req: protocol.RunRequest, sender: "_Sender") -> protocol.RunFinished:
    """Execute one run and build its :class:`RunFinished`. Plugin exceptions become failures."""
    error = validate(registry, req.job_type, req.configuration)
    if error is not None:
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=f"not started: {error}")
    cls = registry.classes[req.job_type]
    last_beat = [0.0]

    def heartbeat() -> None:
        now = time.time()
        if now - last_beat[0] >= HEARTBEAT_MIN_GAP_S:
            last_beat[0] = now
            try:
                sender.send(protocol.Heartbeat(run_id=req.run_id, at=now))
            except (OSError, ValueError):  # the supervisor is gone (its watchdog ends us): never raise in a plugin
                pass

    context = JobContext(
        run_id=req.run_id, job_id=req.job_id, job_name=req.job_name, job_type=req.job_type,
        configuration=cls.parse_configuration(req.configuration),
        scheduled_at=_from_epoch(req.scheduled_at), deadline_at=_from_epoch(req.deadline_at), heartbeat=heartbeat,
    )
    sender.send(protocol.RunStarted(run_id=req.run_id, at=time.time()))
    plugin = cls()
    try:
        result = plugin.execute(context)
        if not isinstance(result, ScheduledJobResult):
            raise TypeError(f"execute() returned {type(result).__name__}, expected ScheduledJobResult")
    except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in a plugin are failures too
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tail = traceback.format_exc()[-4000:]
        error = _text(f"plugin raised {text}")[:MAX_ERROR_CHARS]
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=error, details={"traceback": tail},
                                    notification=notice_text(plugin, context, ScheduledJobResult(
                                        success=False, error_message=error)))
    error = None if result.error_message is None else _text(result.error_message)[:MAX_ERROR_CHARS]
    outcome = ScheduledJobResult(success=result.success is True, details=result.details, error_message=error)
    return protocol.RunFinished(run_id=req.run_id, success=outcome.success, error_message=error,
                                details=_jsonable(result.details), notification=notice_text(plugin, context, outcome))


def notice_text(plugin: BaseScheduledJob, context: JobContext, result: ScheduledJobResult) -> protocol.NoticeText | None:
    """The plugin's ``format_notification(context, result)`` as a :class:`protocol.NoticeText`. One that
    raises or returns something other than a valid ``NotificationContent`` is logged and replaced by the
    default of :class:`BaseScheduledJob`; it never changes the run's result. None if even that fails."""
    for formatter in (type(plugin).format_notification, BaseScheduledJob.format_notification):
        try:
            content = formatter(plugin, context, result)
            if not isinstance(content, NotificationContent):
                raise TypeError(f"returned {type(content).__name__}, expected NotificationContent")
            if content.priority not in ("Low", "Normal", "High"):
                raise ValueError(f"priority must be Low, Normal or High, got {content.priority!r}")
            metadata = content.metadata if isinstance(content.metadata, dict) else None
            subject = " ".join(_text(content.subject).split())  # one header line: no CR/LF, no NUL
            return protocol.NoticeText(subject=subject[:MAX_ERROR_CHARS] or f"Scheduled job '{context.job_name}'",
                                       body=_text(content.body)[:MAX_DETAILS_BYTES], priority=content.priority,
                                       metadata=_jsonable(metadata))
        except BaseException as exc:  # noqa: BLE001 - a notice must never break the run's record
            log.warning("format_notification of %s raised %s: %s; the default notice is used instead",
                        context.job_type, type(exc).__name__, exc)
    return None


class _Sender:
    """Serialises sends from the main thread and plugin threads (heartbeats) on one pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        with self._lock:
            protocol.send(self._conn, message)


class _State:
    """Process state a plugin may change and the next run must not inherit."""

    def __init__(self, cwd: str, environ: dict[str, str], umask: int) -> None:
        self.cwd, self.environ, self.umask = cwd, environ, umask

    @classmethod
    def capture(cls) -> "_State":
        umask = os.umask(0)
        os.umask(umask)
        return cls(os.getcwd(), dict(os.environ), umask)

    def restore(self) -> None:
        try:
            os.chdir(self.cwd)
        except OSError:
            log.warning("could not return to %s after the run", self.cwd)
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.umask(self.umask)


def _ignore_signal(_signum: int, _frame: object) -> None:
    """SIGTERM in a worker: nothing to do (the supervisor decides; it kills with SIGKILL)."""


def _kill_leftovers(watchdog_pid: int, req: protocol.RunRequest) -> list[int]:
    """Kill what a finished run left running: this worker's descendants and the members of its session (a
    daemonised subprocess re-parented to init stays in it, even in a process group of its own), except the
    watchdog. A run may not leave work behind in a reused worker (systemd's ``KillMode=control-group`` for
    a timer's service does the same). Only a process that started its own session and was re-parented
    escapes. Returns the pids."""
    me = os.getpid()
    found = [pid for pid in _session_and_descendants(me) if pid != watchdog_pid]
    killed: list[psutil.Process] = []
    for pid in found:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:  # already over, only not reaped: reap it below
                killed.append(proc)
                continue
            what = " ".join(proc.cmdline())[:120] or proc.name()
            proc.kill()
        except psutil.Error:
            continue
        killed.append(proc)
        log.warning("run %d of job %s left process %d running (%s); killed", req.run_id, req.job_name, pid, what)
    mine = [p for p in killed if _ppid(p) == me]  # others are init's to reap: waiting on them would stall
    if mine:
        psutil.wait_procs(mine, timeout=1.0)  # reaps our own children (no zombies pile up in the worker)
    return [p.pid for p in killed]


def _ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def _session_and_descendants(leader: int) -> set[int]:
    """Pids (other than ``leader``) in the session ``leader`` leads, or below it: one pass over /proc's
    ``stat`` files (a millisecond or two for a hundred processes), psutil where there is no /proc."""
    parents: dict[int, int] = {}
    found: set[int] = set()
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        entries = None
    if entries is None:
        for proc in psutil.process_iter(["ppid"]):
            parents[proc.pid] = proc.info["ppid"] or 0
            try:
                if os.getsid(proc.pid) == leader:
                    found.add(proc.pid)
            except OSError:
                pass
    else:
        for name in entries:
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid = int(name)
            parents[pid] = int(fields[1])
            if int(fields[3]) == leader:  # state ppid pgrp session ...
                found.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    stack, seen = [leader], {leader}
    while stack:
        for pid in children.get(stack.pop(), ()):
            if pid not in seen:
                seen.add(pid)
                found.add(pid)
                stack.append(pid)
    found.discard(leader)
    return found


def _start_watchdog(supervisor_pid: int, busy, fence_at) -> int:
    """Fork the watchdog process. While the worker lives, every 0.1 s it checks that the worker's parent
    is still the supervisor (the kernel re-parents it the moment the supervisor dies, even by SIGKILL) and,
    while a run executes, that the supervisor's lease is still trusted (``fence_at``, renewed by the
    supervisor; a supervisor frozen by SIGSTOP or a suspended VM cannot fence its own runs, so its workers
    do). Otherwise it kills the worker's descendants and process group (the watchdog's own, too). Returns
    the watchdog's pid."""
    worker_pid = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        os.closerange(3, 1 << 16)  # hold no pipe of the worker's: its death must stay visible at once
        worker = psutil.Process(worker_pid)
        while True:
            time.sleep(PARENT_CHECK_INTERVAL_S)
            if os.getppid() != worker_pid:
                os._exit(0)  # the worker is gone (exited or killed): nothing left to guard
            if worker.ppid() != supervisor_pid:
                break
            if busy.value and fence_at is not None and time.monotonic() > fence_at.value:
                break
        for proc in worker.children(recursive=True):
            if proc.pid != os.getpid():
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        os.killpg(worker_pid, signal.SIGKILL)
    except BaseException:  # noqa: BLE001 - the watchdog never returns into the worker's code
        pass
    finally:
        os._exit(0)


def _from_epoch(value: float | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromtimestamp(value, dt.timezone.utc)


def _text(value: object) -> str:
    """A plugin's string as text every database stores: NUL (which PostgreSQL refuses) becomes U+FFFD."""
    return str(value).replace("\x00", "\ufffd")


def _wire_safe(value: object) -> object:
    """JSON values the pipe's msgpack encoding accepts: integers beyond 64 bits become strings."""
    if isinstance(value, dict):
        return {k: _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire_safe(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)
    return value


def _jsonable(details: dict | None) -> dict | None:
    """Details as plain JSON values (anything else becomes its ``repr``), at most ``MAX_DETAILS_BYTES``
    encoded; larger ones are replaced by a preview."""
    if details is None:
        return None
    encoded = msgspec.json.encode(details, enc_hook=repr)
    if len(encoded) > MAX_DETAILS_BYTES:
        return {"truncated": True, "size_bytes": len(encoded),
                "preview": encoded[:2000].decode("utf-8", errors="replace")}
    return _wire_safe(msgspec.json.decode(encoded))
