"""The one bounded wait of the test suite, and the log-line waiter built on the same rule.

Every wait in a test is bounded and waits *on something*: a condition read from the database or a
process (``wait_until``), a line in a child's log (``LogLines.wait_for``), a process sentinel
(``wait_gone``). A wait that runs out fails the test with what it waited for and a bounded diagnostic
(the last value seen, the last log lines), never with a bare timeout. Nothing here sleeps to synchronise:
``wait_until`` re-reads its condition every ``interval_s``, which is bounded polling of state the test
cannot be notified of (a row in a database another process writes).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, TypeVar

import psutil
import pytest

T = TypeVar("T")

DIAGNOSTIC_CHARS = 2000  # a failure message shows at most this much of the last value or the log
TAIL_LINES = 40


def _bounded(text: str, limit: int = DIAGNOSTIC_CHARS) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.02,
               diagnostic: Callable[[], str] | None = None) -> T:
    """``cond()``'s first truthy value, re-read every ``interval_s`` seconds for at most ``timeout_s``.

    Fails the test (``pytest.fail``) with ``what``, the bound, the last value ``cond()`` returned and, if
    given, ``diagnostic()`` (each cut to :data:`DIAGNOSTIC_CHARS`). ``cond`` is always read at least once
    and once more at the deadline, so a condition that holds is never reported as timed out.
    """
    give_up = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        left = give_up - time.monotonic()
        if left <= 0:
            extra = f"\n{_bounded(diagnostic())}" if diagnostic is not None else ""
            pytest.fail(f"{what}: not within {timeout_s:g} s (last value: {_bounded(repr(value), 300)}){extra}")
        time.sleep(min(interval_s, left))


def wait_gone(pids: Iterable[int], timeout_s: float = 5.0) -> list[int]:
    """Wait (bounded, on the processes themselves) until every pid has exited; a zombie counts as exited.
    Returns the pids still alive at the bound (``[]`` when all are gone), for the test to assert on."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    give_up = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        left = give_up - time.monotonic()
        if not alive or left <= 0:
            return [p.pid for p in alive]
        psutil.wait_procs(alive, timeout=min(0.05, left))


class LogLines:
    """The lines of a child's text stream, read by a daemon thread as they come.

    ``wait_for`` consumes lines in order until one matches; ``seen=True`` also searches the lines already
    consumed (for a line that may have come before the one last waited for). ``output`` holds every line
    read so far, in order.
    """

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.consumed: list[str] = []
        self.output: list[str] = []
        self.ended = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)  # end of stream: the child closed it (exited)

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines read, for a failure message."""
        return "".join(self.output[-lines:])

    def wait_for(self, pattern: str, timeout_s: float, *, seen: bool = False) -> re.Match[str]:
        """The next line matching ``pattern`` (``re.search``); with ``seen``, first any consumed one.

        Waits at most ``timeout_s`` in all; fails the test naming the pattern, the bound and the log's
        last :data:`TAIL_LINES` lines, at once if the stream ends first.
        """
        regex = re.compile(pattern)
        if seen:
            for line in self.consumed:
                if match := regex.search(line):
                    return match
        give_up = time.monotonic() + timeout_s
        while not self.ended:
            try:
                got = self.lines.get(timeout=max(0.0, give_up - time.monotonic()))
            except queue.Empty:
                break
            if got is None:
                self.ended = True
                break
            self.consumed.append(got)
            if match := regex.search(got):
                return match
        why = "the log ended" if self.ended else f"not within {timeout_s:g} s"
        pytest.fail(f"no log line matching {pattern!r}: {why}; last lines:\n{_bounded(self.tail())}")
