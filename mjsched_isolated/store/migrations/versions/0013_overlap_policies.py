"""more overlap policies (issue 12 point 7): concurrency modes Replace and QueueAll allowed by the CHECK
constraint on jobs.concurrency_mode, and jobs.max_queued (QueueAll's bound)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02

Existing jobs keep their mode and get ``max_queued`` 10 (used by QueueAll only). A CHECK constraint cannot
be changed in place: PostgreSQL and MySQL/MariaDB drop it and create the wider one; SQLite rebuilds the jobs
table (batch "recreate" from the reflected table, so the columns of every earlier revision are kept,
foreign keys off, every row and id kept). The downgrade turns Replace jobs into Skip and QueueAll jobs
into Queue (their nearest older modes) before narrowing the constraint again.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD_MODES = ("Skip", "Queue", "Concurrent")
NEW_MODES = (*OLD_MODES, "Replace", "QueueAll")
OTHER_CHECKS = {  # the jobs table's other CHECK constraints, as every revision since 0001 has them
    "ck_status": ("status", ("Pending", "Active", "Paused", "Disabled", "Expired")),
    "ck_missed_run_policy": ("missed_run_policy", ("Skip", "RunOnce", "RunAll")),
}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _max_queued() -> sa.Column:
    return sa.Column("max_queued", sa.Integer, nullable=False, server_default="10")


def _jobs_as_it_is(modes: tuple[str, ...]) -> sa.Table:
    """The jobs table as the database has it, for batch ``copy_from``: reflected (whichever revisions ran
    before this one, their columns are kept), its CHECK constraints replaced by ours (SQLite reflection may
    not return them), the one on ``concurrency_mode`` allowing ``modes``."""
    meta = sa.MetaData()
    jobs = sa.Table("jobs", meta, autoload_with=op.get_bind())
    for constraint in [c for c in jobs.constraints if isinstance(c, sa.CheckConstraint)]:
        jobs.constraints.discard(constraint)
    for name, (column, values) in OTHER_CHECKS.items():
        jobs.append_constraint(sa.CheckConstraint(_in(column, values), name=name))
    jobs.append_constraint(sa.CheckConstraint(_in("concurrency_mode", modes), name="ck_concurrency_mode"))
    return jobs


def _require_foreign_keys_off() -> None:
    """Dropping the old jobs table with foreign keys on would cascade-delete every run."""
    if op.get_bind().exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("revision 0013 rebuilds the jobs table on SQLite and must run with foreign keys off "
                           "(through mjsched_isolated.store.migrate)")


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with op.batch_alter_table("jobs", copy_from=_jobs_as_it_is(NEW_MODES), recreate="always",
                                  table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.add_column(_max_queued())
        return
    op.drop_constraint("ck_concurrency_mode", "jobs", type_="check")
    op.create_check_constraint("ck_concurrency_mode", "jobs", _in("concurrency_mode", NEW_MODES))
    op.add_column("jobs", _max_queued())


def downgrade() -> None:
    for new, old in (("Replace", "Skip"), ("QueueAll", "Queue")):
        op.execute(sa.text("UPDATE jobs SET concurrency_mode = :old WHERE concurrency_mode = :new")
                   .bindparams(old=old, new=new))
    if op.get_bind().dialect.name == "sqlite":
        _require_foreign_keys_off()
        with op.batch_alter_table("jobs", copy_from=_jobs_as_it_is(OLD_MODES), recreate="always",
                                  table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.drop_column("max_queued")
        return
    op.drop_column("jobs", "max_queued")
    op.drop_constraint("ck_concurrency_mode", "jobs", type_="check")
    op.create_check_constraint("ck_concurrency_mode", "jobs", _in("concurrency_mode", OLD_MODES))
