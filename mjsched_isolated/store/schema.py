"""Tables, indexes, engine creation and the database clock. The only module with dialect branches.

Tables: ``jobs`` and ``runs`` (the reference's), and ``supervisors``: one row per supervisor process whose
``lease_expires_at`` it renews; a job lease or a run is live only while its supervisor's row is.
``notifications`` is the outbox; ``run_output`` holds each run's captured output in ordered chunks;
``plugin_reloads`` the latest ``plugins reload`` request.

The data model is the reference engine's (reference-engine-spec.md §1.2, §1.3) in snake_case. Timestamps
are stored as naive UTC (``DATETIME(6)`` on MySQL) and read back as aware UTC. The database clock is
used for every lease decision (acquire, extend, expiry), never the supervisor's.
"""

from __future__ import annotations

import datetime as dt
import re
import time

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import (
    ConcurrencyMode,
    JobStatus,
    MissedRunPolicy,
    NotificationEvent,
    NotificationStatus,
    Priority,
    RunStatus,
    values,
)

UTC = dt.UTC

JOB_STATUSES = values(JobStatus)
RUN_STATUSES = values(RunStatus)
CONCURRENCY_MODES = values(ConcurrencyMode)
MISSED_RUN_POLICIES = values(MissedRunPolicy)


SQLITE_EXACT_FORM = ("[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]"  # GLOB: YYYY-MM-DD HH:MM:SS.ffffff
                     " [0-9][0-9]:[0-9][0-9]:[0-9][0-9].[0-9][0-9][0-9][0-9][0-9][0-9]")


