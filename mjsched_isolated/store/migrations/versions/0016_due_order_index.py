"""PostgreSQL: the due read's index carries its whole order (ix_jobs_due replaces ix_jobs_status_next_run_at)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03

The poll reads the first due jobs in the order (next_run_at, last_run_at NULLS FIRST, id). With the index on
(status, next_run_at) alone, PostgreSQL read and sorted every job due at the earliest instant to return the
first few: with 3,000 jobs due every second, ~1,500 rows a poll (issue 11: a third of the server's CPU a
run). ``ix_jobs_due`` on (status, next_run_at, last_run_at NULLS FIRST, id) is that order, so the read is an
index walk that stops at its limit; it serves every use of the old index (its first two columns), which is
dropped, so a claim still writes as many index entries. PostgreSQL only: SQLite and MySQL/MariaDB keep
ix_jobs_status_next_run_at (their due reads are unchanged). Built with a plain CREATE INDEX (the jobs table
is locked against writes while it is built: a short moment for any realistic number of jobs).
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("CREATE INDEX ix_jobs_due ON jobs (status, next_run_at, last_run_at NULLS FIRST, id)")
    op.drop_index("ix_jobs_status_next_run_at", table_name="jobs")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index("ix_jobs_status_next_run_at", "jobs", ["status", "next_run_at"])
    op.drop_index("ix_jobs_due", table_name="jobs")
