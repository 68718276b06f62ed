"""notifications: the outbox table, and jobs.notify_on_missed / jobs.notify_recipients

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Existing jobs get notify_on_missed = false (its server default) and no notify_recipients.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    return sa.CheckConstraint(f"{column} IN ({', '.join(repr(v) for v in values)})", name=f"ck_{column}")


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN, SQLite included (a constant default). Not batch_alter_table: for a
    # server default given as an expression (sa.false()) it would copy and recreate jobs on SQLite.
    op.add_column("jobs", sa.Column("notify_on_missed", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("notify_recipients", sa.Text))

    op.create_table(
        "notifications",
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
    )
    op.create_index("ix_notifications_status_next_attempt_at", "notifications", ["status", "next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_notifications_status_next_attempt_at", table_name="notifications")
    op.drop_table("notifications")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("notify_recipients")
        batch.drop_column("notify_on_missed")
