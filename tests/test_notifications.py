"""Notifications: the durable outbox, the sender, and real channels (aiosmtpd SMTP, stdlib HTTP server)."""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import hmac
import json
import queue
import signal
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sqlalchemy as sa
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from conftest import add_job, isolated_database
from procs import Serve
from waiting import wait_until

from mjsched_isolated import notices
from mjsched_isolated.config import EmailChannel, Notifications, WebhookChannel
from mjsched_isolated.store import Store
from mjsched_isolated.supervisor.channels import DeliveryError, SmtpChannel, WebhookPost
from mjsched_isolated.supervisor.clock import utcnow
from mjsched_isolated.supervisor.notifier import Notifier, backoff_s

SECRET = "s3cr3t-hmac-key"
PASSWORD = "hunter2-smtp-pass"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- real servers -----------------------------------------------------------------------------------
class WebhookServer:
    """A stdlib HTTP server in a thread; every POST lands in ``received`` as (headers, raw body)."""

    def __init__(self, port: int = 0, status: int = 200) -> None:
        received: queue.Queue = queue.Queue()
        self.received = received
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.put((dict(self.headers), body))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Inbox:
    """aiosmtpd handler: every message lands in ``messages`` as (envelope recipients, parsed message)."""

    def __init__(self) -> None:
        self.messages: queue.Queue = queue.Queue()

    async def handle_DATA(self, server, session, envelope):
        import email

        self.messages.put((list(envelope.rcpt_tos), email.message_from_bytes(envelope.content), session))
        return "250 OK"


def smtp_server(**kwargs) -> tuple[Controller, Inbox]:
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port(), **kwargs)
    controller.start()
    return controller, inbox


def _authenticator(server, session, envelope, mechanism, auth_data):
    ok = auth_data.login == b"mailer" and auth_data.password == PASSWORD.encode()
    return AuthResult(success=ok)


ROW = {"id": 1, "channel": "email", "event": "Failure", "job_id": 7, "job_name": "nightly", "run_id": 42,
       "subject": "nightly failed", "body": "Run 42 failed: disk full", "priority": "High", "recipients": None,
       "details": '{"status": "Failed"}', "created_at": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC), "attempts": 1}


# -- channels ----------------------------------------------------------------------------------------
@pytest.mark.timeout(20)
def test_email_plain_and_auth_against_a_real_smtp_server():
    controller, inbox = smtp_server()
    try:
        channel = SmtpChannel(EmailChannel(host="127.0.0.1", port=controller.port, sender="sched@example.org",
                                           recipients=["ops@example.org"]))
        channel.deliver(ROW)
        rcpts, msg, _ = inbox.messages.get(timeout=5)
        assert rcpts == ["ops@example.org"]
        assert msg["Subject"] == "nightly failed" and msg["From"] == "sched@example.org"
        assert msg["X-Priority"].startswith("1")
        assert "disk full" in msg.get_payload() and '"status": "Failed"' in msg.get_payload()
        channel.deliver({**ROW, "recipients": json.dumps(["a@x.org", "b@y.org"])})  # the job's own recipients
        assert inbox.messages.get(timeout=5)[0] == ["a@x.org", "b@y.org"]
    finally:
        controller.stop()

    controller, inbox = smtp_server(authenticator=_authenticator, auth_require_tls=False,
                                    auth_exclude_mechanism=["LOGIN"])
    try:
        good = EmailChannel(host="127.0.0.1", port=controller.port, sender="s@x.org", recipients=["o@x.org"],
                            username="mailer", password=PASSWORD)
        SmtpChannel(good).deliver(ROW)
        assert inbox.messages.get(timeout=5)[2].authenticated
        bad = EmailChannel(host="127.0.0.1", port=controller.port, sender="s@x.org", recipients=["o@x.org"],
                           username="mailer", password="wrong-" + PASSWORD, timeout_s=1)
        with pytest.raises(DeliveryError) as err:  # (aiosmtpd 1.4 answers a bad login by not answering)
            SmtpChannel(bad).deliver(ROW)
        assert str(err.value).startswith("SMTP 127.0.0.1") and PASSWORD not in str(err.value)
        assert inbox.messages.empty()
    finally:
        controller.stop()
    with pytest.raises(DeliveryError) as err:  # nobody to send to: permanent, no retry
        SmtpChannel(EmailChannel(host="127.0.0.1", port=1, sender="s@x.org")).deliver(ROW)
    assert err.value.permanent


