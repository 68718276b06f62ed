"""Tests of mjsched_isolated/plugins/http_check.py against a real HTTP server on 127.0.0.1 (loopback only)."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest
from plugin_helpers import load_plugin, make_context, run_job

from mjsched_isolated.errors import ConfigurationError

HttpCheckJob = load_plugin("http_check")


class _Handler(http.server.BaseHTTPRequestHandler):
    release: threading.Event  # set on the server class by the fixture

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        if self.path == "/ok":
            self._send(200, "hello wörld".encode())
        elif self.path == "/missing":
            self._send(404, b"no such page")
        elif self.path == "/big":
            self._send(200, b"x" * 200_000 + b"NEEDLE")
        elif self.path == "/redirect":
            self._send(302, b"", {"Location": "/ok"})
        elif self.path == "/headers":
            self._send(200, f"token={self.headers.get('X-Token')}".encode())
        elif self.path == "/slow":
            self.server.release.wait(5)  # held until the test is done; the client times out first
            self.close_connection = True  # the client has gone: answer nothing
        else:
            self._send(500, b"unexpected path")

    do_HEAD = do_GET

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self._send(201, b"got " + self.rfile.read(length))


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_ok_with_substring(base_url):
    result = run_job(HttpCheckJob, {"url": f"{base_url}/ok", "expect_substring": "wörld"})
    assert result.success, result.error_message
    d = result.details
    assert d["status"] == 200 and d["substring_found"] is True
    assert d["bytes_read"] == len("hello wörld".encode()) and d["body_truncated"] is False
    assert isinstance(d["latency_ms"], int) and d["duration_ms"] >= d["latency_ms"]


def test_missing_substring_fails(base_url):
    result = run_job(HttpCheckJob, {"url": f"{base_url}/ok", "expect_substring": "goodbye"})
    assert not result.success
    assert result.details["substring_found"] is False
    assert "'goodbye' not found" in result.error_message


def test_wrong_status_fails_with_status_recorded(base_url):
    result = run_job(HttpCheckJob, {"url": f"{base_url}/missing"})
    assert not result.success
    assert result.details["status"] == 404
    assert result.error_message == "status 404 (expected 200)"


def test_expected_error_status_succeeds_and_body_is_checked(base_url):
    result = run_job(
        HttpCheckJob, {"url": f"{base_url}/missing", "expected_status": 404, "expect_substring": "no such"}
    )
    assert result.success, result.error_message


def test_head_reads_no_body(base_url):
    result = run_job(HttpCheckJob, {"url": f"{base_url}/ok", "method": "HEAD"})
    assert result.success, result.error_message
    assert result.details["bytes_read"] == 0


def test_post_sends_body(base_url):
    result = run_job(
        HttpCheckJob,
        {"url": f"{base_url}/submit", "method": "POST", "body": "ping", "expected_status": 201,
         "expect_substring": "got ping"},
    )
    assert result.success, result.error_message


def test_headers_are_sent(base_url):
    result = run_job(
        HttpCheckJob, {"url": f"{base_url}/headers", "headers": {"X-Token": "abc"}, "expect_substring": "token=abc"}
    )
    assert result.success, result.error_message


def test_redirects_followed_or_checked(base_url):
    followed = run_job(HttpCheckJob, {"url": f"{base_url}/redirect"})
    assert followed.success and followed.details["final_url"] == f"{base_url}/ok"
    raw = run_job(HttpCheckJob, {"url": f"{base_url}/redirect", "follow_redirects": False, "expected_status": 302})
    assert raw.success, raw.error_message
    assert raw.details["status"] == 302


def test_body_read_is_capped(base_url):
    result = run_job(
        HttpCheckJob, {"url": f"{base_url}/big", "max_body_bytes": 1000, "expect_substring": "NEEDLE"}
    )
    assert not result.success
    assert result.details["bytes_read"] == 1000 and result.details["body_truncated"] is True
    assert "first 1000 bytes" in result.error_message


def test_timeout_is_a_failure(base_url):
    result = run_job(HttpCheckJob, {"url": f"{base_url}/slow", "timeout_s": 0.3})
    assert not result.success
    assert result.error_message == "timed out after 0.3s"
    assert result.details["status"] is None


def test_connection_refused_is_a_failure():
    with socket.socket() as sock:  # bound but not listening: connecting is refused, and the port stays ours
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        result = run_job(HttpCheckJob, {"url": f"http://127.0.0.1:{port}/", "timeout_s": 2})
    assert not result.success
    assert result.error_message.startswith("connection failed")
    assert result.details["status"] is None


def test_notifications(base_url):
    job = HttpCheckJob()
    context = make_context(HttpCheckJob, {"url": f"{base_url}/missing"})
    note = job.format_notification(context, job.execute(context))
    assert note.priority == "High" and "status 404" in note.body


@pytest.mark.parametrize(
    ("config", "prefix"),
    [
        ({"url": "ftp://example.invalid/x"}, "configuration.url"),
        ({"url": "http:///nohost"}, "configuration.url"),
        ({"url": "http://127.0.0.1/", "method": "DELETE"}, "configuration.method"),
        ({"url": "http://127.0.0.1/", "expected_status": 42}, "configuration.expected_status"),
        ({"url": "http://127.0.0.1/", "timeout_s": 0}, "configuration.timeout_s"),
        ({"url": "http://127.0.0.1/", "headers": {"Bad Name": "x"}}, "configuration.headers"),
        ({"url": "http://127.0.0.1/", "headers": {"X": "a\r\nb"}}, "configuration.headers"),
        ({"url": "http://127.0.0.1/", "method": "HEAD", "expect_substring": "x"}, "configuration.expect_substring"),
        ({"url": "http://127.0.0.1/", "body": "x"}, "configuration.body"),
    ],
)
def test_bad_configuration_names_the_field(config, prefix):
    with pytest.raises(ConfigurationError) as info:
        make_context(HttpCheckJob, config)
    assert str(info.value).startswith(prefix), str(info.value)


def test_slowly_dripping_body_is_abandoned_at_timeout_s():
    """A server sending one byte every 50 ms must not keep the check past its timeout_s."""
    import http.server
    import threading
    import time as _time

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                for _ in range(100000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    _time.sleep(0.05)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = _time.monotonic()
        result = run_job(load_plugin("http_check"),
                         {"url": f"http://127.0.0.1:{server.server_port}/", "timeout_s": 1.0})
        assert _time.monotonic() - started < 3.0
        assert result.success is False and "timed out" in result.error_message
    finally:
        server.shutdown()
        server.server_close()
