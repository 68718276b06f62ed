"""Alembic environment: online only, on the connection :mod:`mjsched_isolated.store.migrate` passes in
``config.attributes["connection"]`` (already locked and inside its transaction; see ``migrate._locked``)."""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError("mjsched_isolated migrations run through mjsched_isolated.store.migrate (python -m "
                       "mjsched_isolated db upgrade), with a connection in config.attributes['connection']")
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():  # joins the caller's transaction: committed (or rolled back) by it
    context.run_migrations()