@pytest.mark.timeout(20)
def test_email_starttls_with_a_self_signed_certificate(tmp_path: Path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=15)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    controller, inbox = smtp_server(tls_context=context, require_starttls=True, authenticator=_authenticator)
    try:
        config = EmailChannel(host="127.0.0.1", port=controller.port, sender="s@x.org", recipients=["o@x.org"],
                              security="starttls", username="mailer", password=PASSWORD)
        with pytest.raises(DeliveryError) as err:  # the certificate is not trusted yet: verified, refused
            SmtpChannel(config).deliver(ROW)
        assert "CERTIFICATE_VERIFY_FAILED" in str(err.value) and PASSWORD not in str(err.value)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        SmtpChannel(config).deliver(ROW)
        _, msg, session = inbox.messages.get(timeout=5)
        assert msg["Subject"] == "nightly failed" and session.authenticated and session.ssl
        with pytest.raises(DeliveryError):  # plain SMTP to a server requiring STARTTLS fails
            SmtpChannel(EmailChannel(host="127.0.0.1", port=controller.port, sender="s@x.org",
                                     recipients=["o@x.org"])).deliver(ROW)
    finally:
        controller.stop()


@pytest.mark.timeout(20)
def test_webhook_posts_signed_json_and_keeps_secrets_out_of_errors():
    server = WebhookServer()
    try:
        WebhookPost(WebhookChannel(url=server.url, secret=SECRET)).deliver({**ROW, "channel": "webhook"})
        headers, body = server.received.get(timeout=5)
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert headers["X-Mjsched-Signature"] == expected
        assert headers["Content-Type"] == "application/json"
        assert headers["X-Mjsched-Delivery"] == str(ROW["id"])  # the same on every attempt: receivers dedupe
        assert json.loads(body) == {"id": ROW["id"], "event": "Failure", "job": "nightly", "run_id": 42,
                                    "subject": "nightly failed",
                                    "body": "Run 42 failed: disk full", "priority": "High",
                                    "details": {"status": "Failed"}, "created_at": "2026-01-02T03:04:05Z"}
        WebhookPost(WebhookChannel(url=server.url)).deliver(ROW)
        assert "X-Mjsched-Signature" not in server.received.get(timeout=5)[0]
        server.status = 500
        with pytest.raises(DeliveryError) as err:
            WebhookPost(WebhookChannel(url=server.url + "?token=" + SECRET, secret=SECRET)).deliver(ROW)
        assert "HTTP 500" in str(err.value) and SECRET not in str(err.value)
    finally:
        server.close()
    with pytest.raises(DeliveryError) as err:  # nobody listening
        WebhookPost(WebhookChannel(url=f"http://127.0.0.1:{free_port()}/x?key={SECRET}", timeout_s=2)).deliver(ROW)
    assert "refused" in str(err.value).lower() and SECRET not in str(err.value)


