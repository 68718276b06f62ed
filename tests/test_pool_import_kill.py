"""A real pool's worker SIGKILLed while importing a plugin module: a kill from outside (the out-of-memory
killer, an operator, a watchdog misreading another /proc) must not cost the module's job types; a module
whose import is killed again is left out, as one that ends the worker in another way is at once."""

from __future__ import annotations

import logging
import time

from mjsched_isolated.supervisor.pool import Pool

KILLED_ONCE = """
import os, signal
from pathlib import Path

from mjsched_isolated import BaseScheduledJob, ScheduledJobResult

_marker = Path(__file__).with_name("once.killed")
if not _marker.exists():  # the first worker to import this module is killed (from outside, as it were)
    _marker.write_text("")
    os.kill(os.getpid(), signal.SIGKILL)


class Once(BaseScheduledJob):
    job_type = "once"

    def execute(self, context):
        return ScheduledJobResult(success=True)
"""

ALWAYS_KILLED = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"


def _first_ready(pool: Pool, timeout_s: float = 20.0):
    give_up = time.monotonic() + timeout_s
    while pool.last_ready is None:
        assert time.monotonic() < give_up, "no worker became ready"
        pool.wait(give_up - time.monotonic())
    return pool.last_ready


def test_a_worker_killed_once_while_importing_does_not_cost_the_modules_job_types(tmp_path, caplog):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "once.py").write_text(KILLED_ONCE)
    pool = Pool(1, str(plugins), log_level=logging.WARNING)
    caplog.set_level(logging.WARNING, "mjsched.pool")
    try:
        pool.start()
        ready = _first_ready(pool)
        assert "once" in {p.job_type for p in ready.plugins}, ready
        assert ready.failures == [] and pool.fatal_modules == {}
        assert "killed (SIGKILL) while importing plugin module once.py; not blamed on the module yet" in caplog.text
        assert pool.killed_importing == set()  # imported since: no longer a suspect
    finally:
        pool.close()


def test_a_module_whose_import_is_killed_twice_is_left_out(tmp_path, caplog):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "killed.py").write_text(ALWAYS_KILLED)
    pool = Pool(2, str(plugins), log_level=logging.WARNING)  # two workers die importing it at start-up
    try:
        pool.start()
        ready = _first_ready(pool)
        failures = {f.module: f.error for f in ready.failures}
        assert "killed by signal SIGKILL" in failures["killed.py"]
        assert "plugin module killed.py: importing it ended the worker process" in caplog.text
    finally:
        pool.close()
