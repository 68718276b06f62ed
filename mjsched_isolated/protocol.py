"""Messages between the supervisor and its worker children: one tagged union of msgspec Structs,
MessagePack-encoded, one message per ``Connection.send_bytes``, over a :class:`Channel` (two one-way pipes).

Supervisor -> child: :class:`RunRequest`, :class:`ValidateRequest`, :class:`Stop`, and while a run executes
:class:`DeadlineExtended` (the only message a busy child is sent).
Child -> supervisor: :class:`Ready`, :class:`RunStarted`, :class:`Heartbeat`, :class:`RunOutput`,
:class:`RunFinished`, :class:`ValidateReply`.
New fields must get defaults so old and new peers keep decoding each other.
"""

from __future__ import annotations

import multiprocessing.context
import os
import select
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from mjsched_isolated.errors import ProtocolError

# The one size cap for text a plugin hands over (details JSON, error messages, notice bodies): what the
# smallest TEXT column of our databases holds (MySQL/MariaDB: 65,535 bytes), with room to spare. The
# worker trims to it before sending; the store enforces it again before writing.
MAX_TEXT_BYTES = 60_000


class PluginInfo(msgspec.Struct, frozen=True):
    """A job type a child loaded: name, the module it came from (a local plugin's file name, e.g.
    ``shell.py``; a built-in's dotted name, e.g. ``mjsched_isolated.plugins.shell``), its one-line
    description, and whether it ships with the package (``builtin``)."""

    job_type: str
    module: str
    description: str = ""
    builtin: bool = False


class LoadFailure(msgspec.Struct, frozen=True):
    """A plugin module that failed to import (or defined a bad job type), with the traceback text.
    ``import_timed_out``: its import was given up (its thread may still end the worker later).
    ``folder``: the failure is the plugins folder itself (``module`` is its path: missing, not a folder,
    unreadable), so a command can exit non-zero without reading ``error``."""

    module: str
    error: str
    import_timed_out: bool = False
    folder: bool = False


class Importing(msgspec.Struct, tag=True, frozen=True):
    """Sent by a child just before it imports a plugin module (file name), so that if the import ends the
    process (``os._exit``, a crash in a C extension) the supervisor knows which module to leave out."""

    module: str


class Ready(msgspec.Struct, tag=True, frozen=True):
    """First message of every child: its pid and what the built-in plugins and its plugins folder yielded.
    ``warnings``: one line each, for what loaded but deserves a word (a local plugin overriding a built-in
    job type); unlike ``failures`` they cost no job type. ``fallbacks``: one line per local module that
    failed to import and was imported from its last good copy instead (logged as errors; see
    :mod:`~mjsched_isolated.worker.loader`)."""

    pid: int
    plugins: list[PluginInfo]
    failures: list[LoadFailure]
    warnings: list[str] = []
    fallbacks: list[str] = []


class RunLimits(msgspec.Struct, frozen=True):
    """Resource limits for one run (None: no limit), applied by the worker (see
    :mod:`mjsched_isolated.worker.limits`): memory in MB, CPU seconds, open files, processes, nice."""

    max_memory_mb: int | None = None
    max_cpu_s: int | None = None
    max_open_files: int | None = None
    max_processes: int | None = None
    nice: int | None = None


class RunRequest(msgspec.Struct, tag=True, frozen=True):
    """Run one job. ``configuration`` is the stored JSON text; times are epoch seconds (UTC); ``limits``
    the run's resource limits (None: none); ``attempt`` 1 for a first run, 2 for its first retry, ...;
    ``previous_details`` a retry's previous attempt's details, as stored (JSON text; None: none);
    ``notice_on_success`` / ``notice_on_failure``: whether a notice of that outcome would be sent (a
    notification channel is on and the job notifies on it): the plugin's ``format_notification`` is called
    only then (issue 11: most runs notify no one);
    ``start_at``: a run claimed ahead of its instant (``claim_ahead_s``) starts its plugin at this instant of
    the worker's clock, never before (None: at once)."""

    run_id: int
    job_id: int
    job_name: str
    job_type: str
    configuration: str | None
    scheduled_at: float | None = None
    deadline_at: float | None = None
    limits: RunLimits | None = None
    attempt: int = 1
    previous_details: str | None = None
    notice_on_success: bool = True
    notice_on_failure: bool = True
    start_at: float | None = None


class RunStarted(msgspec.Struct, tag=True, frozen=True):
    """The plugin's ``execute`` is about to be called; ``at`` is epoch seconds in the child."""

    run_id: int
    at: float


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """``context.heartbeat()`` was called by the plugin of ``run_id``."""

    run_id: int
    at: float


