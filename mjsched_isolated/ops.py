"""The job operations, validated: one implementation for the CLI, the Python :class:`~mjsched_isolated.client.Client`
and (later) a web dashboard.

Each operation takes plain typed arguments (a :class:`Store`, the :class:`Settings`, names, field values)
and ``now`` (aware UTC) where it decides anything; it never prints and never reads a clock, except
:func:`run_job`, an outer loop like ``serve``. Bad input raises :class:`InputError` (or a subclass) with
``.field`` and ``.message``; nothing is written then. Field names are the store's column names
(``cron_expression``), which the CLI re-labels as its flags where they differ.

Rows returned are the views of :func:`job_view` / :func:`run_view`: the store's columns, with
``configuration``, ``notify_recipients`` and ``details`` decoded from their JSON text.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa

from mjsched_isolated import cgroups, cron, jobspec, planner, proctree
from mjsched_isolated.config import Retention, Settings, redact_url
from mjsched_isolated.enums import ConcurrencyMode, JobStatus, RunStatus, values
from mjsched_isolated.errors import (
    InputError,
    MjschedError,
    NotFoundError,
    first_line,
    msgspec_field_error,
)
from mjsched_isolated.isotime import iso
from mjsched_isolated.jobspec import JobSpec
from mjsched_isolated.status import MANUAL_INSTANCE_PREFIX, collect
from mjsched_isolated.store import Store, migrate
from mjsched_isolated.store.migrate import SchemaError
from mjsched_isolated.store.records import JobRow
from mjsched_isolated.supervisor.inspection import inspect_plugins

log = logging.getLogger("mjsched.ops")
Row = dict[str, Any]
JOB_FIELDS: tuple[str, ...] = tuple(JobSpec.__struct_fields__)
NO_RETRY = {"retry_at": None, "retry_attempt": None, "retry_scheduled_at": None, "retry_next_run_at": None}
RUN_STATUSES = values(RunStatus)
SYNC_ATTEMPTS = 3  # a sync that lost a name race to another supervisor's sync re-reads and tries again


class AlreadyRunningError(MjschedError):
    """``run_job`` of a Skip or Replace job whose run holds the lease (``holder``: the supervisor, or None;
    ``run_id``: the live run, when known). A Replace job is not replaced by a manual run: the message says
    to cancel the live run first (``runs cancel``)."""

    def __init__(self, name: str, concurrency_mode: str, holder: str | None, locked_at: dt.datetime | None,
                 run_id: int | None = None) -> None:
        self.name, self.holder, self.run_id = name, holder, run_id
        run = f"run {run_id}" if run_id is not None else "its run"
        where = (f"{run} holds the lease, taken by supervisor {holder} at {locked_at:%Y-%m-%dT%H:%M:%SZ}"
                 if holder and locked_at else f"{holder} is starting or running {run}" if holder
                 else "its run ended just now; try again")
        hint = ("; `jobs run` does not replace a live run: cancel it first (`mjsched runs cancel "
                f"{run_id if run_id is not None else 'ID'}`)" if concurrency_mode == ConcurrencyMode.REPLACE else "")
        super().__init__(f"job {name!r} is already running ({where}); concurrency_mode {concurrency_mode} "
                         f"refuses a second run{hint}")


class DatabaseUnreachableError(MjschedError):
    """``serve``'s database stayed unreachable for longer than ``wait_for_db_s`` (exit 1)."""


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`run_job` did: ``run_id`` of the run it recorded, or None with ``queued`` (a Queue job
    whose live run ends first). ``was_paused``: the job is Paused and stays so (the run was manual)."""

    run_id: int | None
    queued: bool = False
    was_paused: bool = False


class CheckReport(msgspec.Struct, frozen=True):
    """``check``: ``ok`` when ``problems`` is empty; ``notes`` say what was checked."""

    ok: bool
    problems: list[str]
    notes: list[str]


class PruneResult(msgspec.Struct, frozen=True, kw_only=True):
    """``runs prune``: rows deleted (or, with ``dry_run``, that would be) and the rules used."""

    pruned: int
    dry_run: bool
    keep_days: float
    keep_min_per_job: int
    notifications_pruned: int


# -- the database ------------------------------------------------------------------------------------
def open_store(url: str, *, auto_upgrade: bool = False, must_exist: bool = False, field: str = "--db") -> Store:
    """:meth:`Store.open` with connection problems as :class:`InputError` on ``field``. ``must_exist``
    (read-only commands): a SQLite file that does not exist is an error, not a new empty database."""
    if must_exist:
        require_existing_database(url, field)
    try:
        return Store.open(url, auto_upgrade=auto_upgrade)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as exc:  # ValueError: e.g. a bad port
        raise InputError(field, f"not a usable database URL {redact_url(url)!r} ({first_line(exc)})") from None
    except sa.exc.OperationalError as exc:
        reason = str(exc.orig).lower()
        unknown_database = getattr(exc.orig, "args", (None,))[:1] == (1049,)  # MySQL/MariaDB ER_BAD_DB_ERROR
        if (getattr(exc, "connection_invalidated", False) or "connect" in reason or "unable to open" in reason
                or unknown_database):
            raise InputError(field, f"cannot connect to {redact_url(url)!r}: "
                                    f"{str(exc.orig).strip().splitlines()[0]}") from None
        raise


# a server that is down, restarting, failing over or not yet reachable: worth waiting for. Anything else
# (a bad URL, a missing driver, bad credentials, an unknown database, a SQLite path) is a configuration error.
UNREACHABLE_MARKERS = ("connection refused", "could not connect", "can't connect", "connection timed out",
                       "timeout expired", "timed out", "server closed the connection", "connection reset",
                       "lost connection", "the database system is starting up", "the database system is shutting down",
                       "no route to host", "network is unreachable", "could not translate host name",
                       "name or service not known", "temporary failure in name resolution")
WAIT_BACKOFF_S = (0.1, 0.5)  # first and longest pause between tries while the database is unreachable


def database_unreachable(url: str, exc: BaseException) -> bool:
    """Is ``exc`` (from opening ``url``) a server that cannot be reached right now, rather than a
    configuration error? SQLite files are never "unreachable"."""
    if url.startswith("sqlite") or not isinstance(exc, sa.exc.OperationalError):
        return False
    reason = str(exc.orig).lower()
    return any(marker in reason for marker in UNREACHABLE_MARKERS)


def open_store_waiting(url: str, *, auto_upgrade: bool = False, wait_s: float | None = None,
                       on_wait: Callable[[int, float, str], None] | None = None, field: str = "--db") -> Store:
    """:func:`open_store` for ``serve``: while the database *server* is unreachable
    (:func:`database_unreachable`), try again after a pause that doubles from 0.1 s to at most 0.5 s (so a
    database that comes back is used within a second), for at most ``wait_s`` seconds (None: as long
    as it takes). Before each pause ``on_wait(attempt, pause_s, reason)`` is called (log, health). Raises
    :class:`InputError` (``field``) for a configuration error at once, :class:`DatabaseUnreachableError` when
    ``wait_s`` runs out. Reads clocks and sleeps: an outer loop, like :func:`run_job`."""
    started = time.monotonic()
    pause_s = WAIT_BACKOFF_S[0]
    attempt = 0
    while True:
        attempt += 1
        try:
            return Store.open(url, auto_upgrade=auto_upgrade)
        except sa.exc.OperationalError as exc:
            if not database_unreachable(url, exc):
                return open_store(url, auto_upgrade=auto_upgrade, field=field)  # the one-line error
            reason = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig).__name__
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError):
            return open_store(url, auto_upgrade=auto_upgrade, field=field)
        waited_s = time.monotonic() - started
        if wait_s is not None and waited_s + pause_s > wait_s:
            raise DatabaseUnreachableError(f"database {redact_url(url)} still unreachable after {waited_s:.1f} s "
                                      f"({attempt} tries, wait_for_db_s {wait_s:g}): {reason}")
        if on_wait is not None:
            on_wait(attempt, pause_s, reason)
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, WAIT_BACKOFF_S[1])


def require_existing_database(url: str, field: str = "--db") -> None:
    """Raise :class:`InputError` naming ``field`` when ``url`` is a SQLite file that does not exist (a
    read-only command must not create it)."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return  # open_store reports it
    database = parsed.database or ""
    if not parsed.drivername.startswith("sqlite") or database in ("", ":memory:") or database.startswith("file:"):
        return
    if not Path(database).exists():
        raise InputError(field, f"no database at {database!r} (a read-only command does not create one; "
                                "`mjsched db upgrade` or `mjsched jobs add` does)")


