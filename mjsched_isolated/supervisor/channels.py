"""Delivery channels for notifications: log, email (SMTP) and webhook (HTTP POST of JSON).

Each channel's ``deliver(row)`` takes one ``notifications`` row (a dict) and returns on success or raises
:class:`DeliveryError` with a message safe to store and log: secrets (SMTP password, webhook secret, a
password or query string in the webhook URL) never appear in it. Every network call has the channel's
``timeout_s``. Standard library only: ``smtplib`` + ``email.message``, ``urllib.request``, ``hmac``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import smtplib
import ssl
import urllib.error
import urllib.parse
import urllib.request
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import TYPE_CHECKING, Any, Protocol

from mjsched_isolated.config import EmailChannel, Notifications, WebhookChannel
from mjsched_isolated.isotime import iso
from mjsched_isolated.logs import one_line

if TYPE_CHECKING:
    from mjsched_isolated.store.records import NotificationRow

log = logging.getLogger("mjsched.notifications")
SIGNATURE_HEADER = "X-Mjsched-Signature"
DELIVERY_HEADER = "X-Mjsched-Delivery"
_X_PRIORITY = {"High": "1 (Highest)", "Normal": "3 (Normal)", "Low": "5 (Lowest)"}


class DeliveryError(Exception):
    """A delivery failed. ``permanent``: retrying cannot help (e.g. no recipients configured)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class Channel(Protocol):
    name: str
    timeout_s: float

    def deliver(self, row: NotificationRow) -> None: ...


