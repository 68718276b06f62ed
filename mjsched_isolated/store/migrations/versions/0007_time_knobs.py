"""time knobs: jobs.dst_gap_policy, jobs.dst_fold_policy

Revision ID: 0007
Revises: 0003
Create Date: 2026-12-02

Existing jobs get the rules they had: dst_gap_policy 'Shift', dst_fold_policy 'OnceIfFixedHour' (the
server defaults).
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN, SQLite included (constant defaults); no CHECK constraint: jobspec
    # validates the values and the planner refuses an edited bad one (the job is set aside, reported)
    op.add_column("jobs", sa.Column("dst_gap_policy", sa.String(20), nullable=False, server_default="Shift"))
    op.add_column("jobs", sa.Column("dst_fold_policy", sa.String(20), nullable=False,
                                    server_default="OnceIfFixedHour"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("dst_fold_policy")
        batch.drop_column("dst_gap_policy")
