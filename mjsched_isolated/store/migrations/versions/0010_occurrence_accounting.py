"""jobs.missed_count and runs.missed_count: every occurrence accounted for (issue 12)

Revision ID: 0010
Revises: 0008
Create Date: 2026-12-02

``jobs.missed_count``: occurrences the missed-run policy folded into a catch-up run or dropped;
``runs.missed_count``: how many occurrences a catch-up run folded. Both 0 for rows written before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN on every database, SQLite included
    op.add_column("jobs", sa.Column("missed_count", sa.Integer, nullable=False, server_default="0"))
    op.add_column("runs", sa.Column("missed_count", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("missed_count")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("missed_count")