# -- views ---------------------------------------------------------------------------------------------
def job_view(row: Mapping[str, Any]) -> Row:
    """A job row with ``configuration`` (object) and ``notify_recipients`` (list) decoded from JSON."""
    view = {str(k): v for k, v in row.items()}  # plain str keys (SQLAlchemy's are a str subclass)
    for key in ("configuration", "notify_recipients"):
        if isinstance(view.get(key), str):
            try:
                view[key] = json.loads(view[key])
            except ValueError:
                pass  # written by hand or another tool: shown as stored
    if isinstance(view.get("retry_on"), str):  # stored comma-separated
        view["retry_on"] = [s.strip() for s in view["retry_on"].split(",") if s.strip()]
    return view


def run_view(row: Mapping[str, Any]) -> Row:
    """A run row (``details`` is already decoded by the store), with plain ``str`` keys."""
    return {str(k): v for k, v in row.items()}


def list_jobs(store: Store) -> list[Row]:
    """Every job by name, as :func:`job_view` rows."""
    return [job_view(r) for r in store.list_jobs()]


def get_job(store: Store, name: str) -> Row:
    """Job ``name``, with ``pending_backfill_count`` and ``pending_backfill`` (the first
    :data:`PENDING_SHOWN` pending occurrences of ``jobs backfill`` / ``runs retry``: ``scheduled_at``,
    ``attempt``, ``kind``, ``requested_by``, ``requested_at``). Raises :class:`NotFoundError` (field ``name``)."""
    view = job_view(store.get_job(name))
    count, rows = store.backfills.pending(view["id"], PENDING_SHOWN)
    view["pending_backfill_count"] = count
    view["pending_backfill"] = [{k: r[k] for k in ("scheduled_at", "attempt", "kind", "requested_by",
                                                   "requested_at")} for r in rows]
    return view


