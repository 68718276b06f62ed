"""Prometheus metrics and ``/healthz`` for one supervisor, served on ``settings.metrics.host:port``.

Off unless ``metrics.port`` is set: the supervisor then holds a :class:`Metrics` whose methods do nothing.
On, it holds a :class:`PrometheusMetrics` with a *private* ``CollectorRegistry`` (two supervisors in one
process never share counters) served by a stdlib ``ThreadingHTTPServer`` on a daemon thread:

* ``GET /metrics``: the Prometheus text format (``prometheus_client.exposition.generate_latest``).
* ``GET /healthz``: 200 ``{"status": "ok", ...}``, or 503 ``{"status": "unhealthy", "reason": ...}`` when
  the poll loop is stalled or the database was unreachable at the latest poll or lease renewal.

The supervisor calls the small methods below from its single thread (one line per hook); the HTTP thread
only reads. Durations are seconds (Prometheus convention). Stall rule: the loop records a monotonic time
at the end of every step/wait cycle and sleeps at most ``rescan_interval_s`` between cycles, so it is
stalled when no cycle completed for ``stall_after_s + rescan_interval_s``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mjsched_isolated._version import __version__
from mjsched_isolated.errors import InputError

log = logging.getLogger("mjsched.metrics")

# from a few ms (an idle worker picking up a due job) to minutes (a backlog, a slow pool)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0)
KILL_REASONS = ("deadline", "cpu", "fence", "shutdown", "cancel", "replace")


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    """The metrics server on an IPv6 ``host`` (a host with ``:``)."""

    address_family = socket.AF_INET6


class Metrics:
    """The hooks the supervisor, pool and liveness lease call. This base class records nothing: it is
    what a supervisor without ``metrics.port`` holds, so every call site stays a plain one-liner."""

    def start_server(self) -> None:
        """Start serving ``/metrics`` and ``/healthz`` (no-op here)."""

    def stop_server(self) -> None:
        """Stop the HTTP server (no-op here)."""

    def track_inflight(self, count: Callable[[], int]) -> None:
        """``count()`` is read at scrape time for ``mjsched_runs_in_flight``."""

    def run_started(self, latency_s: float | None) -> None:
        """A run was claimed and handed to a worker ``latency_s`` after its scheduled time (None: manual)."""

    def run_finished(self, job_type: str, status: str, duration_s: float) -> None:
        """A run's terminal state was recorded (Completed, Failed, Timeout or Cancelled)."""

    def run_killed(self, reason: str) -> None:
        """A run's process tree was killed; ``reason`` is one of :data:`KILL_REASONS`."""

    def occurrence_skipped(self, reason: str, count: int = 1) -> None:
        """``count`` due occurrences were not run (``missed``, ``backlog``, ``concurrency``), counted in
        the job's ``skipped_count``."""

    def occurrences_missed(self, how: str, count: int) -> None:
        """``count`` occurrences the missed-run policy ``folded`` into a catch-up run or ``dropped``
        (counted in the job's ``missed_count``)."""

    def worker_respawned(self) -> None:
        """The pool started a new child in a vacated slot."""

    def lease_renewal(self, error: str | None) -> None:
        """A liveness-lease renewal was attempted: ``error`` is None on success, else a one-line reason."""

    def poll(self, error: str | None) -> None:
        """A poll of the jobs table ended: ``error`` is None on success, else a one-line reason."""

    def notification_failed(self, channel: str) -> None:
        """A notification could not be delivered on ``channel`` (``email``, ``webhook``)."""

    def loop_completed(self, mono: float) -> None:
        """The poll loop finished a step/wait cycle at monotonic time ``mono``."""


