"""A reused worker child between runs: what one run leaves (processes, process state) never reaches the
next, and finding that nothing was left is cheap. Real worker children through the pool, real signals;
plugins written to a temporary folder; every wait bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from worker_helpers import OneWorker

from mjsched_isolated import protocol

PLUGINS = '''
import json, os, signal, subprocess, sys, threading, time
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Ok(BaseScheduledJob):
    job_type = "ok"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"pid": os.getpid()})


class Escape(BaseScheduledJob):
    """A background process in a session of its own whose parent exits at once: re-parented, outside the
    worker's session and process group (what `setsid sleep 1000 &` in a shell job does)."""
    job_type = "escape"

    def execute(self, context):
        out = subprocess.run(["setsid", "sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True, timeout=10)
        return ScheduledJobResult(success=True, details={"pid": int(out.stdout)})
'''


def _finished(messages: list) -> protocol.RunFinished:
    return messages[-1]


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "isolation.py").write_text(PLUGINS)
    return folder


def test_a_process_that_started_its_own_session_is_killed_and_reaped_after_the_run(plugins):
    with OneWorker(str(plugins)) as one:
        escaped = _finished(one.run("escape")).details["pid"]
        try:
            assert _finished(one.run("ok")).success  # the cleanup of the first run is done before this one
            assert not psutil.pid_exists(escaped)  # killed, and reaped by the worker (no zombie either)
        finally:
            if psutil.pid_exists(escaped):
                os.kill(escaped, 9)


def test_a_run_that_left_nothing_does_not_scan_the_process_table():
    """With the worker a child subreaper, 'nothing left' is read from /proc/self alone; a left process is
    still found (through the full scan)."""
    script = textwrap.dedent('''
        import os, subprocess, sys
        from mjsched_isolated import proctree
        from mjsched_isolated.worker import hygiene
        assert proctree.become_subreaper()
        os.setsid()
        calls = []
        full_scan = proctree.session_and_descendants
        proctree.session_and_descendants = lambda leader: calls.append(leader) or full_scan(leader)
        watchdog = subprocess.Popen(["sleep", "100"])
        assert hygiene.kill_leftovers(watchdog.pid, 1, "j", subreaper=True) == [] and calls == []
        left = subprocess.Popen(["sleep", "100"])
        assert hygiene.kill_leftovers(watchdog.pid, 2, "j", subreaper=True) == [left.pid] and calls
        watchdog.kill(); watchdog.wait()
        print("ok")
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ok", out.stderr