PENDING_SHOWN = 10  # pending backfill entries listed by get_job (the count is exact)


MAX_LIMIT = 2**31 - 1  # every database's INTEGER holds it (SQLite overflowed past 2**63 with a traceback)


def list_runs(store: Store, *, job: str | None = None, status: str | None = None, limit: int = 50) -> list[Row]:
    """Runs newest first. Raises :class:`InputError` on ``limit`` (not an integer from 1 to
    :data:`MAX_LIMIT`) or ``status``; :class:`NotFoundError` (field ``name``) for an unknown ``job``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InputError("limit", f"must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    if status is not None and status not in RUN_STATUSES:
        raise InputError("status", f"must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    return [run_view(r) for r in store.list_runs(job_name=job, status=status, limit=limit)]


def get_run(store: Store, run_id: int) -> Row:
    """Run ``run_id``. Raises :class:`NotFoundError` (field ``id``)."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 0 < run_id < 2**63:
        raise InputError("id", f"no run with id {run_id!r}")
    return run_view(store.get_run(run_id))


def default_actor() -> str:
    """Who is asking, for the records: ``<user>@<hostname>`` of this process."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): the uid will do
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def cancel_run(store: Store, run_id: int, requested_by: str | None = None) -> Row:
    """Ask for run ``run_id`` to be cancelled (Flower's revoke/terminate, Oban Web's cancel): the request
    (``cancel_requested_at`` by the database clock, ``cancel_requested_by`` = ``requested_by`` or
    :func:`default_actor`) is written on the Running run row, and whichever supervisor holds the run
    kills its process tree at its next lease renewal (within ``lease_renew_interval_s``; a run claimed ahead
    that waits for its instant, just before it: its plugin never starts) and records it Cancelled, not
    counted as a failure. A run that finishes first keeps its outcome. Returns the run
    (still Running). Raises :class:`NotFoundError` (field ``id``) for an unknown run, :class:`InputError`
    (``id``) for a run that is no longer Running (nothing written), (``requested_by``) for a name that is
    empty, longer than :data:`MAX_ACTOR_CHARS` or not one line of printable characters."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 0 < run_id < 2**63:
        raise InputError("id", f"no run with id {run_id!r}")
    row = store.request_cancel(run_id, _actor(requested_by))
    if row is None:
        raise NotFoundError("id", f"no run with id {run_id}")
    if row["status"] != RunStatus.RUNNING.value:
        ended = row["completed_at"]
        raise InputError("id", f"run {run_id} is not running: it ended {row['status']}"
                               f"{f' at {ended:%Y-%m-%dT%H:%M:%SZ}' if ended else ''}; nothing to cancel")
    return get_run(store, run_id)
# -- backfill and retry (pending occurrences, mjsched_isolated.store.backfills) -------------------------------
DEFAULT_BACKFILL_MAX = planner.DEFAULT_BACKFILL_MAX  # occurrences a backfill may add unless raised
BACKFILL_MAX_LIMIT = 10_000
BACKFILL_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)  # a window starting earlier is a typo, not a backfill


