"""Capturing what a run writes: fds 1 and 2 of the worker (the plugin's ``print``, its ``sys.stderr``, and
every subprocess that inherits them) and the plugin's ``logging`` records, per run, bounded, sent to the
supervisor as :class:`~mjsched_isolated.protocol.RunOutput` messages that it stores with the run.

:meth:`OutputCapture.install` points fds 1 and 2 at one pipe, read by a thread of the worker. During a run
(:meth:`OutputCapture.begin` .. :meth:`OutputCapture.end`) the thread keeps the first half of
``max_bytes`` (the *head*, sent about once a second while the run writes, so a live run can be followed)
and the last half (the *tail*, a ring of chunks, sent when the run ends); what falls between is counted
and replaced by one marker line, as ``journald``'s and Kubernetes' log rotation keep a bounded amount per
unit. A 100 MB burst therefore costs the worker at most ``max_bytes`` of memory and the supervisor at
most ``max_bytes`` of messages and rows; a run that writes nothing sends nothing. Outside a run (plugin
imports, processes a run left behind) output goes to the worker's real stderr (the supervisor's log),
at most :data:`OUTSIDE_RUN_LIMIT_BYTES` per gap between runs.

The worker's own log records (logger ``mjsched.child``) always go to the real stderr; every other record
emitted during a run (the plugin's ``context.log``, any library's) goes to the run's output instead.
"""

from __future__ import annotations

import codecs
import collections
import io
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable

import msgspec

from mjsched_isolated import protocol

FLUSH_INTERVAL_S = 1.0  # a run's head is sent about this often while the run writes
MAX_MESSAGE_BYTES = 256 * 1024  # one RunOutput message at most: the supervisor's memory stays flat
OUTSIDE_RUN_LIMIT_BYTES = 64 * 1024  # output outside any run reaching the real stderr, per gap
END_DRAIN_BOUND_S = 1.0  # at a run's end, read what is already in the pipe for at most this long
READ_SIZE = 64 * 1024
WORKER_LOGGERS = ("mjsched.child",)  # the worker's own records: never a run's output
_UTF8 = codecs.getincrementaldecoder("utf-8")


class _RunBuffer:
    """One run's output: the head (streamed), the tail ring, and how much was left out between them."""

    def __init__(self, run_id: int, max_bytes: int) -> None:
        self.run_id = run_id
        self.head_left = max_bytes // 2
        self.tail_limit = max_bytes - max_bytes // 2
        self.decoder: codecs.IncrementalDecoder | None = None  # made at the first output: most runs write none
        self.pending: list[str] = []  # decoded head text not sent yet
        self.pending_bytes = 0
        self.flush_at = 0.0  # monotonic: when the pending text is sent (while the run goes on)
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = 0
        self.omitted = 0
        self.total = 0
        self.line_open = False  # the text handed out so far ends inside a line (no "\n" last)

    def take(self, data: bytes) -> None:
        self.total += len(data)
        if self.head_left > 0:
            head, data = data[:self.head_left], data[self.head_left:]
            self.head_left -= len(head)
            if self.decoder is None:
                self.decoder = _UTF8(errors="replace")
            text = self.decoder.decode(head, final=self.head_left == 0)
            if text:
                if not self.pending:  # the first unsent text: sent at the latest one interval from now
                    self.flush_at = time.monotonic() + FLUSH_INTERVAL_S
                self.pending.append(text)
                self.pending_bytes += len(head)
        if data:
            self.tail.append(data)
            self.tail_bytes += len(data)
            while self.tail and self.tail_bytes - len(self.tail[0]) >= self.tail_limit:
                dropped = self.tail.popleft()  # whole chunks while the rest still fills the tail
                self.tail_bytes -= len(dropped)
                self.omitted += len(dropped)

    def take_pending(self) -> str:
        text = "".join(self.pending)
        self.pending, self.pending_bytes = [], 0
        return self._handed(text)

    def _handed(self, text: str) -> str:
        """``text`` as handed out (sent), noting whether it leaves a line open."""
        if text:
            self.line_open = not text.endswith("\n")
        return text

    def snapshot(self, max_bytes: int) -> str:
        """Everything not sent yet, now (the worker got SIGTERM: it may be killed within ``kill_grace_s``):
        as :meth:`finish`, and the tail starts anew, so nothing is sent twice."""
        text = self.finish(max_bytes, final=False)
        self.tail.clear()
        self.tail_bytes = self.omitted = 0
        return text

    def finish(self, max_bytes: int, final: bool = True) -> str:
        """What is left to send when the run ends: the unsent head, the marker, the tail."""
        text = self.take_pending() + self._handed(self.decoder.decode(b"", final=True)
                                                  if final and self.decoder is not None else "")
        tail = b"".join(self.tail)
        if len(tail) > self.tail_limit:
            self.omitted += len(tail) - self.tail_limit
            tail = tail[len(tail) - self.tail_limit:]
        if self.omitted:  # the marker on a line of its own, also when the head was sent earlier (a cut line)
            text += ("\n" if self.line_open else "") + self._handed(
                f"[... {self.omitted} bytes of output left out: the run wrote {self.total} bytes, "
                f"max_run_output_bytes is {max_bytes} (its first and last halves are kept) ...]\n")
        return text + self._handed(tail.decode("utf-8", errors="replace"))


