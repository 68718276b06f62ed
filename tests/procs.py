"""Real ``serve`` processes for tests, with their log read through a pipe (no sleeps)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FIXTURE_PLUGINS


class Serve:
    """A ``serve`` subprocess whose log lines are collected by a reader thread."""

    def __init__(self, db_url: str, *args: str, cwd: Path | None = None, plugins: str = FIXTURE_PLUGINS) -> None:
        cmd = [sys.executable, "-m", "mjsched_isolated", "serve", "--db", db_url, "--plugins", plugins, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []  # lines consumed by wait_for
        self.output: list[str] = []  # every line, in order
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float = 20.0, *, seen: bool = False) -> re.Match:
        """The next log line matching ``pattern`` (or, with ``seen``, also one already consumed), waiting
        at most ``timeout_s`` in all."""
        regex = re.compile(pattern)
        if seen:
            for line in self.log:
                if match := regex.search(line):
                    return match
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, give_up - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no log line matching {pattern!r} within {timeout_s} s; log so far:\n{''.join(self.log)}")
            self.log.append(line)
            match = regex.search(line)
            if match:
                return match

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_factory():
    """``start(db_url, *args, **kw)`` starts a :class:`Serve`; every one started is stopped after the test."""
    made: list[Serve] = []

    def start(db_url: str, *args: str, **kw) -> Serve:
        s = Serve(db_url, *args, **kw)
        made.append(s)
        return s

    yield start
    for s in made:
        s.stop()
