"""The job lease and the life of a run: claim, extend, release, finish, and the abandonment of runs whose
supervisor died.

Lease protocol (reference-engine-spec.md §2, without its defects): each step is **one conditional UPDATE
judged by its row count**, never read-then-write, and expiry is judged by the **database clock**:

* :meth:`Leases.claim` - take the lease if free or expired *and* move ``next_run_at`` past the occurrence
  (compare-and-set on the ``next_run_at`` that was read), then insert the Running run row, in one
  transaction. Each occurrence is claimed at most once (a unique index on ``runs(job_id, scheduled_at)``
  backs this up).
* A job lease is live while its token is set, its ``expected_completion_at`` (the run's deadline plus a
  grace) has not passed, **and** its holder's row in ``supervisors`` has not expired
  (:mod:`.predicates`). Supervisors renew that one row (:mod:`.supervisors`): one statement keeps all
  their leases and runs alive.
* :meth:`Leases.release` / :meth:`Leases.extend` - only if the token matches.
* :meth:`Leases.finish_run` - terminal run row, then statistics (which never touch lease columns), then a
  token-checked release, in one transaction.

Run timestamps share one time base, the database clock, and follow the order in which leases serialised
them: ``started_at`` is the database's now read in the claiming transaction after the leases were judged
(never before the caller's ``not_before``); ``completed_at`` and ``last_run_at`` are the instant the run
ended as the supervisor saw it (database time: local time plus the measured offset), so a result written
late (an outage, a batch) keeps its true end; without one given, the database's now at the write.

Hot path (issue 11): the statements a run needs are built once per dialect (:class:`_Statements`) and
executed with bound parameters, and :meth:`Leases.claim_many` / :meth:`Leases.finish_runs` take a whole
poll's claims, or a whole wait's results, in one transaction; on PostgreSQL a plain batch of either is ONE
statement in autocommit (one round trip), with the same rows written. Job rows are locked in id order by
claims and results alike.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple, cast

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import JobStatus, RunStatus
from mjsched_isolated.isotime import iso
from mjsched_isolated.store import schema
from mjsched_isolated.store.driver import Prepared
from mjsched_isolated.store.outbox import insert_notices
from mjsched_isolated.store.predicates import holder_alive, lease_free
from mjsched_isolated.store.records import (
    AbandonedRun,
    Claim,
    LateResult,
    OutboxRow,
    RunRow,
)
from mjsched_isolated.store.schema import jobs, runs, supervisors
from mjsched_isolated.store.text import fit_json, fit_text

log = logging.getLogger("mjsched.store")


class HeldBeforeStart(NamedTuple):
    """A run claimed ahead, still held, as :meth:`Leases.held_before_start` reads it just before its instant."""

    cancel_requested_by: str | None  # who asked to cancel it (``runs cancel``, a replace request), or None
    job_status: str | None  # its job's status now (None: the job row is gone)
    next_run_at: dt.datetime | None  # its job's next_run_at now
    retry_at: dt.datetime | None  # its job's pending retry, if any


def _db_now_plus_bound(dialect: str, name: str) -> sa.ColumnElement:
    """:func:`schema.db_now_plus` with the seconds as bound parameter ``name`` (a float), so one prebuilt
    statement serves every lease length."""
    seconds = sa.bindparam(name, type_=sa.Float)
    expr: sa.ColumnElement
    if dialect == "sqlite":
        modifier = sa.func.printf("%+.6f seconds", seconds)
        expr = sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", modifier)
    elif dialect == "postgresql":
        expr = sa.func.timezone("UTC", sa.func.clock_timestamp()) + sa.func.make_interval(
            0, 0, 0, 0, 0, 0, sa.cast(seconds, sa.Float))
    elif dialect in ("mysql", "mariadb"):
        expr = sa.func.timestampadd(sa.text("MICROSECOND"), sa.cast(seconds * 1_000_000, sa.BigInteger),
                                    sa.func.utc_timestamp(6))
    else:
        raise NotImplementedError(f"database dialect {dialect!r} is not supported")
    return sa.type_coerce(expr, schema.UTCDateTime)


def _token_is(token: str | None) -> sa.ColumnElement[bool]:
    """The run row was claimed with ``token`` (None: a run without a lease)."""
    return runs.c.lock_token.is_(None) if token is None else runs.c.lock_token == token


class _Statements:
    """The hot path's statements, built once per dialect with bound parameters (issue 11: building them per
    run was 38 % of the supervisor's CPU; a prebuilt statement also keeps its SQLAlchemy cache key, so
    executing it is a compiled-cache hit without rebuilding the key). Parameter names start with ``p_``
    (an UPDATE may not bind a name that is also a column it sets)."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        now = schema.db_now(dialect)
        self.db_now = sa.select(now)
        self._claims: dict[tuple[bool, bool, bool, bool, bool], sa.Update] = {}
        self.insert_run = runs.insert().values(
            job_id=sa.bindparam("p_job_id"), scheduled_at=sa.bindparam("p_scheduled_at", type_=schema.UTCDateTime),
            started_at=sa.bindparam("p_started_at", type_=schema.UTCDateTime), status=RunStatus.RUNNING,
            executed_by_instance=sa.bindparam("p_instance"),
            lock_token=sa.bindparam("p_token"), deadline_at=sa.bindparam("p_deadline_at", type_=schema.UTCDateTime),
            queued_at=sa.bindparam("p_queued_at", type_=schema.UTCDateTime),
            missed_count=sa.bindparam("p_missed", type_=sa.Integer), attempt=sa.bindparam("p_attempt"))
        completed = sa.bindparam("p_completed_at", type_=schema.UTCDateTime)
        # a result lands only on the run row claimed with its token (ids alone could name another run)
        finish_values = dict(
            status=sa.bindparam("p_status"), success=sa.bindparam("p_success", type_=sa.Boolean),
            error_message=sa.bindparam("p_error_message", type_=sa.Text),
            completed_at=sa.func.coalesce(completed, now), details=sa.bindparam("p_details", type_=sa.Text),
            duration_ms=sa.bindparam("p_duration_ms", type_=sa.Float),
            cpu_s=sa.bindparam("p_cpu_s", type_=sa.Float), max_rss_mb=sa.bindparam("p_max_rss_mb", type_=sa.Float))
        finishable = (runs.c.id == sa.bindparam("p_run_id"), runs.c.status == RunStatus.RUNNING)
        self.finish_run = runs.update().where(*finishable, runs.c.lock_token == sa.bindparam("p_token")).values(
            **finish_values)
        self.finish_run_without_lease = runs.update().where(*finishable, runs.c.lock_token.is_(None)).values(
            **finish_values)
        self.release = jobs.update().where(
            jobs.c.id == sa.bindparam("p_job_id"), jobs.c.lock_token == sa.bindparam("p_token")).values(
            lock_token=None, locked_at=None, locked_by_instance=None, expected_completion_at=None)
        last_run_at = sa.func.coalesce(completed, now)
        counts: list[tuple[Any, Any]] = [
            (jobs.c.run_count, jobs.c.run_count + 1),
            (jobs.c.success_count, jobs.c.success_count + sa.bindparam("p_successes", type_=sa.Integer)),
            (jobs.c.failure_count, jobs.c.failure_count + sa.bindparam("p_failures", type_=sa.Integer)),
            (jobs.c.last_run_at, last_run_at),
            # final failures in a row (revision 0012): a success resets it, a failure that will be retried
            # leaves it as it is
            (jobs.c.consecutive_failures, sa.case(
                (sa.bindparam("p_successes", type_=sa.Integer) == 1, 0),
                (sa.bindparam("p_final_failure", type_=sa.Integer) == 1, jobs.c.consecutive_failures + 1),
                else_=jobs.c.consecutive_failures)),
        ]
        duration = sa.bindparam("p_duration_ms", type_=sa.Float)
        where = jobs.c.id == sa.bindparam("p_job_id")
        # the running average is assigned before run_count (MySQL evaluates SET left to right)
        with_duration: list[tuple[Any, Any]] = [
            (jobs.c.avg_duration_ms, sa.case((jobs.c.avg_duration_ms.is_(None), duration),
                                             else_=(jobs.c.avg_duration_ms * jobs.c.run_count + duration)
                                             / (jobs.c.run_count + 1))),
            (jobs.c.last_duration_ms, duration), *counts]
        self.stats_with_duration = jobs.update().where(where).ordered_values(*with_duration)
        self.stats = jobs.update().where(where).ordered_values(*counts)
        # SQLite: a counted result with a duration and a lease, its statistics and its lease release in ONE
        # UPDATE (issue 11: a statement less per run). The release's rule is release's: the lease columns are
        # cleared only if the run's token still holds the lease (SQLite's right-hand sides read the row as it
        # was; lock_token, compared by the others, is set last all the same)
        held = jobs.c.lock_token == sa.bindparam("p_token")
        self.stats_with_duration_release = jobs.update().where(where).ordered_values(
            *with_duration,
            *((col, sa.case((held, None), else_=col)) for col in (
                jobs.c.locked_at, jobs.c.locked_by_instance, jobs.c.expected_completion_at, jobs.c.lock_token)))
        self.pause_on_failures = jobs.update().where(
            where, jobs.c.status == "Active", jobs.c.pause_after_failures.is_not(None),
            jobs.c.pause_after_failures > 0, jobs.c.consecutive_failures >= jobs.c.pause_after_failures).values(
            status="Paused", next_run_at=None, paused_reason=sa.bindparam("p_reason", type_=sa.Text),
            updated_at=sa.func.coalesce(completed, now), **_NO_RETRY)
        retry_at = sa.bindparam("p_retry_at", type_=schema.UTCDateTime(exact=True))
        # a retry is pending while next_run_at is its retry_at; the occurrence it displaced waits in
        # retry_next_run_at (one pending retry per job: a second failure meanwhile is final)
        self.set_retry = jobs.update().where(
            where, jobs.c.status == "Active",
            sa.or_(jobs.c.retry_at.is_(None), jobs.c.next_run_at.is_(None), jobs.c.retry_at != jobs.c.next_run_at),
        ).ordered_values(
            (jobs.c.retry_next_run_at, jobs.c.next_run_at), (jobs.c.next_run_at, retry_at), (jobs.c.retry_at, retry_at),
            (jobs.c.retry_attempt, sa.bindparam("p_retry_attempt", type_=sa.Integer)),
            (jobs.c.retry_scheduled_at, sa.bindparam("p_retry_scheduled_at", type_=schema.UTCDateTime)))

        if dialect != "sqlite":
            self._build_locking(dialect, now)

    def _build_locking(self, dialect: str, now: sa.ColumnElement) -> None:
        """PostgreSQL and MariaDB/MySQL: the lock-and-fetch of a batched claim (db-scheduler's
        ``SELECT ... FOR UPDATE SKIP LOCKED``) and the run rows of a batch in one INSERT ... RETURNING."""
        ids: sa.ColumnElement[bool] = jobs.c.id.in_(sa.bindparam("p_ids", expanding=True))
        if dialect == "postgresql":
            # the lease judged with the rows locked (OF jobs: the supervisors rows read by lease_free are not
            # locked); then the compare-and-sets are sure to hold and go as one pipelined executemany
            cols: list[Any] = [jobs.c.id, jobs.c.next_run_at, lease_free(dialect).label("free"),
                               jobs.c.lock_token.is_(None).label("unheld")]
            # = ANY(array): one SQL text for every batch size (an expanding IN is rendered again per call)
            ids = jobs.c.id == sa.any_(sa.bindparam("p_ids", type_=postgresql.ARRAY(sa.Integer)))
            lock = sa.select(*cols).where(ids).order_by(jobs.c.id)
            self.lock_jobs = lock.with_for_update(of=jobs)
            # a result batch's job rows, locked as its UPDATEs would lock them (FOR NO KEY UPDATE), in id order
            self.lock_jobs_in_order = sa.select(jobs.c.id).where(ids).order_by(jobs.c.id).with_for_update(
                key_share=True)
            self.lock_jobs_skip = lock.with_for_update(of=jobs, skip_locked=True)
        else:
            # MariaDB: only the jobs rows are read under the lock (a locking read's subquery would lock the
            # supervisors rows too); the lease is judged by the per-row UPDATE as on SQLite. By the primary key
            # only: on a small table InnoDB would otherwise scan (and, repeatable read, lock) every row
            lock = (sa.select(jobs.c.id, jobs.c.next_run_at).with_hint(jobs, "FORCE INDEX (PRIMARY)", "*")
                    .where(ids).order_by(jobs.c.id))
            self.lock_jobs = lock.with_for_update()
            self.lock_jobs_skip = lock.with_for_update(skip_locked=True)
        # started_at: the database's now at the INSERT (after every lease was judged), not before p_not_before
        started = sa.type_coerce(sa.func.greatest(now, sa.func.coalesce(
            sa.bindparam("p_not_before", type_=schema.UTCDateTime), now)), schema.UTCDateTime)
        self.insert_runs = runs.insert().values(
            job_id=sa.bindparam("p_job_id"), scheduled_at=sa.bindparam("p_scheduled_at", type_=schema.UTCDateTime),
            started_at=started, status=RunStatus.RUNNING, executed_by_instance=sa.bindparam("p_instance"),
            lock_token=sa.bindparam("p_token"), deadline_at=sa.bindparam("p_deadline_at", type_=schema.UTCDateTime),
            queued_at=sa.bindparam("p_queued_at", type_=schema.UTCDateTime),
            missed_count=sa.bindparam("p_missed", type_=sa.Integer), attempt=sa.bindparam("p_attempt"),
        ).returning(runs.c.id, runs.c.job_id, runs.c.started_at)
        if dialect == "postgresql":
            # the same rows from arrays (unnest): one short SQL text for any batch size. SQLAlchemy's multi-row
            # VALUES grows past psycopg's 4 kB parse cache at ten rows and was parsed again every poll
            # (6 ms of supervisor CPU a poll)
            now_sql = "timezone('UTC', clock_timestamp())"
            self.insert_runs_pg = sa.text(
                "INSERT INTO runs (job_id, scheduled_at, started_at, status, executed_by_instance, lock_token, "
                f"deadline_at, queued_at, missed_count, attempt) SELECT v.job_id, v.scheduled_at, GREATEST({now_sql}, "
                f"COALESCE(CAST(:p_not_before AS timestamp), {now_sql})), 'Running', :p_instance, v.token, "
                "v.deadline_at, v.queued_at, v.missed, v.attempt FROM unnest(CAST(:p_job_ids AS integer[]), "
                "CAST(:p_scheduled AS timestamp[]), CAST(:p_tokens AS varchar[]), CAST(:p_deadlines AS timestamp[]), "
                "CAST(:p_queued AS timestamp[]), CAST(:p_missed AS integer[]), CAST(:p_attempts AS integer[])) "
                "AS v(job_id, scheduled_at, token, deadline_at, queued_at, missed, attempt) "
                "RETURNING id, job_id, started_at",
            ).bindparams(
                sa.bindparam("p_not_before", type_=schema.UTCDateTime), sa.bindparam("p_instance", type_=sa.String),
                *(sa.bindparam(name, type_=postgresql.ARRAY(t)) for name, t in (
                    ("p_job_ids", sa.Integer), ("p_scheduled", sa.DateTime), ("p_tokens", sa.String),
                    ("p_deadlines", sa.DateTime), ("p_queued", sa.DateTime), ("p_missed", sa.Integer),
                    ("p_attempts", sa.Integer))),
            ).columns(runs.c.id, runs.c.job_id, runs.c.started_at)
            # the statistics of a batch (each job once) in one UPDATE: the rules of stats / stats_with_duration,
            # a NULL duration leaving the averages; every right-hand side reads the row as it was
            self.stats_many_pg = sa.text(
                "UPDATE jobs SET avg_duration_ms = CASE WHEN v.duration IS NULL THEN jobs.avg_duration_ms "
                "WHEN jobs.avg_duration_ms IS NULL THEN v.duration ELSE (jobs.avg_duration_ms * jobs.run_count "
                "+ v.duration) / (jobs.run_count + 1) END, last_duration_ms = COALESCE(v.duration, "
                "jobs.last_duration_ms), run_count = jobs.run_count + 1, success_count = jobs.success_count + "
                "v.successes, failure_count = jobs.failure_count + 1 - v.successes, last_run_at = "
                f"COALESCE(v.completed, {now_sql}), consecutive_failures = CASE WHEN v.successes = 1 THEN 0 "
                "WHEN v.final = 1 THEN jobs.consecutive_failures + 1 ELSE jobs.consecutive_failures END "
                "FROM unnest(CAST(:p_job_ids AS integer[]), CAST(:p_successes AS integer[]), "
                "CAST(:p_durations AS float8[]), CAST(:p_final AS integer[]), CAST(:p_completed AS timestamp[])) "
                "AS v(id, successes, duration, final, completed) WHERE jobs.id = v.id",
            ).bindparams(*(sa.bindparam(name, type_=postgresql.ARRAY(t)) for name, t in (
                ("p_job_ids", sa.Integer), ("p_successes", sa.Integer), ("p_durations", sa.Float),
                ("p_final", sa.Integer), ("p_completed", sa.DateTime))))
            self.release_many_pg = sa.text(
                "UPDATE jobs SET lock_token = NULL, locked_at = NULL, locked_by_instance = NULL, "
                "expected_completion_at = NULL FROM unnest(CAST(:p_job_ids AS integer[]), "
                "CAST(:p_tokens AS varchar[])) AS v(id, token) WHERE jobs.id = v.id AND jobs.lock_token = v.token",
            ).bindparams(sa.bindparam("p_job_ids", type_=postgresql.ARRAY(sa.Integer)),
                         sa.bindparam("p_tokens", type_=postgresql.ARRAY(sa.String)))
            # a whole batch of results in one UPDATE, each row still judged alone (Running, claimed with its
            # token; RETURNING names the rows that were): one round trip instead of one per run
            arrays = [("p_run_ids", sa.Integer, "integer"), ("p_tokens", sa.String, "varchar"),
                      ("p_statuses", sa.String, "varchar"), ("p_successes", sa.Boolean, "boolean"),
                      ("p_errors", sa.Text, "text"), ("p_completed", sa.DateTime, "timestamp"),
                      ("p_details", sa.Text, "text"), ("p_durations", sa.Float, "float8"),
                      ("p_cpus", sa.Float, "float8"), ("p_rss", sa.Float, "float8")]
            self.finish_many_pg = sa.text(
                "UPDATE runs SET status = v.status, success = v.success, error_message = v.error_message, "
                "completed_at = COALESCE(v.completed_at, timezone('UTC', clock_timestamp())), details = v.details, "
                "duration_ms = v.duration_ms, cpu_s = v.cpu_s, max_rss_mb = v.max_rss_mb FROM unnest("
                + ", ".join(f"CAST(:{name} AS {sql}[])" for name, _, sql in arrays)
                + ") AS v(id, token, status, success, error_message, completed_at, details, duration_ms, cpu_s, "
                "max_rss_mb) WHERE runs.id = v.id AND runs.status = 'Running' AND runs.lock_token IS NOT DISTINCT "
                "FROM v.token RETURNING runs.id",
            ).bindparams(*(sa.bindparam(name, type_=postgresql.ARRAY(t)) for name, t, _ in arrays))
            # a plain batch of results (each counted, no retry, no pause, no notice; each run and job once) as ONE
            # statement, run in autocommit: the terminal run rows (judged as finish_many_pg judges them), then
            # the job rows of those written, locked in id order as claims lock them (no deadlock with a
            # peer's claim; the run rows first, as the abandonment sweep takes them), then their statistics
            # and lease release in one UPDATE (a row may be updated once per statement). The right-hand sides
            # read the job row as it was, so the release compares the token the run was claimed with.
            # A scalar subquery over the locking CTE is evaluated once, before any job row is updated.
            release = "CASE WHEN jobs.lock_token = fin.token THEN NULL ELSE jobs.{0} END"
            # the one-statement batches reach their rows by primary key: json_to_recordset is estimated at 100
            # rows whatever it holds, so a join on it alone was planned as a hash join over a sequential scan
            # of the whole table (every job, every run row not yet vacuumed: O(table), not O(batch); with 3,000
            # jobs the claim's two scans of jobs took most of its time). ANY(ARRAY(subquery)) is an index
            # condition the planner takes at any table size (issue 11, PostgreSQL deep backlog)
            by_id = "ANY(ARRAY(SELECT {0} FROM {1}))"
            self.finish_plain_pg = sa.text(
                "WITH v AS (SELECT * FROM json_to_recordset(CAST(:p_payload AS json)) AS r(id integer, job_id "
                "integer, token varchar, status varchar, success boolean, error_message text, completed_at "
                "timestamp, details text, duration_ms float8, cpu_s float8, max_rss_mb float8)), "
                "fin AS (UPDATE runs SET status = v.status, success = v.success, error_message = v.error_message, "
                f"completed_at = COALESCE(v.completed_at, {now_sql}), details = v.details, duration_ms = "
                "v.duration_ms, cpu_s = v.cpu_s, max_rss_mb = v.max_rss_mb FROM v WHERE runs.id = v.id AND "
                f"runs.id = {by_id.format('v.id', 'v')} AND runs.status || '' = 'Running' AND runs.lock_token IS NOT "
                "DISTINCT FROM v.token RETURNING runs.id, "
                "v.job_id, v.token, CASE WHEN v.success THEN 1 ELSE 0 END AS successes, v.duration_ms, "
                "v.completed_at), "
                "lk AS (SELECT jobs.id FROM jobs WHERE jobs.id IN (SELECT fin.job_id FROM fin) ORDER BY jobs.id "
                "FOR NO KEY UPDATE), "
                "st AS (UPDATE jobs SET avg_duration_ms = CASE WHEN fin.duration_ms IS NULL THEN "
                "jobs.avg_duration_ms WHEN jobs.avg_duration_ms IS NULL THEN fin.duration_ms ELSE "
                "(jobs.avg_duration_ms * jobs.run_count + fin.duration_ms) / (jobs.run_count + 1) END, "
                "last_duration_ms = COALESCE(fin.duration_ms, jobs.last_duration_ms), run_count = jobs.run_count + 1, "
                "success_count = jobs.success_count + fin.successes, failure_count = jobs.failure_count + 1 - "
                f"fin.successes, last_run_at = COALESCE(fin.completed_at, {now_sql}), consecutive_failures = CASE "
                "WHEN fin.successes = 1 THEN 0 ELSE jobs.consecutive_failures + 1 END, "
                + ", ".join(f"{col} = {release.format(col)}" for col in (
                    "lock_token", "locked_at", "locked_by_instance", "expected_completion_at"))
                + " FROM fin WHERE jobs.id = fin.job_id AND (SELECT count(*) FROM lk) >= 0 RETURNING jobs.id) "
                "SELECT fin.id FROM fin",
            ).bindparams(sa.bindparam("p_payload", type_=sa.Text)).columns(runs.c.id)
            # the one-statement claims' shared parts: the requests as rows (v), then, for the job rows the
            # statement locked ({locked}: a query of lk's ids), the occurrence moved and the lease taken (upd)
            # and the Running run inserted (ins)
            claim_rows_cte = (
                "WITH v AS (SELECT * FROM json_to_recordset(CAST(:p_payload AS json)) AS r(i integer, job_id integer, "
                "seen timestamp, next_run_at timestamp, token varchar, lease_s float8, deadline_at timestamp, "
                "scheduled_at timestamp, queued_at timestamp, missed integer, skipped integer, attempt integer)), ")
            claim_writes_cte = (
                "upd AS (UPDATE jobs SET next_run_at = v.next_run_at, missed_count = jobs.missed_count + v.missed, "
                f"skipped_count = jobs.skipped_count + v.skipped, lock_token = v.token, locked_at = {now_sql}, "
                f"locked_by_instance = :p_instance, expected_completion_at = {now_sql} + make_interval(0, 0, 0, 0, 0, "
                "0, v.lease_s) FROM v WHERE jobs.id = v.job_id AND jobs.id = ANY(ARRAY({locked})) "
                "RETURNING jobs.id), "
                "ins AS (INSERT INTO runs (job_id, scheduled_at, started_at, status, executed_by_instance, lock_token, "
                f"deadline_at, queued_at, missed_count, attempt) SELECT v.job_id, v.scheduled_at, GREATEST({now_sql}, "
                f"COALESCE(CAST(:p_not_before AS timestamp), {now_sql})), 'Running', :p_instance, v.token, "
                "v.deadline_at, v.queued_at, v.missed, v.attempt FROM v JOIN upd ON upd.id = v.job_id "
                "RETURNING runs.id, runs.job_id, runs.started_at) ")
            # a plain batch of claims (the occurrence seen, the lease taken if free, nothing else; each job once)
            # as ONE statement, run in autocommit: the job rows locked in id order (SKIP LOCKED, or waiting for
            # them) with each occurrence and lease judged on the locked row (lease_free's rule, as the
            # predicates module writes it), the compare-and-sets of those that won, and their run rows. A row
            # the lock skipped is reported unlocked (busy: neither won nor lost); the unique index on runs
            # refuses a duplicate run by failing the whole statement (nothing written), as the transaction did
            free = (f"(jobs.lock_token IS NULL OR jobs.expected_completion_at IS NULL OR jobs.expected_completion_at "
                    f"< {now_sql} OR NOT EXISTS (SELECT 1 FROM supervisors AS holder WHERE holder.instance = "
                    f"jobs.locked_by_instance AND holder.lease_expires_at > {now_sql}))")
            by_job = by_id.format("v.job_id", "v")
            claim_sql = (
                claim_rows_cte +
                f"lk AS (SELECT jobs.id, jobs.next_run_at = v.seen AND {free} AS ok, jobs.next_run_at IS DISTINCT "
                f"FROM v.seen AS moved FROM jobs JOIN v ON jobs.id = v.job_id WHERE jobs.id = {by_job} "
                "ORDER BY jobs.id FOR UPDATE OF jobs{skip}), " +
                claim_writes_cte.format(locked="SELECT lk.id FROM lk WHERE lk.ok") +
                "SELECT v.i, lk.id IS NOT NULL AND NOT lk.moved AS locked, ins.id, ins.started_at FROM v LEFT JOIN "
                "lk ON lk.id = "
                "v.job_id LEFT JOIN ins ON ins.job_id = v.job_id")
            self.claim_plain_pg, self.claim_plain_skip_pg = (sa.text(claim_sql.format(skip=skip)).bindparams(
                sa.bindparam("p_payload", type_=sa.Text), sa.bindparam("p_instance", type_=sa.String),
                sa.bindparam("p_not_before", type_=schema.UTCDateTime),
            ).columns(sa.column("i", sa.Integer), sa.column("locked", sa.Boolean), sa.column("id", sa.Integer),
                      sa.column("started_at", schema.UTCDateTime)) for skip in ("", " SKIP LOCKED"))
            # a contended poll's plain candidates (more than its free slots, in its order of preference): the
            # first p_limit of them whose row is not locked by a peer (SKIP LOCKED) and whose occurrence and
            # lease still hold on the locked row (the conditions rechecked on the row as a peer left it) are
            # claimed, in the same statement: a row a peer just took makes way for the next candidate instead
            # of a lost claim and an idle worker. The rows are locked with the conditions in WHERE, so LIMIT
            # counts only rows that passed them (PostgreSQL applies it above the row locking)
            self.claim_pool_pg = sa.text(
                claim_rows_cte +
                f"lk AS (SELECT jobs.id FROM jobs JOIN v ON jobs.id = v.job_id WHERE jobs.id = {by_job} AND "
                f"jobs.next_run_at = v.seen AND {free} ORDER BY v.i LIMIT :p_limit FOR UPDATE OF jobs SKIP LOCKED), " +
                claim_writes_cte.format(locked="SELECT lk.id FROM lk") +
                "SELECT v.i, ins.id, ins.started_at FROM v JOIN ins ON ins.job_id = v.job_id",
            ).bindparams(
                sa.bindparam("p_payload", type_=sa.Text), sa.bindparam("p_instance", type_=sa.String),
                sa.bindparam("p_not_before", type_=schema.UTCDateTime), sa.bindparam("p_limit", type_=sa.Integer),
            ).columns(sa.column("i", sa.Integer), sa.column("id", sa.Integer),
                      sa.column("started_at", schema.UTCDateTime))

    def claim(self, seen_is_none: bool, take_lease: bool, only_free_lease: bool, with_status: bool,
              retry: bool = False) -> sa.Update:
        """The occurrence compare-and-set (plus the lease, a status change, and for a ``retry`` the end of
        the pending retry) for one shape of claim."""
        key = (seen_is_none, take_lease, only_free_lease, with_status, retry)
        stmt = self._claims.get(key)
        if stmt is None:
            conds = [jobs.c.id == sa.bindparam("p_job_id"),
                     jobs.c.next_run_at.is_(None) if seen_is_none
                     else jobs.c.next_run_at == sa.bindparam("p_seen", type_=schema.UTCDateTime(exact=True))]
            next_run_at = sa.bindparam("p_next_run_at", type_=schema.UTCDateTime(exact=True))
            values: dict[str, Any] = {
                "next_run_at": next_run_at,
                "missed_count": jobs.c.missed_count + sa.bindparam("p_missed", type_=sa.Integer),
                "skipped_count": jobs.c.skipped_count + sa.bindparam("p_skipped", type_=sa.Integer)}
            if with_status:
                values.update(status=sa.bindparam("p_status"),
                              updated_at=sa.bindparam("p_now", type_=schema.UTCDateTime))
            if retry:
                values.update(_NO_RETRY)
            if take_lease:
                conds.append(jobs.c.lock_token.is_(None) if only_free_lease else lease_free(self.dialect))
                values.update(lock_token=sa.bindparam("p_token"), locked_at=schema.db_now(self.dialect),
                              locked_by_instance=sa.bindparam("p_instance"),
                              expected_completion_at=_db_now_plus_bound(self.dialect, "p_lease_s"))
            stmt = self._claims[key] = jobs.update().where(*conds).values(**values)
        return stmt


