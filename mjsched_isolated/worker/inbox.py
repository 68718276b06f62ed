"""What the supervisor sends a worker child, read by the child: between runs, the next request; while a
run executes, the deadline extensions its heartbeats earned (:class:`~mjsched_isolated.protocol.DeadlineExtended`),
read by the plugin's thread when it asks (``context.heartbeat()``, ``context.deadline_at``). One pipe, read
under one lock; a message that is not a deadline, should one arrive during a run, is kept for the loop."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from mjsched_isolated import protocol
from mjsched_isolated.errors import ProtocolError


class Inbox:
    """The child's end of its pipe, for reading. ``next()`` blocks for the loop's next message (raises
    ``EOFError``/``OSError`` when the supervisor is gone, :class:`ProtocolError` on garbage);
    ``deadline_for(run_id)`` never blocks."""

    def __init__(self, conn: Connection | protocol.Channel) -> None:
        self._frames = protocol.FrameReader(conn.fileno())  # one read a message (issue 11)
        self._lock = threading.Lock()
        self._kept: list[protocol.ToChild] = []

    def next(self) -> protocol.ToChild:
        """The next message for the loop (one kept during a run first). A deadline that arrives after its
        run ended is skipped."""
        while True:
            with self._lock:
                message = self._kept.pop(0) if self._kept else protocol.decode_to_child(self._frames.recv_bytes())
            if not isinstance(message, protocol.DeadlineExtended):
                return message

    def deadline_for(self, run_id: int) -> float | None:
        """The newest deadline (epoch seconds) the supervisor sent for run ``run_id`` since the last call,
        None if none came. Reads only what is already there; other messages are kept for :meth:`next`."""
        newest = None
        with self._lock:
            try:
                while (data := self._frames.recv_ready()) is not None:
                    message = protocol.decode_to_child(data)
                    if isinstance(message, protocol.DeadlineExtended):
                        if message.run_id == run_id:
                            newest = message.deadline_at
                    else:
                        self._kept.append(message)
            except (EOFError, OSError, ProtocolError):  # the supervisor is gone (the watchdog ends us), or garbage
                pass
        return newest