class PrometheusMetrics(Metrics):
    """Metrics of one supervisor (``instance``), on a private registry, served on ``host:port`` (port 0:
    a free port, see :attr:`address`). ``stall_after_s`` and ``rescan_interval_s`` give the stall bound."""

    def __init__(self, instance: str, host: str, port: int, stall_after_s: float, rescan_interval_s: float) -> None:
        # prometheus_client is loaded only by a supervisor that serves metrics (metrics.port set)
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info  # noqa: PLC0415 - above

        self.instance, self.host, self.port = instance, host, port
        self.stall_bound_s = stall_after_s + rescan_interval_s
        self.registry = r = CollectorRegistry()
        self.up = Gauge("mjsched_up", "1 while this supervisor's metrics server runs", registry=r)
        self.up.set(1)
        Info("mjsched_build", "version of mjsched_isolated", registry=r).info(
            {"version": __version__, "instance": instance})
        self.runs_finished = Counter("mjsched_runs_finished", "runs whose terminal state was recorded",
                                     ["job_type", "status"], registry=r)
        self.runs_in_flight = Gauge("mjsched_runs_in_flight", "runs executing in this supervisor's workers",
                                    registry=r)
        self.dispatch_latency = Histogram("mjsched_dispatch_latency_seconds",
                                          "run started_at - scheduled_at (scheduled runs only)",
                                          buckets=LATENCY_BUCKETS_S, registry=r)
        self.run_duration = Histogram("mjsched_run_duration_seconds", "run completed_at - started_at",
                                      ["job_type"], buckets=DURATION_BUCKETS_S, registry=r)
        self.kills = Counter("mjsched_kills", "runs whose process tree was killed", ["reason"], registry=r)
        for reason in KILL_REASONS:
            self.kills.labels(reason)
        self.skipped = Counter("mjsched_occurrences_skipped", "due occurrences not run", ["reason"], registry=r)
        self.missed = Counter("mjsched_occurrences_missed", "occurrences the missed-run policy folded into a "
                              "catch-up run or dropped", ["how"], registry=r)
        for how in ("folded", "dropped"):
            self.missed.labels(how)
        self.respawns = Counter("mjsched_worker_respawns", "worker children started in vacated slots", registry=r)
        self.renewal_failures = Counter("mjsched_lease_renewal_failures", "failed liveness-lease renewals",
                                        registry=r)
        self.poll_failures = Counter("mjsched_poll_failures", "polls of the jobs table that failed", registry=r)
        self.notification_failures = Counter("mjsched_notification_failures", "failed notification delivery attempts",
                                             ["channel"], registry=r)
        self.last_loop_mono = time.monotonic()
        self.database_error: str | None = None  # of the latest poll or lease renewal; None if it worked
        self.address: tuple[str, int] | None = None
        self._server: ThreadingHTTPServer | None = None

    # -- hooks -------------------------------------------------------------------------------------
    def track_inflight(self, count: Callable[[], int]) -> None:
        self.runs_in_flight.set_function(count)

    def run_started(self, latency_s: float | None) -> None:
        if latency_s is not None:
            self.dispatch_latency.observe(max(0.0, latency_s))

    def run_finished(self, job_type: str, status: str, duration_s: float) -> None:
        self.runs_finished.labels(job_type, status).inc()
        self.run_duration.labels(job_type).observe(max(0.0, duration_s))

    def run_killed(self, reason: str) -> None:
        self.kills.labels(reason).inc()

    def occurrence_skipped(self, reason: str, count: int = 1) -> None:
        self.skipped.labels(reason).inc(count)

    def occurrences_missed(self, how: str, count: int) -> None:
        self.missed.labels(how).inc(count)

    def worker_respawned(self) -> None:
        self.respawns.inc()

    def lease_renewal(self, error: str | None) -> None:
        self.database_error = error  # the latest database round trip decides
        if error is not None:
            self.renewal_failures.inc()

    def poll(self, error: str | None) -> None:
        self.database_error = error
        if error is not None:
            self.poll_failures.inc()

    def notification_failed(self, channel: str) -> None:
        self.notification_failures.labels(channel).inc()

    def loop_completed(self, mono: float) -> None:
        self.last_loop_mono = mono

    # -- health ------------------------------------------------------------------------------------
    def health(self, mono: float) -> tuple[bool, dict]:
        """(healthy, JSON body) at monotonic time ``mono``. Unhealthy when the database failed at the latest
        poll or lease renewal (whichever came last), or no loop cycle completed within
        ``stall_after_s + rescan_interval_s``."""
        age_s = round(mono - self.last_loop_mono, 3)
        body = {"instance": self.instance, "last_loop_age_s": age_s}
        if self.database_error is not None:
            return False, {"status": "unhealthy", "reason": f"database unreachable: {self.database_error}", **body}
        if age_s > self.stall_bound_s:
            return False, {"status": "unhealthy",
                           "reason": f"poll loop stalled: no completed step for {age_s:.1f} s", **body}
        return True, {"status": "ok", **body}

    # -- HTTP --------------------------------------------------------------------------------------
    def start_server(self) -> None:
        """Bind and serve on a daemon thread; logs the URL. Raises :class:`InputError` (``metrics.port``)
        if the address cannot be bound. A second call does nothing (``serve`` binds before it writes)."""
        if self._server is not None:
            return
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                metrics._handle(self)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not logged
                pass

        server_class = _ThreadingHTTPServer6 if ":" in self.host else ThreadingHTTPServer
        try:
            self._server = server_class((self.host, self.port), Handler)
        except OSError as exc:
            raise InputError("metrics.port",
                             f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self._server.daemon_threads = True
        bound_host, bound_port = self._server.server_address[:2]  # an IPv6 address has 4 fields
        self.address = (str(bound_host), bound_port)  # str already: bytes are for AF_UNIX only
        threading.Thread(target=self._server.serve_forever, name="mjsched-metrics", daemon=True).start()
        shown = f"[{self.address[0]}]" if ":" in self.address[0] else self.address[0]
        log.info("metrics on http://%s:%d/metrics (health: /healthz)", shown, self.address[1])

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        # loaded with PrometheusMetrics, see __init__
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest  # noqa: PLC0415 - above

        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            status, content_type, payload = 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        elif path == "/healthz":
            healthy, body = self.health(time.monotonic())
            status, content_type, payload = 200 if healthy else 503, "application/json", json.dumps(body).encode()
        else:
            status, content_type, payload = 404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n"
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)


def for_settings(settings) -> Metrics:
    """A :class:`PrometheusMetrics` when ``settings.metrics.port`` is set, else the no-op :class:`Metrics`."""
    if settings.metrics.port is None:
        return Metrics()
    return PrometheusMetrics(settings.instance, settings.metrics.host, settings.metrics.port,
                             settings.metrics.stall_after_s, settings.rescan_interval_s)
