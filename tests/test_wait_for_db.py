"""``serve`` started while its database server is unreachable: it waits and retries with backoff (each try
logged, ``/healthz`` unhealthy) and dispatches as soon as the server answers; ``wait_for_db_s`` bounds the
wait; a configuration error still exits 2 at once.

The shared PostgreSQL server is never stopped: the supervisor is pointed at a port of this test's own, first
closed (connections refused), then forwarded to the real server by a small TCP proxy run here.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from conftest import FIXTURE_PLUGINS, add_job, isolated_database
from procs import Serve

from mjsched_isolated.store import Store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def forwarding(port: int, upstream: tuple[str, int]) -> Iterator[None]:
    """Listen on 127.0.0.1:``port`` and forward every connection to ``upstream`` until the block ends."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    open_socks: list[socket.socket] = [listener]

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            open_socks.extend((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        for sock in open_socks:
            with contextlib.suppress(OSError):
                sock.close()


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(60)
def test_serve_waits_for_an_unreachable_postgresql_and_dispatches_once_it_answers(tmp_path):
    with isolated_database("postgresql", tmp_path) as url:
        with Store.open(url) as store:
            add_job(store, "first", "ok", "0 0 1 1 *")
        real = sa.engine.make_url(url)
        port = _free_port()  # closed: nothing listens there yet
        proxied = real.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
        serve = Serve(proxied, "--metrics-port", "0", "--rescan-interval-s", "0.5")
        try:
            metrics_port = int(serve.wait_for(r"metrics on http://\S+:(\d+)/metrics").group(1))
            tries = [serve.wait_for(r"database \S+ unreachable \(try (\d+): .*\); trying again in ([\d.]+) s")
                     for _ in range(4)]
            assert [int(m.group(1)) for m in tries] == [1, 2, 3, 4]
            assert [float(m.group(2)) for m in tries] == [0.1, 0.2, 0.4, 0.5]  # backoff, capped at 0.5 s
            status, body = _health(metrics_port)
            assert status == 503 and "waiting for the database" in body["reason"]
            # at the cap, each try is like the next: a server down for 20 s is met exactly as this one is
            serve.wait_for(r"trying again in 0\.5 s")
            assert serve.proc.poll() is None
            with forwarding(port, (real.host or "127.0.0.1", real.port or 5432)):
                back = time.monotonic()
                serve.wait_for(r"run \d+ started: job first", 20)
                took_s = time.monotonic() - back
                print(f"first run started {took_s:.2f} s after the database came back")
                # issue 12: dispatching within a second of the database coming back (at most one 0.5 s pause,
                # then opening the store and the first claim: 0.7-0.9 s measured); slack for a machine at load
                # 10-15 (1.9 s seen there); a backoff that kept growing would take 5 s or more
                assert took_s < 3.0
                serve.wait_for(r"run \d+ finished: job first Completed", 20)
                assert _health(metrics_port)[0] == 200
                serve.proc.terminate()
                assert serve.proc.wait(20) == 0
        finally:
            serve.stop()


@pytest.mark.timeout(60)
def test_wait_for_db_s_bounds_the_wait_and_configuration_errors_exit_2_at_once(tmp_path):
    closed = f"postgresql+psycopg://postgres@127.0.0.1:{_free_port()}/test"
    base = [sys.executable, "-m", "mjsched_isolated", "serve", "--plugins", FIXTURE_PLUGINS]
    proc = subprocess.run([*base, "--db", closed, "--wait-for-db-s", "1"], capture_output=True, text=True,
                          timeout=30, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"error: database \S+ still unreachable after [\d.]+ s \(\d+ tries, wait_for_db_s 1\)",
                     proc.stderr), proc.stderr
    assert "trying again in 0.1 s" in proc.stderr
    proc = subprocess.run([*base, "--db", closed, "--wait-for-db-s", "0"], capture_output=True, text=True,
                          timeout=30, cwd=tmp_path)
    assert proc.returncode == 1 and "trying again" not in proc.stderr, proc.stderr
    for url in ("postgresql+nosuchdriver://x@127.0.0.1/test", "sqlite:////nonexistent-dir/x/mjsched.db"):
        proc = subprocess.run([*base, "--db", url], capture_output=True, text=True, timeout=30, cwd=tmp_path)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "--db" in errors[0], proc.stderr
        assert "trying again" not in proc.stderr
