"""backfill and retry-a-run: the ``backfills`` table of pending occurrences

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02

A new table only: existing rows are untouched and no job has a pending backfill after the upgrade.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "backfills",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("scheduled_at", _utc_datetime()),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),
        sa.Column("kind", sa.String(20), nullable=False, server_default="Backfill"),
        sa.Column("retry_of_run_id", sa.Integer),
        sa.Column("requested_at", _utc_datetime(), nullable=False),
        sa.Column("requested_by", sa.String(255), nullable=False),
        sa.CheckConstraint("kind IN ('Backfill', 'Retry')", name="ck_kind"),
        sa.UniqueConstraint("job_id", "scheduled_at", "attempt", name="uq_backfills_job_id_scheduled_at_attempt"),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("backfills")
