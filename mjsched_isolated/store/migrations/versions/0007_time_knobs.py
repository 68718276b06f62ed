"""time knobs: jobs.dst_gap_policy, jobs.dst_fold_policy, jobs.missed_run_grace_s, jobs.max_total_runtime_s

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

Existing jobs get the rules they had: dst_gap_policy 'Shift', dst_fold_policy 'OnceIfFixedHour' (the
server defaults), no missed_run_grace_s (the reference's rule) and no max_total_runtime_s (no hard cap).
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN, SQLite included (constant defaults); no CHECK constraint: jobspec
    # validates the values and the planner refuses an edited bad one (the job is set aside, reported)
    op.add_column("jobs", sa.Column("dst_gap_policy", sa.String(20), nullable=False, server_default="Shift"))
    op.add_column("jobs", sa.Column("dst_fold_policy", sa.String(20), nullable=False,
                                    server_default="OnceIfFixedHour"))
    op.add_column("jobs", sa.Column("missed_run_grace_s", sa.Float))
    op.add_column("jobs", sa.Column("max_total_runtime_s", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("max_total_runtime_s")
        batch.drop_column("missed_run_grace_s")
        batch.drop_column("dst_fold_policy")
        batch.drop_column("dst_gap_policy")
