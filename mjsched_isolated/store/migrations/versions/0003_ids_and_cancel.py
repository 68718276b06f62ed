"""ids never reused on SQLite (AUTOINCREMENT on jobs, runs, notifications); runs.cancel_requested_at and
runs.cancel_requested_by (`runs cancel`)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

SQLite without AUTOINCREMENT hands out the largest id + 1, so the id of a deleted newest row comes back:
a removed job's live run and the next run of a re-added job would share an id (issue 12). SQLite cannot
add AUTOINCREMENT to an existing table, so on SQLite the three tables are rebuilt (batch "recreate", with
foreign keys off: see ``migrate._locked``), keeping every row and id; the new ``sqlite_sequence`` starts
from the largest id kept. PostgreSQL and MySQL/MariaDB never reuse ids: there only the columns are added.
Existing runs get no cancel request (NULL).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    return sa.CheckConstraint(f"{column} IN ({', '.join(repr(v) for v in values)})", name=f"ck_{column}")


def _tables_at_0002(*, with_cancel: bool = False) -> dict[str, sa.Table]:
    """The three tables as revision 0002 left them (batch ``copy_from``: reflection would drop the CHECK
    constraints on SQLite); ``with_cancel``: runs with this revision's columns (for the downgrade)."""
    meta = sa.MetaData()
    jobs = sa.Table(
        "jobs", meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("job_type", sa.String(100), nullable=False),
        sa.Column("description", sa.Text),
        sa.Column("cron_expression", sa.String(120), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False, server_default="UTC"),
        sa.Column("status", sa.String(20), nullable=False, server_default="Pending"),
        sa.Column("configuration", sa.Text),
        sa.Column("start_at", _utc_datetime()),
        sa.Column("end_at", _utc_datetime()),
        sa.Column("next_run_at", _utc_datetime()),
        sa.Column("last_run_at", _utc_datetime()),
        sa.Column("run_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("success_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failure_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("skipped_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_duration_ms", sa.Float),
        sa.Column("avg_duration_ms", sa.Float),
        sa.Column("concurrency_mode", sa.String(20), nullable=False, server_default="Skip"),
        sa.Column("missed_run_policy", sa.String(20), nullable=False, server_default="RunOnce"),
        sa.Column("max_jitter_s", sa.Float),
        sa.Column("run_immediately_if_never_run", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("max_runtime_minutes", sa.Integer),
        sa.Column("notify_on_success", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("notify_on_failure", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("lock_token", sa.String(36)),
        sa.Column("locked_at", _utc_datetime()),
        sa.Column("locked_by_instance", sa.String(255)),
        sa.Column("expected_completion_at", _utc_datetime()),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("updated_at", _utc_datetime(), nullable=False),
        sa.Column("notify_on_missed", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("notify_recipients", sa.Text),
        _check("status", ("Pending", "Active", "Paused", "Disabled", "Expired")),
        _check("concurrency_mode", ("Skip", "Queue", "Concurrent")),
        _check("missed_run_policy", ("Skip", "RunOnce", "RunAll")),
        sa.Index("ix_jobs_status_next_run_at", "status", "next_run_at"),
    )
    runs = sa.Table(
        "runs", meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("scheduled_at", _utc_datetime()),
        sa.Column("started_at", _utc_datetime(), nullable=False),
        sa.Column("completed_at", _utc_datetime()),
        sa.Column("status", sa.String(20), nullable=False, server_default="Running"),
        sa.Column("success", sa.Boolean),
        sa.Column("error_message", sa.Text),
        sa.Column("details", sa.Text),
        sa.Column("queued_at", _utc_datetime()),
        sa.Column("executed_by_instance", sa.String(255)),
        sa.Column("lock_token", sa.String(36)),
        sa.Column("deadline_at", _utc_datetime()),
        sa.Column("duration_ms", sa.Float),
        *(_cancel_columns() if with_cancel else []),
        _check("status", ("Running", "Completed", "Failed", "Cancelled", "Timeout")),
        sa.UniqueConstraint("job_id", "scheduled_at", name="uq_runs_job_id_scheduled_at"),
        sa.Index("ix_runs_job_id_started_at", "job_id", "started_at"),
        sa.Index("ix_runs_status", "status"),
    )
    notifications = sa.Table(
        "notifications", meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("channel", sa.String(20), nullable=False),
        sa.Column("event", sa.String(20), nullable=False),
        sa.Column("job_id", sa.Integer),
        sa.Column("job_name", sa.String(200), nullable=False),
        sa.Column("run_id", sa.Integer),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("priority", sa.String(10), nullable=False, server_default="Normal"),
        sa.Column("recipients", sa.Text),
        sa.Column("details", sa.Text),
        sa.Column("status", sa.String(20), nullable=False, server_default="Pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", _utc_datetime(), nullable=False),
        sa.Column("claimed_by", sa.String(255)),
        sa.Column("claimed_until", _utc_datetime()),
        sa.Column("last_error", sa.Text),
        sa.Column("created_at", _utc_datetime(), nullable=False),
        sa.Column("sent_at", _utc_datetime()),
        _check("event", ("Success", "Failure", "Skipped", "Missed")),
        _check("status", ("Pending", "Sent", "Failed")),
        _check("priority", ("Low", "Normal", "High")),
        sa.Index("ix_notifications_status_next_attempt_at", "status", "next_attempt_at"),
    )
    return {"jobs": jobs, "runs": runs, "notifications": notifications}


def _cancel_columns() -> list[sa.Column]:
    return [sa.Column("cancel_requested_at", _utc_datetime()), sa.Column("cancel_requested_by", sa.String(255))]


def _require_foreign_keys_off() -> None:
    """Dropping the old jobs table with foreign keys on would cascade-delete every run."""
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("revision 0003 rebuilds tables on SQLite and must run with foreign keys off "
                           "(through mjsched_isolated.store.migrate)")


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        for name, table in _tables_at_0002().items():
            with op.batch_alter_table(name, copy_from=table, recreate="always",
                                      table_kwargs={"sqlite_autoincrement": True}) as batch:
                if name == "runs":
                    for column in _cancel_columns():
                        batch.add_column(column)
        return
    for column in _cancel_columns():
        op.add_column("runs", column)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        for name, table in _tables_at_0002(with_cancel=True).items():
            with op.batch_alter_table(name, copy_from=table, recreate="always") as batch:
                if name == "runs":
                    batch.drop_column("cancel_requested_by")
                    batch.drop_column("cancel_requested_at")
        return
    op.drop_column("runs", "cancel_requested_by")
    op.drop_column("runs", "cancel_requested_at")
