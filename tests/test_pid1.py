"""``serve`` as a container's PID 1 (no init): orphans of killed worker trees (their watchdogs, a plugin's
grandchildren) are re-parented to it, and it reaps them, so zombies do not pile up. A real PID namespace
(``unshare --pid --fork --mount-proc``, root only) and real deadline kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import FIXTURE_PLUGINS, add_job
from waiting import LogLines, wait_until

from mjsched_isolated.store import Store

YEARLY = "0 0 1 1 *"
ROOT = Path(__file__).resolve().parent.parent

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


def _in_pid_namespace_without_its_proc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``args`` run by this Python as PID 1 of a new PID namespace that kept the host's /proc (``unshare -pf``
    without ``--mount-proc``)."""
    return subprocess.run(["unshare", "-pf", "--kill-child", sys.executable, *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


@needs_pid_namespace
def test_serve_refuses_and_check_reports_a_pid_namespace_without_its_own_proc(tmp_path):
    """Under ``unshare -pf`` without ``--mount-proc``, every worker's watchdog read the host process with the
    worker's pid, found a stranger's parent and killed the worker at once (every slot refilled, forever)."""
    db = tmp_path / "m.db"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    served = _in_pid_namespace_without_its_proc("-m", "mjsched_isolated", "serve", "--db", f"sqlite:///{db}",
                                                "--plugins", str(plugins), "--run-for", "0", cwd=tmp_path)
    assert served.returncode == 2, served
    (line,) = served.stderr.splitlines()
    assert line.startswith("error: /proc: mounted for another PID namespace") and "unshare --mount-proc" in line
    assert not db.exists()  # nothing written
    with Store.open(f"sqlite:///{tmp_path / 'jobs.db'}") as store:  # jobs run (and the Python API) refuse too
        add_job(store, "j", "ok", YEARLY)
    ran = _in_pid_namespace_without_its_proc("-m", "mjsched_isolated", "jobs", "run", "j", "--db",
                                             f"sqlite:///{tmp_path / 'jobs.db'}", "--plugins", FIXTURE_PLUGINS,
                                             cwd=tmp_path)
    assert ran.returncode == 2, ran
    assert ran.stderr.splitlines()[-1].startswith("error: /proc: mounted for another PID namespace"), ran
    checked = _in_pid_namespace_without_its_proc("-m", "mjsched_isolated", "check", "--db", f"sqlite:///{db}",
                                                 "--plugins", str(plugins), cwd=tmp_path)
    assert checked.returncode == 1, checked
    assert "PROBLEM /proc: mounted for another PID namespace" in checked.stdout


WATCHDOG_UNDER_FOREIGN_PROC = """
import os, sys, time, multiprocessing
from mjsched_isolated.worker import watchdog
busy = multiprocessing.RawValue("b", 1)
fence_at = multiprocessing.RawValue("d", time.monotonic() + 1.0)
started = time.monotonic()
worker = os.fork()
if worker == 0:
    os.setpgid(0, 0)
    watchdog.start(1, busy, fence_at)
    while True:
        time.sleep(60)  # the worker, idle until its watchdog kills it
_, status = os.waitpid(worker, 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, time.monotonic() - started)
"""


@needs_pid_namespace
def test_a_watchdog_under_another_namespaces_proc_spares_its_worker_until_the_fence(tmp_path):
    """The watchdog of a worker whose /proc is another PID namespace's (an embedding that did not go through
    ``serve``'s refusal) no longer reads a stranger's parent there: the worker lives until its fence passes
    (1 s), then is killed as before (not 0.1 s after it started)."""
    done = _in_pid_namespace_without_its_proc("-c", WATCHDOG_UNDER_FOREIGN_PROC, cwd=tmp_path)
    assert done.returncode == 0, done
    sig, lived_s = done.stdout.split()
    assert int(sig) == signal.SIGKILL and float(lived_s) >= 1.0, done.stdout
