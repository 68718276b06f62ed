"""run_output: each run's captured output in ordered chunks; plugin_reloads: `plugins reload` requests

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

New tables only: existing runs simply have no output rows, and no reload has been requested.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0005"
down_revision = "0004"
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
    op.create_table(
        "plugin_reloads",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("requested_at", _utc_datetime(), nullable=False),
        sa.Column("requested_by", sa.String(255), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("plugin_reloads")
    op.drop_table("run_output")
