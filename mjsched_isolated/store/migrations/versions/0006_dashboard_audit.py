"""dashboard: the audit table (who did what, when) and an index on runs.started_at for its charts

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

Adds only: existing rows are untouched. ``ix_runs_started_at`` serves the dashboard's "runs by status over
the last hour/day" and its time filters on a table of millions of runs.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", _utc_datetime(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("action", sa.String(50), nullable=False),
        sa.Column("target", sa.String(255)),
        sa.Column("outcome", sa.String(20), nullable=False),
        sa.Column("details", sa.Text),
        sa.Column("remote_addr", sa.String(64)),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_runs_started_at", "runs", ["started_at", "status"])


def downgrade() -> None:
    op.drop_index("ix_runs_started_at", table_name="runs")
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_table("audit_log")
