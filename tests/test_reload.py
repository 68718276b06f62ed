"""Plugin reload (issue 14): a run goes to a worker that has its job type; workers are replaced when the
plugin files change, on ``plugins reload`` (through the database) or on SIGHUP without a terminal, once
their run ends; a module that no longer imports keeps the current workers; SIGHUP with a controlling
terminal is a hang-up (drain and stop, issue 12)."""

from __future__ import annotations

import msgspec
import pytest
from conftest import add_job

from mjsched_isolated import protocol

YEARLY = "0 0 1 1 *"


def _without(ready: protocol.Ready, job_type: str) -> protocol.Ready:
    return msgspec.structs.replace(ready, plugins=[p for p in ready.plugins if p.job_type != job_type])


# -- dispatch: a run goes to a worker that has its type ------------------------------------------------------
def test_a_run_goes_to_an_idle_worker_that_has_its_type_not_to_the_last_one(mem_store, fake_factory):
    """The defect: dispatch took the job types of the most recently started worker and handed the job to any
    idle worker, so a worker started before a plugin was added got its runs ("unknown job type")."""
    d = fake_factory(max_concurrent_jobs=2)
    old, new = d.pool.workers[1], d.pool.workers[0]
    old.ready = _without(old.ready, "ok")  # started before the plugin of "ok" was added; idle_workers()[-1]
    d.pool.last_ready = new.ready
    d.pool.hold()
    add_job(mem_store, "j", "ok", YEARLY)
    d.until(lambda: bool(d.supervisor.inflight))
    (flight,) = d.supervisor.inflight.values()
    assert flight.worker is new


def test_a_job_whose_type_only_a_busy_worker_has_waits_for_it_without_spinning(mem_store, fake_factory):
    d = fake_factory(max_concurrent_jobs=2)
    with_type, without = d.pool.workers[0], d.pool.workers[1]
    without.ready = _without(without.ready, "ok")
    d.pool.hold("first")
    add_job(mem_store, "first", "ok", YEARLY)
    d.until(lambda: bool(d.supervisor.inflight))
    add_job(mem_store, "second", "ok", YEARLY)
    now, mono = d.supervisor.read_clock()
    d.supervisor.step(now, mono)
    assert [f.job_name for f in d.supervisor.inflight.values()] == ["first"]  # not handed to `without`
    next_due = d.supervisor.dispatcher.next_due_at()  # the loop waits for a result, no 1 ms spin on "second"
    assert next_due is None or (next_due - now).days >= 1
    assert mem_store.get_job("second")["skipped_count"] == 0  # not skipped as unavailable either
    d.pool.hold("second")
    (first_run,) = d.pool.held
    d.pool.finish(first_run)  # the worker that has the type is free again: "second" goes to it
    d.until(lambda: len(mem_store.list_runs(job_name="second")) == 1)
    (flight,) = d.supervisor.inflight.values()
    assert (flight.job_name, flight.worker) == ("second", with_type)


# -- reload with real workers ------------------------------------------------------------------------------
VERSIONED = '''
from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Versioned(BaseScheduledJob):
    job_type = "versioned"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={{"version": VERSION}})


VERSION = {version}
'''

WAITER = '''
import time
from pathlib import Path
import msgspec
import pytest
from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Config(msgspec.Struct, kw_only=True):
    wait_for: str


class Waiter(BaseScheduledJob[Config]):
    job_type = "waiter"

    def execute(self, context):
        give_up = time.monotonic() + 20
        while not Path(context.configuration.wait_for).exists() and time.monotonic() < give_up:
            time.sleep(0.02)
        return ScheduledJobResult(success=True)
'''


def _write_plugin(path, text: str, *, bump_s: int) -> None:
    """Write ``text`` with a modification time ``bump_s`` seconds ahead: a change the watcher must see even
    when the size is the same and the write falls in the same clock tick as the previous one."""
    import os
    import time

    path.write_text(text)
    stamp = time.time_ns() + bump_s * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