def test_backoff_doubles_up_to_its_cap_with_small_jitter():
    assert [backoff_s(n, 5, 600, rand=lambda: 0.0) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert backoff_s(30, 5, 600, rand=lambda: 0.0) == 600
    assert backoff_s(1, 5, 600, rand=lambda: 1.0) == pytest.approx(5.5)


# -- the outbox in the store -----------------------------------------------------------------------
def _notice_rows(job: dict, run_id: int | None, channels=("log", "webhook"), event="Failure") -> list[dict]:
    return notices.outbox_rows(notices.Notice(event=event, job_id=job["id"], job_name=job["name"], run_id=run_id,
                                              subject="s", body="b", priority="High"), channels)


@pytest.mark.timeout(60)
def test_outbox_rows_are_written_in_the_finish_run_transaction(any_store: Store):
    store = any_store
    now = store.db_now()
    job = add_job(store, "j", "fail", "0 0 1 1 *", now=now)
    claim = store.claim(job, now=now, next_run_at=now + dt.timedelta(hours=1), instance="me", lease_s=60,
                        deadline_at=now + dt.timedelta(minutes=5), scheduled_at=job["next_run_at"])
    assert claim is not None
    bad = [*_notice_rows(job, claim.run_id), {**_notice_rows(job, claim.run_id)[0], "event": "Bogus"}]
    with pytest.raises(sa.exc.DBAPIError):  # the CHECK constraint rejects the last row: the whole transaction goes
        store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                         error_message="x", details=None, duration_ms=1.0, notices=bad)
    assert store.get_run(claim.run_id)["status"] == "Running"
    assert store.get_job("j")["failure_count"] == 0 and store.list_notifications() == []
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                            error_message="x", details=None, duration_ms=1.0, notices=_notice_rows(job, claim.run_id))
    rows = store.list_notifications()
    assert [(r["channel"], r["status"], r["attempts"], r["run_id"]) for r in rows] == [
        ("log", "Pending", 0, claim.run_id), ("webhook", "Pending", 0, claim.run_id)]
    assert all(r["created_at"] is not None and r["next_attempt_at"] is not None for r in rows)
    # a run no longer Running is not finished again, and writes no notice
    assert not store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                                error_message="x", details=None, duration_ms=1.0,
                                notices=_notice_rows(job, claim.run_id))
    assert len(store.list_notifications()) == 2
    # a claim is one conditional UPDATE: the second claimant loses; settling needs the claim
    first = rows[0]["id"]
    assert (store.claim_notification(first, "a", 60) or {})["attempts"] == 1
    assert store.claim_notification(first, "b", 60) is None
    assert not store.notification_sent(first, "b")
    assert store.notification_sent(first, "a")
    assert store.list_notifications(status="Sent")[0]["sent_at"] is not None


@pytest.mark.timeout(20)
def test_abandoned_runs_write_failure_notices_for_jobs_that_want_them(store: Store):
    now = store.db_now()
    for name, notify in (("wants", True), ("quiet", False)):
        job = add_job(store, name, "ok", "0 0 1 1 *", now=now, notify_on_failure=notify,
                      notify_recipients=json.dumps(["x@y.org"]))
        store.claim(job, now=now, next_run_at=now + dt.timedelta(hours=1), instance="ghost-1", lease_s=60,
                    deadline_at=now + dt.timedelta(minutes=5), scheduled_at=job["next_run_at"])
    abandoned = store.abandon_orphaned_runs(
        notices_for=lambda run: notices.outbox_rows(notices.for_abandoned(run), ["log", "email"]))
    assert len(abandoned) == 2
    rows = store.list_notifications()
    assert [(r["job_name"], r["channel"], r["event"], r["priority"]) for r in rows] == [
        ("wants", "log", "Failure", "High"), ("wants", "email", "Failure", "High")]
    assert "abandoned" in rows[0]["body"] and json.loads(rows[1]["recipients"]) == ["x@y.org"]


# -- the sender ----------------------------------------------------------------------------------------
@pytest.mark.timeout(40)
def test_two_senders_racing_on_postgresql_deliver_each_row_once(tmp_path: Path):
    server = WebhookServer()
    with isolated_database("postgresql", tmp_path) as url:
        stores = [Store.open(url), Store.open(url)]
        try:
            now = stores[0].db_now()
            job = add_job(stores[0], "j", "ok", "0 0 1 1 *", now=now)
            rows = [r for i in range(60) for r in _notice_rows({**job}, i, channels=("webhook",))]
            assert stores[0].set_next_run_at(job["id"], job["next_run_at"], None, now, notices=rows)
            config = Notifications(log=False, webhook=WebhookChannel(url=server.url))
            senders = [Notifier(s, config, f"sender-{i}", poll_interval_s=0.02, batch_size=60)
                       for i, s in enumerate(stores)]
            for sender in senders:
                sender.start()
            wait_until(lambda: len(stores[0].list_notifications(status="Sent")) == 60, 30, "all rows Sent")
            for sender in senders:
                assert sender.stop(5)
            seen: collections.Counter[int] = collections.Counter()
            while not server.received.empty():
                seen[json.loads(server.received.get()[1])["run_id"]] += 1
            assert seen == collections.Counter(range(60))  # every row exactly once
            assert all(s.delivered > 0 for s in senders), [s.delivered for s in senders]  # a real race
            assert {r["attempts"] for r in stores[0].list_notifications()} == {1}
        finally:
            for s in stores:
                s.close()
            server.close()