class OutputCapture:
    """fds 1 and 2 of this worker read by a thread; see the module docstring. ``send`` is the worker's
    thread-safe pipe sender; ``max_bytes`` the setting ``max_run_output_bytes``."""

    def __init__(self, send: Callable[[msgspec.Struct], None], max_bytes: int) -> None:
        self.send = send
        self.max_bytes = max_bytes
        self.real_stderr: io.TextIOWrapper | None = None  # the supervisor's stderr, for the worker's own log
        self._run: _RunBuffer | None = None
        self._lock = threading.RLock()  # the reader reads the pipe and takes the data under it (see end)
        self._ended = threading.Event()
        self._read_fd = -1
        self._control_w = -1
        self._outside = 0

    @property
    def active(self) -> bool:
        return self._run is not None

    def install(self) -> None:
        """Point fds 1 and 2 at the capture pipe and start its reader thread. Call after the watchdog is
        forked (it keeps the real stderr) and before plugins load."""
        real_fd = os.dup(2)
        os.set_inheritable(real_fd, False)
        self.real_stderr = io.TextIOWrapper(io.FileIO(real_fd, "w"), encoding="utf-8", errors="backslashreplace",
                                            line_buffering=True)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        control_r, self._control_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # a pipe makes stdout block-buffered: keep lines in order
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True)
        threading.Thread(target=self._read_loop, args=(control_r,), name="mjsched-output", daemon=True).start()

    def route_logging(self) -> None:
        """Send the worker's log handlers to the real stderr, and the records of a run (other than the
        worker's own) to the run's output instead. Call after :func:`mjsched_isolated.logs.configure`."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and self.real_stderr is not None:
                handler.setStream(self.real_stderr)
                handler.addFilter(lambda record: not self.active or _is_worker_record(record))
        run_handler = _RunLogHandler()
        run_handler.addFilter(lambda record: self.active and not _is_worker_record(record))
        run_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(run_handler)

    # -- a run's bounds (main thread) ------------------------------------------------------------------
    def begin(self, run_id: int) -> None:
        """Output from now on belongs to run ``run_id``."""
        with self._lock:
            self._run = _RunBuffer(run_id, self.max_bytes)
            self._outside = 0

    def end(self, timeout_s: float = 5.0) -> int:
        """The run's output is complete: flush Python's streams, let the reader take what is in the pipe,
        send the rest (head, marker, tail). Returns the bytes the run wrote. Bounded by ``timeout_s``."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # a plugin closed or replaced it
                pass
        run = self._run
        if run is None:
            return 0
        with self._lock:  # a run that wrote nothing ends here, without waking the reader thread (issue 11)
            if run.total == 0 and not select.select([self._read_fd], [], [], 0)[0]:
                self._run = None
                return 0
        self._ended.clear()
        try:
            os.write(self._control_w, b"e")
        except OSError:
            return run.total
        self._ended.wait(timeout_s)
        return run.total

    def flush_now(self) -> None:
        """Ask the reader to send everything the current run wrote so far, tail included (safe in a signal
        handler: one ``write``). The worker calls it on SIGTERM, which precedes a kill at the deadline, so a
        killed run keeps its last output."""
        try:
            os.write(self._control_w, b"f")
        except OSError:
            pass

    # -- the reader thread ------------------------------------------------------------------------------
    def _read_loop(self, control_r: int) -> None:
        while True:
            run = self._run
            timeout = None if run is None or not run.pending else max(0.0, run.flush_at - time.monotonic())
            ready, _, _ = select.select([self._read_fd, control_r], [], [], timeout)
            if self._read_fd in ready:
                with self._lock:  # read and taken at once: end() sees either the data in the pipe or the run's
                    data = os.read(self._read_fd, READ_SIZE)
                    if data:
                        self._take(data)
                if not data:
                    return
            if control_r in ready:
                if os.read(control_r, 1) == b"f":
                    self._drain()
                    with self._lock:
                        run = self._run
                        text = run.snapshot(self.max_bytes) if run is not None else ""
                    if run is not None:
                        self._send(run.run_id, text)
                else:
                    self._finish_run()
                continue
            run = self._run
            if run is not None and run.pending and time.monotonic() >= run.flush_at:
                self._send(run.run_id, run.take_pending())

    def _take(self, data: bytes) -> None:
        with self._lock:
            run = self._run
            if run is not None:
                run.take(data)
                return
        if self._outside < OUTSIDE_RUN_LIMIT_BYTES and self.real_stderr is not None:
            data = data[:OUTSIDE_RUN_LIMIT_BYTES - self._outside]
            self._outside += len(data)
            try:
                self.real_stderr.buffer.write(data)
                self.real_stderr.flush()
            except (OSError, ValueError):
                pass

    def _finish_run(self) -> None:
        """Read what is already in the pipe, then send the rest of the run's output and end the run."""
        self._drain()
        with self._lock:
            run, self._run = self._run, None
        if run is not None:
            self._send(run.run_id, run.finish(self.max_bytes))
        self._ended.set()

    def _drain(self) -> None:
        """Read what is already in the pipe (bounded: a process left running may write forever)."""
        bound = time.monotonic() + END_DRAIN_BOUND_S
        while time.monotonic() < bound and select.select([self._read_fd], [], [], 0)[0]:
            data = os.read(self._read_fd, READ_SIZE)
            if not data:
                break
            self._take(data)

    def _send(self, run_id: int, text: str) -> None:
        for start in range(0, len(text), MAX_MESSAGE_BYTES // 4):  # <= MAX_MESSAGE_BYTES of UTF-8 each
            try:
                self.send(protocol.RunOutput(run_id=run_id, text=text[start:start + MAX_MESSAGE_BYTES // 4]))
            except (OSError, ValueError):  # the supervisor is gone; its watchdog ends this worker
                return


def _is_worker_record(record: logging.LogRecord) -> bool:
    return record.name in WORKER_LOGGERS


class _RunLogHandler(logging.Handler):
    """Writes a run's log records to ``sys.stderr`` (fd 2, the capture pipe), in order with its prints."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a plugin that closed sys.stderr must not break logging
            self.handleError(record)
