"""supervisors.max_concurrent_jobs and supervisors.version: what status and the dashboard show of each

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

Both nullable: rows written before this revision show none (a supervisor writes them when it registers).
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN on every database, SQLite included
    op.add_column("supervisors", sa.Column("max_concurrent_jobs", sa.Integer))
    op.add_column("supervisors", sa.Column("version", sa.String(40)))


def downgrade() -> None:
    with op.batch_alter_table("supervisors") as batch:
        batch.drop_column("version")
        batch.drop_column("max_concurrent_jobs")