@pytest.mark.timeout(40)
def test_a_failing_channel_never_changes_the_run_and_gives_up_after_max_attempts(driver_factory, store: Store):
    server = WebhookServer(status=500)
    failures: list[str] = []
    try:
        config = Notifications(webhook=WebhookChannel(url=server.url, secret=SECRET), max_attempts=3,
                               retry_backoff_s=0.01, retry_backoff_max_s=0.05)
        d = driver_factory(notifications=config)
        sender = Notifier(store, config, "sender", poll_interval_s=0.02, on_delivery_failure=failures.append).start()
        d.supervisor.notifier = sender
        add_job(store, "broken", "fail", "0 0 1 1 *")
        d.until(lambda: [r for r in store.list_runs(job_name="broken") if r["status"] != "Running"])
        wait_until(lambda: store.list_notifications(status="Failed"), 15, "webhook row Failed")
        assert sender.stop(5)
        run = store.list_runs(job_name="broken")[0]
        assert (run["status"], run["success"], run["error_message"]) == ("Failed", False, "it did not work")
        by_channel = {r["channel"]: r for r in store.list_notifications()}
        assert by_channel["log"]["status"] == "Sent" and by_channel["log"]["attempts"] == 1
        hook = by_channel["webhook"]
        assert (hook["status"], hook["attempts"]) == ("Failed", 3)
        assert "HTTP 500" in hook["last_error"] and SECRET not in hook["last_error"]
        assert failures == ["webhook"] * 3 and server.received.qsize() == 3
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_outcomes_that_notify_and_the_text_they_carry(driver_factory, store: Store):
    d = driver_factory(lease_timeout_s=1.5, max_concurrent_jobs=4,
                       notifications=Notifications(webhook=WebhookChannel(url="http://127.0.0.1:9/never")))
    now = utcnow()
    add_job(store, "fails", "fail", "0 0 1 1 *")
    add_job(store, "raises", "boom", "0 0 1 1 *")
    add_job(store, "crashes", "exit", "0 0 1 1 *")
    add_job(store, "hangs", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 30}))
    d.until(lambda: all(store.list_runs(job_name=n) and store.list_runs(job_name=n)[0]["status"] != "Running"
                        for n in ("fails", "raises", "crashes", "hangs")), 30)
    add_job(store, "ok-quiet", "ok", "0 0 1 1 *")
    add_job(store, "ok-loud", "ok", "0 0 1 1 *", notify_on_success=True, notify_recipients=json.dumps(["a@b.org"]))
    add_job(store, "fancy", "fancy_notice", "0 0 1 1 *", notify_on_success=True)
    add_job(store, "bad-format", "bad_notice", "0 0 1 1 *", notify_on_success=True)
    add_job(store, "missed", "ok", "* * * * *", next_run_at=now - dt.timedelta(hours=1), missed_run_policy="Skip",
            notify_on_missed=True)
    add_job(store, "busy", "sleep", "* * * * * *", configuration=json.dumps({"seconds": 30}), notify_on_missed=True,
            notify_on_failure=False)
    add_job(store, "cancel-me", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 30}), max_runtime_minutes=1)
    names = ("ok-quiet", "ok-loud", "fancy", "bad-format")
    d.until(lambda: all(store.list_runs(job_name=n) and store.list_runs(job_name=n)[0]["status"] != "Running"
                        for n in names) and any(r["event"] == "Skipped" for r in store.list_notifications())
            and store.list_runs(job_name="cancel-me"), 30)
    d.supervisor.cancel_all(d.supervisor.read_clock()[0], "interrupted by shutdown")  # Cancelled: no notice
    assert store.list_runs(job_name="cancel-me")[0]["status"] == "Cancelled"
    rows = [r for r in store.list_notifications() if r["channel"] == "webhook"]
    assert len(store.list_notifications()) == 2 * len(rows)  # one row per channel: log and webhook
    by_job = {r["job_name"]: r for r in rows}
    assert set(by_job) == {"fails", "raises", "crashes", "hangs", "ok-loud", "fancy", "bad-format", "missed", "busy"}
    assert {n: by_job[n]["event"] for n in by_job} == {
        "fails": "Failure", "raises": "Failure", "crashes": "Failure", "hangs": "Failure", "ok-loud": "Success",
        "fancy": "Success", "bad-format": "Success", "missed": "Missed", "busy": "Skipped"}
    assert by_job["fails"]["priority"] == "High" and "it did not work" in by_job["fails"]["body"]
    fails_run = store.list_runs(job_name="fails")[0]
    assert json.loads(by_job["fails"]["details"])["scheduled_at"] == fails_run["scheduled_at"].isoformat().replace(
        "+00:00", "Z")
    assert "kaboom" in by_job["raises"]["body"]
    assert "died during the run" in by_job["crashes"]["body"]
    assert "timed out" in by_job["hangs"]["subject"] and json.loads(by_job["hangs"]["details"])["status"] == "Timeout"
    assert json.loads(by_job["ok-loud"]["recipients"]) == ["a@b.org"]
    assert (by_job["fancy"]["subject"], by_job["fancy"]["body"], by_job["fancy"]["priority"]) == (
        "fancy fancy ok", "custom body", "Low")
    assert json.loads(by_job["fancy"]["details"])["custom"] == 1
    # format_notification raised: the run is recorded as executed and the default notice is used
    bad_run = store.list_runs(job_name="bad-format")[0]
    assert (bad_run["status"], bad_run["details"]) == ("Completed", {"kept": True})
    assert by_job["bad-format"]["subject"] == "Scheduled job 'bad-format' completed"
    assert sum(r["job_name"] == "busy" for r in rows) >= 1 and all(
        r["event"] == "Skipped" for r in rows if r["job_name"] == "busy")