@pytest.fixture
def versioned(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    _write_plugin(folder / "versioned.py", VERSIONED.format(version=1), bump_s=0)
    return folder


def _run_details(store, name: str) -> dict:
    (run,) = store.list_runs(job_name=name)
    assert run["status"] == "Completed", run
    return run["details"]


@pytest.mark.timeout(60)
def test_editing_a_plugin_while_serve_runs_changes_the_next_run_and_a_syntax_error_keeps_the_old_code(
        versioned, db_url, store):
    from procs import Serve

    serve = Serve(db_url, "--max-concurrent-jobs", "2", plugins=str(versioned))
    try:
        serve.wait_ready()
        add_job(store, "v1", "versioned", YEARLY)
        serve.wait_for(r"run \d+ finished: job v1 Completed")
        assert _run_details(store, "v1") == {"version": 1}

        _write_plugin(versioned / "versioned.py", VERSIONED.format(version=2), bump_s=1)
        serve.wait_for(r"plugin reload: every worker is replaced")
        add_job(store, "v2", "versioned", YEARLY)
        serve.wait_for(r"run \d+ finished: job v2 Completed")
        assert _run_details(store, "v2") == {"version": 2}  # no restart

        _write_plugin(versioned / "versioned.py", VERSIONED.format(version="2 +"), bump_s=2)  # a typo in a deploy
        refused = serve.wait_for(r"plugin reload refused: plugin module versioned.py no longer imports")
        assert "SyntaxError" in refused.string and "versioned" in refused.string
        add_job(store, "v3", "versioned", YEARLY)
        serve.wait_for(r"run \d+ finished: job v3 Completed")
        assert _run_details(store, "v3") == {"version": 2}  # the old code, not a lost job type
    finally:
        serve.stop()


@pytest.mark.timeout(60)
def test_plugins_reload_reaches_a_supervisor_through_the_database_and_busy_workers_finish_first(
        tmp_path, db_url, store, driver_factory, capsys, monkeypatch):
    import json

    from clirun import Cli

    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "waiter.py").write_text(WAITER)
    d = driver_factory(plugins_dir=str(folder), max_concurrent_jobs=2, lease_renew_interval_s=0.2).start()
    release = tmp_path / "release"
    add_job(store, "busy", "waiter", YEARLY, configuration=json.dumps({"wait_for": str(release)}))
    d.until(lambda: len(d.supervisor.inflight) == 1)
    (flight,) = d.supervisor.inflight.values()
    busy_pid = flight.worker.pid
    idle_pid = next(w.pid for w in d.pool.workers.values() if w is not None and w.pid != busy_pid)

    result = Cli(capsys, monkeypatch, tmp_path)("plugins", "reload", "--db", db_url)
    assert result.stdout.startswith("plugin reload requested (request 1)")
    d.until(lambda: d.supervisor.reloader.reloads == 1)
    pids = {w.pid for w in d.pool.workers.values() if w is not None}
    assert busy_pid in pids and idle_pid not in pids  # the idle one is replaced at once, the busy one kept
    assert flight.run_id in d.supervisor.inflight

    release.touch()
    d.until(lambda: not d.supervisor.inflight)
    d.until(lambda: busy_pid not in {w.pid for w in d.pool.workers.values() if w is not None})
    assert store.list_runs(job_name="busy")[0]["status"] == "Completed"  # its run ended normally first


# -- SIGHUP: hang-up with a terminal, reload without one ----------------------------------------------------
@pytest.mark.timeout(60)
def test_sighup_without_a_controlling_terminal_reloads_plugins_and_serve_keeps_running(versioned, db_url, store):
    import signal

    from procs import Serve

    serve = Serve(db_url, plugins=str(versioned), start_new_session=True)  # no controlling terminal
    try:
        serve.wait_ready()
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for(r"plugin reload: SIGHUP")
        serve.wait_for(r"plugin reload: every worker is replaced")
        add_job(store, "after", "versioned", YEARLY)
        serve.wait_for(r"run \d+ finished: job after Completed")  # still serving
        assert serve.proc.poll() is None
    finally:
        serve.stop()