_NO_RETRY: dict[str, Any] = {"retry_at": None, "retry_attempt": None, "retry_scheduled_at": None,
                             "retry_next_run_at": None}


def _naive(at: dt.datetime | None) -> dt.datetime | None:
    """An aware datetime as the naive UTC the columns store (for arrays, which bypass :class:`UTCDateTime`)."""
    return None if at is None else at.astimezone(dt.UTC).replace(tzinfo=None)


def _plain(outcomes: Sequence[Outcome]) -> bool:
    """Each outcome counted, without a retry, a pause to judge or a notice, each run and each job once."""
    return (all(o.count and o.retry_at is None and o.pause_reason is None and not o.notices and not o.pause_notices
                for o in outcomes)
            and len({o.run_id for o in outcomes}) == len({o.job_id for o in outcomes}) == len(outcomes))


def _claim_payload(requests: Sequence[ClaimRequest], tokens: Sequence[str]) -> str:
    """The JSON rows of the one-statement claims (``claim_plain_pg``, ``claim_pool_pg``), ``i`` the index."""
    return msgspec.json.encode([{
        "i": i, "job_id": r.job["id"], "seen": _naive(r.job["next_run_at"]), "next_run_at": _naive(r.next_run_at),
        "token": t, "lease_s": r.lease_s, "deadline_at": _naive(r.deadline_at),
        "scheduled_at": _naive(r.scheduled_at), "queued_at": _naive(r.queued_at), "missed": r.missed,
        "skipped": r.skipped, "attempt": r.attempt} for i, (r, t) in enumerate(zip(requests, tokens, strict=True))
    ]).decode()