@pytest.mark.parametrize("channel", [True, False])
def test_a_run_request_asks_for_the_plugin_notice_only_where_one_is_sent(mem_store, fake_factory, channel):
    """The worker formats the plugin's notice only for an outcome that is notified (issue 11): a channel is on
    and the job notifies on that outcome, as :func:`notices.for_run` judges."""
    on = Notifications(webhook=WebhookChannel(url="http://127.0.0.1:9/never")) if channel else Notifications(log=False)
    d = fake_factory(max_concurrent_jobs=3, notifications=on)
    add_job(mem_store, "quiet", "ok", "0 0 1 1 *")
    add_job(mem_store, "loud", "ok", "0 0 1 1 *", notify_on_success=True)
    add_job(mem_store, "mute", "ok", "0 0 1 1 *", notify_on_failure=False)
    d.until(lambda: len(d.pool.submitted) == 3, 10)
    asked = {r.job_name: (r.notice_on_success, r.notice_on_failure) for r in d.pool.submitted}
    assert asked == ({"quiet": (False, True), "loud": (True, True), "mute": (False, False)} if channel else
                     dict.fromkeys(("quiet", "loud", "mute"), (False, False)))


# -- through a real serve process ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_failing_job_emails_and_a_webhook_notice_survives_a_restart(store: Store, db_url: str, monkeypatch):
    controller, inbox = smtp_server()
    hook_port = free_port()  # nobody listens here yet: the webhook is down
    for key, value in {"EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(controller.port), "EMAIL_SENDER": "s@x.org",
                       "EMAIL_RECIPIENTS": "ops@x.org,dev@x.org", "WEBHOOK_URL": f"http://127.0.0.1:{hook_port}/h",
                       "WEBHOOK_SECRET": SECRET, "RETRY_BACKOFF_S": "0.1", "RETRY_BACKOFF_MAX_S": "0.3",
                       "MAX_ATTEMPTS": "1000"}.items():
        monkeypatch.setenv(f"MJSCHED_NOTIFICATIONS_{key}", value)
    add_job(store, "broken", "fail", "0 0 1 1 *")
    first = Serve(db_url, "--lease-ttl-s", "3", "--lease-renew-interval-s", "1", "--max-concurrent-jobs", "1")
    server = None
    try:
        first.wait_for(r"run \d+ finished: job broken Failed", 30)
        rcpts, msg, _ = inbox.messages.get(timeout=15)
        assert sorted(rcpts) == ["dev@x.org", "ops@x.org"] and msg["Subject"] == "Scheduled job 'broken' failed"
        assert "it did not work" in msg.get_payload()
        wait_until(lambda: any(r["channel"] == "webhook" and r["attempts"] >= 2 for r in store.list_notifications()),
                   15, "webhook retried")
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(15) == 0
        hook = next(r for r in store.list_notifications() if r["channel"] == "webhook")
        assert hook["status"] == "Pending" and "Connection refused" in hook["last_error"]
        assert SECRET not in "".join(first.output)
        server = WebhookServer(port=hook_port)
        second = Serve(db_url, "--lease-ttl-s", "3", "--lease-renew-interval-s", "1", "--max-concurrent-jobs", "1")
        try:
            headers, body = server.received.get(timeout=20)
            assert json.loads(body)["job"] == "broken" and json.loads(body)["event"] == "Failure"
            assert headers["X-Mjsched-Signature"] == "sha256=" + hmac.new(SECRET.encode(), body,
                                                                           hashlib.sha256).hexdigest()
            wait_until(lambda: {r["status"] for r in store.list_notifications()} == {"Sent"}, 10, "all Sent")
        finally:
            second.stop()
        assert inbox.messages.empty()  # the email went once, before the restart
        assert store.list_runs(job_name="broken")[0]["status"] == "Failed"
    finally:
        first.stop()
        controller.stop()
        if server:
            server.close()


