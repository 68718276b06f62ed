"""Log handlers: the text format (unchanged, tests parse it) or one JSON object per line, on stderr.

``settings.log_format`` / ``--log-format``: ``text`` (default) or ``json``. A JSON line holds ``ts``
(ISO-8601 UTC with milliseconds, ``Z``), ``level``, ``logger``, ``event`` (the formatted message) and, when
known, ``job``, ``run_id`` (passed as ``extra=`` by the supervisor, or set for the run a worker child is
executing), ``supervisor`` (the instance), ``worker`` (a child's pid) and ``exc`` (a traceback). Worker
children configure the same format (the pool passes it), so their lines, including what plugins log
through :mod:`logging`, are JSON too; what a plugin writes to stdout/stderr directly is not.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_TEXT_FORMAT = "%(asctime)s %(levelname)s [worker {pid}] %(name)s: %(message)s"
FORMATS = ("text", "json")

# the run a worker child is executing: (job name, run id), attached to its JSON lines
current_run: tuple[str, int] | None = None


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT` (``worker``: :data:`WORKER_TEXT_FORMAT` for that pid), the same text as
    ``logging.Formatter(TEXT_FORMAT)`` gives, built with one f-string and the date-time text kept for the
    second it belongs to (issue 11: a line per run started and ended at INFO; the generic formatter's
    ``strftime``, format-string search and ``%`` formatting were most of a line's cost). A record with an
    exception or a stack goes through the generic formatter."""

    def __init__(self, worker_pid: int | None = None) -> None:
        fmt = TEXT_FORMAT if worker_pid is None else WORKER_TEXT_FORMAT.format(pid=worker_pid)
        super().__init__(fmt)
        self._middle = "" if worker_pid is None else f"[worker {worker_pid}] "
        self._second: int | None = None
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        record.message = record.getMessage()
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        record.asctime = f"{self._second_text},{int(record.msecs):03d}"
        return f"{record.asctime} {record.levelname} {self._middle}{record.name}: {record.message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; see the module docstring for the keys."""

    def __init__(self, instance: str | None = None, worker_pid: int | None = None) -> None:
        super().__init__()
        self.instance = instance
        self.worker_pid = worker_pid

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
        line: dict = {"ts": ts.replace("+00:00", "Z"), "level": record.levelname, "logger": record.name,
                      "event": record.getMessage()}
        job, run_id = getattr(record, "job", None), getattr(record, "run_id", None)
        if job is None and run_id is None and current_run is not None:
            job, run_id = current_run
        if job is not None:
            line["job"] = job
        if run_id is not None:
            line["run_id"] = run_id
        if self.instance is not None:
            line["supervisor"] = self.instance
        if self.worker_pid is not None:
            line["worker"] = self.worker_pid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        return json.dumps(line, default=str)


class BatchingStreamHandler(logging.StreamHandler):
    """A ``StreamHandler`` whose lines can be written in batches: while a thread holds a batch
    (:func:`batched`), the lines it logs are kept and written together, with one ``write`` and one flush,
    when the batch ends (issue 11: the supervisor's loop logs a line per run started and one per run
    ended, each written and flushed on its own). A line another thread logs meanwhile writes the kept
    lines first, then its own: the file keeps the order in which the lines were logged. Without a batch it
    is a plain ``StreamHandler``."""

    def __init__(self, stream: object = None) -> None:
        super().__init__(stream)
        self._holder: int | None = None  # the thread whose lines are kept
        self._kept: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:  # called with self.lock held (Handler.handle)
        if self._holder is not None:
            if self._holder == threading.get_ident():
                try:
                    self._kept.append(self.format(record) + self.terminator)
                except Exception:  # noqa: BLE001 - as StreamHandler.emit: a bad record never breaks the caller
                    self.handleError(record)
                if len(self._kept) >= BATCH_MAX_LINES:
                    self._write_kept()
                return
            self._write_kept()
        super().emit(record)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self._kept:
                self._write_kept()
            else:
                super().flush()

    def _write_kept(self) -> None:
        if self._kept:
            text, self._kept = "".join(self._kept), []
            try:
                self.stream.write(text)
                super().flush()
            except Exception:  # noqa: BLE001 - as logging.Handler.handleError without a record: never raise
                if logging.raiseExceptions:
                    sys.stderr.write("--- Logging error: batched lines could not be written ---\n")

    def start_batch(self) -> bool:
        """Keep this thread's lines from now on; False (nothing done) if a batch is already held."""
        with self.lock:  # type: ignore[union-attr]
            if self._holder is not None:
                return False
            self._holder = threading.get_ident()
            return True

    def end_batch(self) -> None:
        """Write the kept lines (one write) and stop keeping them."""
        with self.lock:  # type: ignore[union-attr]
            self._holder = None
            self._write_kept()


