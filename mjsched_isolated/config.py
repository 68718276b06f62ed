"""Engine settings: one frozen msgspec Struct with a few sections, validated once, durations in seconds
(``*_s``), sizes in MiB (``*_mb``).

Where a value comes from, highest first (:func:`load_settings`): command-line flags, then the environment
(``MJSCHED_<KEY>``, and ``MJSCHED_<SECTION>_<KEY>`` inside a section, e.g. ``MJSCHED_RETENTION_KEEP_DAYS``,
``MJSCHED_NOTIFICATIONS_EMAIL_PASSWORD``), then the TOML file (``--config FILE`` or ``MJSCHED_CONFIG``),
then the defaults below. Unknown keys and wrong types are :class:`InputError` naming the key
(``retention.keep_days``). Secrets (SMTP password, webhook secret, a password in the database URL) are
never shown by ``repr``/``str`` of these objects.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import socket
import tomllib
import typing
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from mjsched_isolated.errors import InputError, msgspec_field_error

MAX_SECONDS = 10 * 365 * 86400.0
MAX_KILL_GRACE_S = 300.0
MAX_CATCHUP_RUNS = 1000  # a RunAll decision reads up to 2x this many occurrences (~0.1 ms each) in the loop
MAX_INSTANCE_CHARS = 200  # the column holds 255; leases and runs copy it into columns of 255
DEFAULT_DATABASE_URL = "sqlite:///mjsched.db"
ENV_PREFIX = "MJSCHED_"


def default_instance() -> str:
    """``<hostname>-<pid>-<6 random hex digits>``: the reference's ``LockedByInstance`` format (§2.5) made
    unique per start. Hostname and pid repeat in containers (the entrypoint is PID 1 at every start and
    the hostname survives a restart): a restarted supervisor that took its crashed predecessor's name
    would renew that predecessor's lease and keep its dead runs "live" (issue 12). Hostname and pid are
    also kept as columns of the ``supervisors`` row."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _doc(text: str, *, cli: str | None = None) -> msgspec.Meta:
    """A setting's description (CLI flag help is generated from it). ``cli``: ``"hidden"`` (no flag:
    tests only), ``"common"`` (a flag of every command, not only ``serve``) or None."""
    return msgspec.Meta(description=text, extra={"cli": cli} if cli else {})


def _seconds(section: str, owner: Any, names: tuple[str, ...], *, positive: bool = True) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is None:
            continue
        if not math.isfinite(value) or abs(value) > MAX_SECONDS or (value <= 0 if positive else value < 0):
            kind = "a positive" if positive else "a non-negative"
            raise InputError(f"{section}{name}", f"must be {kind} finite number of seconds up to {MAX_SECONDS:.0f}, "
                                                 f"got {value}")