@pytest.mark.timeout(60)
def test_awkward_plugin_output_is_recorded_on_postgresql_not_retried_forever(tmp_path):
    """NUL bytes (PostgreSQL refuses them in text), a CR/LF subject and 100-bit integers from a plugin: the
    run is still recorded at once with its real outcome, and its notice is one clean header line."""
    from conftest import Driver

    with isolated_database("postgresql", tmp_path) as url:
        store = Store.open(url)
        d = Driver(store, url, notifications=Notifications(webhook=WebhookChannel(url="http://127.0.0.1:9/never")))
        try:
            d.start()
            add_job(store, "awkward-fails", "awkward", "0 0 1 1 *")
            add_job(store, "awkward-succeeds", "awkward", "0 0 1 1 *", configuration=json.dumps({"succeed": True}),
                    notify_on_success=True)
            names = ("awkward-fails", "awkward-succeeds")
            d.until(lambda: all(store.list_runs(job_name=n) and store.list_runs(job_name=n)[0]["status"] != "Running"
                                for n in names), 30)
            assert not d.supervisor.pending  # nothing kept for a retry that could never succeed
        finally:
            d.close()
        failed = store.list_runs(job_name="awkward-fails")[0]
        ok = store.list_runs(job_name="awkward-succeeds")[0]
        assert failed["status"] == "Failed" and failed["error_message"] == "bad\ufffdbyte"
        assert ok["status"] == "Completed", ok  # unencodable metadata never turns a success into a failure
        assert ok["details"]["big"] == str(10**30) and ok["details"]["nul"] == "a\x00b"
        notes = {r["job_name"]: r for r in store.list_notifications() if r["channel"] == "webhook"}
        for name in names:
            assert notes[name]["subject"] == "line1 Bcc: evil@example.org"
            assert notes[name]["body"] == "body\ufffdwith nul"
            assert json.loads(notes[name]["details"])["big"] == str(10**30)
        store.close()


@pytest.mark.timeout(60)
def test_a_result_the_database_refuses_is_recorded_without_the_plugin_text(tmp_path):
    """The supervisor's own guard, below the child's: a refused value (here a NUL byte handed straight to
    record on PostgreSQL) is a permanent error, recorded at once without the text, never retried forever."""
    from conftest import Driver

    with isolated_database("postgresql", tmp_path) as url:
        store = Store.open(url)
        d = Driver(store, url, notifications=Notifications(webhook=WebhookChannel(url="http://127.0.0.1:9/never")))
        try:
            d.start()
            add_job(store, "refused", "sleep", "0 0 1 1 *", configuration=json.dumps({"seconds": 30}))
            d.until(lambda: bool(d.supervisor.inflight), 20)
            flight = d.supervisor.inflight.pop(next(iter(d.supervisor.inflight)))
            d.pool.kill(flight.worker)
            d.supervisor.record(flight, d.supervisor.read_clock()[0], status="Failed", success=False,
                                error_message="refused\x00text", details={"k": 1})
            assert not d.supervisor.pending
        finally:
            d.close()
        run = store.list_runs(job_name="refused")[0]
        assert run["status"] == "Failed" and run["details"] is None
        assert run["error_message"].startswith("result refused by the database")
        assert "ended Failed" in run["error_message"]
        assert not [r for r in store.list_notifications() if r["job_name"] == "refused"]
        store.close()