BATCH_MAX_LINES = 256  # a batch this long is written at once: memory stays small, lines do not wait long


@contextmanager
def batched() -> Iterator[None]:
    """Within the block, this thread's log lines are written together at its end (see
    :class:`BatchingStreamHandler`; nothing changes where the root logger has none). The supervisor's loop
    holds one from the start of a cycle to its wait, and from the wait's end to the cycle's end: a line
    is written at the latest when the loop next waits. Nested blocks join the outer one."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, BatchingStreamHandler) and h.start_batch()]
    try:
        yield
    finally:
        for handler in handlers:
            handler.end_batch()


class LeanLogRecord(logging.LogRecord):
    """A ``LogRecord`` built without the work whose result is the same for every record once
    :func:`configure` has turned off the caller lookup and the thread and process fields: the file name and
    module derived from ``"(unknown file)"`` and those fields' ``None`` are set as constants, in the
    standard constructor's order (issue 11: splitting the path was a tenth of a log line's cost). A record
    for which they would differ (a caller's file given, those fields switched back on) is built by the
    standard constructor."""

    def __init__(self, name: str, level: int, pathname: str, lineno: int, msg: object, args: Any,
                 exc_info: Any, func: str | None = None, sinfo: str | None = None, **kwargs: Any) -> None:
        if (pathname != _UNKNOWN_FILE or logging.logThreads or logging.logProcesses or logging.logMultiprocessing
                or _TASK_NAME):
            super().__init__(name, level, pathname, lineno, msg, args, exc_info, func, sinfo, **kwargs)
            return
        ct = time.time()
        self.name = name
        self.msg = msg
        if args and len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
            args = args[0]
        self.args = args
        self.levelname = logging.getLevelName(level)
        self.levelno = level
        self.pathname = pathname
        self.filename = _UNKNOWN_FILE  # os.path.basename("(unknown file)")
        self.module = _UNKNOWN_FILE  # os.path.splitext of it
        self.exc_info = exc_info
        self.exc_text = None
        self.stack_info = sinfo
        self.lineno = lineno
        self.funcName = func  # type: ignore[assignment]  # None, as the standard constructor sets it
        self.created = ct
        self.msecs = int((ct - int(ct)) * 1000) + 0.0
        self.relativeCreated = (ct - logging._startTime) * 1000  # type: ignore[attr-defined]
        self.thread = None
        self.threadName = None
        self.processName = None
        self.process = None


_UNKNOWN_FILE = "(unknown file)"  # the pathname of a record made without the caller lookup
_TASK_NAME = sys.version_info >= (3, 12)  # records there carry an asyncio task's name: the standard constructor


def configure(level: str | int, fmt: str = "text", instance: str | None = None, *,
              worker_pid: int | None = None) -> None:
    """Replace the root logger's handlers with one stderr handler in ``fmt`` (``text`` or ``json``) at
    ``level``. ``instance``: the supervisor named in JSON lines; ``worker_pid``: set in worker children
    (text lines then carry ``[worker PID]``). Records no longer carry the caller's file/line, thread or
    process (no format shows them). Raises ``ValueError`` for an unknown ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"log_format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = BatchingStreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(instance, worker_pid))
    else:
        handler.setFormatter(TextFormatter(worker_pid))
    # what no format of ours shows is not gathered for every record (the logging HOWTO's "Optimization"):
    # the caller's file and line, the thread, the process ids (issue 11: a line per run started and ended)
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    if logging.getLogRecordFactory() is logging.LogRecord:  # an application's own factory is kept
        logging.setLogRecordFactory(LeanLogRecord)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def set_instance(instance: str) -> None:
    """Name the supervisor in JSON lines from now on (known only once settings are built)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.instance = instance


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # terminal escapes, CR and the like


def one_line(text: object, limit: int = 2000) -> str:
    """Text a plugin supplied (an error message, a notice), made safe for one log line: its lines joined
    by ``" | "``, control characters (ANSI/OSC escapes, CR, NUL) as ``?``, at most ``limit`` characters.
    A newline in a plugin's error must not forge a log line of the supervisor's."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    flat = _CONTROL.sub("?", " | ".join(lines).replace("\t", " "))
    return flat if len(flat) <= limit else flat[:limit] + " [...]"