class Retention(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[retention]``: finished runs older than ``keep_days`` are deleted, except each job's newest
    ``keep_min_per_job`` (``keep_days = 0`` keeps everything: pruning off). The supervisor prunes every
    ``prune_interval_s``, ``prune_batch_size`` rows per transaction, so it never holds long locks."""

    keep_days: float = 30.0
    keep_min_per_job: int = 100
    prune_interval_s: float = 300.0
    prune_batch_size: int = 500

    def __post_init__(self) -> None:
        if not math.isfinite(self.keep_days) or not 0 <= self.keep_days <= 36500:
            raise InputError("retention.keep_days",
                             f"must be between 0 (keep everything) and 36500, got {self.keep_days}")
        if self.keep_min_per_job < 0:
            raise InputError("retention.keep_min_per_job", f"must be 0 or more, got {self.keep_min_per_job}")
        if not 1 <= self.prune_batch_size <= 100_000:
            raise InputError("retention.prune_batch_size", f"must be between 1 and 100000, got {self.prune_batch_size}")
        _seconds("retention.", self, ("prune_interval_s",))


class Recycling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[recycling]``: a worker child that has run ``max_tasks_per_child`` runs, or whose own resident
    memory (psutil, measured after each run) exceeds ``max_memory_per_child_mb``, is replaced between
    runs, never during one. ``None`` (the default) turns a limit off (as Celery's worker options)."""

    max_tasks_per_child: int | None = None
    max_memory_per_child_mb: float | None = None

    def __post_init__(self) -> None:
        if self.max_tasks_per_child is not None and self.max_tasks_per_child < 1:
            raise InputError("recycling.max_tasks_per_child", f"must be 1 or more, got {self.max_tasks_per_child}")
        mb = self.max_memory_per_child_mb
        if mb is not None and (not math.isfinite(mb) or not 1 <= mb <= 1_048_576):
            raise InputError("recycling.max_memory_per_child_mb", f"must be between 1 and 1048576 MiB, got {mb}")


# a run's resource limits (worker/limits.py): memory MB, CPU seconds, open files, processes, nice level.
# Open files: at least 64, as the worker itself holds about 20 descriptors (pipes, logging) and a command
# started by the run needs some more; below that every run failed with EMFILE before its plugin did anything.
LIMIT_RANGES = {"max_memory_mb": (1, 1 << 30), "max_cpu_s": (1, 10 * 365 * 86400), "max_open_files": (64, 1 << 20),
                "max_processes": (1, 1 << 22), "nice": (-20, 19)}


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[limits]``: resource limits of every run whose job sets none of its own (a job's column wins,
    field by field). ``None`` (the default): no limit. See docs/operating/isolation.md."""

    max_memory_mb: int | None = None
    max_cpu_s: int | None = None
    max_open_files: int | None = None
    max_processes: int | None = None
    nice: int | None = None

    def __post_init__(self) -> None:
        for field, (low, high) in LIMIT_RANGES.items():
            value = getattr(self, field)
            if value is not None and not low <= value <= high:
                raise InputError(f"limits.{field}", f"must be between {low} and {high}, got {value}")


class Isolation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[isolation]``: ``cgroups``: ``"auto"`` (default) puts each worker and everything it starts in a
    cgroup of its own where the machine allows (cgroup v2, else v1; see mjsched_isolated/cgroups.py and
    docs/operating/isolation.md); ``"v2"`` or ``"v1"`` only that version; ``"off"`` none (the worker's
    child subreaper and per-process rlimits only). Where cgroups cannot be used, ``serve`` and ``check``
    say why and the workers run without."""

    cgroups: Literal["auto", "v2", "v1", "off"] = "auto"


class Metrics(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[metrics]``: Prometheus ``/metrics`` and ``/healthz`` on ``host:port``; off while ``port`` is
    unset. Binds to 127.0.0.1 unless told otherwise. ``stall_after_s``: ``/healthz`` fails when the poll
    loop has not completed a step for this long."""

    port: Annotated[int | None, _doc("serve Prometheus /metrics and /healthz on this port (0: a free one); "
                                     "off if unset")] = None
    host: Annotated[str, _doc("address for the metrics port")] = "127.0.0.1"
    stall_after_s: Annotated[float, _doc("/healthz fails when the poll loop has not completed a step for this "
                                         "many seconds")] = 60.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise InputError("metrics.port", f"must be between 0 and 65535, got {self.port}")
        _seconds("metrics.", self, ("stall_after_s",))


class Dashboard(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[dashboard]``: ``mjsched dashboard``'s address and who may use it. Binds to 127.0.0.1 unless told;
    another address is refused unless ``operator_password`` or ``operator_token`` is set. Passwords and
    tokens are secrets (set them with ``MJSCHED_DASHBOARD_OPERATOR_PASSWORD`` and the like rather than in
    the file); each may be given as plain text or as a hash printed by ``mjsched dashboard --hash-password``
    (``scrypt$...``), and the dashboard keeps only hashes in memory. The ``viewer_*`` ones grant the
    read-only role, the ``operator_*`` ones may also act. ``session_secret`` signs session cookies (random
    per process when unset: sessions then end with the process)."""

    host: str = "127.0.0.1"
    port: int = 8520
    operator_password: str | None = None
    viewer_password: str | None = None
    operator_token: str | None = None
    viewer_token: str | None = None
    session_secret: str | None = None
    session_max_age_s: float = 12 * 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InputError("dashboard.port", f"must be between 0 and 65535, got {self.port}")
        if not self.host.strip():
            raise InputError("dashboard.host", "must not be empty")
        for name in ("operator_password", "viewer_password", "operator_token", "viewer_token", "session_secret"):
            value = getattr(self, name)
            if value is not None and len(value) < 8:
                raise InputError(f"dashboard.{name}", "must be at least 8 characters long")
        _seconds("dashboard.", self, ("session_max_age_s",))

    def __repr__(self) -> str:
        secret = ("operator_password", "viewer_password", "operator_token", "viewer_token", "session_secret")
        shown = ", ".join(f"{name}={'***' if getattr(self, name) else None}" for name in secret)
        return f"Dashboard(host={self.host!r}, port={self.port}, {shown})"


def is_email_address(address: str) -> bool:
    """A plausible single address (``local@domain``, no spaces, separators or header characters): enough
    to catch a typo or a header injection; the SMTP server has the last word."""
    text = address.strip()
    local, at, domain = text.rpartition("@")
    return bool(at and local and domain) and not any(c.isspace() or c in ",;<>\"" for c in text)


class EmailChannel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[notifications.email]``: SMTP delivery (stdlib smtplib). ``security``: ``none``, ``starttls`` or
    ``ssl`` (implicit TLS). ``recipients``: used for jobs that name none of their own. ``password`` is a
    secret: set it with ``MJSCHED_NOTIFICATIONS_EMAIL_PASSWORD`` rather than in the file."""

    host: str
    sender: str
    port: int = 25
    security: Literal["none", "starttls", "ssl"] = "none"
    username: str | None = None
    password: str | None = None
    recipients: list[str] = []
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise InputError("notifications.email.host", "must not be empty")
        if not is_email_address(self.sender):
            raise InputError("notifications.email.sender", f"not an email address: {self.sender!r}")
        for i, address in enumerate(self.recipients):
            if not is_email_address(address):
                raise InputError(f"notifications.email.recipients[{i}]", f"not an email address: {address!r}")
        if not 1 <= self.port <= 65535:
            raise InputError("notifications.email.port", f"must be between 1 and 65535, got {self.port}")
        _seconds("notifications.email.", self, ("timeout_s",))

    def __repr__(self) -> str:
        return (f"EmailChannel(host={self.host!r}, port={self.port}, security={self.security!r}, "
                f"sender={self.sender!r}, username={self.username!r}, password={'***' if self.password else None})")


class WebhookChannel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[notifications.webhook]``: an HTTP POST of the notification as JSON to ``url``. With ``secret``
    (set it with ``MJSCHED_NOTIFICATIONS_WEBHOOK_SECRET``), the body is signed: header
    ``X-Mjsched-Signature: sha256=<hex HMAC-SHA256 of the body>``."""

    url: str
    secret: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError("notifications.webhook.url", f"must be an http:// or https:// URL with a host, "
                                                          f"got {self.url!r}")
        _seconds("notifications.webhook.", self, ("timeout_s",))

    def __repr__(self) -> str:
        return f"WebhookChannel(url={self.url!r}, timeout_s={self.timeout_s}, secret={'***' if self.secret else None})"


class Notifications(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[notifications]``: the log channel is on unless ``log = false``; email and webhook are on when
    their section is present. A failed delivery is retried with exponential backoff from
    ``retry_backoff_s`` up to ``retry_backoff_max_s``, at most ``max_attempts`` times per channel."""

    log: bool = True
    email: EmailChannel | None = None
    webhook: WebhookChannel | None = None
    max_attempts: int = 8
    retry_backoff_s: float = 5.0
    retry_backoff_max_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 1000:
            raise InputError("notifications.max_attempts", f"must be between 1 and 1000, got {self.max_attempts}")
        _seconds("notifications.", self, ("retry_backoff_s", "retry_backoff_max_s"))
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise InputError("notifications.retry_backoff_max_s",
                             f"must be at least retry_backoff_s ({self.retry_backoff_s}), "
                             f"got {self.retry_backoff_max_s}")

    def channels(self) -> list[str]:
        """Names of the enabled channels, in delivery order."""
        return [name for name, on in (("log", self.log), ("email", self.email), ("webhook", self.webhook)) if on]


MAX_CLAIM_AHEAD_S = 1.0  # a claim further ahead holds a worker idle, and commits the run before edits can stop it
MAX_RUN_OUTPUT_BYTES = 1024**3  # 1 GiB: beyond it a run's output belongs in a file it writes itself


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the supervisor needs besides its store and pool; the TOML file's top level.

    Each field's meaning is in its ``msgspec.Meta`` description (:func:`field_docs`; the ``serve`` flags
    and the settings reference are generated from them). Durations are seconds; reference values are
    from reference-engine-spec.md (``defaultLockTimeout`` 600 s, heartbeat 5 min / 6 min).
    """

    database_url: Annotated[str, _doc("SQLAlchemy database URL (SQLite file, PostgreSQL, MariaDB/MySQL)",
                                      cli="common")] = DEFAULT_DATABASE_URL
    plugins_dir: Annotated[str | None, _doc(
        "folder of local plugin modules, added to the built-in plugins; unset: ./plugins if that folder "
        "exists (an explicitly named folder that does not exist is an error)", cli="common")] = None
    jobs_file: Annotated[str | None, _doc(
        "TOML jobs file synced when serve starts (default: <plugins_dir or ./plugins>/jobs.toml if it exists)")
    ] = None
    max_concurrent_jobs: Annotated[int, _doc("the cap: worker children, so runs at once")] = 5
    lease_timeout_s: Annotated[float, _doc(
        "default run deadline and lease length in seconds; a job's max_runtime_minutes only lengthens it")] = 600.0
    shutdown_timeout_s: Annotated[float, _doc("drain bound in seconds on SIGTERM/SIGINT")] = 30.0
    kill_grace_s: Annotated[float, _doc(
        "seconds between SIGTERM and SIGKILL for a run past its deadline (0: SIGKILL at once; at most half "
        f"of lease_ttl_s is used, so the job's lease outlasts it); as Kubernetes' "
        f"terminationGracePeriodSeconds, at most {MAX_KILL_GRACE_S:.0f}")] = 5.0
    rescan_interval_s: Annotated[float, _doc(
        "longest sleep in seconds before looking for job changes by others and runs of dead supervisors")] = 1.0
    claim_ahead_s: Annotated[float, _doc(
        "an idle supervisor claims an occurrence up to this many seconds before its instant and hands it to a "
        "worker, which starts it at the instant, never before (0: claimed at the instant); at most "
        f"{MAX_CLAIM_AHEAD_S:g}")] = 0.1
    heartbeat_interval_s: Annotated[float, _doc("at most one deadline extension per this many seconds")] = 300.0
    heartbeat_lease_s: Annotated[float, _doc("a heartbeat extends the run's deadline to now + this many seconds")
                                 ] = 360.0
    worker_ready_timeout_s: Annotated[float, _doc("seconds a worker child may take to import plugins and "
                                                  "report ready")] = 60.0
    plugin_import_timeout_s: Annotated[float, _doc("seconds one plugin module may take to import before it "
                                                   "is left out")] = 10.0
    max_run_output_bytes: Annotated[int, _doc(
        "bytes of a run's output (stdout, stderr, logging) kept with it: its first and last halves when it "
        "writes more (see `runs logs`)")] = 4 * 1024 * 1024
    lease_ttl_s: Annotated[float, _doc(
        "this supervisor's liveness lease in seconds; a dead one's runs are recovered within TTL + rescan")] = 30.0
    lease_renew_interval_s: Annotated[float, _doc("seconds between renewals of the liveness lease")] = 10.0
    clock_skew_s: Annotated[float, _doc("seconds added to the local clock (tests simulating a wrong clock)",
                                        cli="hidden")] = 0.0
    max_catchup_runs: Annotated[int, _doc(
        f"RunAll jobs catch up at most this many missed occurrences (at most {MAX_CATCHUP_RUNS})")] = 100
    instance: Annotated[str, _doc(
        "this supervisor's name in leases and logs (default <hostname>-<pid>-<random 6 hex>); a name given "
        "here must be unique among live supervisors and should change at each start")] = \
        msgspec.field(default_factory=default_instance)
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], _doc("log level", cli="common")] = "INFO"
    log_format: Annotated[Literal["text", "json"], _doc("text, or json: one JSON object per line on stderr",
                                                        cli="common")] = "text"
    auto_upgrade: Annotated[bool, _doc("apply pending schema migrations at start instead of refusing to start")
                            ] = False
    wait_for_db_s: Annotated[float | None, _doc(
        "serve started while the database server is unreachable retries (backoff up to 0.5 s, each try logged, "
        "/healthz unhealthy) for at most this many seconds, then exits 1; unset: waits as long as it takes; "
        "0: exits at once")] = None
    retention: Retention = msgspec.field(default_factory=Retention)
    recycling: Recycling = msgspec.field(default_factory=Recycling)
    limits: Limits = msgspec.field(default_factory=Limits)
    isolation: Isolation = msgspec.field(default_factory=Isolation)
    metrics: Metrics = msgspec.field(default_factory=Metrics)
    notifications: Notifications = msgspec.field(default_factory=Notifications)
    dashboard: Dashboard = msgspec.field(default_factory=Dashboard)

    def __post_init__(self) -> None:
        if not self.database_url.strip():
            raise InputError("database_url", "must not be empty")
        if not 1 <= len(self.instance) <= MAX_INSTANCE_CHARS or not self.instance.isprintable():
            shown = repr(self.instance[:40]) + (f"... ({len(self.instance)} characters)"
                                                if len(self.instance) > 40 else "")
            raise InputError("instance", f"must be one line of 1 to {MAX_INSTANCE_CHARS} printable characters, "
                                         f"got {shown}")
        for name in ("lease_timeout_s", "shutdown_timeout_s", "rescan_interval_s", "heartbeat_interval_s",
                     "heartbeat_lease_s", "worker_ready_timeout_s", "plugin_import_timeout_s", "lease_ttl_s",
                     "lease_renew_interval_s", "clock_skew_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_SECONDS:
                raise InputError(name, f"must be a finite number of seconds up to {MAX_SECONDS:.0f}, got {value}")
        if self.wait_for_db_s is not None and not 0 <= self.wait_for_db_s <= MAX_SECONDS:
            raise InputError("wait_for_db_s", f"must be from 0 to {MAX_SECONDS:.0f} seconds, got {self.wait_for_db_s}")
        if not 1 <= self.max_catchup_runs <= MAX_CATCHUP_RUNS:
            raise InputError("max_catchup_runs",
                             f"must be between 1 and {MAX_CATCHUP_RUNS}, got {self.max_catchup_runs}")
        if not 1 <= self.max_concurrent_jobs <= 1000:
            raise InputError("max_concurrent_jobs",
                             f"must be an integer between 1 and 1000, got {self.max_concurrent_jobs}")
        for name in ("lease_timeout_s", "rescan_interval_s", "heartbeat_lease_s", "worker_ready_timeout_s",
                     "plugin_import_timeout_s", "lease_ttl_s", "lease_renew_interval_s"):
            if not getattr(self, name) > 0:
                raise InputError(name, f"must be a positive number of seconds, got {getattr(self, name)}")
        if not 0 <= self.claim_ahead_s <= MAX_CLAIM_AHEAD_S:
            raise InputError("claim_ahead_s", f"must be between 0 and {MAX_CLAIM_AHEAD_S:g} seconds, "
                                              f"got {self.claim_ahead_s}")
        if not 0 <= self.kill_grace_s <= MAX_KILL_GRACE_S:
            raise InputError("kill_grace_s", f"must be between 0 and {MAX_KILL_GRACE_S:.0f} seconds, "
                                             f"got {self.kill_grace_s}")
        for name in ("shutdown_timeout_s", "heartbeat_interval_s"):
            if not getattr(self, name) >= 0:
                raise InputError(name, f"must be zero or more seconds, got {getattr(self, name)}")
        if not 1024 <= self.max_run_output_bytes <= MAX_RUN_OUTPUT_BYTES:
            raise InputError("max_run_output_bytes", f"must be an integer from 1024 to {MAX_RUN_OUTPUT_BYTES}, "
                             f"got {self.max_run_output_bytes}")
        if self.heartbeat_lease_s <= self.heartbeat_interval_s:  # a run that beats steadily would lapse between
            raise InputError("heartbeat_lease_s", f"must be longer than heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g} s: at most one extension per interval), or a run that "
                             f"heartbeats steadily times out between extensions; got {self.heartbeat_lease_s:g}")
        if self.lease_renew_interval_s >= self.lease_ttl_s * 0.8:
            raise InputError("lease_renew_interval_s", f"must be well below lease_ttl_s ({self.lease_ttl_s} s); "
                             f"got {self.lease_renew_interval_s}")

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        fields["database_url"] = redact_url(self.database_url)
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "key")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (SQLAlchemy's own rendering), for logs and errors."""
    import sqlalchemy as sa  # noqa: PLC0415 - loaded only where needed

    try:
        parsed = sa.engine.make_url(url)
    except Exception:  # noqa: BLE001 - unparseable (a bad port, say): mask what looks like a secret anyway
        masked = re.sub(r"(://[^:/@]*:)[^/]*@", r"\1***@", url)
        secret_param = r"([?&][^=&]*(?:" + "|".join(SECRET_WORDS) + r")[^=&]*=)[^&]*"
        return re.sub(secret_param, r"\1***", masked, flags=re.IGNORECASE)
    # a password can also be a query parameter (?password=..., libpq's form): masked the same way
    query = {k: ("***" if any(word in k.lower() for word in SECRET_WORDS) else v) for k, v in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


# -- loading: flags > environment > file > defaults --------------------------------------------------------
SECTIONS: dict[str, type[msgspec.Struct]] = {"retention": Retention, "recycling": Recycling, "limits": Limits,
                                             "isolation": Isolation, "metrics": Metrics, "notifications": Notifications,
                                             "dashboard": Dashboard}
CHANNELS: dict[str, type[msgspec.Struct]] = {"email": EmailChannel, "webhook": WebhookChannel}


def read_config_file(path: str, field: str = "--config") -> dict[str, Any]:
    """The TOML file's table. Raises :class:`InputError` (naming ``field``) if unreadable or not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise InputError(field, f"cannot read {path!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(field, f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(field, f"{path} is not UTF-8 text (byte {exc.start})") from None


def _env_value(struct: type[msgspec.Struct], field: str, name: str, raw: str) -> Any:
    """The environment variable ``name``'s string as ``struct.field``'s type: lists are comma-separated,
    numbers and booleans (``true``/``false``/``1``/``0``) by msgspec's lax string rules."""
    kind = typing.get_type_hints(struct)[field]
    value: Any = [part.strip() for part in raw.split(",") if part.strip()] if typing.get_origin(kind) is list else raw
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise InputError(name, str(exc).split(" - at ")[0]) from None


def environment_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """The nested settings table spelled by ``MJSCHED_*`` variables (unknown ``MJSCHED_*`` names are
    ignored: the CLI reads a few of its own, such as ``MJSCHED_CONFIG``)."""
    out: dict[str, Any] = {}
    for field in Settings.__struct_fields__:
        name = ENV_PREFIX + field.upper()
        if field not in SECTIONS and (raw := environ.get(name)) is not None:
            out[field] = _env_value(Settings, field, name, raw)
    for section, struct in SECTIONS.items():
        for field in struct.__struct_fields__:
            if field in CHANNELS:
                for sub in CHANNELS[field].__struct_fields__:
                    name = f"{ENV_PREFIX}{section}_{field}_{sub}".upper()
                    if (raw := environ.get(name)) is not None:
                        value = _env_value(CHANNELS[field], sub, name, raw)
                        out.setdefault(section, {}).setdefault(field, {})[sub] = value
            elif (raw := environ.get(name := f"{ENV_PREFIX}{section}_{field}".upper())) is not None:
                out.setdefault(section, {})[field] = _env_value(struct, field, name, raw)
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_settings(table: dict[str, Any]) -> Settings:
    """Validate a nested settings table. Raises :class:`InputError` naming the key (``retention.keep_days``)."""
    try:
        return msgspec.convert(table, Settings)
    except InputError:
        raise
    except msgspec.ValidationError as exc:
        field, message = msgspec_field_error(exc, "")
        message = {"unknown field": "unknown setting", "missing required field": "is required"}.get(message, message)
        raise InputError(field or "configuration", message) from None


def load_settings(*, config_path: str | None = None, environ: dict[str, str] | None = None,
                  flags: dict[str, Any] | None = None) -> Settings:
    """Settings from defaults < the TOML file (``config_path``, else ``$MJSCHED_CONFIG``) < ``MJSCHED_*``
    environment variables < ``flags`` (a nested table of values given on the command line; ``None``
    values are ignored). Raises :class:`InputError` naming the key at fault."""
    environ = dict(os.environ if environ is None else environ)
    path = config_path or environ.get("MJSCHED_CONFIG") or None
    table = read_config_file(path, "--config" if config_path else "MJSCHED_CONFIG") if path else {}
    if path:  # a value of the wrong type is reported even if the environment or a flag overrides it
        check_types(table, where=f" (in {path})")
    table = _merge(table, environment_overrides(environ))
    table = _merge(table, _drop_none(flags or {}))
    return build_settings(table)


def check_types(table: dict[str, Any], struct: type[msgspec.Struct] = Settings, prefix: str = "",
                where: str = "") -> None:
    """Check each key of a settings table (a configuration file's) alone: unknown keys and values of the
    wrong type raise :class:`InputError` naming the key (``where`` is added to the message), whatever the
    other sources say later. Ranges and checks across keys are left to the merged settings
    (:func:`build_settings`): a flag may make them hold."""
    hints = typing.get_type_hints(struct, include_extras=False)
    for key, value in table.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise InputError(name, f"unknown setting{where}")
        kind = hints[key]
        section = next((t for t in (kind, *typing.get_args(kind))
                        if isinstance(t, type) and issubclass(t, msgspec.Struct)), None)
        if section is not None and isinstance(value, dict):
            check_types(value, section, f"{name}.", where)
            continue
        try:
            msgspec.convert(value, kind)
        except InputError:  # a range or a check across keys: judged on the merged settings
            pass
        except msgspec.ValidationError as exc:
            raise InputError(name, f"{str(exc).split(' - at ')[0]}{where}") from None


def _drop_none(table: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            value = _drop_none(value)
            if value:
                out[key] = value
        elif value is not None:
            out[key] = value
    return out


# -- what the CLI and the docs read ------------------------------------------------------------------------
class FieldDoc(msgspec.Struct, frozen=True):
    """One setting as documentation: ``key`` (``metrics.port``), its type without ``None``, whether
    ``None`` is allowed, the default (None when it is computed, as ``instance``), the description and the
    ``cli`` role (see :func:`_doc`)."""

    key: str
    type: Any
    optional: bool
    default: Any
    description: str
    cli: str | None


def field_docs(struct: type[msgspec.Struct] = Settings, prefix: str = "") -> list[FieldDoc]:
    """The described scalar fields of ``struct`` (sections are not descended into), in declaration order."""
    hints = typing.get_type_hints(struct, include_extras=True)
    out = []
    for field in msgspec.structs.fields(struct):
        hint = hints[field.name]
        if typing.get_origin(hint) is not Annotated:
            continue
        kind, *extras = typing.get_args(hint)
        meta = next(e for e in extras if isinstance(e, msgspec.Meta))
        args = typing.get_args(kind)
        optional = type(None) in args and typing.get_origin(kind) is not Literal
        if optional:
            kind = next(a for a in args if a is not type(None))
        default = None if field.default is msgspec.NODEFAULT else field.default
        out.append(FieldDoc(key=prefix + field.name, type=kind, optional=optional, default=default,
                            description=meta.description or "", cli=(meta.extra or {}).get("cli")))
    return out


def effective_plugins_dir(settings: Settings) -> str | None:
    """The local plugins folder to load: the configured one, else ``./plugins`` when that folder exists,
    else None (built-in plugins only)."""
    if settings.plugins_dir is not None:
        return settings.plugins_dir
    return "plugins" if Path("plugins").is_dir() else None


def default_jobs_file(settings: Settings) -> str | None:
    """``serve``'s jobs file: ``jobs_file``, else ``<plugins_dir or ./plugins>/jobs.toml`` when it exists."""
    if settings.jobs_file is not None:
        return settings.jobs_file
    candidate = Path(settings.plugins_dir or "plugins", "jobs.toml")
    return str(candidate) if candidate.is_file() else None