@pytest.mark.timeout(30)
def test_a_black_holed_webhook_holds_up_no_other_channel_and_foreign_channels_wait(store: Store):
    """Each channel has its own sender thread: a webhook that accepts and never answers costs its own rows
    their timeout, while log notices go out at once; a row for a channel this supervisor lacks (email) is
    never claimed here, so it waits, untouched, for a supervisor that has it."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts (the kernel does) and never answers
    try:
        now = store.db_now()
        job = add_job(store, "j", "ok", "0 0 1 1 *", now=now)
        rows = [r for i in range(5) for r in _notice_rows({**job}, i, channels=("webhook", "log", "email"))]
        assert store.set_next_run_at(job["id"], job["next_run_at"], None, now, notices=rows)
        config = Notifications(webhook=WebhookChannel(url=f"http://127.0.0.1:{hole.getsockname()[1]}/x", timeout_s=3))
        sender = Notifier(store, config, "s", poll_interval_s=0.05).start()
        try:
            wait_until(lambda: len([r for r in store.list_notifications(status="Sent") if r["channel"] == "log"]) == 5,
                       2.5, "every log notice sent while the first webhook delivery still waits")
            by_channel = collections.defaultdict(list)
            for r in store.list_notifications():
                by_channel[r["channel"]].append(r)
            assert not any(r["status"] == "Sent" for r in by_channel["webhook"])
            assert all(r["status"] == "Pending" and r["attempts"] == 0 and r["claimed_by"] is None
                       for r in by_channel["email"])
        finally:
            sender.stop(0.1)
    finally:
        hole.close()


def test_email_and_webhook_carry_the_notice_id_on_every_attempt():
    channel = SmtpChannel(EmailChannel(host="127.0.0.1", sender="sched@example.org", recipients=["a@x.org", "a@x.org"]))
    first, again = channel.message(ROW), channel.message(ROW)
    assert first["Message-ID"] == again["Message-ID"] == "<mjsched-notification-1@example.org>"
    assert first["To"] == "a@x.org"  # duplicates in a recipients list are sent once


@pytest.mark.timeout(60)
def test_long_texts_fit_every_database_and_the_failure_notice_survives(any_store: Store):
    """MariaDB's TEXT holds 65,535 bytes: an 80 KB body of two-byte characters, a 200 KB error message and
    big details are cut to fit, on every database, and the run and its notice are both recorded."""
    store = any_store
    now = store.db_now()
    job = add_job(store, "wordy", "fail", "0 0 1 1 *", now=now)
    claim = store.claim(job, now=now, next_run_at=now + dt.timedelta(hours=1), instance="me", lease_s=60,
                        deadline_at=now + dt.timedelta(minutes=1), take_lease=True, scheduled_at=job["next_run_at"])
    assert claim is not None
    body = "é" * 40_000
    rows = notices.outbox_rows(notices.Notice(event="Failure", job_id=job["id"], job_name="wordy", run_id=claim.run_id,
                                              subject="s" * 5000, body=body, priority="High"), ("log",))
    assert store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                            error_message="x" * 200_000, details={"blob": "ü" * 50_000}, duration_ms=1.0, notices=rows)
    run = store.get_run(claim.run_id)
    assert run["status"] == "Failed" and run["error_message"].startswith("x" * 1000)
    assert "cut: 200000 bytes" in run["error_message"]
    assert run["details"]["truncated"] is True
    (note,) = store.list_notifications()
    assert note["body"].startswith("é" * 1000) and len(note["body"].encode()) <= 60_000
    assert len(note["subject"].encode()) <= 1_000


def test_a_skip_notice_gives_the_occurrence_in_the_z_form():
    job = {"id": 1, "name": "j", "notify_on_missed": True}
    when = dt.datetime(2026, 12, 3, 5, 40, tzinfo=dt.UTC)
    notice = notices.for_skip(job, when, event="Skipped", reason="a run is still live")
    assert notice is not None and "The occurrence 2026-12-03T05:40:00Z of job 'j' was not run" in notice.body