def _finish_payload(outcomes: Sequence[Outcome]) -> str:
    """The JSON rows of the one-statement results (``finish_plain_pg``)."""
    return msgspec.json.encode([{
        "id": o.run_id, "job_id": o.job_id, "token": o.token, "status": str(o.status), "success": o.success,
        "error_message": fit_text(o.error_message), "completed_at": _naive(o.completed_at),
        "details": fit_json(o.details), "duration_ms": o.duration_ms, "cpu_s": o.cpu_s,
        "max_rss_mb": o.max_rss_mb} for o in outcomes]).decode()


def _plain_claims(requests: Sequence[ClaimRequest]) -> bool:
    """Each request takes the lease if free (not only if unheld) of an occurrence seen, changes no status and
    ends no retry; each job once."""
    return (all(r.take_lease and not r.only_free_lease and r.status is None and not r.retry
                and r.job["next_run_at"] is not None for r in requests)
            and len({r.job["id"] for r in requests}) == len(requests))


def poolable(requests: Sequence[ClaimRequest]) -> bool:
    """:func:`_plain_claims` for a first attempt of a scheduled occurrence (what :meth:`Leases.claim_pool`
    takes): the lease taken if free, no status change, no retry, each job once."""
    return _plain_claims(requests) and all(r.scheduled_at is not None and r.attempt == 1 for r in requests)


