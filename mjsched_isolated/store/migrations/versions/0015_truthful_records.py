"""runs.late_status, late_completed_at, late_error_message, late_details: the true result of an abandoned run

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

A run whose supervisor stopped renewing its lease is recorded Failed ("abandoned: ...") by another
supervisor. When the original supervisor comes back with the run's real outcome, that outcome is kept in
these columns (the run stays Failed: its job's lease and statistics are not touched). All nullable: no run
recorded before this revision has one.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN on every database, SQLite included
    op.add_column("runs", sa.Column("late_status", sa.String(20)))
    op.add_column("runs", sa.Column("late_completed_at", _utc_datetime()))
    op.add_column("runs", sa.Column("late_error_message", sa.Text))
    op.add_column("runs", sa.Column("late_details", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for column in ("late_details", "late_error_message", "late_completed_at", "late_status"):
            batch.drop_column(column)
