"""resource limits per job: jobs.max_memory_mb, max_cpu_s, max_open_files, max_processes, nice

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

All nullable, no default: existing jobs get no limit of their own (the settings' [limits] apply).
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = ("max_memory_mb", "max_cpu_s", "max_open_files", "max_processes", "nice")


def upgrade() -> None:
    for name in COLUMNS:  # plain ALTER TABLE ADD COLUMN on every database, SQLite included
        op.add_column("jobs", sa.Column(name, sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