class _ReplacedGoneError(Exception):
    """The run to be replaced is no longer Running: roll the replacement back."""


class _RecheckError(Exception):
    """A claim's UPDATE did not match what its locking read judged (a lease renewed in between): the batch
    is rolled back and judged row by row."""


class ClaimRequest(msgspec.Struct, frozen=True):
    """One occurrence to claim (see :meth:`Leases.claim` for the fields). ``attempt``: the run's attempt
    number (1, or a retry's); ``retry``: this claims the job's pending retry (its columns are cleared)."""

    job: Mapping[str, Any]
    next_run_at: dt.datetime | None
    lease_s: float
    deadline_at: dt.datetime
    take_lease: bool = True
    scheduled_at: dt.datetime | None = None
    queued_at: dt.datetime | None = None
    status: str | None = None
    only_free_lease: bool = False
    missed: int = 0  # occurrences this claim folds (added to the job's and the run's missed_count)
    skipped: int = 0  # occurrences it passes over because a run was live (Queue: added to skipped_count)
    attempt: int = 1
    retry: bool = False


class Outcome(msgspec.Struct):
    """One run's terminal state for :meth:`Leases.finish_runs` (see :meth:`Leases.finish_run` for the fields;
    ``completed_at`` None: the database's now at the write). ``retry_at``: the failure is retried then
    (attempt ``attempt + 1`` of occurrence ``scheduled_at``); ``pause_reason``/``pause_notices``: what a
    pause on repeated failure records, should this final failure reach the job's ``pause_after_failures``."""

    run_id: int
    job_id: int
    token: str | None
    status: str
    success: bool | None
    error_message: str | None = None
    details: dict[str, Any] | None = None
    duration_ms: float | None = None
    count: bool = True
    notices: list[OutboxRow] | None = None
    completed_at: dt.datetime | None = None
    cpu_s: float | None = None
    max_rss_mb: float | None = None
    scheduled_at: dt.datetime | None = None
    attempt: int = 1
    retry_at: dt.datetime | None = None
    pause_reason: str | None = None
    pause_notices: list[OutboxRow] | None = None
    retry_set: bool = False  # set by finish_runs: the retry was written (no other retry was pending)
    paused: bool = False  # set by finish_runs: the job was paused by this outcome
    fenced: bool = False  # the run was killed because its supervisor lost its lease: not a result to keep late
    unstarted: bool = False  # claimed ahead, ended before its instant: its plugin never started


ABANDONED_PREFIX = "abandoned: "  # how an abandoned run's error_message begins (the sweep's verdict)


def _abandon_message(run: Mapping[str, Any]) -> str:
    expired = run["holder_expired_at"]
    return (f"{ABANDONED_PREFIX}supervisor {run['executed_by_instance']} stopped renewing its lease "
            f"({'expired ' + iso(expired) if expired else 'no longer registered'}) while "
            f"the run (started {iso(run['started_at'])}) was in flight")