class _LenientSQLiteDateTime(sqlite.DATETIME):
    """SQLite's DATETIME, but a value that is not a timestamp (a number, or text edited by hand such as
    ``2026-11-29T10:00:00Z``) reads as None instead of failing the whole query or being half-parsed: one
    bad row must not stop every poll. ``exact``: only the form the store itself writes (microseconds)
    is read, for columns compared by value (``next_run_at``'s compare-and-set would never match another
    spelling of the same instant); see :data:`SQLITE_EXACT_FORM`."""

    _FORM = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?")
    _EXACT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{6}")

    def __init__(self, exact: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.exact = exact
        self._form = self._EXACT if exact else self._FORM

    def result_processor(self, dialect, coltype):
        form = self._form

        def process(value):
            if value is None or isinstance(value, dt.datetime):
                return value
            if not isinstance(value, str) or not form.fullmatch(value):
                return None
            # the forms matched are ISO 8601: the C parser reads them as SQLAlchemy's would, faster
            return _parsed_or_none(value)

        return process


def _parsed_or_none(text: str) -> dt.datetime | None:
    """``text`` (in a timestamp's shape) as a datetime, or None for an impossible one edited by hand such as
    ``2026-99-99 99:99:99``: read as unset like any other text that is not a timestamp, never an error that
    would fail every poll and every command reading the row (new-user review)."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return None


# SQLite's timestamps are text: the texts of the instants bound lately, and the instants of the texts read
# lately (datetimes are immutable, so one object serves every reader). A poll binds and reads the same few
# instants over and over - the occurrence due, the poll's now, the batch's start and end - and formatting or
# parsing one cost more than the SQL statement's own share of it (issue 11, callgrind). Emptied when full.
TIMESTAMP_CACHE_SIZE = 1024
_SQLITE_TEXTS: dict[dt.datetime, str] = {}
_SQLITE_PARSED: dict[str, dt.datetime] = {}  # lenient columns (any form :class:`_LenientSQLiteDateTime` reads)
_SQLITE_EXACT_PARSED: dict[str, dt.datetime] = {}  # exact columns: only the store's own form


class UTCDateTime(sa.TypeDecorator):
    """Aware UTC datetimes in and out; stored naive UTC with microseconds. On SQLite a stored value that
    is not a timestamp reads as None (see :class:`_LenientSQLiteDateTime`)."""

    impl = sa.DateTime
    cache_ok = True

    def __init__(self, exact: bool = False) -> None:
        super().__init__()
        self.exact = exact

    def load_dialect_impl(self, dialect):
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        if dialect.name == "sqlite":
            return _LenientSQLiteDateTime(exact=self.exact)
        return dialect.type_descriptor(sa.DateTime(timezone=False))

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; pass aware UTC datetimes")
        return value.astimezone(UTC).replace(tzinfo=None)

    # SQLite: the same conversions in one step each (issue 11: a poll reads a dozen timestamps per job, and
    # datetime.replace with a keyword was 6 % of the supervisor's instructions per run)
    def bind_processor(self, dialect):
        if dialect.name != "sqlite":
            return super().bind_processor(dialect)

        texts = _SQLITE_TEXTS

        def process(value):  # SQLite's DATETIME text, microseconds: "YYYY-MM-DD HH:MM:SS.ffffff"
            if value is None:
                return None
            if value.tzinfo is None:
                raise ValueError("naive datetime given to the store; pass aware UTC datetimes")
            text = texts.get(value)  # equal aware datetimes are one instant: one text
            if text is None:
                text = (value if value.tzinfo is UTC else value.astimezone(UTC)).isoformat(" ", "microseconds")[:26]
                if len(texts) >= TIMESTAMP_CACHE_SIZE:
                    texts.clear()
                texts[value] = text
            return text

        return process

    def result_processor(self, dialect, coltype):
        if dialect.name != "sqlite":
            return super().result_processor(dialect, coltype)
        form = _LenientSQLiteDateTime._EXACT if self.exact else _LenientSQLiteDateTime._FORM
        parsed = _SQLITE_EXACT_PARSED if self.exact else _SQLITE_PARSED

        def process(value):  # as _LenientSQLiteDateTime then process_result_value
            if value is None:
                return None
            if isinstance(value, str):
                when = parsed.get(value)
                if when is None:
                    if not form.fullmatch(value):
                        return None
                    when = _parsed_or_none(value + "+00:00")  # the C parser; tzinfo is datetime.UTC
                    if when is None:
                        return None
                    if len(parsed) >= TIMESTAMP_CACHE_SIZE:
                        parsed.clear()
                    parsed[value] = when
                return when
            if isinstance(value, dt.datetime):
                return value.replace(tzinfo=UTC)
            return None

        return process

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if isinstance(value, str):  # SQLite values written by the database clock, or edited by hand
            try:
                value = dt.datetime.fromisoformat(value)
            except ValueError:
                return None  # unreadable: treated as unset (the supervisor reschedules a job without next_run_at)
        return value.replace(tzinfo=UTC)


def _check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    quoted = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({quoted})", name=f"ck_{column}")


metadata = sa.MetaData()

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("job_type", sa.String(100), nullable=False),
    sa.Column("description", sa.Text),
    sa.Column("cron_expression", sa.String(120), nullable=False),
    sa.Column("timezone", sa.String(64), nullable=False, server_default="UTC"),
    sa.Column("status", sa.String(20), nullable=False, server_default="Pending"),
    sa.Column("configuration", sa.Text),
    sa.Column("start_at", UTCDateTime),
    sa.Column("end_at", UTCDateTime),
    sa.Column("next_run_at", UTCDateTime(exact=True)),
    sa.Column("last_run_at", UTCDateTime),
    sa.Column("run_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("success_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("failure_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("skipped_count", sa.Integer, nullable=False, server_default="0"),
    # occurrences the missed-run policy folded into a catch-up run or dropped (revision 0010)
    sa.Column("missed_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_duration_ms", sa.Float),
    sa.Column("avg_duration_ms", sa.Float),
    sa.Column("concurrency_mode", sa.String(20), nullable=False, server_default="Skip"),
    # QueueAll: at most this many occurrences wait while a run is live, the oldest skipped beyond it (0013)
    sa.Column("max_queued", sa.Integer, nullable=False, server_default="10"),
    sa.Column("missed_run_policy", sa.String(20), nullable=False, server_default="RunOnce"),
    sa.Column("max_jitter_s", sa.Float),
    sa.Column("run_immediately_if_never_run", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("max_runtime_minutes", sa.Integer),
    # resource limits of each run (None: the settings' [limits]); see worker/limits.py
    sa.Column("max_memory_mb", sa.Integer),
    sa.Column("max_cpu_s", sa.Integer),
    sa.Column("max_open_files", sa.Integer),
    sa.Column("max_processes", sa.Integer),
    sa.Column("nice", sa.Integer),
    sa.Column("notify_on_success", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("notify_on_failure", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("notify_on_missed", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("notify_recipients", sa.Text),  # JSON list of addresses; none: the channel's own recipients
    # -- time knobs (revision 0007); values checked by jobspec, an edited bad one makes the job "bad" --
    sa.Column("dst_gap_policy", sa.String(20), nullable=False, server_default="Shift"),
    sa.Column("dst_fold_policy", sa.String(20), nullable=False, server_default="OnceIfFixedHour"),
    sa.Column("missed_run_grace_s", sa.Float),  # none: missed once the next occurrence is due
    sa.Column("max_total_runtime_s", sa.Float),  # none: no hard cap
    # -- retries and pause on repeated failure (revision 0012); see planner.retry_at --
    sa.Column("max_retries", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retry_backoff_s", sa.Float, nullable=False, server_default="10"),  # the first retry's delay
    sa.Column("retry_backoff_factor", sa.Float, nullable=False, server_default="2"),
    sa.Column("retry_backoff_max_s", sa.Float),  # none: no cap on the delay
    sa.Column("retry_max_jitter_s", sa.Float),  # none: no jitter
    sa.Column("retry_on", sa.String(100)),  # comma-separated run statuses; none: Failed,Timeout
    # the pending retry (all NULL: none): due at retry_at (= next_run_at while pending), of occurrence
    # retry_scheduled_at, attempt retry_attempt; retry_next_run_at is the next_run_at it displaced
    sa.Column("retry_at", UTCDateTime),
    sa.Column("retry_attempt", sa.Integer),
    sa.Column("retry_scheduled_at", UTCDateTime),
    sa.Column("retry_next_run_at", UTCDateTime),
    sa.Column("pause_after_failures", sa.Integer),  # none: never paused for failures
    sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),  # final failures in a row
    sa.Column("paused_reason", sa.Text),
    sa.Column("lock_token", sa.String(36)),
    sa.Column("locked_at", UTCDateTime),
    sa.Column("locked_by_instance", sa.String(255)),
    sa.Column("expected_completion_at", UTCDateTime),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    _check("status", JOB_STATUSES),
    _check("concurrency_mode", CONCURRENCY_MODES),
    _check("missed_run_policy", MISSED_RUN_POLICIES),
    sa.Index("ix_jobs_status_next_run_at", "status", "next_run_at"),
    sqlite_autoincrement=True,  # ids are never reused (PostgreSQL and MySQL never reuse them anyway)
)

runs = sa.Table(
    "runs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("scheduled_at", UTCDateTime),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("completed_at", UTCDateTime),
    sa.Column("status", sa.String(20), nullable=False, server_default="Running"),
    sa.Column("success", sa.Boolean),
    sa.Column("error_message", sa.Text),
    sa.Column("details", sa.Text),
    sa.Column("queued_at", UTCDateTime),
    sa.Column("executed_by_instance", sa.String(255)),
    sa.Column("lock_token", sa.String(36)),
    sa.Column("deadline_at", UTCDateTime),
    sa.Column("duration_ms", sa.Float),
    # `runs cancel`: when and by whom (user@host or an actor) a cancel was asked; the holder acts on it
    sa.Column("cancel_requested_at", UTCDateTime),
    sa.Column("cancel_requested_by", sa.String(255)),
    # a catch-up run: how many later occurrences it folded (revision 0010)
    sa.Column("missed_count", sa.Integer, nullable=False, server_default="0"),
    # what the run used, measured by its worker (revision 0011): CPU seconds, peak resident memory in MiB
    sa.Column("cpu_s", sa.Float),
    sa.Column("max_rss_mb", sa.Float),
    sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),  # 1 the first run, 2 its first retry
    # an abandoned run's true outcome, reported later by its own supervisor (revision 0015): kept, never
    # counted; the run stays Failed (abandoned) as far as its job's lease and statistics go
    sa.Column("late_status", sa.String(20)),
    sa.Column("late_completed_at", UTCDateTime),
    sa.Column("late_error_message", sa.Text),
    sa.Column("late_details", sa.Text),
    _check("status", RUN_STATUSES),
    sa.Index("ix_runs_job_id_started_at", "job_id", "started_at"),
    sa.Index("ix_runs_status", "status"),
    sa.Index("ix_runs_started_at", "started_at", "status"),  # dashboard charts, time filters (revision 0006)
    # at most one run per occurrence and attempt, whatever the number of supervisors (manual runs have no
    # scheduled_at; a retry is a new run of the same occurrence, revision 0012)
    sa.UniqueConstraint("job_id", "scheduled_at", "attempt", name="uq_runs_job_id_scheduled_at_attempt"),
    # a deleted run's id must never come back: a late result of the old run would land on the new one
    sqlite_autoincrement=True,
)

# pending occurrences to run outside the regular schedule (revision 0014): `jobs backfill` (attempt 1 of each
# occurrence of a past window that has no run) and `runs retry` (the next attempt of a run's occurrence). A
# supervisor claims one by deleting its row in the transaction that inserts the run (mjsched_isolated.store.backfills)
backfills = sa.Table(
    "backfills", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("scheduled_at", UTCDateTime),  # the occurrence (None: a retry of a manual run)
    sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),
    sa.Column("kind", sa.String(20), nullable=False, server_default="Backfill"),  # Backfill or Retry
    sa.Column("retry_of_run_id", sa.Integer),  # Retry: the run retried (no foreign key: it may be pruned)
    sa.Column("requested_at", UTCDateTime, nullable=False),
    sa.Column("requested_by", sa.String(255), nullable=False),
    sa.CheckConstraint("kind IN ('Backfill', 'Retry')", name="ck_kind"),
    # one pending entry per occurrence and attempt (idempotent requests); also the job's index
    sa.UniqueConstraint("job_id", "scheduled_at", "attempt", name="uq_backfills_job_id_scheduled_at_attempt"),
    sqlite_autoincrement=True,
)

supervisors = sa.Table(
    "supervisors", metadata,
    sa.Column("instance", sa.String(255), primary_key=True),
    sa.Column("hostname", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("heartbeat_at", UTCDateTime, nullable=False),
    # the liveness lease: every lease and run this supervisor holds is live only while this is in the future
    sa.Column("lease_expires_at", UTCDateTime, nullable=False),
    sa.Column("stopped_at", UTCDateTime),
    sa.Column("max_concurrent_jobs", sa.Integer),  # its worker cap (None: a row written before 0008)
    sa.Column("version", sa.String(40)),  # the mjsched_isolated version it runs
)

NOTIFICATION_EVENTS = values(NotificationEvent)
NOTIFICATION_STATUSES = values(NotificationStatus)
PRIORITIES = values(Priority)

# the durable outbox: one row per (notice, channel), written in the transaction that records its cause
notifications = sa.Table(
    "notifications", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("channel", sa.String(20), nullable=False),
    sa.Column("event", sa.String(20), nullable=False),
    sa.Column("job_id", sa.Integer),  # no foreign key: a notice outlives its job and its run
    sa.Column("job_name", sa.String(200), nullable=False),
    sa.Column("run_id", sa.Integer),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("priority", sa.String(10), nullable=False, server_default="Normal"),
    sa.Column("recipients", sa.Text),  # JSON list
    sa.Column("details", sa.Text),  # JSON object (NotificationContent.metadata)
    sa.Column("status", sa.String(20), nullable=False, server_default="Pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", UTCDateTime, nullable=False),
    sa.Column("claimed_by", sa.String(255)),
    sa.Column("claimed_until", UTCDateTime),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("sent_at", UTCDateTime),
    _check("event", NOTIFICATION_EVENTS),
    _check("status", NOTIFICATION_STATUSES),
    _check("priority", PRIORITIES),
    sa.Index("ix_notifications_status_next_attempt_at", "status", "next_attempt_at"),
    sqlite_autoincrement=True,
)


# a run's captured output (stdout, stderr, logging records of its worker): ordered chunks, each at most
# OUTPUT_CHUNK_BYTES of UTF-8 (under MariaDB's 64 KB TEXT), deleted with the run (see mjsched_isolated.store.output)
run_output = sa.Table(
    "run_output", metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)

# `plugins reload` requests: every supervisor compares the newest id with the one it last acted on (see
# mjsched_isolated.supervisor.reload); older rows are deleted by the next request
plugin_reloads = sa.Table(
    "plugin_reloads", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("requested_at", UTCDateTime, nullable=False),
    sa.Column("requested_by", sa.String(255), nullable=False),
)

# who did what through the dashboard, and when (revision 0006): one row per action, refused ones too
audit_log = sa.Table(
    "audit_log", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.Column("actor", sa.String(255), nullable=False),
    sa.Column("role", sa.String(20), nullable=False),
    sa.Column("action", sa.String(50), nullable=False),
    sa.Column("target", sa.String(255)),
    sa.Column("outcome", sa.String(20), nullable=False),
    sa.Column("details", sa.Text),
    sa.Column("remote_addr", sa.String(64)),
    sa.Index("ix_audit_log_at", "at"),
)


def create_engine(url: str, *, auto_upgrade: bool = False) -> Engine:
    """An engine whose schema is at this code's revision: an empty database is migrated to head, an
    outdated one only with ``auto_upgrade``, else :class:`migrate.SchemaError` (see :mod:`.migrate`)."""
    from mjsched_isolated.store import migrate  # noqa: PLC0415 - migrate imports alembic; schema stays light

    engine = connect(url)
    try:
        migrate.prepare(engine, auto_upgrade=auto_upgrade)
    except BaseException:
        engine.dispose()
        raise
    return engine


def connect(url: str) -> Engine:
    """An engine, schema untouched. SQLite gets WAL, a 30 s busy timeout and foreign keys, and its pool hands
    out the connection returned last (LIFO): a connection sees another's commit as a changed database and
    drops its whole page cache, so taking turns among the pool's connections (the default FIFO, once a
    thread's connection joined the pool) re-read pages for every transaction (issue 11: 7.5 ``pread`` calls
    a run in a saturated supervisor, 0.6 with LIFO)."""
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 30}, pool_use_lifo=True)

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cursor = dbapi_conn.cursor()
            if url not in ("sqlite://", "sqlite:///:memory:"):
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
    else:
        engine = sa.create_engine(url)
        _ping_when_idle(engine)
    return engine


IDLE_PING_S = 1.0
"""A pooled connection idle this long (seconds) is pinged before it is handed out (see :func:`_ping_when_idle`)."""


def _ping_when_idle(engine: Engine) -> None:
    """Pessimistic disconnect handling without a round trip per checkout (issue 11: ``pool_pre_ping`` pinged
    every checkout, a fifth of a busy supervisor's round trips on PostgreSQL): a connection is pinged only
    if it sat in the pool :data:`IDLE_PING_S` or longer. A ping that finds it dead raises
    ``DisconnectionError``, so the pool replaces it (SQLAlchemy tries three times), and marks the whole pool
    stale (every connection opened before is replaced at its next checkout), as an error found by a
    statement does (:mod:`.driver` does the same for its prepared statements)."""
    dialect = engine.dialect

    @sa.event.listens_for(engine, "checkin")
    def _checkin(_dbapi_conn, record) -> None:
        record.info["mjsched_idle_since"] = time.monotonic()

    @sa.event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn, record, proxy) -> None:
        since = record.info.pop("mjsched_idle_since", None)
        if since is None or time.monotonic() - since < IDLE_PING_S:  # new, or used a moment ago
            return
        try:
            alive = dialect.do_ping(dbapi_conn)
        except dialect.loaded_dbapi.Error as exc:
            if not dialect.is_disconnect(exc, dbapi_conn, None):
                raise
            engine.pool._invalidate(proxy, exc, _checkin=False)  # the others are as stale: replaced at checkout
            raise sa.exc.DisconnectionError(f"connection lost while idle: {exc}") from exc
        if alive is False:
            engine.pool._invalidate(proxy, None, _checkin=False)
            raise sa.exc.DisconnectionError("connection lost while idle")


def reader(engine: Engine) -> Engine:
    """``engine`` for reads that write nothing (the poll's due reads, liveness reads): on PostgreSQL the
    same pool in autocommit (``isolation_level="AUTOCOMMIT"``, set on the driver's connection without a
    round trip), so a read is one round trip instead of BEGIN, the read and the ROLLBACK of the pool's
    reset (which also made psycopg drop its prepared statements: ``DEALLOCATE ALL``, a fourth); each
    statement still sees one consistent snapshot. Elsewhere ``engine`` itself (MariaDB would switch its
    autocommit with a round trip each way; SQLite's driver begins no transaction for a read)."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="AUTOCOMMIT")
    return engine


def db_now(dialect_name: str) -> sa.ColumnElement:
    """The database's current UTC time as a SQL expression (typed :class:`UTCDateTime`)."""
    return db_now_plus(dialect_name, 0.0)


def db_now_plus(dialect_name: str, seconds: float) -> sa.ColumnElement:
    """The database's current UTC time plus ``seconds``, as a SQL expression."""
    expr: sa.ColumnElement
    if dialect_name == "sqlite":
        expr = sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"{seconds:+.6f} seconds")
    elif dialect_name == "postgresql":
        expr = sa.func.timezone("UTC", sa.func.clock_timestamp()) + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)
    elif dialect_name in ("mysql", "mariadb"):
        expr = sa.func.timestampadd(sa.text("MICROSECOND"), int(seconds * 1_000_000), sa.func.utc_timestamp(6))
    else:
        raise NotImplementedError(f"database dialect {dialect_name!r} is not supported")
    return sa.type_coerce(expr, UTCDateTime)
