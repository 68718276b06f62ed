"""run_output: each run's captured output (stdout, stderr, logging records) in ordered chunks

Revision ID: 0005
Revises: 0002
Create Date: 2026-12-02

A new table only: existing runs simply have no output rows.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0005"
down_revision = "0002"
branch_labels = None
depends_on = None


def _utc_datetime() -> sa.types.TypeEngine:
    """schema.UTCDateTime's storage as of this revision: naive UTC, DATETIME(6) on MySQL/MariaDB."""
    return sa.DateTime(timezone=False).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "run_output",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("created_at", _utc_datetime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("run_output")