class BackfillResult(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`backfill_job` did: of the ``occurrences`` in ``[window_start, window_end]``, ``added``
    (pending now; a supervisor runs them), ``already_run`` (a run of the occurrence exists, any attempt),
    ``already_pending`` (added by an earlier request) and ``left_to_schedule`` (at or after the job's
    ``next_run_at``: the regular schedule runs them). Times are aware UTC."""

    job_name: str
    window_start: dt.datetime
    window_end: dt.datetime
    occurrences: int
    added: list[dt.datetime]
    already_run: list[dt.datetime]
    already_pending: list[dt.datetime]
    left_to_schedule: list[dt.datetime]
    requested_by: str
    requested_at: dt.datetime


MAX_ACTOR_CHARS = 200  # a ``requested_by`` name (one line)


def _actor(requested_by: str | None) -> str:
    """``requested_by`` stripped, or :func:`default_actor` (cut to :data:`MAX_ACTOR_CHARS`). Raises
    :class:`InputError` (``requested_by``) unless it is one line of 1 to :data:`MAX_ACTOR_CHARS` characters
    without control characters; the error shows at most the first 40 characters of it."""
    if requested_by is None:
        return default_actor()[:MAX_ACTOR_CHARS]
    actor = requested_by.strip() if isinstance(requested_by, str) else None
    if actor is None or not 1 <= len(actor) <= MAX_ACTOR_CHARS or not actor.isprintable():
        shown = repr(requested_by[:40]) + (f"... ({len(requested_by)} characters)" if len(requested_by) > 40 else "") \
            if isinstance(requested_by, str) else repr(requested_by)
        raise InputError("requested_by", f"must be one line of 1 to {MAX_ACTOR_CHARS} printable characters, "
                                         f"got {shown}")
    return actor


def _window_bound(field: str, value: Any, job: Mapping[str, Any]) -> dt.datetime:
    if not isinstance(value, dt.datetime):
        raise InputError(field, f"must be a date-time, got {value!r}")
    return value.replace(tzinfo=cron.zone(job["timezone"])) if value.tzinfo is None else value


def backfill_job(store: Store, name: str, start: dt.datetime, end: dt.datetime, now: dt.datetime, *,
                 max_occurrences: int = DEFAULT_BACKFILL_MAX, requested_by: str | None = None,
                 audit_role: str | None = "cli") -> BackfillResult:
    """Run job ``name``'s occurrences in the past window ``[start, end]`` (naive times are read in the job's
    timezone; its cron, zone, DST policies and jitter give the occurrences, as for the regular schedule)
    through the normal path: they are stored as pending (durable) and the supervisors claim them under the
    cap, the job's concurrency mode and lease, each run recorded with its own ``scheduled_at``
    (Temporal's schedule backfill, ``kubectl create job --from``). Idempotent: an occurrence that has a run
    (any attempt) or is already pending is not added again. The job's ``next_run_at`` is not touched, and
    occurrences at or after it are left to the regular schedule. Written in one transaction with an
    ``audit_log`` row (``audit_role``; None: the caller audits, as the dashboard does).

    Raises :class:`NotFoundError` (``name``); :class:`InputError` naming ``name`` when the job is Expired or
    Disabled (only Active jobs run pending entries; a Paused job's wait until it is resumed), ``from``/``to``
    (not a date-time, ``from`` before 1970, ``to`` before ``from`` or after ``now``), ``max`` (not 1 to
    :data:`BACKFILL_MAX_LIMIT`, or the window holds more occurrences than it), ``requested_by``; nothing is
    written then."""
    if isinstance(max_occurrences, bool) or not isinstance(max_occurrences, int) \
            or not 1 <= max_occurrences <= BACKFILL_MAX_LIMIT:
        raise InputError("max", f"must be an integer from 1 to {BACKFILL_MAX_LIMIT}, got {max_occurrences!r}")
    actor = _actor(requested_by)
    job = store.get_job(name)
    if job["status"] in (JobStatus.EXPIRED, JobStatus.DISABLED):  # its pending entries would never run
        how = ("its end_at has passed: move end_at later (jobs update) first" if job["status"] == JobStatus.EXPIRED
               else "make it Active (its status in the jobs file, or jobs resume) first")
        raise InputError("name", f"job {name!r} is {job['status']}: a backfill of it would never run; {how}")
    lo, hi = _window_bound("from", start, job), _window_bound("to", end, job)
    if lo < BACKFILL_EPOCH:
        raise InputError("from", f"must be after {iso(BACKFILL_EPOCH)}, got {iso(lo)}")
    if hi < lo:
        raise InputError("to", f"must not be before from ({iso(lo)}), got {iso(hi)}")
    if hi > now:
        raise InputError("to", f"must not be in the future (a backfill runs past occurrences), got {iso(hi)}")
    try:
        found = planner.occurrences_in_window(job, lo, hi, max_occurrences)
    except (MjschedError, OverflowError, ValueError) as exc:
        raise InputError("cron_expression", f"job {name!r} has no usable schedule: {first_line(exc)}") from None
    if len(found) > max_occurrences:
        raise InputError("max", f"the window {iso(lo)} to {iso(hi)} holds more than {max_occurrences} "
                                "occurrences of job " f"{name!r}; narrow the window or raise the bound")
    # the schedule's next occurrence (a pending automatic retry displaces it into retry_next_run_at)
    regular = job["retry_next_run_at"] if planner.pending_retry(job) else job["next_run_at"]
    left = [t for t in found if regular is not None and t >= regular]
    wanted = [t for t in found if t not in left]
    audit = None if audit_role is None else {
        "actor": actor[:255], "role": audit_role[:20], "action": "backfill", "target": name[:255], "outcome": "ok",
        "details": json.dumps({"from": lo.isoformat(), "to": hi.isoformat(), "max": max_occurrences,
                               "occurrences": len(found)})}
    added = store.backfills.add_backfill(job["id"], wanted, requested_by=actor, requested_at=now, audit=audit)
    return BackfillResult(job_name=name, window_start=lo, window_end=hi, occurrences=len(found),
                          added=added["added"], already_run=added["already_run"],
                          already_pending=added["already_pending"], left_to_schedule=left,
                          requested_by=actor, requested_at=now)


def retry_run(store: Store, run_id: int, now: dt.datetime, *, requested_by: str | None = None) -> Row:
    """Run run ``run_id``'s occurrence again (Oban Web's retry, Hangfire's requeue): a new run with the same
    ``scheduled_at`` and the next ``attempt``, made pending (durable) for a supervisor to start through
    the normal path (cap, mode, lease) at its next poll, while the job is Active. Returns the pending
    entry (``job_name``, ``scheduled_at``, ``attempt``, ``retry_of_run_id``, ``requested_by``, ...).

    Raises :class:`NotFoundError` (``id``) for an unknown run; :class:`InputError` (``id``) when the run
    has not ended, when another run of the job is live and its concurrency mode is not Concurrent, or when
    a retry of this occurrence is already pending; nothing is written then."""
    run = get_run(store, run_id)
    actor = _actor(requested_by)
    job = store.get_job_by_id(run["job_id"])
    if job is None:
        raise NotFoundError("id", f"the job of run {run_id} no longer exists")
    if run["status"] == RunStatus.RUNNING.value:
        raise InputError("id", f"run {run_id} is still running: wait for it to end, or cancel it (`runs cancel`)")
    if job["concurrency_mode"] != ConcurrencyMode.CONCURRENT:
        live = store.backfills.live_run_id(job["id"])
        if live is not None:
            raise InputError("id", f"job {job['name']!r} has a live run ({live}) and concurrency_mode "
                                   f"{job['concurrency_mode']} runs one at a time: wait for it or cancel it")
    scheduled_at = run["scheduled_at"]
    if scheduled_at is not None and job["retry_at"] is not None and job["retry_scheduled_at"] == scheduled_at:
        raise InputError("id", f"an automatic retry of this occurrence is already pending (attempt "
                               f"{job['retry_attempt']} at {job['retry_at']:%Y-%m-%dT%H:%M:%SZ})")
    waiting = store.backfills.pending_retry(job["id"], scheduled_at, run_id)
    if waiting is not None:
        raise InputError("id", f"a retry of this occurrence is already pending (attempt {waiting['attempt']}, "
                               f"requested by {waiting['requested_by']})")
    attempt = (store.backfills.attempts_of(job["id"], scheduled_at) if scheduled_at is not None
               else run["attempt"]) + 1
    entry = store.backfills.add_retry(job["id"], scheduled_at, attempt, retry_of_run_id=run_id,
                                      requested_by=actor, requested_at=now)
    return {**{str(k): v for k, v in entry.items()}, "job_name": job["name"], "job_status": job["status"]}


def run_output(store: Store, run_id: int, after_seq: int = -1) -> tuple[list[tuple[int, str]], bool]:
    """Run ``run_id``'s captured output after chunk ``after_seq`` as ``(seq, text)`` chunks in order, and
    whether the run is still Running (read first: once it is not, the chunks returned are all there is).
    Raises :class:`NotFoundError` (field ``id``)."""
    running = get_run(store, run_id)["status"] == "Running"
    return store.run_output(run_id, after_seq), running


def status(store: Store) -> Row:
    """The ``status`` report (:func:`mjsched_isolated.status.collect`)."""
    return collect(store)


# -- job specs -----------------------------------------------------------------------------------------
def make_spec(fields: Mapping[str, Any], where: str = "") -> JobSpec:
    """A checked :class:`JobSpec` from field values by their store names (``configuration`` a dict,
    ``start_at`` a datetime, enums or their strings). Raises :class:`InputError` naming the field
    (unknown ones too), prefixed by ``where``."""
    for key in fields:
        if key not in JOB_FIELDS:
            raise InputError(f"{where}{key}", f"unknown job field; known: {', '.join(JOB_FIELDS)}")
    try:
        spec = msgspec.convert(dict(fields), JobSpec)
    except msgspec.ValidationError as exc:
        field, message = msgspec_field_error(exc, "")
        raise InputError(f"{where}{field}", message) from None
    return jobspec.check(spec, where)


def require_plugins_dir(settings: Settings) -> None:
    """Raise :class:`InputError` (``plugins_dir``) when an explicitly named plugins folder (``--plugins``,
    ``MJSCHED_PLUGINS_DIR``, ``plugins_dir``) does not exist: a wrong working directory or a host not yet
    updated, whose jobs would be checked, or run, without its plugins."""
    if settings.plugins_dir is not None and not Path(settings.plugins_dir).is_dir():
        raise InputError("plugins_dir", f"plugins folder {settings.plugins_dir!r} does not exist or is not a folder")


def validate_configurations(settings: Settings, specs: Sequence[JobSpec],
                            prefix: Callable[[int], str] = lambda i: "") -> None:
    """Ask a worker child whether each spec's ``job_type`` exists and its configuration is valid. The child
    starts from the last good plugin copies of a live ``serve`` of the same plugins folder on this machine:
    a job type whose file no longer imports but which serve keeps running (its last good version) is
    accepted, with a warning naming the broken file (logged). Raises :class:`InputError` naming
    ``<prefix(i)>job_type`` or ``<prefix(i)>configuration.<path>``."""
    require_plugins_dir(settings)
    checks = [(s.job_type, jobspec.row_values(s)["configuration"]) for s in specs]
    report = inspect_plugins(settings, checks, borrow_good_plugins=True)
    for i, error in enumerate(report.errors):
        if error is not None:
            field, _, message = error.partition(": ")  # the worker's reply is one "<field>: <message>" line
            if field == "job_type" and report.failures:  # the type may live in a module that did not load
                message += ("; plugin modules that failed to load: " + ", ".join(f.module for f in report.failures)
                            + " (see `plugins list`), and no `serve` of this plugins folder on this machine keeps a "
                              "last good version of them: a job of that type could not run")
            raise InputError(f"{prefix(i)}{field}", message)
    modules = {p.job_type: p.module for p in report.plugins}
    for job_type in sorted({job_type for job_type, _ in checks}):
        for fallback in report.fallbacks:
            if job_type in modules and fallback.startswith(f"plugin module {modules[job_type]} "):
                log.warning("job_type %r accepted: checked against the last good version of its plugin, which "
                            "serve keeps running until the file is fixed: %s", job_type, fallback)


def _spec_fields_of(row: Mapping[str, Any]) -> dict[str, Any]:
    view = job_view(row)
    return {key: view[key] for key in JOB_FIELDS if key in view}


# -- writes --------------------------------------------------------------------------------------------
def prepare_job(settings: Settings, fields: Mapping[str, Any], now: dt.datetime) -> Row:
    """The column values of a new job from field values by store name: checked, its configuration
    validated by the plugin in a worker child, ``next_run_at`` computed from ``now`` (Active unless
    ``status`` says otherwise; an Active job with no occurrence left is Expired). Raises
    :class:`InputError` naming the field. Touches no database."""
    spec = make_spec(fields)
    validate_configurations(settings, [spec])
    return jobspec.with_next_run_at({"status": JobStatus.ACTIVE.value, **jobspec.row_values(spec)}, now)


def insert_job(store: Store, values: Row, now: dt.datetime) -> Row:
    """Insert :func:`prepare_job` values. Raises :class:`InputError` (``name``) if the name is taken."""
    store.add_job(values, now)
    return get_job(store, values["name"])


def add_job(store: Store, settings: Settings, fields: Mapping[str, Any], now: dt.datetime) -> Row:
    """Create a job from field values by store name (:func:`prepare_job` then :func:`insert_job`).
    Raises :class:`InputError` naming the field; nothing is written then. Returns the new job."""
    return insert_job(store, prepare_job(settings, fields, now), now)


def update_job(store: Store, settings: Settings, name: str, changes: Mapping[str, Any], now: dt.datetime) -> Row:
    """Change some fields of job ``name``, keeping its history (runs, counters). A change of the schedule
    (cron, zone, start/end, status) recomputes ``next_run_at`` from ``now``; a change of type or
    configuration is validated by the plugin. Renaming is refused (field ``name``). Raises
    :class:`NotFoundError` / :class:`InputError`. Returns the job."""
    if "name" in changes and changes["name"] != name:
        raise InputError("name", "a job cannot be renamed; add a new one and remove this one")
    old = store.get_job(name)
    spec = make_spec({**_spec_fields_of(old), **changes})
    values = jobspec.row_values(spec)
    changed = {k: v for k, v in values.items() if old.get(k) != v}
    if "job_type" in changed or "configuration" in changed:
        validate_configurations(settings, [spec])
    if jobspec.schedule_fields_changed(old, changed):
        scheduled = jobspec.with_next_run_at({**old, **values}, now)
        changed["next_run_at"] = scheduled["next_run_at"]
        if scheduled["status"] != old["status"]:
            changed["status"] = scheduled["status"]
    if changed:
        store.update_job(name, changed, now)
    return get_job(store, name)


def pause_job(store: Store, name: str, now: dt.datetime) -> Row:
    """Stop scheduling job ``name`` (a run in progress is not interrupted; a pending retry is dropped).
    Committed more than 50 ms before an occurrence's instant, it prevents that run even if a supervisor
    already claimed it ahead (withdrawn before its instant, recorded never started); in the last 50 ms the
    run may start (docs: Concurrency, Pausing). Returns the job."""
    store.update_job(name, {"status": JobStatus.PAUSED.value, "next_run_at": None, **NO_RETRY}, now)
    return get_job(store, name)


def resume_job(store: Store, name: str, now: dt.datetime) -> Row:
    """Schedule job ``name`` again from ``now``; it becomes Expired if its ``end_at`` has passed. Clears a
    pause on repeated failure (``paused_reason``, ``consecutive_failures``)."""
    job = store.get_job(name)
    values = jobspec.with_next_run_at({**job, "status": JobStatus.ACTIVE.value}, now)
    store.update_job(name, {"status": values["status"], "next_run_at": values["next_run_at"], "paused_reason": None,
                            "consecutive_failures": 0, **NO_RETRY}, now)
    return get_job(store, name)


def remove_job(store: Store, name: str) -> None:
    """Delete job ``name`` and its runs. Raises :class:`NotFoundError`."""
    store.remove_job(name)


def run_job(store: Store, settings: Settings, name: str, *, on_paused: Callable[[Row], None] | None = None
            ) -> RunOutcome:
    """Run job ``name`` once now through a worker child and wait until its run is recorded (like
    Kubernetes ``create job --from`` or a Temporal trigger, a Paused job runs too and stays Paused;
    ``on_paused`` is told first). Its schedule is left as it is. Registers as supervisor
    ``jobs-run-<instance>`` for the run. Reads clocks (an outer loop). Raises
    :class:`AlreadyRunningError` when a Skip or Replace job's run is live (naming it), :class:`InputError`
    (``job_type``) when its plugin is not available, ``TimeoutError`` when no worker becomes ready;
    ``KeyboardInterrupt`` cancels the run and propagates."""
    from mjsched_isolated.supervisor import Supervisor, utcnow  # noqa: PLC0415 - loaded only where needed
    from mjsched_isolated.supervisor.pool import Pool  # noqa: PLC0415 - loaded only where needed

    require_plugins_dir(settings)
    job = store.get_job(name)
    if (problem := jobspec.stored_problem(job)) is not None:  # a number edited by hand: named, not run
        raise problem
    paused = job["status"] == JobStatus.PAUSED
    if paused and on_paused is not None:
        on_paused(job_view(job))
    manual = msgspec.structs.replace(settings, max_concurrent_jobs=1,
                                     instance=MANUAL_INSTANCE_PREFIX + settings.instance)
    # the last good plugin copies of a serve of this machine: its job types, after a refused reload too
    pool = Pool.from_settings(manual, size=1, borrow_good_plugins=True)
    try:
        run_id = Supervisor(manual, store, pool).run_now(job, ready_timeout_s=manual.worker_ready_timeout_s)
    finally:
        pool.close()
    if run_id is not None:
        return RunOutcome(run_id=run_id, was_paused=paused)
    if job["concurrency_mode"] in (ConcurrencyMode.QUEUE, ConcurrencyMode.QUEUE_ALL):
        store.queue_now(job["id"], utcnow())
        return RunOutcome(run_id=None, queued=True, was_paused=paused)
    current = store.get_job(name)
    live = store.list_runs(job_name=name, status=RunStatus.RUNNING, limit=1)
    raise AlreadyRunningError(name, job["concurrency_mode"], current["locked_by_instance"], current["locked_at"],
                              live[0]["id"] if live else None)


def load_jobs_file(settings: Settings, path: str) -> list[JobSpec]:
    """The checked specs of the TOML jobs file ``path``, configurations validated by their plugins.
    Raises :class:`InputError` naming ``<path>: jobs[i].<field>``. Touches no database."""
    specs = jobspec.load_file(path)
    validate_configurations(settings, specs, prefix=lambda i: f"{path}: jobs[{i}].")
    return specs


def apply_jobs(store: Store, specs: Sequence[JobSpec], now: dt.datetime) -> tuple[int, int]:
    """Create or update (by name) a job per spec in one transaction (:meth:`Store.apply_job_changes`);
    other jobs are untouched, and a job's ``status`` is kept unless its spec sets it. A schedule change
    recomputes ``next_run_at`` from ``now``. Returns ``(created, updated)``."""
    for attempt in range(SYNC_ATTEMPTS):
        existing = {row["name"]: row for row in store.list_jobs()}
        creates: list[Row] = []
        updates: list[tuple[str, Row]] = []
        for spec in specs:
            values = jobspec.row_values(spec)
            old = existing.get(spec.name)
            if old is None:
                creates.append(jobspec.with_next_run_at({"status": JobStatus.ACTIVE.value, **values}, now))
                continue
            changed = {k: v for k, v in values.items() if old.get(k) != v}
            if jobspec.schedule_fields_changed(old, changed):
                changed["next_run_at"] = jobspec.with_next_run_at({**old, **values}, now)["next_run_at"]
            if changed:
                updates.append((spec.name, changed))
        try:
            store.apply_job_changes(creates, updates, now)
        except InputError as exc:  # created meanwhile by another supervisor's sync: read again, update it
            if exc.field != "name" or attempt == SYNC_ATTEMPTS - 1:
                raise
            continue
        return len(creates), len(updates)
    raise AssertionError("unreachable")


def sync_jobs(store: Store, settings: Settings, path: str, now: dt.datetime) -> tuple[int, int]:
    """``jobs sync``: :func:`load_jobs_file` then :func:`apply_jobs`, all or nothing."""
    return apply_jobs(store, load_jobs_file(settings, path), now)


# -- check and retention -------------------------------------------------------------------------------
def check(settings: Settings, jobs_file: str | None = None) -> CheckReport:
    """Settings (already valid), plugins imported in a child (a folder that cannot be read is a
    problem), ``jobs_file`` (default the configured one), and every job in the database (cron, zone,
    type, configuration, notice recipients). Writes nothing: a SQLite file that does not exist is a
    problem, not a new database."""
    problems: list[str] = []
    plugins = settings.plugins_dir or "./plugins if present"
    channels = ", ".join(settings.notifications.channels())
    notes = [f"settings: ok (database {redact_url(settings.database_url)}, plugins {plugins}, "
             f"cap {settings.max_concurrent_jobs}, notification channels {channels})"]
    report = inspect_plugins(settings)
    notes.append(f"plugins: {len(report.plugins)} job type(s): "
                 + (", ".join(sorted(p.job_type for p in report.plugins)) or "none"))
    notes.extend(f"plugins: {warning}" for warning in report.warnings)
    notes.append(f"isolation: {proctree.containment(cgroups.probe(settings.isolation.cgroups))}")
    if (foreign_proc := proctree.foreign_proc()) is not None:
        problems.append(f"/proc: {foreign_proc}")
    for failure in report.failures:
        problems.append(f"plugin module {failure.module}: failed to import: {last_line(failure.error)}")
    jobs_file = jobs_file or settings.jobs_file
    if jobs_file:
        try:
            specs = jobspec.load_file(jobs_file)
            validate_configurations(settings, specs, prefix=lambda i: f"{jobs_file}: jobs[{i}].")
            notes.append(f"jobs file {jobs_file}: {len(specs)} job(s) ok")
        except InputError as exc:
            problems.append(f"jobs file: {exc}")
    jobs: list[JobRow] = []
    bad_times: dict[int, tuple[str, str]] = {}
    try:  # read-only: a SQLite file that does not exist is a problem (a typo in --db), not a new database
        store = open_store(settings.database_url, must_exist=True)
    except InputError as exc:
        problems.append(str(exc))
    except SchemaError as exc:  # outdated, or newer than this code: nothing else to check in it
        problems.append(str(exc))
    else:
        try:
            jobs = store.list_jobs()
            bad_times = store.unreadable_time_window()
        finally:
            store.close()
        notes.append(f"database schema: up to date ({migrate.head_revision()})")
    bad: set[str] = set()

    def problem(job: JobRow, text: str) -> None:
        bad.add(job["name"])
        problems.append(f"job {job['name']}: {text}")

    for job in jobs:
        try:
            cron.validate(job["cron_expression"], job["timezone"])
        except InputError as exc:
            problem(job, str(exc))
        if (stored := jobspec.stored_problem(job)) is not None:
            problem(job, str(stored))
        if job["id"] in bad_times:
            field, raw = bad_times[job["id"]]
            problem(job, f"{field}: {raw[:40]!r} in the database is not a timestamp (edited by hand?)")
    checks = [(job["job_type"], job["configuration"]) for job in jobs]
    for job, error in zip(jobs, inspect_plugins(settings, checks).errors if checks else []):
        if error is not None:
            problem(job, error)
    email = settings.notifications.email
    if email is not None and not email.recipients:
        for job in jobs:
            if (job["notify_on_failure"] or job["notify_on_success"] or job["notify_on_missed"]) \
                    and not job["notify_recipients"]:
                problem(job, "notify_recipients: none, and notifications.email.recipients is empty: its email "
                             "notices could not be delivered")
    notes.append(f"jobs: {len(jobs)} in the database, {len(jobs) - len(bad)} ok")
    return CheckReport(ok=not problems, problems=problems, notes=notes)


def last_line(text: str) -> str:
    """The last non-empty line of a traceback or message (``"?"`` if none)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "?"


def retention_with(base: Retention, *, keep_days: float | None = None,
                   keep_min_per_job: int | None = None) -> Retention:
    """``base`` with the given values replaced, validated. Raises :class:`InputError` naming
    ``retention.keep_days`` / ``retention.keep_min_per_job``."""
    given = {k: v for k, v in (("keep_days", keep_days), ("keep_min_per_job", keep_min_per_job)) if v is not None}
    return Retention(**{**msgspec.structs.asdict(base), **given})


def prune(store: Store, retention: Retention, *, dry_run: bool = False) -> PruneResult:
    """Delete (or count, with ``dry_run``) finished runs older than ``retention.keep_days`` beyond each
    job's newest ``keep_min_per_job``, and delivered or given-up notices as old, in batches. Judged by
    the database clock (run timestamps are written by it)."""
    now = store.db_now()
    if dry_run:
        count = store.count_prunable_runs(now, retention.keep_days, retention.keep_min_per_job)
        notices = store.count_prunable_notifications(now, retention.keep_days)
    else:
        count = store.prune_runs(now, retention.keep_days, retention.keep_min_per_job, retention.prune_batch_size)
        notices = store.prune_notifications(now, retention.keep_days, retention.prune_batch_size)
    return PruneResult(pruned=count, dry_run=dry_run, keep_days=retention.keep_days,
                       keep_min_per_job=retention.keep_min_per_job, notifications_pruned=notices)
