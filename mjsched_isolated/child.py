"""The worker child: a top-level entry point started with the *spawn* method, in its own session.

It imports the plugins (the supervisor never does), says :class:`Ready`, then serves one request at a
time until :class:`Stop` or end-of-pipe. It never touches the database. A watchdog thread kills the
child's whole process group (plugin grandchildren included) as soon as its supervisor is gone.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import psutil

from . import protocol
from .api import JobContext, ScheduledJobResult
from .errors import ConfigurationError
from .loader import Registry, load_plugins

log = logging.getLogger("mjsched.child")

PARENT_CHECK_INTERVAL_S = 0.1
HEARTBEAT_MIN_GAP_S = 0.25  # the child never floods the pipe; the supervisor throttles for real


def main(conn: Connection, plugins_dir: str, parent_pid: int, log_level: int = logging.INFO) -> None:
    """Child entry point (picklable, plain arguments only)."""
    os.setsid()  # own session and process group: the supervisor kills the group, grandchildren included
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is the supervisor's decision
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [worker {os.getpid()}] %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    registry = load_plugins(plugins_dir)  # failures travel in Ready; the supervisor logs them once
    sender = _Sender(conn)
    sender.send(protocol.Ready(pid=os.getpid(), plugins=registry.infos, failures=registry.failures))
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
            sender.send(run(registry, message, sender))


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
            sender.send(protocol.Heartbeat(run_id=req.run_id, at=now))

    context = JobContext(
        run_id=req.run_id, job_id=req.job_id, job_name=req.job_name, job_type=req.job_type,
        configuration=cls.parse_configuration(req.configuration),
        scheduled_at=_from_epoch(req.scheduled_at), deadline_at=_from_epoch(req.deadline_at), heartbeat=heartbeat,
    )
    sender.send(protocol.RunStarted(run_id=req.run_id, at=time.time()))
    try:
        result = cls().execute(context)
        if not isinstance(result, ScheduledJobResult):
            raise TypeError(f"execute() returned {type(result).__name__}, expected ScheduledJobResult")
    except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in a plugin are failures too
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tail = traceback.format_exc()[-4000:]
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=f"plugin raised {text}",
                                    details={"traceback": tail})
    return protocol.RunFinished(run_id=req.run_id, success=bool(result.success), error_message=result.error_message,
                                details=_jsonable(result.details))


class _Sender:
    """Serialises sends from the main thread and plugin threads (heartbeats) on one pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        with self._lock:
            protocol.send(self._conn, message)


def _watch_parent(parent_pid: int) -> None:
    """Supervisor gone: kill every descendant (even those in sessions of their own), then our group."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_INTERVAL_S)
    for proc in psutil.Process().children(recursive=True):
        try:
            proc.kill()
        except psutil.Error:
            pass
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _from_epoch(value: float | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromtimestamp(value, dt.timezone.utc)


def _jsonable(details: dict | None) -> dict | None:
    """Details as plain JSON values (anything else becomes its ``repr``)."""
    if details is None:
        return None
    return msgspec.json.decode(msgspec.json.encode(details, enc_hook=repr))
