"""``serve`` as a container's PID 1 (no init): orphans of killed worker trees (their watchdogs, a plugin's
grandchildren) are re-parented to it, and it reaps them, so zombies do not pile up. A real PID namespace
(``unshare --pid --fork --mount-proc``, root only) and real deadline kills."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest
from conftest import FIXTURE_PLUGINS, add_job
from waiting import LogLines, wait_until

YEARLY = "0 0 1 1 *"

needs_pid_namespace = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                         reason="a PID namespace needs root and unshare(1)")


def _zombies(pid: int) -> list[int]:
    zombies = []
    for child in psutil.Process(pid).children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return zombies


@needs_pid_namespace
def test_serve_as_pid_1_reaps_the_orphans_of_killed_runs(store, db_url, tmp_path):
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "mjsched_isolated",
           "serve", "--db", db_url, "--plugins", FIXTURE_PLUGINS, "--lease-timeout-s", "0.5", "--kill-grace-s", "0",
           "--max-concurrent-jobs", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = LogLines(proc.stdout)
    try:
        lines.wait_for("worker isolation: workers are child subreapers", 30)
        lines.wait_for("running as PID 1", 30, seen=True)
        pid1 = psutil.Process(proc.pid).children()[0].pid  # the namespace's PID 1, as this namespace sees it
        for n in range(3):  # each kill orphans the worker's watchdog and the plugin's grandchild
            add_job(store, f"hung{n}", "hang", YEARLY, configuration=json.dumps({"marker_dir": str(tmp_path)}))
        for n in range(3):
            lines.wait_for(rf"run \d+ finished: job hung{n} Timeout", 30, seen=True)
        orphans = len(list(tmp_path.glob("*.grandchild"))) + 3
        assert orphans == 6
        assert wait_until(lambda: _zombies(pid1) == [], 10, "every orphan reaped by PID 1",
                          diagnostic=lambda: str(_zombies(pid1))) is True
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child subreaper is Linux's")
def test_check_and_serve_say_how_workers_contain_leftovers(db_url, tmp_path, capsys, monkeypatch):
    from clirun import Cli
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})
    cli("db", "upgrade")
    out = cli("check", expect=1).stdout  # the fixture folder has a plugin that fails to import on purpose
    from mjsched_isolated import cgroups
    mechanism = cgroups.probe().split(" under ")[0]  # "cgroup v2 per worker", or "cgroups are not used (why)"
    assert "isolation: workers are child subreapers" in out and mechanism in out
