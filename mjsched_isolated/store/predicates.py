"""SQL conditions shared by the jobs and leases modules: when a job lease is free (reference-engine-spec.md
§2, judged by the database clock), and whether a supervisor is alive."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from mjsched_isolated.store import schema
from mjsched_isolated.store.schema import jobs, supervisors


def holder_alive(dialect: str, instance_column: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """EXISTS a ``supervisors`` row for ``instance_column`` whose liveness lease has not expired (DB clock)."""
    holder = supervisors.alias("holder")
    return sa.exists().where(holder.c.instance == instance_column,
                             holder.c.lease_expires_at > schema.db_now(dialect))


def lease_free(dialect: str) -> sa.ColumnElement[bool]:
    """A job's lease is free: no token, no expiry, expiry passed (DB clock), or its holder is not alive."""
    return sa.or_(jobs.c.lock_token.is_(None), jobs.c.expected_completion_at.is_(None),
                  jobs.c.expected_completion_at < schema.db_now(dialect),
                  sa.not_(holder_alive(dialect, jobs.c.locked_by_instance)))
