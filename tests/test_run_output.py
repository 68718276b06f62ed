"""Per-run output: the ``run_output`` store (chunks, order, retention with the run, migration 0005 on every
backend), the worker's capture (mjsched_isolated.worker.output) through real worker children, and what
``runs logs`` and ``Client.run_logs`` show."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from alembic import command
from conftest import add_job

from mjsched_isolated.store import Store, migrate, schema
from mjsched_isolated.store.output import OUTPUT_CHUNK_BYTES, split_text
from mjsched_isolated.store.schema import run_output, runs

UTC = dt.UTC
NOW = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=UTC)


def _run(store: Store, job_id: int, *, days_ago: float = 0.0, status: str = "Completed") -> int:
    started = NOW - dt.timedelta(days=days_ago)
    with store.engine.begin() as conn:
        key = conn.execute(runs.insert().values(job_id=job_id, started_at=started, status=status,
                                                completed_at=None if status == "Running" else started)
                           ).inserted_primary_key
    assert key is not None
    return int(key[0])


def _output_run_ids(store: Store) -> set[int]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(run_output.c.run_id)).scalars())


# -- the store -------------------------------------------------------------------------------------------
def test_split_text_keeps_every_character_and_each_piece_fits_a_mariadb_text():
    text = "a" * 20_000 + "é" * 10_000 + "\U0001f600" * 5_000 + "\x00"
    pieces = split_text(text)
    assert "".join(pieces) == text.replace("\x00", "\ufffd")
    assert all(0 < len(p.encode("utf-8")) <= OUTPUT_CHUNK_BYTES for p in pieces)
    assert split_text("") == []


def test_append_and_read_in_order_on_every_backend(any_store):
    store = any_store
    run_id = _run(store, add_job(store, "j", "ok", now=NOW)["id"], status="Running")
    big = "x" * (OUTPUT_CHUNK_BYTES * 2 + 5)  # one text longer than a row holds: split over three rows
    next_seq = store.append_run_output(run_id, 0, ["first\n", big], NOW)
    assert next_seq == 4
    assert store.append_run_output(run_id, next_seq, [], NOW) == next_seq  # nothing: no write
    store.append_run_output(run_id, next_seq, ["last ü\n"], NOW)
    chunks = store.run_output(run_id)
    assert [seq for seq, _ in chunks] == [0, 1, 2, 3, 4]
    assert "".join(text for _, text in chunks) == "first\n" + big + "last ü\n"
    assert store.run_output(run_id, after_seq=3) == [(4, "last ü\n")]


def test_output_is_deleted_with_its_run_by_retention_and_job_removal(any_store):
    store = any_store
    job = add_job(store, "j", "ok", now=NOW)["id"]
    other = add_job(store, "other", "ok", now=NOW)["id"]
    old, young, live, removed = (_run(store, job, days_ago=30), _run(store, job, days_ago=1),
                                 _run(store, job, days_ago=60, status="Running"), _run(store, other))
    for run_id in (old, young, live, removed):
        store.append_run_output(run_id, 0, [f"run {run_id}\n"], NOW)
    assert store.retention.prune_runs(NOW, keep_days=10, keep_min_per_job=0) == 1
    assert _output_run_ids(store) == {young, live, removed}
    store.remove_job("other")
    assert _output_run_ids(store) == {young, live}


def test_sqlite_without_foreign_keys_still_deletes_output_with_the_run(db_url):
    """A connection that does not enforce foreign keys (sqlite3 opened by hand, another tool) must not
    leave output rows behind: retention deletes them explicitly."""
    store = Store.open(db_url)
    try:
        run_id = _run(store, add_job(store, "j", "ok", now=NOW)["id"], days_ago=30)
        store.append_run_output(run_id, 0, ["x\n"], NOW)
        with store.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 0
        plain = Store(sa.create_engine(db_url))  # no pragmas: foreign keys off, as sqlite3's default
        assert plain.retention.prune_runs(NOW, keep_days=10, keep_min_per_job=0) == 1
        plain.close()
        assert _output_run_ids(store) == set()
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_migration_0005_upgrades_a_database_with_runs(backend_url):
    engine = schema.connect(backend_url)
    try:
        with engine.begin() as conn:
            command.upgrade(migrate.config(conn), "0002")
            conn.execute(schema.jobs.insert().values(id=1, name="j", job_type="ok", cron_expression="* * * * *",
                                                     created_at=NOW, updated_at=NOW))
            conn.execute(runs.insert().values(id=7, job_id=1, started_at=NOW, status="Completed", details='{"a": 1}'))
        assert migrate.check(engine).state == "outdated"
        migrate.upgrade(engine)
        assert migrate.check(engine).state == "current"
        store = Store.open(backend_url)
        try:
            assert store.get_run(7)["details"] == {"a": 1}
            assert store.run_output(7) == []
            store.append_run_output(7, 0, ["after the upgrade\n"], NOW)
            assert store.run_output(7) == [(0, "after the upgrade\n")]
            with pytest.raises(sa.exc.IntegrityError):  # the foreign key exists: no output of a missing run
                store.append_run_output(8, 0, ["orphan"], NOW)
        finally:
            store.close()
    finally:
        engine.dispose()


# -- the worker's capture, through a real worker child -----------------------------------------------------
WRITER = '''
import logging, os, subprocess, sys, time
from pathlib import Path
import msgspec
from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Config(msgspec.Struct, kw_only=True):
    big_bytes: int = 0
    wait_for: str | None = None  # a file whose existence ends the run (bounded)


class Writer(BaseScheduledJob[Config]):
    job_type = "writer"

    def execute(self, context):
        print("one: print")
        sys.stderr.write("two: stderr\\n")
        logging.getLogger("some.library").warning("three: a logging record")
        context.log.info("four: the plugin's logger")
        subprocess.run([sys.executable, "-c", "import os; os.write(1, b'five: child stdout\\\\n'); "
                        "os.write(2, b'six: child stderr\\\\n')"], check=True)
        if context.configuration.big_bytes:
            line = b"y" * 1023 + b"\\n"
            for _ in range(context.configuration.big_bytes // 1024):
                os.write(1, line)
        print("seven: last")
        if context.configuration.wait_for:
            give_up = time.monotonic() + 20
            while not Path(context.configuration.wait_for).exists() and time.monotonic() < give_up:
                time.sleep(0.05)
        return ScheduledJobResult(success=True)


class FloodWaitConfig(msgspec.Struct, kw_only=True):
    written: str
    release: str


class FloodWait(BaseScheduledJob[FloodWaitConfig]):
    """Overflows the bound, writes a last line, then waits (as a hung run would) until released."""
    job_type = "flood_wait"

    def execute(self, context):
        for _ in range(200):
            os.write(1, b"z" * 1023 + b"\\n")
        os.write(1, b"LAST LINE before the hang\\n")
        Path(context.configuration.written).touch()
        give_up = time.monotonic() + 20
        while not Path(context.configuration.release).exists() and time.monotonic() < give_up:
            time.sleep(0.02)
        return ScheduledJobResult(success=True)


class Quiet(BaseScheduledJob):
    job_type = "quiet"

    def execute(self, context):
        return ScheduledJobResult(success=True)
'''

IN_ORDER = ["one: print", "two: stderr", "three: a logging record", "four: the plugin's logger",
            "five: child stdout", "six: child stderr", "seven: last"]


@pytest.fixture
def writer_plugins(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "writer.py").write_text(WRITER)
    return str(folder)


def _positions(text: str, needles: list[str]) -> list[int]:
    return [text.find(n) for n in needles]


@pytest.mark.timeout(30)
def test_worker_sends_a_runs_prints_logging_and_child_output_in_order_and_nothing_for_a_quiet_run(writer_plugins):
    from worker_helpers import OneWorker

    from mjsched_isolated import protocol

    with OneWorker(writer_plugins) as one:
        messages = one.run("writer")
        text = "".join(m.text for m in messages if isinstance(m, protocol.RunOutput))
        positions = _positions(text, IN_ORDER)
        assert all(p >= 0 for p in positions), text
        assert positions == sorted(positions), text
        assert "WARNING some.library: three: a logging record" in text
        last = [i for i, m in enumerate(messages) if isinstance(m, protocol.RunOutput)][-1]
        assert isinstance(messages[-1], protocol.RunFinished) and last < len(messages) - 1  # output first
        quiet = one.run("quiet")
        assert not [m for m in quiet if isinstance(m, protocol.RunOutput)]  # nothing for a silent run


@pytest.mark.timeout(30)
def test_a_burst_is_bounded_in_the_worker_keeping_head_and_tail_with_a_marker(writer_plugins):
    from worker_helpers import OneWorker

    from mjsched_isolated import protocol

    with OneWorker(writer_plugins) as one:
        one.pool.max_run_output_bytes = 64 * 1024  # the next worker takes it
        one.pool.kill(one.worker)
        one.ready = one._until(lambda m: isinstance(m, protocol.Ready))[-1]
        messages = one.run("writer", '{"big_bytes": 4000000}')
    pieces = [m.text for m in messages if isinstance(m, protocol.RunOutput)]
    text = "".join(pieces)
    assert text.startswith("one: print\n") and text.endswith("seven: last\n")
    assert "bytes of output left out" in text and "max_run_output_bytes is 65536" in text
    assert len(text.encode()) < 64 * 1024 + 1000
    assert all(len(p.encode()) <= 256 * 1024 for p in pieces)


# -- end to end: serve stores it; runs logs (live and after) and the Client show it -----------------------
@pytest.mark.timeout(60)
def test_serve_stores_a_runs_output_shown_live_and_afterwards_while_its_log_stays_clean(writer_plugins, db_url,
                                                                                         tmp_path, capsys,
                                                                                         monkeypatch):
    import json
    import subprocess
    import sys

    from clirun import Cli
    from procs import Serve
    from waiting import wait_until

    from mjsched_isolated.client import Client

    store = Store.open(db_url)
    finish = tmp_path / "finish"
    add_job(store, "w", "writer", "0 0 1 1 *", configuration=json.dumps({"wait_for": str(finish)}))
    serve = Serve(db_url, plugins=writer_plugins)
    logs_cmd = [sys.executable, "-m", "mjsched_isolated", "runs", "logs", "--db", db_url]
    try:
        run_id = int(serve.wait_for(r"run (\d+) started: job w").group(1))
        with Client(db_url) as client:
            wait_until(lambda: "seven: last" in client.run_logs(run_id), 15, "the live run's output in the database")
            assert store.get_run(run_id)["status"] == "Running"
            follower = subprocess.Popen([*logs_cmd, str(run_id), "--follow"], stdout=subprocess.PIPE, text=True)
            finish.touch()
            serve.wait_for(rf"run {run_id} finished: job w Completed")
            followed, _ = follower.communicate(timeout=20)
            assert follower.returncode == 0
            stored = client.run_logs(run_id)
    finally:
        serve.stop()
        store.close()
    positions = _positions(stored, IN_ORDER)
    assert all(p >= 0 for p in positions) and positions == sorted(positions), stored
    assert followed == stored
    # afterwards: the same command in this process (a cold one costs a second of imports; --follow above is cold)
    cli = Cli(capsys, monkeypatch, tmp_path)
    after = cli("runs", "logs", "--db", db_url, str(run_id), expect=None)
    assert (after.returncode, after.stdout) == (0, stored)
    missing = cli("runs", "logs", "--db", db_url, "999", expect=None)
    assert missing.returncode == 2 and missing.stderr.startswith("error: id: ")
    assert not [line for line in serve.output if any(n in line for n in IN_ORDER)]  # the supervisor log is clean


def test_plugin_reload_requests_grow_and_keep_one_row(any_store):
    store = any_store
    assert store.latest_plugin_reload() == 0
    first = store.request_plugin_reload("host-1")
    second = store.request_plugin_reload("host-2")
    assert second["id"] > first["id"] and store.latest_plugin_reload() == second["id"]
    assert second["requested_by"] == "host-2" and second["requested_at"].tzinfo is not None
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(schema.plugin_reloads)).scalar_one() == 1


@pytest.mark.timeout(40)
def test_sigterm_before_a_deadline_kill_sends_the_output_so_far_tail_included(writer_plugins, tmp_path):
    """At a deadline the supervisor sends SIGTERM, then SIGKILL after kill_grace_s: the worker sends what the
    run wrote so far on SIGTERM (its tail is otherwise held until the run ends), and nothing twice."""
    import json
    import os
    import signal

    from waiting import wait_until
    from worker_helpers import OneWorker

    from mjsched_isolated import protocol

    written, release = tmp_path / "written", tmp_path / "release"
    with OneWorker(writer_plugins) as one:
        one.pool.max_run_output_bytes = 64 * 1024
        one.pool.kill(one.worker)
        one.ready = one._until(lambda m: isinstance(m, protocol.Ready))[-1]
        request = protocol.RunRequest(run_id=7, job_id=1, job_name="t", job_type="flood_wait", configuration=json.dumps(
            {"written": str(written), "release": str(release)}))
        one.pool.submit(one.worker, request)
        wait_until(written.exists, 15, "the plugin wrote its output")
        os.kill(one.worker.pid, signal.SIGTERM)
        before = one._until(lambda m: isinstance(m, protocol.RunOutput) and "LAST LINE" in m.text)
        release.touch()
        after = one._until(lambda m: isinstance(m, protocol.RunFinished))
    text = "".join(m.text for m in before + after if isinstance(m, protocol.RunOutput))
    assert text.count("LAST LINE before the hang") == 1 and "bytes of output left out" in text
    assert after[-1].success


@pytest.mark.timeout(30)
def test_a_shell_commands_stdout_and_stderr_are_the_runs_output_as_well_as_its_tails():
    """A ``shell`` run's output is in ``runs logs`` like a plugin's prints (new-user review M1), not only
    in ``details.stdout_tail``."""
    import json

    from worker_helpers import OneWorker

    from mjsched_isolated import protocol

    command = ["sh", "-c", "echo shell-out-1; echo shell-err >&2; echo shell-out-2"]
    with OneWorker(None) as one:
        messages = one.run("shell", json.dumps({"command": command}))
    text = "".join(m.text for m in messages if isinstance(m, protocol.RunOutput))
    assert all(line in text.splitlines() for line in ("shell-out-1", "shell-err", "shell-out-2")), text
    assert text.index("shell-out-1") < text.index("shell-out-2")
    finished = messages[-1]
    assert isinstance(finished, protocol.RunFinished) and finished.success


def test_the_left_out_marker_is_on_a_line_of_its_own_even_after_the_head_was_sent_cut_in_a_line():
    """New-user review L6: the head, sent live while the run wrote, ended inside a line and the marker was
    glued to it (``aaaa[... 9950 bytes of output left out ...]``)."""
    from mjsched_isolated.worker.output import _RunBuffer

    for flushed_live in (True, False):
        buffer = _RunBuffer(1, 100)
        buffer.take(b"a" * 10_000)  # no newline at all: the head (50 bytes) is cut inside the line
        sent = buffer.take_pending() if flushed_live else ""
        text = sent + buffer.finish(100)
        lines = text.splitlines()
        assert lines[0] == "a" * 50 and lines[1].startswith("[... 9900 bytes of output left out"), text
        assert lines[1].endswith("...]") and lines[2] == "a" * 50


NASTY = "plain\n\x1b[2J\x1b[H\x1b]0;owned\x07\x9b31mred\x1b[0m\tcrlf\r\nover\rwrite\n"


def _on_a_terminal(argv: list[str]) -> str:
    """What ``argv`` writes to stdout when stdout is a real terminal (a pseudo-terminal in raw mode: no
    newline translation), read to the end."""
    import os
    import pty
    import subprocess
    import tty

    controller, terminal = pty.openpty()
    tty.setraw(terminal)
    try:
        proc = subprocess.Popen(argv, stdout=terminal, stderr=subprocess.PIPE)
        os.close(terminal)
        terminal = -1
        out = b""
        while True:
            try:
                piece = os.read(controller, 65536)
            except OSError:  # EIO: the process closed the terminal (it exited)
                break
            if not piece:
                break
            out += piece
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else None
        return out.decode()
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


@pytest.mark.timeout(30)
def test_runs_logs_shows_control_characters_as_escapes_on_a_terminal_and_as_stored_elsewhere(
        store, db_url, tmp_path, capsys, monkeypatch):
    """A run's output could move the cursor, clear the screen and retitle the terminal of whoever read it
    with ``runs logs``. On a terminal they are now visible escapes; ``--raw``, a pipe or a file get the
    output as stored."""
    import sys

    from clirun import Cli

    run_id = _run(store, add_job(store, "j", "ok", now=NOW)["id"])
    store.append_run_output(run_id, 0, [NASTY], NOW)
    both = ("import sys; from mjsched_isolated.cli import main; "  # one cold start for both
            "args = ['runs', 'logs', '--db', sys.argv[1], sys.argv[2]]; "
            "main(args); print('=== --raw'); main([*args, '--raw'])")
    escaped, raw = _on_a_terminal([sys.executable, "-c", both, db_url, str(run_id)]).split("=== --raw\n")
    assert escaped == "plain\n\\x1b[2J\\x1b[H\\x1b]0;owned\\x07\\x9b31mred\\x1b[0m\tcrlf\r\nover\\x0dwrite\n"
    assert raw == NASTY
    cli = Cli(capsys, monkeypatch, tmp_path)
    assert cli("runs", "logs", "--db", db_url, str(run_id)).stdout == NASTY  # captured: not a terminal


def test_a_terminal_sees_unicode_format_characters_as_escapes_too():
    """A bidi override (U+202E) or a zero-width character in a run's output reorders or hides what the terminal
    shows ("Trojan Source"): shown as escapes like the control characters; everything else is left as it is."""
    import sys
    import unicodedata

    from mjsched_isolated.cli import render

    text = "ok \u202eevil\u202c \u2066iso\u2069 zero\u200bwidth\ufeff tag\U000e0041 sep\u2028x é 中 \U0001f600\n"
    assert render.visible(text) == ("ok \\u202eevil\\u202c \\u2066iso\\u2069 zero\\u200bwidth\\ufeff tag\\U000e0041 "
                                    "sep\\u2028x é 中 \U0001f600\n")
    assert render.safe("a\u202eb\u00adc") == "a?b?c"
    missed = [f"U+{c:04X}" for c in range(sys.maxunicode + 1)
              if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp") and render.visible(chr(c)) == chr(c)]
    assert missed == []  # every format character this Python knows
