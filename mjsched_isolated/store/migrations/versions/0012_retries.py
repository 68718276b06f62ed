"""retries and pause on repeated failure: runs.attempt, a unique index on runs(job_id, scheduled_at,
attempt), the jobs' retry policy, pending-retry and pause-on-failure columns

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

Existing runs become attempt 1; existing jobs get no retries (``max_retries`` 0), no pending retry, no
pause on failure and ``consecutive_failures`` 0: they behave exactly as before. The unique index on an
occurrence's runs gains ``attempt`` (a retry is a new run of the same occurrence). On SQLite the runs table
is rebuilt (a constraint cannot be dropped in place; batch "recreate" from the reflected table, foreign
keys off, every row, column and id kept); elsewhere the new index is created before the old one is dropped.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

OLD_UNIQUE = "uq_runs_job_id_scheduled_at"
NEW_UNIQUE = "uq_runs_job_id_scheduled_at_attempt"


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _job_columns() -> list[sa.Column]:
    return [
        sa.Column("max_retries", sa.Integer, nullable=False, server_default="0"),
        sa.Column("retry_backoff_s", sa.Float, nullable=False, server_default="10"),
        sa.Column("retry_backoff_factor", sa.Float, nullable=False, server_default="2"),
        sa.Column("retry_backoff_max_s", sa.Float),
        sa.Column("retry_max_jitter_s", sa.Float),
        sa.Column("retry_on", sa.String(100)),
        sa.Column("retry_at", _utc_datetime()),
        sa.Column("retry_attempt", sa.Integer),
        sa.Column("retry_scheduled_at", _utc_datetime()),
        sa.Column("retry_next_run_at", _utc_datetime()),
        sa.Column("pause_after_failures", sa.Integer),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("paused_reason", sa.Text),
    ]


def _runs_as_it_is() -> sa.Table:
    """The runs table as the database has it, for batch ``copy_from``: reflected (so whichever revisions
    ran before this one, their columns are kept), with the CHECK constraint on ``status`` that SQLite
    reflection may not return."""
    meta = sa.MetaData()
    runs = sa.Table("runs", meta, autoload_with=op.get_bind())
    if not any(isinstance(c, sa.CheckConstraint) and c.name == "ck_status" for c in runs.constraints):
        runs.append_constraint(sa.CheckConstraint(
            "status IN ('Running', 'Completed', 'Failed', 'Cancelled', 'Timeout')", name="ck_status"))
    return runs


def _require_foreign_keys_off() -> None:
    """Dropping the old runs table with foreign keys on would cascade into run_output."""
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("revision 0012 rebuilds the runs table on SQLite and must run with foreign keys off "
                           "(through mjsched_isolated.store.migrate)")


def upgrade() -> None:
    for column in _job_columns():
        op.add_column("jobs", column)
    attempt = sa.Column("attempt", sa.Integer, nullable=False, server_default="1")
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with op.batch_alter_table("runs", copy_from=_runs_as_it_is(), recreate="always",
                                  table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.add_column(attempt)
            batch.drop_constraint(OLD_UNIQUE, type_="unique")
            batch.create_unique_constraint(NEW_UNIQUE, ["job_id", "scheduled_at", "attempt"])
        return
    op.add_column("runs", attempt)
    op.create_unique_constraint(NEW_UNIQUE, "runs", ["job_id", "scheduled_at", "attempt"])
    op.drop_constraint(OLD_UNIQUE, "runs", type_="unique")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with op.batch_alter_table("runs", copy_from=_runs_as_it_is(), recreate="always",
                                  table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.drop_constraint(NEW_UNIQUE, type_="unique")
            batch.drop_column("attempt")
            batch.create_unique_constraint(OLD_UNIQUE, ["job_id", "scheduled_at"])
    else:
        op.create_unique_constraint(OLD_UNIQUE, "runs", ["job_id", "scheduled_at"])
        op.drop_constraint(NEW_UNIQUE, "runs", type_="unique")
        op.drop_column("runs", "attempt")
    with op.batch_alter_table("jobs") as batch:
        for column in reversed(_job_columns()):
            batch.drop_column(column.name)
