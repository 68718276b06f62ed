"""runs.cpu_s and runs.max_rss_mb: the CPU time and peak memory a run used, measured by its worker

Revision ID: 0011
Revises: 0009
Create Date: 2026-12-02

Both nullable: runs recorded before this revision, and runs that were killed, have none.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN on every database, SQLite included
    op.add_column("runs", sa.Column("cpu_s", sa.Float))
    op.add_column("runs", sa.Column("max_rss_mb", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("max_rss_mb")
        batch.drop_column("cpu_s")
