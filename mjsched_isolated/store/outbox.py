"""The durable notification outbox: rows written in the transaction that records their cause
(:func:`insert_notices`), then claimed, sent and settled by the notifier (one conditional UPDATE each,
judged by its row count; claims expire by the database clock)."""

from __future__ import annotations

from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from mjsched_isolated.enums import NotificationStatus
from mjsched_isolated.store import schema
from mjsched_isolated.store.records import NotificationRow, OutboxRow
from mjsched_isolated.store.schema import notifications
from mjsched_isolated.store.text import MAX_SUBJECT_BYTES, fit_text


def insert_notices(conn: sa.Connection, dialect: str, rows: list[OutboxRow]) -> None:
    """Insert outbox rows on ``conn``, inside the caller's transaction: Pending, due now by the DB clock,
    subject/body/details/recipients fitted to their column caps (:mod:`.text`)."""
    now_expr = schema.db_now(dialect)
    for row in rows:
        values = {**row, "subject": fit_text(row["subject"], MAX_SUBJECT_BYTES), "body": fit_text(row["body"]),
                  "details": fit_text(row.get("details")), "recipients": fit_text(row.get("recipients"))}
        conn.execute(notifications.insert().values(**values, status=NotificationStatus.PENDING, attempts=0,
                                                   created_at=now_expr, next_attempt_at=now_expr))


class Outbox:
    """Reads and settles ``notifications`` rows for the notifier and ``status``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def _claimable(self) -> list[sa.ColumnElement[bool]]:
        now_expr = schema.db_now(self.dialect)
        return [notifications.c.status == NotificationStatus.PENDING, notifications.c.next_attempt_at <= now_expr,
                sa.or_(notifications.c.claimed_until.is_(None), notifications.c.claimed_until < now_expr)]

    def due_notification_ids(self, limit: int, channel: str | None = None) -> list[int]:
        """Ids of Pending notifications (of ``channel``, if given) due by the DB clock and not claimed (or
        whose claim expired), oldest first (an index range on ``(status, next_attempt_at)``)."""
        query = (sa.select(notifications.c.id).where(*self._claimable())
                 .order_by(notifications.c.next_attempt_at, notifications.c.id).limit(limit))
        if channel is not None:
            query = query.where(notifications.c.channel == channel)
        with self.engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def claim_notification(self, notification_id: int, instance: str, lease_s: float) -> NotificationRow | None:
        """Claim one due notification for ``lease_s`` seconds (DB clock) and count the attempt: one
        conditional UPDATE judged by its row count, so of several senders exactly one wins. Returns the
        claimed row, or None if it is no longer due or another sender holds it."""
        stmt = notifications.update().where(notifications.c.id == notification_id, *self._claimable()).values(
            claimed_by=instance, claimed_until=schema.db_now_plus(self.dialect, lease_s),
            attempts=notifications.c.attempts + 1)
        with self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                return None
            row = conn.execute(sa.select(notifications).where(notifications.c.id == notification_id)).mappings().one()
            return cast(NotificationRow, dict(row))

    def notification_sent(self, notification_id: int, instance: str) -> bool:
        """Mark a notification this sender claimed as Sent (DB clock). False if the claim was lost."""
        return self._settle(notification_id, instance, status=NotificationStatus.SENT,
                            sent_at=schema.db_now(self.dialect), last_error=None)

    def notification_attempt_failed(self, notification_id: int, instance: str, error: str,
                                    retry_in_s: float | None) -> bool:
        """Record a failed delivery: Pending again, due in ``retry_in_s`` seconds (DB clock), or Failed for
        good when ``retry_in_s`` is None. ``error`` is stored as ``last_error`` (callers keep secrets out
        of it). False if the claim was lost."""
        if retry_in_s is None:
            return self._settle(notification_id, instance, status=NotificationStatus.FAILED, last_error=error)
        return self._settle(notification_id, instance, status=NotificationStatus.PENDING, last_error=error,
                            next_attempt_at=schema.db_now_plus(self.dialect, retry_in_s))

    def _settle(self, notification_id: int, instance: str, **values: Any) -> bool:
        stmt = notifications.update().where(
            notifications.c.id == notification_id, notifications.c.status == NotificationStatus.PENDING,
            notifications.c.claimed_by == instance).values(claimed_until=None, **values)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def list_notifications(self, *, status: str | None = None, limit: int = 1000) -> list[NotificationRow]:
        """Outbox rows, oldest first (``recipients``/``details`` as stored: JSON text)."""
        query = sa.select(notifications).order_by(notifications.c.id).limit(limit)
        if status is not None:
            query = query.where(notifications.c.status == status)
        with self.engine.connect() as conn:
            return [cast(NotificationRow, dict(r)) for r in conn.execute(query).mappings()]