class RunOutput(msgspec.Struct, tag=True, frozen=True):
    """The next piece of what run ``run_id`` wrote (stdout, stderr, logging records), in order, already
    bounded by the worker (see :mod:`mjsched_isolated.worker.output`); at most 256 KB of UTF-8."""

    run_id: int
    text: str


class NoticeText(msgspec.Struct, frozen=True):
    """The plugin's ``format_notification`` result: ``priority`` is Low, Normal or High; ``metadata`` a
    JSON object (stored as the notice's ``details``)."""

    subject: str
    body: str
    priority: str = "Normal"
    metadata: dict[str, Any] | None = None


class RunFinished(msgspec.Struct, tag=True, frozen=True):
    """The plugin returned (or raised). ``status`` is ``Completed`` or ``Failed``. ``notification``: the
    plugin's ``format_notification`` text for this outcome (None: the supervisor formats a default).
    ``retiring``: the child exits after this run, and why (the run left threads behind, ...): it must get
    no other run; its slot is refilled. ``cpu_s`` (CPU seconds) and ``max_rss_mb`` (peak resident memory,
    MiB): what the run used (:mod:`~mjsched_isolated.worker.accounting`); None where not measured."""

    run_id: int
    success: bool
    error_message: str | None = None
    details: dict[str, Any] | None = None
    notification: NoticeText | None = None
    retiring: str | None = None
    cpu_s: float | None = None
    max_rss_mb: float | None = None


class DeadlineExtended(msgspec.Struct, tag=True, frozen=True):
    """A heartbeat of run ``run_id`` moved its deadline to ``deadline_at`` (epoch seconds, UTC, as in
    :class:`RunRequest`): what the plugin's ``context.deadline_at`` shows from then on. Sent once per
    effective extension (at most one per ``heartbeat_interval_s``); a child that gets it after the run
    ended ignores it."""

    run_id: int
    deadline_at: float


class ValidateRequest(msgspec.Struct, tag=True, frozen=True):
    """Check that ``job_type`` exists and that ``configuration`` (JSON text) is valid for it."""

    job_type: str
    configuration: str | None


class ValidateReply(msgspec.Struct, tag=True, frozen=True):
    """``error`` is None when valid, else a one-line message naming the field."""

    error: str | None = None


class Stop(msgspec.Struct, tag=True, frozen=True):
    """Exit cleanly after the current message."""


ToChild = RunRequest | ValidateRequest | Stop | DeadlineExtended
ToSupervisor = Importing | Ready | RunStarted | Heartbeat | RunOutput | RunFinished | ValidateReply

_encoder = msgspec.msgpack.Encoder()
_to_child = msgspec.msgpack.Decoder(ToChild)
_to_supervisor = msgspec.msgpack.Decoder(ToSupervisor)


class Channel:
    """One end of the supervisor-worker link: two one-way pipes, read from one (``recv_bytes``, ``poll``,
    ``fileno`` for waiting), written to the other (``send_bytes``), as a duplex ``Connection`` is used.

    Not a socket pair (``multiprocessing.Pipe(duplex=True)``): a Unix socket has one wait queue for both
    directions, so when the supervisor reads a worker's result the kernel wakes the worker already blocked
    reading its next request, for nothing - a context switch into an idle worker per run (issue 11: 3
    voluntary switches a run instead of 2, measured with ``perf record -e sched:sched_switch``). A pipe
    wakes its readers only for data and its writers only for room; it is also the lighter kernel path (no
    socket buffer per message). Pickled for a spawned child as its two ``Connection`` objects."""

    __slots__ = ("fileno", "poll", "reader", "recv_bytes", "send_bytes", "writer")

    def __init__(self, reader: Connection, writer: Connection) -> None:
        self.reader, self.writer = reader, writer
        self.recv_bytes = reader.recv_bytes  # bound once: no extra call per message
        self.poll = reader.poll
        self.fileno = reader.fileno
        self.send_bytes = writer.send_bytes

    def __reduce__(self) -> tuple[type[Channel], tuple[Connection, Connection]]:
        return Channel, (self.reader, self.writer)

    @property
    def closed(self) -> bool:
        return self.reader.closed and self.writer.closed

    def close(self) -> None:
        """Close both pipes (the peer reads EOF; its writes fail with ``BrokenPipeError``)."""
        self.reader.close()
        self.writer.close()


