"""Real ``serve`` processes for tests, with their log read through a pipe (no sleeps)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURE_PLUGINS
from waiting import LogLines

READY = r"job types available"  # logged once the first worker has loaded the plugins: the loop is going


class Serve:
    """A ``python -m mjsched_isolated serve`` subprocess (stdout and stderr on one pipe) whose log lines
    are collected by a reader thread (:class:`waiting.LogLines`)."""

    def __init__(self, db_url: str, *args: str, cwd: Path | None = None, plugins: str = FIXTURE_PLUGINS,
                 env: dict[str, str] | None = None, **popen: Any) -> None:
        cmd = [sys.executable, "-m", "mjsched_isolated", "serve", "--db", db_url, "--plugins", plugins, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                     env=env, **popen)
        assert self.proc.stdout is not None
        self.log_lines = LogLines(self.proc.stdout)

    @property
    def output(self) -> list[str]:
        """Every line logged so far, in order."""
        return self.log_lines.output

    @property
    def log(self) -> list[str]:
        """The lines :meth:`wait_for` has consumed."""
        return self.log_lines.consumed

    def wait_for(self, pattern: str, timeout_s: float = 30.0, *, seen: bool = False) -> re.Match[str]:
        """The next log line matching ``pattern`` (or, with ``seen``, also one already consumed), waiting
        at most ``timeout_s`` in all; fails the test with the log's tail otherwise."""
        return self.log_lines.wait_for(pattern, timeout_s, seen=seen)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until the supervisor has a worker with the plugins loaded (its loop is going)."""
        self.wait_for(READY, timeout_s)

    def stop(self) -> None:
        """SIGKILL the supervisor if it still runs (its workers' watchdogs take them down) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@contextlib.contextmanager
def serves() -> Iterator[Callable[..., Serve]]:
    """``start(db_url, *args, **kw)`` starts a :class:`Serve`; every one started is stopped on leaving."""
    made: list[Serve] = []

    def start(db_url: str, *args: str, **kw: Any) -> Serve:
        s = Serve(db_url, *args, **kw)
        made.append(s)
        return s

    try:
        yield start
    finally:
        for s in made:
            s.stop()


@pytest.fixture
def serve_factory() -> Iterator[Callable[..., Serve]]:
    """:func:`serves` as a fixture: every ``serve`` a test starts is stopped after it."""
    with serves() as start:
        yield start