def _json_field(raw: Any) -> Any:
    if raw is None or not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _scrub(text: str, secrets: tuple[str | None, ...]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text[:1000]


class LogChannel:
    """One log line per notice on logger ``mjsched.notifications``: WARNING for High priority, else INFO."""

    name = "log"
    timeout_s = 0.0

    def deliver(self, row: NotificationRow) -> None:
        level = logging.WARNING if row["priority"] == "High" else logging.INFO
        log.log(level, "notification %s (%s) job %s run %s: %s | %s", row["event"], row["priority"], row["job_name"],
                row["run_id"] if row["run_id"] is not None else "-", one_line(row["subject"]), one_line(row["body"]))


class SmtpChannel:
    """Email over SMTP (``[notifications.email]``): ``security`` none, ``starttls`` or ``ssl`` (implicit
    TLS), AUTH when ``username`` is set. Certificates are verified with the system's trust store
    (``SSL_CERT_FILE`` names another). Recipients: the row's (the job's ``notify_recipients``), else the
    channel's ``recipients``; none at all is a permanent failure."""

    name = "email"

    def __init__(self, config: EmailChannel) -> None:
        self.config = config
        self.timeout_s = config.timeout_s

    def message(self, row: NotificationRow) -> EmailMessage:
        recipients = list(dict.fromkeys(_json_field(row.get("recipients")) or self.config.recipients))
        if not recipients:
            raise DeliveryError("no recipients: set notifications.email.recipients or the job's notify_recipients",
                                permanent=True)
        msg = EmailMessage()
        msg["Subject"] = row["subject"]
        msg["From"] = self.config.sender
        msg["To"] = ", ".join(recipients)
        msg["Date"] = formatdate(localtime=False)
        # one Message-ID per notice, the same on every attempt: delivery is at-least-once (a retry after a
        # lost reply, a claim that expired mid-delivery), and mail clients and servers drop the duplicate
        domain = self.config.sender.rpartition("@")[2] or "mjsched"
        msg["Message-ID"] = (f"<mjsched-notification-{row['id']}@{domain}>" if row.get("id")
                             else make_msgid(domain=domain))
        msg["X-Priority"] = _X_PRIORITY.get(row["priority"], "3 (Normal)")
        msg["X-Mjsched-Event"] = row["event"]
        body = row["body"]
        details = _json_field(row.get("details"))
        if details:
            body += "\n\nDetails:\n" + json.dumps(details, indent=2, sort_keys=True, default=str)
        msg.set_content(body)
        return msg

    def deliver(self, row: NotificationRow) -> None:
        msg = self.message(row)
        cfg = self.config
        try:
            if cfg.security == "ssl":
                smtp: smtplib.SMTP = smtplib.SMTP_SSL(cfg.host, cfg.port, timeout=cfg.timeout_s,
                                                      context=ssl.create_default_context())
            else:
                smtp = smtplib.SMTP(cfg.host, cfg.port, timeout=cfg.timeout_s)
            with smtp:
                if cfg.security == "starttls":
                    smtp.starttls(context=ssl.create_default_context())
                if cfg.username:
                    smtp.login(cfg.username, cfg.password or "")
                refused = smtp.send_message(msg)
        except DeliveryError:
            raise
        except (smtplib.SMTPException, OSError, ssl.SSLError) as exc:
            text = f"SMTP {cfg.host}:{cfg.port}: {type(exc).__name__}: {exc}"
            raise DeliveryError(_scrub(text, (cfg.password,))) from None
        if refused:
            raise DeliveryError(_scrub(f"SMTP {cfg.host}:{cfg.port} refused recipients {sorted(refused)}",
                                       (cfg.password,)))


class WebhookPost:
    """An HTTP POST of the notice as JSON (``[notifications.webhook]``). Fields: ``id`` (the notification's,
    also in header ``X-Mjsched-Delivery``: the same on every attempt, for at-least-once delivery), ``event``, ``job``,
    ``run_id``, ``subject``, ``body``, ``priority``, ``details``, ``created_at`` (ISO-8601 UTC). With a
    ``secret``, header ``X-Mjsched-Signature: sha256=<hex HMAC-SHA256 of the raw body>`` (GitHub's
    webhook convention). Any 2xx is success; anything else, or no answer within ``timeout_s``, fails."""

    name = "webhook"

    def __init__(self, config: WebhookChannel) -> None:
        self.config = config
        self.timeout_s = config.timeout_s
        parts = urllib.parse.urlsplit(config.url)
        # for messages: no credentials, no query string (tokens often live there)
        netloc = parts.hostname or ""
        if parts.port is not None:
            netloc += f":{parts.port}"
        self.safe_url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    def payload(self, row: NotificationRow) -> bytes:
        return json.dumps({
            "id": row.get("id"), "event": row["event"], "job": row["job_name"], "run_id": row["run_id"],
            "subject": row["subject"], "body": row["body"], "priority": row["priority"],
            "details": _json_field(row.get("details")), "created_at": iso(row.get("created_at"), missing=None),
        }, sort_keys=True).encode("utf-8")

    def deliver(self, row: NotificationRow) -> None:
        body = self.payload(row)
        headers = {"Content-Type": "application/json", "User-Agent": "mjsched-notifier",
                   DELIVERY_HEADER: str(row.get("id"))}  # the same on every attempt: receivers drop duplicates
        if self.config.secret:
            digest = hmac.new(self.config.secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
            headers[SIGNATURE_HEADER] = f"sha256={digest}"
        request = urllib.request.Request(self.config.url, data=body, headers=headers, method="POST")
        secrets = (self.config.secret, urllib.parse.urlsplit(self.config.url).password)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                response.read(65536)
                status = response.status
        except urllib.error.HTTPError as exc:
            raise DeliveryError(_scrub(f"webhook {self.safe_url}: HTTP {exc.code} {exc.reason}", secrets)) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DeliveryError(_scrub(f"webhook {self.safe_url}: {type(exc).__name__}: {reason}", secrets)) from None
        if not 200 <= status < 300:
            raise DeliveryError(f"webhook {self.safe_url}: HTTP {status}")


def build(config: Notifications) -> dict[str, Channel]:
    """The enabled channels by name (``config.channels()`` order)."""
    out: dict[str, Channel] = {}
    if config.log:
        out["log"] = LogChannel()
    if config.email is not None:
        out["email"] = SmtpChannel(config.email)
    if config.webhook is not None:
        out["webhook"] = WebhookPost(config.webhook)
    return out