class Leases:
    """Job leases and run rows from claim to terminal state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._stmts = _Statements(self.dialect)
        self.reader = schema.reader(engine)  # reads that write nothing: no transaction round trips (PostgreSQL)
        st, d = self._stmts, engine.dialect
        # recording a result, per run: compiled once, run through the DBAPI cursor (:mod:`.driver`)
        self._finish_run = Prepared(st.finish_run, d)
        self._finish_run_without_lease = Prepared(st.finish_run_without_lease, d)
        self._stats = Prepared(st.stats, d)
        self._stats_with_duration = Prepared(st.stats_with_duration, d)
        self._release = Prepared(st.release, d)
        self._stats_release = Prepared(st.stats_with_duration_release, d) if self.dialect == "sqlite" else None
        # claiming, per run: the same, for the occurrence compare-and-set of each shape and the run row
        self._db_now = Prepared(st.db_now, d)
        self._insert_run = Prepared(st.insert_run.returning(runs.c.id) if self.dialect == "postgresql"
                                    else st.insert_run, d)
        self._claim_prepared: dict[int, Prepared] = {}  # id of a claim statement (:meth:`_Statements.claim`)
        if self.dialect == "postgresql":
            self._finish_plain_pg = Prepared(st.finish_plain_pg, d)
            self._claim_plain_pg = Prepared(st.claim_plain_pg, d)
            self._claim_plain_skip_pg = Prepared(st.claim_plain_skip_pg, d)
            self._claim_pool_pg = Prepared(st.claim_pool_pg, d)

    def claim(self, job: Mapping[str, Any], *, now: dt.datetime, next_run_at: dt.datetime | None, instance: str,
              lease_s: float, deadline_at: dt.datetime, take_lease: bool = True,
              scheduled_at: dt.datetime | None = None, queued_at: dt.datetime | None = None,
              status: str | None = None, only_free_lease: bool = False) -> Claim | None:
        """Claim the occurrence ``job["next_run_at"]`` (or a manual run when ``scheduled_at`` is None and
        ``next_run_at`` is ``job["next_run_at"]``) and insert its Running run row, atomically. ``job``
        needs ``id``, ``name`` and ``next_run_at``; ``status`` optionally changes the job's status too.

        With ``take_lease`` the job's lease must be free or expired (DB clock) and becomes this run's for
        ``lease_s`` seconds with a fresh random token; ``only_free_lease``: a lease held by anyone, even one
        that looks expired, is not taken. Returns None if another holder has the lease or the occurrence
        was already claimed (``next_run_at`` changed since it was read).
        """
        request = ClaimRequest(job, next_run_at, lease_s, deadline_at, take_lease, scheduled_at, queued_at, status,
                               only_free_lease)
        return self.claim_many([request], now=now, instance=instance)[0]

    def claim_replacement(self, request: ClaimRequest, replaced: Outcome, *, now: dt.datetime,
                          instance: str) -> Claim | None:
        """Replace (concurrency_mode): claim occurrence ``request.scheduled_at`` of a job whose lease the run to
        be replaced holds (``replaced.token``), taking the lease over with a fresh token, and record that run's
        end (``replaced``: Cancelled, its ``error_message`` also written as who asked its cancel), with the
        new Running run row, in ONE transaction - before the replaced run is killed, so the replacement is
        committed first and the records never show two runs at once: a job paused, edited or moved meanwhile
        (its ``next_run_at`` no longer the one read, its status no longer Active, the lease no longer that
        run's) or a replaced run no longer Running is not claimed (None, nothing written), and the live run
        is left alone. The release the replaced run's record makes finds the new token and leaves it."""
        job, seen = request.job, request.job["next_run_at"]
        token = uuid.uuid4().hex
        values: dict[str, Any] = {
            "next_run_at": request.next_run_at, "lock_token": token, "locked_at": schema.db_now(self.dialect),
            "locked_by_instance": instance,
            "expected_completion_at": schema.db_now_plus(self.dialect, request.lease_s),
            "skipped_count": jobs.c.skipped_count + request.skipped}
        if request.status is not None:
            values.update(status=request.status, updated_at=now)
        try:
            with self.engine.begin() as conn:
                if conn.execute(jobs.update().where(
                        jobs.c.id == job["id"], jobs.c.next_run_at == seen, jobs.c.status == JobStatus.ACTIVE,
                        jobs.c.lock_token == replaced.token).values(**values)).rowcount != 1:
                    return None
                conn.execute(runs.update().where(runs.c.id == replaced.run_id, runs.c.cancel_requested_at.is_(None))
                             .values(cancel_requested_at=schema.db_now(self.dialect),
                                     cancel_requested_by=(replaced.error_message or "")[:255]))
                if not self._finish_in(conn, [replaced])[0]:
                    raise _ReplacedGoneError
                started_at = self._db_now.rows(conn)[0][0]
                started_at = max(started_at, now)
                run_id = self._insert_run.insert(conn, {
                    "p_job_id": job["id"], "p_scheduled_at": request.scheduled_at, "p_instance": instance,
                    "p_token": token, "p_started_at": started_at, "p_deadline_at": request.deadline_at,
                    "p_queued_at": None, "p_missed": 0, "p_attempt": 1})
        except (sa.exc.IntegrityError, _ReplacedGoneError):  # a run of the occurrence exists, or the replaced
            return None  # run's row is not Running any more (abandoned): nothing written
        return Claim(run_id=run_id, lock_token=token, started_at=started_at)

    def claim_many(self, requests: Sequence[ClaimRequest], *, now: dt.datetime, instance: str,
                   not_before: dt.datetime | None = None, busy: set[int] | None = None) -> list[Claim | None]:
        """Claim several occurrences in ONE transaction (issue 11: one commit for a whole poll's worth), each
        judged by its own row count exactly as :meth:`claim` judges one: a request that lost (lease held,
        occurrence already claimed) gets None and writes nothing; the others get their :class:`Claim`.
        Returns one entry per request, in order. The runs' ``started_at`` is the database's now, read
        after every lease was judged, but not before ``not_before`` (the caller's instant that judged the
        occurrences due: a database clock a little behind it must not record a run as started before its
        scheduled instant). If the unique index on ``runs(job_id, scheduled_at)``
        refuses a row, the batch is rolled back and the requests are claimed one transaction each, so only
        the refused one is lost.

        PostgreSQL and MariaDB/MySQL lock the requested job rows first (``SELECT ... FOR UPDATE``, by id),
        as db-scheduler's lock-and-fetch does. With ``busy`` (a set the caller passes) the lock is ``SKIP
        LOCKED``: a job row another transaction holds (another supervisor claiming it, a result being
        recorded) is not waited for; its request gets None *and its index is added to* ``busy`` - it
        neither won nor lost, and stays due for the next poll. On PostgreSQL the leases are judged in that
        locking read, so the compare-and-sets go as one pipelined executemany and the run rows as one
        ``INSERT ... RETURNING``: about 5 round trips for a batch instead of 2 per run plus 3; a plain batch
        (:func:`_plain_claims`: the lease taken if free, nothing else) is all of that in ONE statement in
        autocommit (:meth:`_claim_plain`), one round trip; as it holds its rows only that long, a request
        whose occurrence moved on since it was read (a peer's claim just committed) is counted in ``busy``
        there too."""
        if not requests:
            return []
        try:
            if self.dialect == "postgresql" and _plain_claims(requests):
                return self._claim_plain(requests, instance, not_before, busy)
            if self.dialect != "sqlite" and len({r.job["id"] for r in requests}) == len(requests):
                try:
                    return self._claim_locked(requests, now, instance, not_before, busy)
                except _RecheckError:  # a lease changed between the locking read and its UPDATE: judge row by row
                    if busy is not None:
                        busy.clear()
            with self.engine.begin() as conn:
                tokens = [self._take_occurrence(conn, r, now, instance) for r in requests]
                won = [t is not False for t in tokens]
                if not any(won):
                    return [None] * len(requests)
                # the database's now, read after every lease was judged: in the records a run never starts
                # before the run whose lease it took ended
                started_at = self._db_now.rows(conn)[0][0]
                if not_before is not None and started_at < not_before:
                    started_at = not_before
                return self._insert_runs(conn, requests, tokens, won, started_at, instance)
        except sa.exc.IntegrityError:
            if busy is not None:
                busy.clear()  # the requests are claimed one by one below, each waiting for its row
            if len(requests) == 1:
                job = requests[0].job
                log.warning("job %s: occurrence %s already has a run; claim refused by the unique index",
                            job["name"], job["next_run_at"])
                return [None]
        return [self.claim_many([r], now=now, instance=instance, not_before=not_before, busy=None)[0]
                for r in requests]

    def claim_pool(self, requests: Sequence[ClaimRequest], limit: int, *, instance: str,
                   not_before: dt.datetime | None = None) -> list[Claim | None]:
        """PostgreSQL: claim at most ``limit`` of ``requests`` - interchangeable candidates in order of
        preference, each plain (:func:`poolable`) - in ONE statement in autocommit (``claim_pool_pg``): the
        first ``limit`` whose job row no other transaction holds (``SKIP LOCKED``) and whose occurrence and
        lease still hold on the locked row, each judged and written as :meth:`claim_many` judges and writes a
        plain claim. For a fleet polling the same due rows: a row a peer took makes way for the next
        candidate. One entry per request, in order: a :class:`Claim`, or None (not taken: held, moved, lost
        or simply not needed; never a verdict on the occurrence). Raises ``ValueError`` on another dialect or
        a request that is not plain."""
        if self.dialect != "postgresql" or not poolable(requests):
            raise ValueError("claim_pool: plain requests on PostgreSQL only")
        if not requests or limit <= 0:
            return [None] * len(requests)
        tokens = [uuid.uuid4().hex for _ in requests]
        payload = _claim_payload(requests, tokens)
        claims: list[Claim | None] = [None] * len(requests)
        try:
            with self.reader.connect() as conn:
                rows = self._claim_pool_pg.rows(conn, {"p_payload": payload, "p_instance": instance,
                                                       "p_not_before": not_before, "p_limit": limit})
        except sa.exc.IntegrityError:  # an occurrence already has a run (the unique index): nothing written
            log.warning("a pooled claim of %d candidates was refused by the unique index on runs; none taken",
                        len(requests))
            return claims
        for i, run_id, started_at in rows:
            claims[i] = Claim(run_id=int(run_id), lock_token=tokens[i], started_at=started_at)
        return claims

    def _claim_plain(self, requests: Sequence[ClaimRequest], instance: str, not_before: dt.datetime | None,
                     busy: set[int] | None) -> list[Claim | None]:
        """PostgreSQL, a plain batch (:func:`_plain_claims`): :meth:`claim_many` as ONE statement in autocommit
        (``claim_plain_pg``: one round trip instead of BEGIN, the locking read, the compare-and-sets, the
        INSERT and COMMIT), each request judged as :meth:`_claim_locked` judges it."""
        tokens = [uuid.uuid4().hex for _ in requests]
        payload = _claim_payload(requests, tokens)
        stmt = self._claim_plain_pg if busy is None else self._claim_plain_skip_pg
        with self.reader.connect() as conn:
            rows = stmt.rows(conn, {"p_payload": payload, "p_instance": instance, "p_not_before": not_before})
        claims: list[Claim | None] = [None] * len(requests)
        for i, locked, run_id, started_at in rows:
            if run_id is not None:
                claims[i] = Claim(run_id=int(run_id), lock_token=tokens[i], started_at=started_at)
            elif not locked and busy is not None:
                # locked by another transaction (SKIP LOCKED), the job gone, or its occurrence moved on since
                # the poll read it: a peer's claim, just committed (one statement holds its rows so briefly
                # that peers rarely find them locked): contention all the same, not a live run to skip
                busy.add(i)
        return claims

    def _claim_locked(self, requests: Sequence[ClaimRequest], now: dt.datetime, instance: str,
                      not_before: dt.datetime | None, busy: set[int] | None) -> list[Claim | None]:
        """:meth:`claim_many` on PostgreSQL and MariaDB/MySQL: lock the jobs rows (skipping those locked
        elsewhere when ``busy`` is given), judge each occurrence against the locked row, write the
        compare-and-sets, then every run row in one INSERT ... RETURNING. Raises :class:`_RecheckError` (all
        rolled back) if an UPDATE did not match what the locking read judged."""
        st = self._stmts
        pg = self.dialect == "postgresql"
        with self.engine.begin() as conn:
            locked = {row.id: row for row in conn.execute(st.lock_jobs if busy is None else st.lock_jobs_skip,
                                                          {"p_ids": [r.job["id"] for r in requests]})}
            tokens: list[str | bool | None] = []
            groups: dict[tuple[bool, bool, bool, bool, bool], list[dict[str, Any]]] = {}
            for i, r in enumerate(requests):
                row = locked.get(r.job["id"])
                seen = r.job["next_run_at"]
                if row is None:  # locked by another transaction (SKIP LOCKED), or the job is gone
                    if busy is not None:
                        busy.add(i)
                    tokens.append(False)
                elif row.next_run_at != seen:  # the occurrence was claimed or moved: lost, nothing written
                    tokens.append(False)
                elif not pg:  # MariaDB: the lease judged by the conditional UPDATE's row count
                    tokens.append(self._take_occurrence(conn, r, now, instance))
                elif r.take_lease and not (row.unheld if r.only_free_lease else row.free):
                    tokens.append(False)
                else:
                    token = uuid.uuid4().hex if r.take_lease else None
                    tokens.append(token)
                    key = (seen is None, r.take_lease, r.only_free_lease, r.status is not None, r.retry)
                    groups.setdefault(key, []).append({
                        "p_job_id": r.job["id"], "p_seen": seen, "p_next_run_at": r.next_run_at,
                        "p_status": r.status, "p_now": now, "p_token": token, "p_instance": instance,
                        "p_lease_s": r.lease_s, "p_missed": r.missed, "p_skipped": r.skipped})
            for key, params in groups.items():  # the rows are ours: each compare-and-set must hold
                if conn.execute(st.claim(*key), params).rowcount != len(params):
                    raise _RecheckError
            won = [(i, r, t) for i, (r, t) in enumerate(zip(requests, tokens, strict=True)) if t is not False]
            claims: list[Claim | None] = [None] * len(requests)
            if not won:
                return claims
            where = {r.job["id"]: i for i, r, _ in won}
            if pg:
                inserted = conn.execute(st.insert_runs_pg, {
                    "p_not_before": not_before, "p_instance": instance,
                    "p_job_ids": [r.job["id"] for _, r, _ in won],
                    "p_scheduled": [_naive(r.scheduled_at) for _, r, _ in won],
                    "p_tokens": [t if isinstance(t, str) else None for _, _, t in won],
                    "p_deadlines": [_naive(r.deadline_at) for _, r, _ in won],
                    "p_queued": [_naive(r.queued_at) for _, r, _ in won],
                    "p_missed": [r.missed for _, r, _ in won], "p_attempts": [r.attempt for _, r, _ in won]})
            else:
                inserted = conn.execute(st.insert_runs, [{
                    "p_job_id": r.job["id"], "p_scheduled_at": r.scheduled_at, "p_instance": instance,
                    "p_token": t if isinstance(t, str) else None, "p_deadline_at": r.deadline_at,
                    "p_queued_at": r.queued_at, "p_missed": r.missed, "p_attempt": r.attempt,
                    "p_not_before": not_before} for _, r, t in won])
            for row in inserted:
                i = where[row.job_id]
                t = tokens[i]
                claims[i] = Claim(run_id=int(row.id), lock_token=t if isinstance(t, str) else None,
                                  started_at=row.started_at)
            return claims

    def _take_occurrence(self, conn: sa.Connection, r: ClaimRequest, now: dt.datetime,
                         instance: str) -> str | bool | None:
        """The compare-and-set of one request: its lease token (None: a claim without a lease), or False if
        it lost."""
        token = uuid.uuid4().hex if r.take_lease else None
        seen = r.job["next_run_at"]
        params: dict[str, Any] = {"p_job_id": r.job["id"], "p_seen": seen, "p_next_run_at": r.next_run_at,
                                  "p_status": r.status, "p_now": now, "p_token": token, "p_instance": instance,
                                  "p_lease_s": r.lease_s, "p_missed": r.missed, "p_skipped": r.skipped}
        stmt = self._stmts.claim(seen is None, r.take_lease, r.only_free_lease, r.status is not None, r.retry)
        prepared = self._claim_prepared.get(id(stmt))
        if prepared is None:
            prepared = self._claim_prepared[id(stmt)] = Prepared(stmt, self.engine.dialect)
        return token if prepared.execute(conn, params) == 1 else False

    def _insert_runs(self, conn: sa.Connection, requests: Sequence[ClaimRequest], tokens: list[str | bool | None],
                     won: list[bool], started_at: dt.datetime, instance: str) -> list[Claim | None]:
        """The Running run rows of the won requests, one INSERT each (an executemany with RETURNING is no
        cheaper: without a sentinel column SQLAlchemy sends it row by row)."""
        claims: list[Claim | None] = []
        for r, t, w in zip(requests, tokens, won, strict=True):
            if not w:
                claims.append(None)
                continue
            lock_token = t if isinstance(t, str) else None
            run_id = self._insert_run.insert(conn, {
                "p_job_id": r.job["id"], "p_scheduled_at": r.scheduled_at, "p_instance": instance,
                "p_token": lock_token, "p_started_at": started_at, "p_deadline_at": r.deadline_at,
                "p_queued_at": r.queued_at, "p_missed": r.missed, "p_attempt": r.attempt})
            claims.append(Claim(run_id=run_id, lock_token=lock_token, started_at=started_at))
        return claims

    def extend(self, job_id: int, token: str | None, lease_s: float, run_id: int, deadline_at: dt.datetime) -> bool:
        """Heartbeat: move run ``run_id``'s deadline to ``deadline_at`` and, if ``token`` still holds the
        job's lease, its expiry to DB-now + ``lease_s``. False (and nothing written) if the token lost
        the lease; a run without a lease (Concurrent) only gets its deadline moved."""
        with self.engine.begin() as conn:
            if token is not None:
                stmt = jobs.update().where(jobs.c.id == job_id, jobs.c.lock_token == token).values(
                    expected_completion_at=schema.db_now_plus(self.dialect, lease_s))
                if conn.execute(stmt).rowcount != 1:
                    return False
            conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING,
                                             _token_is(token)).values(deadline_at=deadline_at))
        return True

    def release(self, job_id: int, token: str) -> bool:
        """Clear the lease if ``token`` still holds it (idempotent: a second call returns False)."""
        with self.engine.begin() as conn:
            return conn.execute(self._stmts.release, {"p_job_id": job_id, "p_token": token}).rowcount == 1

    def finish_run(self, run_id: int, job_id: int, token: str | None, *, status: str, success: bool | None,
                   error_message: str | None, details: dict[str, Any] | None, duration_ms: float | None,
                   count: bool = True, notices: list[OutboxRow] | None = None,
                   completed_at: dt.datetime | None = None) -> bool:
        """Record a run's terminal state (``status``, a :class:`RunStatus` other than Running), update the
        job's statistics (if ``count``), release its lease and write ``notices`` (outbox rows), in one
        transaction; ``error_message`` and ``details`` are fitted to the column cap (:mod:`.text`).
        ``completed_at``: when the run ended (database time; None: the database's now). Only a run still
        ``Running`` and claimed with ``token`` is finished; returns False otherwise (e.g. it was abandoned
        meanwhile), and then touches nothing else."""
        outcome = Outcome(run_id, job_id, token, status, success, error_message, details, duration_ms, count,
                          notices, completed_at)
        return self.finish_runs([outcome])[0]

    def finish_runs(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """:meth:`finish_run` for several runs in ONE transaction (group commit: results that arrived
        together), each judged by its own row count. Returns one bool per outcome, in order. The statistics
        and releases of the runs that were still Running are then written as one batch of parameters per
        statement (executemany). Any error rolls back the whole batch (the caller then retries, or records
        the outcomes one at a time to find the one the database refuses). On PostgreSQL a plain batch
        (:func:`_plain`) is one statement (:meth:`_finish_plain`)."""
        if not outcomes:
            return []
        if self.dialect == "postgresql" and _plain(outcomes):
            return self._finish_plain(outcomes)
        with self.engine.begin() as conn:
            return self._finish_in(conn, outcomes)

    def _finish_in(self, conn: sa.Connection, outcomes: Sequence[Outcome]) -> list[bool]:
        """The writes of :meth:`finish_runs` in the caller's transaction ``conn`` (also used by
        :meth:`claim_replacement`). True per outcome written."""
        st = self._stmts
        # a result lands only on the run row claimed with its token (an id alone could name another run)
        if self.dialect == "postgresql" and len({o.run_id for o in outcomes}) == len(outcomes) > 1:
            done = self._finish_rows_pg(conn, outcomes)
        else:
            done = [(self._finish_run if o.token is not None else self._finish_run_without_lease).execute(conn, {
                "p_run_id": o.run_id, "p_token": o.token, "p_status": o.status, "p_success": o.success,
                "p_error_message": fit_text(o.error_message), "p_completed_at": o.completed_at,
                "p_details": fit_json(o.details), "p_duration_ms": o.duration_ms, "p_cpu_s": o.cpu_s,
                "p_max_rss_mb": o.max_rss_mb}) == 1 for o in outcomes]
        # the job rows in id order, as claims lock them (a peer's claim waiting on one row while holding
        # another must not meet this transaction the other way round): a stable sort for the per-row
        # writes, and on PostgreSQL, whose batched UPDATEs lock in the plan's order, a locking read first
        won = sorted((o for o, d in zip(outcomes, done, strict=True) if d), key=lambda o: o.job_id)
        if self.dialect == "postgresql" and len({o.job_id for o in won}) > 1:
            conn.execute(st.lock_jobs_in_order, {"p_ids": sorted({o.job_id for o in won})})
        for o in won:  # the pending retry, before the statistics (a retried failure is not final)
            if o.retry_at is not None:
                o.retry_set = conn.execute(st.set_retry, {
                    "p_job_id": o.job_id, "p_retry_at": o.retry_at, "p_retry_attempt": o.attempt + 1,
                    "p_retry_scheduled_at": o.scheduled_at}).rowcount == 1
        counted = [o for o in won if o.count]
        # PostgreSQL, each job once in the batch: the statistics of all in one UPDATE ... FROM unnest
        pg_batch = self.dialect == "postgresql" and len(counted) > 1 and len({o.job_id for o in counted}) == len(
            counted)
        if pg_batch:
            conn.execute(st.stats_many_pg, {
                "p_job_ids": [o.job_id for o in counted], "p_successes": [1 if o.success else 0 for o in counted],
                "p_durations": [o.duration_ms for o in counted],
                "p_final": [0 if o.success or o.retry_set else 1 for o in counted],
                "p_completed": [_naive(o.completed_at) for o in counted]})
        # SQLite: the release of a counted run with a duration goes with its statistics (released: its id)
        released = {id(o) for o in counted if self._stats_release is not None and o.duration_ms is not None
                    and o.token is not None and (o.pause_reason is None or o.success or o.retry_set)}
        for stmt, group in ((self._stats, [o for o in counted if o.duration_ms is None and not pg_batch]),
                            (self._stats_with_duration, [o for o in counted if o.duration_ms is not None
                                                         and not pg_batch and id(o) not in released]),
                            (self._stats_release, [o for o in counted if id(o) in released])):
            if group and stmt is not None:
                stmt.executemany(conn, [{"p_job_id": o.job_id, "p_successes": 1 if o.success else 0,
                                         "p_failures": 0 if o.success else 1, "p_duration_ms": o.duration_ms,
                                         "p_final_failure": 0 if o.success or o.retry_set else 1,
                                         "p_completed_at": o.completed_at, "p_token": o.token}
                                        for o in group])
        for o in won:
            if o.pause_reason is not None and not o.success and not o.retry_set and o.count:
                o.paused = conn.execute(st.pause_on_failures, {
                    "p_job_id": o.job_id, "p_reason": o.pause_reason,
                    "p_completed_at": o.completed_at}).rowcount == 1
                if o.paused and o.pause_notices:
                    insert_notices(conn, self.dialect, o.pause_notices)
        releases = [{"p_job_id": o.job_id, "p_token": o.token} for o in won
                    if o.token is not None and id(o) not in released]
        if self.dialect == "postgresql" and len(releases) > 1:
            conn.execute(st.release_many_pg, {"p_job_ids": [r["p_job_id"] for r in releases],
                                              "p_tokens": [r["p_token"] for r in releases]})
        elif releases:
            self._release.executemany(conn, releases)
        for o in won:
            if o.notices:
                insert_notices(conn, self.dialect, o.notices)
        return done

    def _finish_plain(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """PostgreSQL, a plain batch (:func:`_plain`): :meth:`finish_runs` as ONE statement in autocommit
        (``finish_plain_pg``: one round trip instead of BEGIN, three statements and COMMIT), the same rows
        written. True per outcome written."""
        with self.reader.connect() as conn:
            written = {row[0] for row in self._finish_plain_pg.rows(conn, {"p_payload": _finish_payload(outcomes)})}
        return [o.run_id in written for o in outcomes]

    def _finish_rows_pg(self, conn: sa.Connection, outcomes: Sequence[Outcome]) -> list[bool]:
        """PostgreSQL: the terminal run rows of ``outcomes`` (distinct run ids) in one UPDATE ... FROM
        unnest(...) RETURNING, each judged as :meth:`finish_run` judges one; True per outcome written."""
        written = set(conn.execute(self._stmts.finish_many_pg, {
            "p_run_ids": [o.run_id for o in outcomes], "p_tokens": [o.token for o in outcomes],
            "p_statuses": [str(o.status) for o in outcomes], "p_successes": [o.success for o in outcomes],
            "p_errors": [fit_text(o.error_message) for o in outcomes],
            "p_completed": [_naive(o.completed_at) for o in outcomes],
            "p_details": [fit_json(o.details) for o in outcomes], "p_durations": [o.duration_ms for o in outcomes],
            "p_cpus": [o.cpu_s for o in outcomes], "p_rss": [o.max_rss_mb for o in outcomes]}).scalars())
        return [o.run_id in written for o in outcomes]

    def keep_late_result(self, outcome: Outcome, instance: str,
                         notices_for: Callable[[LateResult], list[OutboxRow]] | None = None) -> LateResult | None:
        """Keep the true ``outcome`` of a run that another supervisor abandoned while ``instance`` (its own
        supervisor) was cut off or frozen: its status, end, error and details go to the run's ``late_*``
        columns, and ``notices_for(result)`` (the caller's outbox rows) in the same transaction. Nothing else
        changes: the run stays Failed (abandoned), the job's statistics, lease and retry are left as the
        abandonment set them (the run stays fenced as far as exactly-once goes). Only a run of ``instance``
        claimed with the outcome's token, recorded abandoned and without a late result yet, is written;
        returns what was kept, None otherwise (the row is gone, was not abandoned, or already has one)."""
        cond = (runs.c.id == outcome.run_id, runs.c.executed_by_instance == instance, _token_is(outcome.token),
                runs.c.status == RunStatus.FAILED, runs.c.error_message.startswith(ABANDONED_PREFIX, autoescape=True),
                runs.c.late_status.is_(None))
        with self.engine.begin() as conn:
            written = conn.execute(runs.update().where(*cond).values(
                late_status=outcome.status, late_error_message=fit_text(outcome.error_message),
                late_details=fit_json(outcome.details),
                late_completed_at=sa.func.coalesce(sa.bindparam("p_completed_at", outcome.completed_at,
                                                                type_=schema.UTCDateTime),
                                                   schema.db_now(self.dialect)))).rowcount
            if written != 1:
                return None
            row = conn.execute(
                sa.select(runs.c.id, runs.c.job_id, runs.c.executed_by_instance, runs.c.started_at,
                          runs.c.completed_at, runs.c.error_message, runs.c.late_status, runs.c.late_completed_at,
                          runs.c.late_error_message, jobs.c.name.label("job_name"), jobs.c.notify_on_failure,
                          jobs.c.notify_recipients)
                .join(jobs, jobs.c.id == runs.c.job_id).where(runs.c.id == outcome.run_id)).mappings().one()
            result = cast(LateResult, dict(row))
            rows = notices_for(result) if notices_for is not None else []
            if rows:
                insert_notices(conn, self.dialect, rows)
        return result

    def running_runs(self, instance: str | None = None) -> list[RunRow]:
        """Running runs (of supervisor ``instance``, if given)."""
        query = sa.select(runs).where(runs.c.status == RunStatus.RUNNING)
        if instance is not None:
            query = query.where(runs.c.executed_by_instance == instance)
        with self.reader.connect() as conn:
            return [cast(RunRow, dict(r)) for r in conn.execute(query).mappings()]

    def held_runs(self, tokens: Mapping[int, str | None], instance: str) -> dict[int, str | None]:
        """Of the runs ``tokens`` (run id -> the job lease token it was claimed with, None for a run
        without a lease), those still Running, executed by ``instance`` under that same token, and whose
        job lease (if they had one) still carries it. Each held run maps to who asked to cancel it (its
        ``cancel_requested_by``, ``"someone"`` if only the time was set) or None. Matching the token and
        the instance, not the id alone, means a run row that is not this run's is never taken for it."""
        if not tokens:
            return {}
        query = (sa.select(runs.c.id, runs.c.lock_token, runs.c.cancel_requested_at, runs.c.cancel_requested_by,
                           jobs.c.lock_token.label("job_token"))
                 .outerjoin(jobs, jobs.c.id == runs.c.job_id)
                 .where(runs.c.id.in_(sorted(tokens)), runs.c.status == RunStatus.RUNNING,
                        runs.c.executed_by_instance == instance))
        with self.reader.connect() as conn:
            rows = conn.execute(query).mappings().all()
        held: dict[int, str | None] = {}
        for row in rows:
            token = tokens[row["id"]]
            if row["lock_token"] != token or (token is not None and row["job_token"] != token):
                continue
            held[row["id"]] = ((row["cancel_requested_by"] or "someone")
                               if row["cancel_requested_at"] is not None else None)
        return held

    def held_before_start(self, tokens: Mapping[int, str | None], instance: str) -> dict[int, HeldBeforeStart]:
        """:meth:`held_runs` for runs claimed ahead of their instant, just before it (one read): each held run
        maps to who asked to cancel it (or None) and its job's ``status``, ``next_run_at`` and ``retry_at``
        as they are now, so the supervisor can withdraw a run whose job was paused, disabled or re-planned
        (an edit of its schedule) since the claim, before the plugin starts."""
        if not tokens:
            return {}
        query = (sa.select(runs.c.id, runs.c.lock_token, runs.c.cancel_requested_at, runs.c.cancel_requested_by,
                           jobs.c.lock_token.label("job_token"), jobs.c.status.label("job_status"),
                           jobs.c.next_run_at, jobs.c.retry_at)
                 .outerjoin(jobs, jobs.c.id == runs.c.job_id)
                 .where(runs.c.id.in_(sorted(tokens)), runs.c.status == RunStatus.RUNNING,
                        runs.c.executed_by_instance == instance))
        with self.reader.connect() as conn:
            rows = conn.execute(query).mappings().all()
        held: dict[int, HeldBeforeStart] = {}
        for row in rows:
            token = tokens[row["id"]]
            if row["lock_token"] != token or (token is not None and row["job_token"] != token):
                continue
            held[row["id"]] = HeldBeforeStart(
                (row["cancel_requested_by"] or "someone") if row["cancel_requested_at"] is not None else None,
                row["job_status"], row["next_run_at"], row["retry_at"])
        return held

    def request_cancel(self, run_id: int, requested_by: str) -> RunRow | None:
        """Ask whichever supervisor holds run ``run_id`` to cancel it: sets ``cancel_requested_at`` (DB
        clock) and ``cancel_requested_by`` on the row if it is still Running (a repeated request keeps the
        first time and asker). Returns the row as it is afterwards, None if no run has that id. The
        holder sees the request at its next lease renewal (:meth:`held_runs`)."""
        with self.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.id == run_id, runs.c.status == RunStatus.RUNNING,
                                             runs.c.cancel_requested_at.is_(None))
                         .values(cancel_requested_at=schema.db_now(self.dialect),
                                 cancel_requested_by=requested_by[:255]))
            row = conn.execute(sa.select(runs).where(runs.c.id == run_id)).mappings().first()
        return None if row is None else cast(RunRow, dict(row))

    def request_replace(self, job_id: int, token: str, requested_by: str) -> int:
        """Replace (concurrency_mode): ask whichever supervisor holds job ``job_id``'s lease ``token`` to
        cancel the run claimed with it, as :meth:`request_cancel` does (``cancel_requested_at`` by the
        database clock, ``cancel_requested_by`` = ``requested_by``), unless a cancel is already asked. One
        UPDATE; returns how many runs it asked (0 or 1)."""
        with self.engine.begin() as conn:
            return conn.execute(runs.update().where(
                runs.c.job_id == job_id, runs.c.lock_token == token, runs.c.status == RunStatus.RUNNING,
                runs.c.cancel_requested_at.is_(None)).values(cancel_requested_at=schema.db_now(self.dialect),
                                                               cancel_requested_by=requested_by[:255])).rowcount

    def abandon_orphaned_runs(self, exclude_run_ids: AbstractSet[int] = frozenset(),
                              notices_for: Callable[[AbandonedRun], list[OutboxRow]] | None = None,
                              previous_life_of: str | None = None) -> list[AbandonedRun]:
        """Mark Failed every Running run whose supervisor is gone (its ``supervisors`` row expired by the DB
        clock, or missing), count it as a failure and free its job lease (token-checked), each in one short
        transaction guarded by ``status = 'Running'``. ``exclude_run_ids``: runs the caller itself
        supervises. ``notices_for``: the caller's outbox rows for an abandoned run (the store records facts
        and formats no notice), written in that run's transaction. ``previous_life_of``: a supervisor's own
        instance name at its first sweep, before it claims anything: every Running run under that name is
        then a dead process's that had the name before (a crashed ``serve --instance NAME`` restarted), which
        the new row would otherwise keep alive forever. Returns the abandoned runs."""
        orphan_q = (sa.select(runs, supervisors.c.lease_expires_at.label("holder_expired_at"),
                              schema.db_now(self.dialect).label("db_now"), jobs.c.name.label("job_name"),
                              jobs.c.notify_on_failure, jobs.c.notify_recipients)
                    .join(jobs, jobs.c.id == runs.c.job_id)
                    .outerjoin(supervisors, supervisors.c.instance == runs.c.executed_by_instance)
                    .where(runs.c.status == RunStatus.RUNNING,
                           sa.or_(sa.not_(holder_alive(self.dialect, runs.c.executed_by_instance)),
                                  runs.c.executed_by_instance == previous_life_of) if previous_life_of is not None
                           else sa.not_(holder_alive(self.dialect, runs.c.executed_by_instance))))
        if exclude_run_ids:
            orphan_q = orphan_q.where(runs.c.id.not_in(sorted(exclude_run_ids)))
        with self.reader.connect() as conn:
            orphans = conn.execute(orphan_q).mappings().all()
        abandoned = []
        for orphan in orphans:
            row = dict(orphan)
            run = cast(AbandonedRun, {**row, "error_message": _abandon_message(row)})
            if self._abandon(run, notices_for):
                abandoned.append(run)
        return abandoned

    def _abandon(self, run: AbandonedRun, notices_for: Callable[[AbandonedRun], list[OutboxRow]] | None) -> bool:
        # the run was lost when its supervisor's lease ended, not when this sweep noticed: any takeover
        # claim came after that moment, so the records never show the two runs overlapping
        expired = run["holder_expired_at"]
        ended = min(run["db_now"], expired) if expired else run["db_now"]
        started = run["started_at"]  # None: text edited by hand into a SQLite file (the row is still abandoned)
        duration_ms = None if started is None else max(0.0, (ended - started).total_seconds() * 1000)
        with self.engine.begin() as conn:
            if not conn.execute(runs.update().where(runs.c.id == run["id"], runs.c.status == RunStatus.RUNNING)
                                .values(status=RunStatus.FAILED, success=False, completed_at=ended,
                                        error_message=run["error_message"], duration_ms=duration_ms)).rowcount:
                return False
            conn.execute(self._stmts.stats_with_duration, {"p_job_id": run["job_id"], "p_successes": 0,
                                                           "p_failures": 1, "p_final_failure": 1,
                                                           "p_duration_ms": duration_ms,
                                                           "p_completed_at": ended})
            if run["lock_token"] is not None:
                conn.execute(self._stmts.release, {"p_job_id": run["job_id"], "p_token": run["lock_token"]})
            rows = notices_for(run) if notices_for is not None else []
            if rows:
                insert_notices(conn, self.dialect, rows)
        return True
