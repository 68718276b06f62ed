"""Read-only views for ``status``, ``runs list`` and ``runs show``: runs with their job's name, and the
projections ``status`` prints. Nothing here writes."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import JobStatus, RunStatus
from mjsched_isolated.errors import NotFoundError, require_utf8
from mjsched_isolated.store import schema
from mjsched_isolated.store.records import (
    InflightRun,
    NextDueJob,
    RecentFailure,
    RunView,
    SupervisorStatus,
)
from mjsched_isolated.store.schema import jobs, runs, supervisors


def _run_view(row: sa.RowMapping) -> RunView:
    """``row`` with ``details`` and ``late_details`` decoded from JSON (left as text if not JSON)."""
    view: dict[str, Any] = dict(row)
    for key in ("details", "late_details"):
        if view.get(key):
            try:
                view[key] = json.loads(view[key])
            except ValueError:
                pass
    return cast(RunView, view)


class Views:
    """Reads across ``runs``, ``jobs`` and ``supervisors`` for display."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def get_run(self, run_id: int) -> RunView:
        """Run ``run_id``. Raises :class:`NotFoundError` (field ``id``)."""
        query = sa.select(runs, jobs.c.name.label("job_name")).join(jobs, jobs.c.id == runs.c.job_id).where(
            runs.c.id == run_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        if row is None:
            raise NotFoundError("id", f"no run with id {run_id}")
        return _run_view(row)

    def list_runs(self, *, job_name: str | None = None, status: str | None = None, limit: int = 50) -> list[RunView]:
        """Up to ``limit`` runs (of job ``job_name``, in ``status``, if given), newest first. Raises
        :class:`NotFoundError` (field ``name``) for an unknown ``job_name``."""
        query = sa.select(runs, jobs.c.name.label("job_name")).join(jobs, jobs.c.id == runs.c.job_id)
        if job_name is not None:
            require_utf8("name", job_name)
            query = query.where(jobs.c.name == job_name)
        if status is not None:
            query = query.where(runs.c.status == status)
        query = query.order_by(runs.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            if (job_name is not None
                    and conn.execute(sa.select(jobs.c.id).where(jobs.c.name == job_name)).first() is None):
                raise NotFoundError("name", f"no job named {job_name!r}")
            return [_run_view(r) for r in conn.execute(query).mappings()]

    def previous_attempt_details(self, job_id: int, scheduled_at: dt.datetime, attempt: int) -> str | None:
        """The stored ``details`` (JSON text) of attempt ``attempt - 1`` of job ``job_id``'s occurrence
        ``scheduled_at`` (a retry's previous attempt); None if it has none or is gone (pruned). One indexed
        read (the occurrence's unique key), made only for retries."""
        query = sa.select(runs.c.details).where(runs.c.job_id == job_id, runs.c.scheduled_at == scheduled_at,
                                                runs.c.attempt == attempt - 1)
        with self.engine.connect() as conn:
            details = conn.execute(query).scalar()
        return details if isinstance(details, str) else None

    def status_supervisors(self, hide_after_s: float = 3600.0) -> list[SupervisorStatus]:
        """Supervisors whose liveness lease is live or ended less than ``hide_after_s`` seconds ago (a clean
        stop ends it at once), latest lease expiry first (the live ones). Each row has the ``supervisors``
        columns plus ``alive`` (lease not expired by the database clock)."""
        now_expr = schema.db_now(self.dialect)
        alive = sa.case((supervisors.c.lease_expires_at > now_expr, sa.true()), else_=sa.false())
        query = (sa.select(supervisors, alive.label("alive"))
                 .where(supervisors.c.lease_expires_at > schema.db_now_plus(self.dialect, -hide_after_s))
                 .order_by(supervisors.c.lease_expires_at.desc(), supervisors.c.instance))
        with self.engine.connect() as conn:
            return [cast(SupervisorStatus, {**r, "alive": bool(r["alive"])}) for r in conn.execute(query).mappings()]

    def inflight_runs(self) -> list[InflightRun]:
        """Running runs, oldest first (the ``ix_runs_status`` index)."""
        query = (sa.select(runs.c.id, jobs.c.name.label("job_name"), jobs.c.job_type, runs.c.executed_by_instance,
                           runs.c.started_at, runs.c.deadline_at, runs.c.scheduled_at, runs.c.cancel_requested_by)
                 .join(jobs, jobs.c.id == runs.c.job_id).where(runs.c.status == RunStatus.RUNNING)
                 .order_by(runs.c.started_at, runs.c.id))
        with self.engine.connect() as conn:
            return [cast(InflightRun, dict(r)) for r in conn.execute(query).mappings()]

    def next_due_jobs(self, limit: int = 10) -> list[NextDueJob]:
        """The first ``limit`` Active jobs by ``next_run_at`` (an index walk on ``(status, next_run_at)``)."""
        query = (sa.select(jobs.c.name, jobs.c.next_run_at, jobs.c.cron_expression, jobs.c.timezone)
                 .where(jobs.c.status == JobStatus.ACTIVE, jobs.c.next_run_at.is_not(None))
                 .order_by(jobs.c.next_run_at, jobs.c.id).limit(limit))
        with self.engine.connect() as conn:
            return [cast(NextDueJob, dict(r)) for r in conn.execute(query).mappings()]

    def recent_failures(self, limit: int = 10) -> list[RecentFailure]:
        """The last ``limit`` Failed or Timeout runs, newest ``completed_at`` first."""
        query = (sa.select(runs.c.id, jobs.c.name.label("job_name"), runs.c.status, runs.c.completed_at,
                           runs.c.error_message)
                 .join(jobs, jobs.c.id == runs.c.job_id)
                 .where(runs.c.status.in_((RunStatus.FAILED, RunStatus.TIMEOUT)))
                 .order_by(runs.c.completed_at.desc(), runs.c.id.desc()).limit(limit))
        with self.engine.connect() as conn:
            return [cast(RecentFailure, dict(r)) for r in conn.execute(query).mappings()]
