"""baseline: jobs, runs and supervisors as created by create_all before migrations existed

Revision ID: 0001
Revises:
Create Date: 2026-11-30

A database with these tables and no ``alembic_version`` (made by an earlier version) is recognised as
this revision by ``mjsched_isolated.store.migrate``.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    return sa.CheckConstraint(f"{column} IN ({', '.join(repr(v) for v in values)})", name=f"ck_{column}")


def upgrade() -> None:
    op.create_table(
        "jobs",
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
        _check("status", ("Pending", "Active", "Paused", "Disabled", "Expired")),
        _check("concurrency_mode", ("Skip", "Queue", "Concurrent")),
        _check("missed_run_policy", ("Skip", "RunOnce", "RunAll")),
    )
    op.create_index("ix_jobs_status_next_run_at", "jobs", ["status", "next_run_at"])

    op.create_table(
        "runs",
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
        _check("status", ("Running", "Completed", "Failed", "Cancelled", "Timeout")),
        sa.UniqueConstraint("job_id", "scheduled_at", name="uq_runs_job_id_scheduled_at"),
    )
    op.create_index("ix_runs_job_id_started_at", "runs", ["job_id", "started_at"])
    op.create_index("ix_runs_status", "runs", ["status"])

    op.create_table(
        "supervisors",
        sa.Column("instance", sa.String(255), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", _utc_datetime(), nullable=False),
        sa.Column("heartbeat_at", _utc_datetime(), nullable=False),
        sa.Column("lease_expires_at", _utc_datetime(), nullable=False),
        sa.Column("stopped_at", _utc_datetime()),
    )


def downgrade() -> None:
    op.drop_table("supervisors")
    op.drop_table("runs")
    op.drop_table("jobs")
