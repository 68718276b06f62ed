"""Pruning finished runs and settled notifications: reads of ids, then short DELETE transactions in
batches, so no long lock is held and several supervisors may prune at once. ``now`` is the caller's
clock; ``keep_days = 0`` keeps everything. Running runs and Pending notifications are never touched."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import NotificationStatus, RunStatus
from mjsched_isolated.store.output import RunOutput
from mjsched_isolated.store.schema import notifications, runs

_SETTLED = (NotificationStatus.SENT, NotificationStatus.FAILED)


def _prunable(now: dt.datetime, keep_days: float,
              keep_min_per_job: int) -> tuple[sa.Subquery, sa.ColumnElement[bool]]:
    """(ranked subquery, condition): finished runs that started before ``now - keep_days`` and are not
    among their job's newest ``keep_min_per_job`` finished runs. ROW_NUMBER() is a window function of
    SQLite >= 3.25, PostgreSQL and MySQL 8 / MariaDB 10.2."""
    rank = sa.func.row_number().over(partition_by=runs.c.job_id, order_by=(runs.c.started_at.desc(), runs.c.id.desc()))
    ranked = (sa.select(runs.c.id, runs.c.started_at, rank.label("rank"))
              .where(runs.c.status != RunStatus.RUNNING).subquery("ranked"))
    cutoff = now - dt.timedelta(days=keep_days)
    return ranked, sa.and_(ranked.c.rank > keep_min_per_job, ranked.c.started_at < cutoff)


class Retention:
    """Deletes of old ``runs`` and ``notifications`` rows."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def count_prunable_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int) -> int:
        """How many runs :meth:`prune_runs` would delete now (0 when ``keep_days`` is 0: keep everything)."""
        if keep_days <= 0:
            return 0
        ranked, cond = _prunable(now, keep_days, keep_min_per_job)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(ranked).where(cond)).scalar_one()

    def prunable_run_ids(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, limit: int) -> list[int]:
        """Up to ``limit`` ids of runs :meth:`prune_runs` would delete, lowest first (one read; no lock held
        on SQLite in WAL mode, PostgreSQL or InnoDB). Empty when ``keep_days`` is 0."""
        if keep_days <= 0:
            return []
        ranked, cond = _prunable(now, keep_days, keep_min_per_job)
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(ranked.c.id).where(cond).order_by(ranked.c.id).limit(limit)).scalars())

    def delete_finished_runs(self, run_ids: list[int]) -> int:
        """Delete the given runs unless Running, in one short transaction. Returns how many were deleted
        (ids already gone, e.g. pruned by another supervisor, are not counted). Their output rows go in
        the same transaction (explicitly: SQLite enforces the cascade only with ``foreign_keys=ON``)."""
        if not run_ids:
            return 0
        with self.engine.begin() as conn:
            finished = sa.select(runs.c.id).where(runs.c.id.in_(run_ids), runs.c.status != RunStatus.RUNNING)
            RunOutput.delete_for_runs(conn, finished)
            stmt = runs.delete().where(runs.c.id.in_(run_ids), runs.c.status != RunStatus.RUNNING)
            return conn.execute(stmt).rowcount

    def prune_runs(self, now: dt.datetime, keep_days: float, keep_min_per_job: int, batch_size: int = 500,
                   max_batches: int | None = None) -> int:
        """Delete finished runs that started more than ``keep_days`` days before ``now``, keeping each job's
        newest ``keep_min_per_job`` finished runs whatever their age, ``batch_size`` ids per read and DELETE
        transaction, until nothing is left or ``max_batches`` batches ran. Returns the number deleted."""
        deleted = batches = 0
        while max_batches is None or batches < max_batches:
            ids = self.prunable_run_ids(now, keep_days, keep_min_per_job, batch_size)
            deleted += self.delete_finished_runs(ids)
            batches += 1
            if len(ids) < batch_size:
                break
        return deleted

    def _old_settled_notifications(self, now: dt.datetime, keep_days: float) -> sa.ColumnElement[bool]:
        return sa.and_(notifications.c.status.in_(_SETTLED),
                       notifications.c.created_at < now - dt.timedelta(days=keep_days))

    def count_prunable_notifications(self, now: dt.datetime, keep_days: float) -> int:
        """How many notifications :meth:`prune_notifications` would delete now (``runs prune --dry-run``)."""
        if keep_days <= 0:
            return 0
        query = sa.select(sa.func.count()).select_from(notifications).where(
            self._old_settled_notifications(now, keep_days))
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one()

    def prune_notifications(self, now: dt.datetime, keep_days: float, batch_size: int = 500,
                            max_batches: int | None = None) -> int:
        """Delete delivered (Sent) and given-up (Failed) notifications created more than ``keep_days`` days
        before ``now``, ``batch_size`` per short transaction; Pending ones are never touched. Returns the
        number deleted."""
        if keep_days <= 0:
            return 0
        old = self._old_settled_notifications(now, keep_days)
        deleted = batches = 0
        while max_batches is None or batches < max_batches:
            with self.engine.connect() as conn:
                ids = list(conn.execute(sa.select(notifications.c.id).where(old)
                                        .order_by(notifications.c.id).limit(batch_size)).scalars())
            if ids:
                with self.engine.begin() as conn:
                    deleted += conn.execute(notifications.delete().where(
                        notifications.c.id.in_(ids), notifications.c.status != NotificationStatus.PENDING)).rowcount
            batches += 1
            if len(ids) < batch_size:
                break
        return deleted