@pytest.mark.timeout(60)
def test_sighup_with_a_controlling_terminal_is_a_hang_up_that_drains_like_sigterm(versioned, db_url, store):
    """Issue 12: a closed terminal or lost SSH session sent SIGHUP and serve died without draining."""
    import fcntl
    import os
    import pty
    import signal
    import termios

    from procs import Serve

    controller, terminal = pty.openpty()

    def take_terminal() -> None:  # after start_new_session's setsid: the pty becomes the controlling terminal
        fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)

    serve = Serve(db_url, plugins=str(versioned), start_new_session=True, stdin=terminal,
                  preexec_fn=take_terminal)
    os.close(terminal)
    try:
        serve.wait_ready()
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for(r"shutting down: no new runs")
        assert serve.proc.wait(30) == 0
        serve.wait_for(r"supervisor .* stopped")
        assert not [line for line in serve.output if "plugin reload" in line]
    finally:
        serve.stop()
        os.close(controller)


@pytest.mark.timeout(60)
def test_a_worker_refilled_while_a_broken_module_is_on_disk_imports_its_last_good_version(
        versioned, db_url, store, driver_factory, caplog):
    """New-user review M2: after a refused reload, a worker that replaces a killed one (or a crashed or
    recycled one) still has the job type, with the code that last loaded, and the pool logs an error."""
    import logging

    d = driver_factory(plugins_dir=str(versioned), max_concurrent_jobs=1)
    (first,) = d.pool.idle_workers()
    _write_plugin(versioned / "versioned.py", VERSIONED.format(version="2 +"), bump_s=1)
    d.until(lambda: d.supervisor.reloader.refused == 1)
    caplog.set_level(logging.ERROR)
    d.pool.kill(first)
    d.until(lambda: [w.pid for w in d.pool.idle_workers()] not in ([], [first.pid]))
    (refilled,) = d.pool.idle_workers()
    assert "versioned" in {p.job_type for p in refilled.ready.plugins}
    assert any("plugin module versioned.py no longer imports (SyntaxError" in r.getMessage()
               and "last good version" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    add_job(store, "after-kill", "versioned", YEARLY)
    d.until(lambda: [r["status"] for r in store.list_runs(job_name="after-kill")] == ["Completed"])
    assert _run_details(store, "after-kill") == {"version": 1}  # the pre-edit code


def test_the_last_good_copy_is_not_used_for_a_module_removed_then_added_back_broken(tmp_path):
    """A removed module loses its copy: added back broken, it is a new module that fails (as at start)."""
    from mjsched_isolated.worker.loader import load_plugins

    folder, keep = tmp_path / "plugins", tmp_path / "keep"
    folder.mkdir()
    keep.mkdir()
    (folder / "versioned.py").write_text(VERSIONED.format(version=1))
    assert "versioned" in load_plugins(folder, builtins=False, keep_dir=keep).classes
    (folder / "versioned.py").write_text(VERSIONED.format(version="2 +"))
    kept = load_plugins(folder, builtins=False, keep_dir=keep)
    assert "versioned" in kept.classes and kept.fallbacks and not kept.failures
    (folder / "versioned.py").unlink()
    assert load_plugins(folder, builtins=False, keep_dir=keep).classes == {}
    (folder / "versioned.py").write_text(VERSIONED.format(version="2 +"))
    broken = load_plugins(folder, builtins=False, keep_dir=keep)
    assert "versioned" not in broken.classes and [f.module for f in broken.failures] == ["versioned.py"]


@pytest.mark.timeout(60)
def test_jobs_run_after_a_refused_reload_runs_the_last_good_version_as_serves_refilled_workers_do(
        versioned, db_url, store, driver_factory, tmp_path, capsys, monkeypatch):
    """``jobs run`` started a pool of its own whose worker imported the broken file: the job type was not
    available to it while ``serve``'s refilled workers ran it. It now starts from the last good copies of
    the live ``serve`` (same plugins folder, same machine) and says so, as a refilled worker does."""
    from clirun import Cli

    d = driver_factory(plugins_dir=str(versioned), max_concurrent_jobs=1)
    _write_plugin(versioned / "versioned.py", VERSIONED.format(version="2 +"), bump_s=1)
    d.until(lambda: d.supervisor.reloader.refused == 1)
    add_job(store, "by-hand", "versioned", YEARLY)
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": str(versioned)})
    result = cli("jobs", "run", "by-hand")
    assert result.stdout.startswith("run ") and ": Completed in" in result.stdout, result
    assert "plugin module versioned.py no longer imports (SyntaxError" in result.stderr
    assert _run_details(store, "by-hand") == {"version": 1}  # the code serve runs, not a lost job type


def test_only_the_copies_of_a_live_process_that_nobody_else_may_write_are_borrowed(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from mjsched_isolated.supervisor.pool import borrow_good_copies, keep_dir_prefix

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prefix = keep_dir_prefix(str(tmp_path / "plugins"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    into = tmp_path / "into"
    into.mkdir()
    for owner, mode, name in ((os.getpid(), 0o700, "live.py"), (int(gone.stdout), 0o700, "dead.py"),
                              (os.getpid(), 0o777, "writable.py")):
        folder = tmp_path / f"{prefix}{owner}-{name[:-3]}"
        folder.mkdir()
        (folder / name).write_text("x = 1\n")
        folder.chmod(mode)
    assert borrow_good_copies(prefix, str(into)) == 1
    assert sorted(p.name for p in into.iterdir()) == ["live.py"]


@pytest.mark.timeout(60)
def test_a_broken_save_right_after_an_accepted_reload_falls_back_to_the_accepted_version(
        versioned, db_url, store, driver_factory, caplog):
    """New-user review (reload13): v2 accepted, v3 (broken) saved at once: the refilled workers read v3 and
    fell back to the last good copy, still v1 (the copy was written by a worker only once it imported v2).
    The accepted probe's bytes are now the last good copies before any worker is replaced."""
    import logging
    from pathlib import Path

    d = driver_factory(plugins_dir=str(versioned), max_concurrent_jobs=1)
    _write_plugin(versioned / "versioned.py", VERSIONED.format(version=2), bump_s=1)
    d.until(lambda: d.supervisor.reloader.reloads == 1)
    assert "VERSION = 2" in (Path(d.pool.keep_dir) / "versioned.py").read_text()  # at acceptance, not later
    assert (Path(d.pool.keep_dir) / ".lock").is_file()  # held while the pool lives (stale folders: see below)
    caplog.set_level(logging.ERROR)
    _write_plugin(versioned / "versioned.py", VERSIONED.format(version="3 +"), bump_s=2)
    add_job(store, "after", "versioned", YEARLY)
    d.until(lambda: [r["status"] for r in store.list_runs(job_name="after")] == ["Completed"])
    assert _run_details(store, "after") == {"version": 2}


@pytest.mark.timeout(60)
def test_a_fallback_is_logged_at_every_reload_event_even_with_the_same_error_text(
        versioned, db_url, store, driver_factory, caplog):
    """The "imported its last good version" error was logged once per text for the life of the pool: a
    second breakage with the same error went unsaid. Now once per text per reload event."""
    import logging

    caplog.set_level(logging.ERROR)
    d = driver_factory(plugins_dir=str(versioned), max_concurrent_jobs=1)

    def fallbacks() -> int:
        return sum("last good version" in r.getMessage() for r in caplog.records)

    for refused in (1, 2):
        _write_plugin(versioned / "versioned.py", VERSIONED.format(version="2 +" + " " * refused), bump_s=refused)
        d.until(lambda: d.supervisor.reloader.refused == refused)  # noqa: B023 - used in this iteration
        (worker,) = d.pool.idle_workers()
        d.pool.kill(worker)
        d.until(lambda: fallbacks() == refused)  # noqa: B023
    assert fallbacks() == 2


def test_a_copy_read_earlier_never_replaces_one_read_later(tmp_path):
    """A worker that read v1 before v2 was accepted and finishes importing after it was kept does not put
    v1 back."""
    from mjsched_isolated.worker.loader import keep_copy

    target = tmp_path / "versioned.py"
    assert keep_copy(target, b"VERSION = 2\n", 2_000)
    assert not keep_copy(target, b"VERSION = 1\n", 1_000)
    assert target.read_bytes() == b"VERSION = 2\n"
    assert keep_copy(target, b"VERSION = 3\n", 3_000) and target.read_bytes() == b"VERSION = 3\n"
    assert target.stat().st_mtime_ns == 3_000


def test_copy_folders_of_dead_pools_of_this_user_are_removed_at_start(tmp_path, monkeypatch):
    """New-user review (reload13): a ``serve`` killed with SIGKILL left its folder of copies for ever."""
    import os
    import subprocess
    import sys
    import tempfile

    from mjsched_isolated.supervisor.pool import keep_dir_prefix, remove_stale_keep_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    plugins = str(tmp_path / "plugins")
    cases = {  # name: (prefix, pid, mode, modified seconds ago), removed?
        "dead": ((keep_dir_prefix(plugins), gone, 0o700, 0), True),
        "dead-probe": ((keep_dir_prefix(plugins, probe=True), gone, 0o700, 0), True),
        "live": ((keep_dir_prefix(plugins), os.getpid(), 0o700, 0), False),
        "reused": ((keep_dir_prefix(plugins), os.getpid(), 0o700, 10 ** 6), True),  # older than this process
        "writable": ((keep_dir_prefix(plugins), gone, 0o777, 0), False),
        "other-user": ((keep_dir_prefix(plugins).replace(f"-{os.getuid()}-", f"-{os.getuid() + 1}-"), gone, 0o700,
                        0), False),
    }
    for name, ((prefix, pid, mode, age), _) in cases.items():
        folder = tmp_path / f"{prefix}{pid}-x{name.replace('-', '_')}"
        folder.mkdir()
        (folder / "versioned.py").write_text("x = 1\n")
        folder.chmod(mode)
        stamp = int((__import__("time").time() - age) * 1e9)
        os.utime(folder, ns=(stamp, stamp))
    assert remove_stale_keep_dirs() == sum(removed for _, removed in cases.values())
    left = {p.name.rsplit("-x", 1)[1] for p in tmp_path.iterdir() if "-x" in p.name}
    assert left == {n.replace("-", "_") for n, (_, removed) in cases.items() if not removed}


def test_a_locked_copy_folder_is_removed_once_its_process_is_killed_whatever_its_process_id(tmp_path, monkeypatch):
    """The copy folders are locked (flock) by their pool: a ``serve`` that is PID 1 of another PID namespace
    sharing ``/tmp`` (its id in use here by another process) is judged by its lock, not its id."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from mjsched_isolated.supervisor.pool import keep_dir_prefix, lock_keep_dir, remove_stale_keep_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prefix = keep_dir_prefix(str(tmp_path / "plugins"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tempfile; from mjsched_isolated.supervisor.pool import lock_keep_dir\n"
         f"d = tempfile.mkdtemp(prefix={prefix + '1-'!r}, dir={str(tmp_path)!r}); lock_keep_dir(d); print(d, "
         "flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    killed = holder.stdout.readline().strip()  # named PID 1: an id in use here, as in another namespace
    own = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    fd = lock_keep_dir(own)
    try:
        assert remove_stale_keep_dirs() == 0  # both locked by a live process
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert remove_stale_keep_dirs() == 1
        assert not os.path.exists(killed) and os.path.isdir(own)
    finally:
        os.close(fd)
        holder.kill()
        holder.wait()
    assert remove_stale_keep_dirs() == 1 and not os.path.exists(own)


@pytest.mark.timeout(60)
def test_jobs_add_of_a_type_whose_file_broke_is_accepted_with_a_warning_while_serve_runs_its_last_good_copy(
        versioned, db_url, store, driver_factory, tmp_path, capsys, monkeypatch):
    """``jobs add --type X`` was refused while X's file was broken, though ``serve`` kept running X's last good
    copy: the check's worker now starts from serve's copies, and the CLI accepts the job, warning that the
    file is broken. Without a serve keeping a copy it is still refused, saying why."""
    from clirun import Cli

    d = driver_factory(plugins_dir=str(versioned), max_concurrent_jobs=1)
    _write_plugin(versioned / "versioned.py", VERSIONED.format(version="2 +"), bump_s=1)
    d.until(lambda: d.supervisor.reloader.refused == 1)
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": str(versioned)})
    result = cli("jobs", "add", "new", "--type", "versioned", "--cron", YEARLY)
    assert result.stdout.startswith("job 'new' added"), result
    warning = [line for line in result.stderr.splitlines() if "job_type 'versioned' accepted" in line]
    assert warning and "plugin module versioned.py no longer imports (SyntaxError" in warning[0], result.stderr
    d.until(lambda: store.get_job("new") is not None)
    d.close()  # no serve keeps a copy any more: refused, saying why
    result = cli("jobs", "add", "newer", "--type", "versioned", "--cron", YEARLY, expect=2)
    assert "failed to load: versioned.py" in result.stderr and "could not run" in result.stderr, result.stderr
