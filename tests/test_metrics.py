"""Metrics, /healthz and JSON logs of a real ``serve`` process, scraped over HTTP.

The database outage is made with a TCP proxy in this test process (127.0.0.1:<free port> -> PostgreSQL)
that is cut and restored; the shared PostgreSQL server itself is never stopped.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import FIXTURE_PLUGINS, add_job, isolated_database
from procs import serves
from prometheus_client.parser import text_string_to_metric_families

from mjsched_isolated.store import Store
from mjsched_isolated.supervisor.metrics import PrometheusMetrics

METRICS_LINE = r"metrics on http://127\.0\.0\.1:(\d+)/metrics"


@pytest.fixture
def serve():
    with serves() as start:
        yield start


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, parsed by prometheus_client: {(name, labels): value}."""
    status, text = get(port, "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.timeout(60)
def test_metrics_count_runs_latency_durations_kills_and_health(store, db_url, serve):
    add_job(store, "quick", "ok", "* * * * * *")
    add_job(store, "slow", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 30}))
    # --kill-grace-s 0: SIGKILL at the deadline, so the worker dies and its slot is refilled (with a grace,
    # a plugin without a SIGTERM handler ends at once and its worker lives on: no respawn to count)
    s = serve(db_url, "--metrics-port", "0", "--lease-timeout-s", "0.5", "--max-concurrent-jobs", "2",
              "--kill-grace-s", "0")
    port = int(s.wait_for(METRICS_LINE).group(1))
    s.wait_for(r"run \d+ finished: job slow Timeout")
    s.wait_for(r"run \d+ finished: job quick Completed")
    first = scrape(port)
    s.wait_for(r"run \d+ finished: job quick Completed")
    second = scrape(port)

    completed = value(first, "mjsched_runs_finished_total", job_type="ok", status="Completed")
    assert completed >= 1
    assert value(second, "mjsched_runs_finished_total", job_type="ok", status="Completed") > completed
    assert value(first, "mjsched_runs_finished_total", job_type="sleep", status="Timeout") == 1
    assert value(first, "mjsched_kills_total", reason="deadline") == 1
    assert value(first, "mjsched_kills_total", reason="fence") == 0
    assert value(first, "mjsched_worker_respawns_total") >= 1  # the killed worker's slot was refilled
    assert value(first, "mjsched_dispatch_latency_seconds_count") >= 2
    assert value(first, "mjsched_run_duration_seconds_count", job_type="sleep") == 1
    # killed at its 0.5 s deadline, which counts from the poll that claimed it; the recorded duration counts
    # from the claim's own database time, a few milliseconds later (more under load)
    assert value(first, "mjsched_run_duration_seconds_sum", job_type="sleep") >= 0.4
    assert value(first, "mjsched_run_duration_seconds_count", job_type="ok") >= 1
    assert value(first, "mjsched_up") == 1
    assert 0 <= value(first, "mjsched_runs_in_flight") <= 2

    status, body = get(port, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert get(port, "/nothing")[0] == 404
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(20) == 0


class Proxy:
    """A TCP forwarder 127.0.0.1:<port> -> ``target`` that can be cut (connections closed, new ones
    refused) and restored on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                return  # the listener was cut
            with self.lock:
                self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        assert self.listener is not None
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self.listener.close()
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@pytest.mark.timeout(60)
def test_healthz_is_503_naming_the_database_while_it_is_unreachable(tmp_path, serve):
    with isolated_database("postgresql", tmp_path) as url:
        direct = sa.engine.make_url(url)
        Store.open(url).close()  # the schema exists before the proxy is involved
        proxy = Proxy((direct.host, direct.port or 5432))
        proxied = direct.set(port=proxy.port).render_as_string(hide_password=False)
        try:
            s = serve(proxied, "--metrics-port", "0", "--lease-ttl-s", "5", "--lease-renew-interval-s", "0.5",
                      "--max-concurrent-jobs", "1")
            port = int(s.wait_for(METRICS_LINE).group(1))
            s.wait_for(r"job types available")  # the loop has gone round: registered, polled
            status, body = get(port, "/healthz")
            assert status == 200, body

            proxy.cut()
            s.wait_for(r"lease renewal failed", 30)
            status, body = get(port, "/healthz")
            assert status == 503
            health = json.loads(body)
            assert health["status"] == "unhealthy" and health["reason"].startswith("database unreachable")
            assert value(scrape(port), "mjsched_lease_renewal_failures_total") >= 1

            proxy.restore()
            s.wait_for(r"lease renewed again", 30)
            status, body = get(port, "/healthz")
            assert status == 200, body
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(20) == 0
        finally:
            for each in list(proxy.sockets):
                each.close()
            if proxy.listener is not None:
                proxy.listener.close()


def test_healthz_reports_a_stalled_loop_after_stall_after_s_plus_one_rescan_interval():
    metrics = PrometheusMetrics("test-1", "127.0.0.1", 0, stall_after_s=10.0, rescan_interval_s=2.0)
    metrics.loop_completed(100.0)
    assert metrics.health(111.9)[0] is True  # a long Pool.wait (up to rescan_interval_s) is not a stall
    healthy, body = metrics.health(112.5)
    assert not healthy and body["reason"].startswith("poll loop stalled")
    metrics.loop_completed(112.6)
    assert metrics.health(112.7)[0] is True
    metrics.poll("connection refused")
    assert metrics.health(112.7) == (False, {"status": "unhealthy", "instance": "test-1", "last_loop_age_s": 0.1,
                                             "reason": "database unreachable: connection refused"})
    metrics.lease_renewal(None)  # the latest round trip worked
    assert metrics.health(112.7)[0] is True



def test_the_docs_list_every_metric_and_every_label_value_the_code_exports():
    """docs/operating/metrics.md against the registry itself: a metric (or a label value created up front,
    like ``how="folded"``) the code exports but the table does not name is a doc bug."""
    metrics = PrometheusMetrics("test-1", "127.0.0.1", 0, stall_after_s=10.0, rescan_interval_s=2.0)
    for reason in ("missed", "backlog", "concurrency"):  # the reasons the dispatcher skips with
        metrics.occurrence_skipped(reason)
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operating" / "metrics.md").read_text()
    rows = {line.split("`")[1]: line for line in doc.splitlines() if line.startswith("| `mjsched_")}
    for family in metrics.registry.collect():
        name = {"counter": family.name + "_total", "info": family.name + "_info"}.get(family.type, family.name)
        assert name in rows, f"{name} is exported but not in docs/operating/metrics.md"
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label not in ("le", "instance", "version"):
                    assert f"`{value}`" in rows[name], f"{name}: label {label}={value} not in the docs' row"
    assert "job_type_unavailable" not in doc  # no longer skipped: left due for a supervisor that has the type


@pytest.mark.timeout(30)
def test_a_metrics_port_that_cannot_be_bound_is_bad_input(db_url):
    serve = [sys.executable, "-m", "mjsched_isolated", "serve", "--db", db_url, "--plugins", FIXTURE_PLUGINS]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # both refusals at once: two cold interpreters cost a loaded machine seconds each
        procs = [subprocess.Popen([*serve, "--metrics-port", str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for p in (port, 70000)]
        (_, taken_err), (_, range_err) = (p.communicate(timeout=25) for p in procs)
    bound, out_of_range = procs
    assert bound.returncode == 2
    assert taken_err.strip().splitlines() == [taken_err.strip()]  # one line
    assert taken_err.startswith("error: metrics.port: cannot listen on 127.0.0.1:")
    assert not Path(db_url.removeprefix("sqlite:///")).exists()  # refused before anything was written
    assert out_of_range.returncode == 2 and "metrics.port" in range_err


CHATTY = '''
import logging
from mjsched_isolated import BaseScheduledJob, ScheduledJobResult

class Chatty(BaseScheduledJob):
    job_type = "chatty"

    def execute(self, context):
        logging.getLogger("chatty").info("hello from the plugin")
        return ScheduledJobResult(success=True)
'''


@pytest.mark.timeout(40)
def test_json_logs_one_object_per_line_with_job_and_run_id(store, db_url, serve, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "chatty.py").write_text(CHATTY)
    add_job(store, "talk", "chatty", "0 0 1 1 *")
    s = serve(db_url, "--log-format", "json", "--max-concurrent-jobs", "1", plugins=str(plugins))
    run_id = int(s.wait_for(r'"event": "run (\d+) finished: job talk Completed').group(1))
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(r'"event": "supervisor \S+ stopped"')
    assert s.proc.wait(20) == 0

    lines = [json.loads(line) for line in s.output]  # every line is one JSON object
    assert all({"ts", "level", "logger", "event"} <= line.keys() for line in lines)
    assert all(line["ts"].endswith("Z") and len(line["ts"]) == len("2026-01-01T00:00:00.000Z") for line in lines)
    started = next(line for line in lines if line["event"].startswith(f"run {run_id} started"))
    finished = next(line for line in lines if line["event"].startswith(f"run {run_id} finished"))
    for line in (started, finished):
        assert line["job"] == "talk" and line["run_id"] == run_id and line["supervisor"]
    worker = [line for line in lines if "worker" in line]  # the worker child's own lines are JSON too
    assert all(line["worker"] > 0 for line in worker)
    # the plugin's logging record is the run's output (runs logs), not a line of the supervisor's log
    assert not [line for line in lines if line["event"] == "hello from the plugin"]
    assert "INFO chatty: hello from the plugin" in "".join(text for _, text in store.run_output(run_id))
