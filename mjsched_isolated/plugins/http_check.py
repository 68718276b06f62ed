"""``http_check`` job type: request a URL with the standard library and check status and body.

Never raises for network trouble: a wrong status, a missing substring, a connection error or a timeout
all give ``success=False`` with an ``error_message``. Proxies come from the usual environment variables.

Details: ``url``, ``method``, ``expected_status``, ``status`` (int or None when no response arrived),
``reason``, ``final_url`` (after redirects), ``latency_ms`` (until the status line and headers arrived),
``duration_ms`` (including the body), ``bytes_read`` (body bytes read, at most ``max_body_bytes``),
``body_truncated``, and ``substring_found`` when ``expect_substring`` is set.
"""

import re
import socket
import time
import urllib.parse
from typing import Annotated, Any, Literal

import msgspec

from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
)
from mjsched_isolated.errors import ConfigurationError

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 header field name
_CHUNK = 65536


class HttpCheckConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``url``: http:// or https:// URL. ``method``: GET, HEAD or POST. ``expected_status``: the status
    that counts as success. ``expect_substring``: text the decoded body must contain (not with HEAD).
    ``timeout_s``: seconds for the whole check (also the per-socket-operation timeout). ``headers``:
    request headers. ``body``: request body for POST (UTF-8). ``follow_redirects``: follow 3xx (set false
    to check a redirect itself). ``max_body_bytes``: body bytes read at most (the rest is not read)."""

    url: str
    method: Literal["GET", "HEAD", "POST"] = "GET"
    expected_status: Annotated[int, msgspec.Meta(ge=100, le=599)] = 200
    expect_substring: str | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    body: str | None = None
    follow_redirects: bool = True
    max_body_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1_000_000


def _no_redirect_handler() -> Any:
    """A handler refusing redirects (urllib then raises HTTPError carrying the 3xx status)."""
    import urllib.request  # noqa: PLC0415 - ~5 MB, loaded only by runs that need it (see execute)

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            return None

    return NoRedirect()


class HttpCheckJob(BaseScheduledJob[HttpCheckConfiguration]):
    """Succeeds when the response has ``expected_status`` (and contains ``expect_substring``)."""

    job_type = "http_check"
    configuration_type = HttpCheckConfiguration
    description = "Request an http(s) URL; check the status code and optionally a body substring"

    def validate_configuration(self, configuration: HttpCheckConfiguration) -> None:
        try:
            parts = urllib.parse.urlsplit(configuration.url)
            parts.port  # noqa: B018 - raises ValueError for a malformed port
        except ValueError as exc:
            raise ConfigurationError(f"configuration.url: {exc}") from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ConfigurationError("configuration.url: must be an http:// or https:// URL with a host")
        if any(c in configuration.url for c in "\r\n\t "):
            raise ConfigurationError("configuration.url: must not contain whitespace")
        for name, value in configuration.headers.items():
            if not _TOKEN.match(name):
                raise ConfigurationError(f"configuration.headers.{name}: not a valid header name")
            if "\r" in value or "\n" in value:
                raise ConfigurationError(f"configuration.headers.{name}: value must not contain line breaks")
        if configuration.method == "HEAD" and configuration.expect_substring is not None:
            raise ConfigurationError("configuration.expect_substring: a HEAD response has no body to search")
        if configuration.body is not None and configuration.method != "POST":
            raise ConfigurationError("configuration.body: only allowed with method POST")

    def execute(self, context: JobContext[HttpCheckConfiguration]) -> ScheduledJobResult:
        cfg: HttpCheckConfiguration = context.configuration
        details: dict = {
            "url": cfg.url, "method": cfg.method, "expected_status": cfg.expected_status, "status": None,
            "latency_ms": None, "bytes_read": 0, "body_truncated": False,
        }
        data = cfg.body.encode("utf-8") if cfg.body is not None else (b"" if cfg.method == "POST" else None)
        # urllib.request (with http.client and ssl: ~5 MB) is imported by the runs that need it, not by
        # every worker that loads the built-in plugins
        import urllib.error  # noqa: PLC0415 - see above
        import urllib.request  # noqa: PLC0415 - see above

        request = urllib.request.Request(cfg.url, data=data, headers=dict(cfg.headers), method=cfg.method)
        opener = urllib.request.build_opener(*([] if cfg.follow_redirects else [_no_redirect_handler()]))
        start = time.monotonic()
        try:
            try:
                response = opener.open(request, timeout=cfg.timeout_s)
            except urllib.error.HTTPError as exc:  # a non-2xx status is still a response
                response = exc
            with response:
                details["latency_ms"] = _ms(start)
                details["status"] = response.status if response.status is not None else response.code
                details["reason"] = response.reason
                details["final_url"] = response.geturl()
                body = b"" if cfg.method == "HEAD" else self._read_body(response, cfg, start, details)
        except TimeoutError:
            return self._fail(details, start, f"timed out after {cfg.timeout_s:g}s")
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                return self._fail(details, start, f"timed out after {cfg.timeout_s:g}s")
            return self._fail(details, start, f"connection failed: {reason}")
        except Exception as exc:  # noqa: BLE001 - OSError, HTTPException, ValueError...: a failed check
            return self._fail(details, start, f"request failed: {type(exc).__name__}: {exc}")
        details["duration_ms"] = _ms(start)

        if details["status"] != cfg.expected_status:
            return ScheduledJobResult(
                success=False, details=details,
                error_message=f"status {details['status']} (expected {cfg.expected_status})",
            )
        if cfg.expect_substring is not None:
            charset = response.headers.get_content_charset() or "utf-8"
            try:
                text = body.decode(charset, errors="replace")
            except LookupError:  # unknown charset name
                text = body.decode("utf-8", errors="replace")
            details["substring_found"] = cfg.expect_substring in text
            if not details["substring_found"]:
                where = f"first {len(body)} bytes of the body" if details["body_truncated"] else "body"
                return ScheduledJobResult(
                    success=False, details=details,
                    error_message=f"{cfg.expect_substring!r} not found in the {where}",
                )
        return ScheduledJobResult(success=True, details=details)

    @staticmethod
    def _read_body(response, cfg: HttpCheckConfiguration, start: float, details: dict) -> bytes:
        """Read up to ``max_body_bytes`` in chunks, raising TimeoutError past ``timeout_s`` in total."""
        chunks: list[bytes] = []
        remaining = cfg.max_body_bytes
        while remaining > 0:
            chunk = response.read1(min(_CHUNK, remaining))  # what has arrived: a drip-feed cannot stall us
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
            details["bytes_read"] += len(chunk)
            if time.monotonic() - start > cfg.timeout_s:
                raise TimeoutError("body read exceeded timeout_s")
        if remaining <= 0 and response.read(1):
            details["body_truncated"] = True
        return b"".join(chunks)

    @staticmethod
    def _fail(details: dict, start: float, message: str) -> ScheduledJobResult:
        details["duration_ms"] = _ms(start)
        return ScheduledJobResult(success=False, details=details, error_message=message)

    def format_notification(self, context: JobContext[HttpCheckConfiguration],
            result: ScheduledJobResult) -> NotificationContent:
        d = result.details or {}
        target = f"{d.get('method', '')} {d.get('url', '')}".strip()
        if result.success:
            return NotificationContent(
                subject=f"Scheduled job '{context.job_name}' completed",
                body=f"Run {context.run_id}: {target} answered {d.get('status')} in {d.get('latency_ms')} ms.",
            )
        return NotificationContent(
            subject=f"Scheduled job '{context.job_name}' failed: {target}",
            body=f"Run {context.run_id}: {target} check failed: {result.error_message}.",
            priority="High",
        )


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