def channel_pair(ctx: multiprocessing.context.BaseContext) -> tuple[Channel, Channel]:
    """``(supervisor's end, child's end)``: two one-way pipes of ``ctx``, crossed."""
    child_reads, supervisor_writes = ctx.Pipe(duplex=False)
    supervisor_reads, child_writes = ctx.Pipe(duplex=False)
    return Channel(supervisor_reads, supervisor_writes), Channel(child_reads, child_writes)


def send(conn: Connection | Channel, message: msgspec.Struct) -> None:
    """Encode and send one message. Raises ``OSError``/``BrokenPipeError`` if the peer is gone."""
    conn.send_bytes(_encoder.encode(message))


_LONG = 0x7FFFFFFF  # multiprocessing's framing: a longer message has the length -1, then 8 bytes of length


def write_fd(conn: Connection | Channel) -> int:
    """The descriptor ``conn`` writes to (a :class:`Channel`'s outgoing pipe, or a duplex ``Connection``)."""
    return conn.writer.fileno() if isinstance(conn, Channel) else conn.fileno()


def send_fd(fd: int, message: msgspec.Struct) -> None:
    """:func:`send` written straight to ``fd``, framed as ``Connection.send_bytes`` frames it (the peer reads
    it with ``recv_bytes``): encoded after its 4-byte length in one buffer and written with one ``write``
    (issue 11: the worker's result without ``Connection``'s layers; a partial write goes on with the rest).
    Raises ``OSError``/``BrokenPipeError`` if the peer is gone. The caller serialises writers."""
    buffer = bytearray(4)
    _encoder.encode_into(message, buffer, 4)
    size = len(buffer) - 4
    if size > _LONG:
        buffer[0:4] = b"\xff\xff\xff\xff" + size.to_bytes(8, "big")
    else:
        buffer[0:4] = size.to_bytes(4, "big")
    view = memoryview(buffer)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """The worker's reading of ``Connection.send_bytes`` frames from a descriptor: ``os.read`` of up to
    :data:`READ_SIZE` bytes at once, so a message usually takes one ``read`` where ``recv_bytes`` makes two
    (its length, then its body) through several layers (issue 11); bytes of a next message read with it are
    kept for the next call. Not thread-safe: the caller holds a lock."""

    READ_SIZE = 64 * 1024

    __slots__ = ("_chunks", "_fd", "_held")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._chunks: list[bytes] = []  # read and not taken yet, in order (joined once a message is whole)
        self._held = 0  # their length

    def _take(self) -> bytes | None:
        """The next whole message kept, removed from the buffer; None if none is complete yet."""
        chunks = self._chunks
        if not chunks:
            return None
        buffer = chunks[0]
        if len(buffer) < 12 and len(chunks) > 1:  # the length may span reads
            buffer = b"".join(chunks)
            chunks[:] = [buffer]
        if len(buffer) < 4:
            return None
        size, start = int.from_bytes(buffer[:4], "big", signed=True), 4
        if size == -1:
            if len(buffer) < 12:
                return None
            size, start = int.from_bytes(buffer[4:12], "big"), 12
        end = start + size
        if self._held < end:
            return None
        if len(buffer) < end:  # a long message over several reads: joined once, now that it is whole
            buffer = b"".join(chunks)
        rest = buffer[end:]
        self._chunks, self._held = ([rest] if rest else []), len(rest)
        return buffer[start:end]

    def _fill(self) -> None:
        """One ``read`` (blocking); ``EOFError`` at the end of the pipe between messages, ``OSError`` in one."""
        data = os.read(self._fd, self.READ_SIZE)
        if not data:
            if self._held:
                raise OSError("got end of file during message")
            raise EOFError
        self._chunks.append(data)
        self._held += len(data)

    def recv_bytes(self) -> bytes:
        """The next message's bytes, waiting for it as ``Connection.recv_bytes`` does."""
        while (message := self._take()) is None:
            self._fill()
        return message

    def recv_ready(self) -> bytes | None:
        """The next message's bytes if it can be had without waiting (kept, or readable now), else None:
        a message the pipe holds only part of is kept, not waited for."""
        while (message := self._take()) is None:
            if not select.select([self._fd], [], [], 0)[0]:
                return None
            self._fill()
        return message


def decode_to_child(data: bytes) -> ToChild:
    """Decode a supervisor->child message; raises :class:`ProtocolError` on garbage."""
    try:
        return _to_child.decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"bad message to child: {exc}") from None


def decode_to_supervisor(data: bytes) -> ToSupervisor:
    """Decode a child->supervisor message; raises :class:`ProtocolError` on garbage."""
    try:
        return _to_supervisor.decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"bad message to supervisor: {exc}") from None
