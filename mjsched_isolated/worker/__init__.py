"""The worker side of the process boundary: everything that runs inside a pooled child process.

It imports only the shared protocol (:mod:`mjsched_isolated.protocol`), the plugin API
(:mod:`mjsched_isolated.api`), errors and logging: never the store, SQLAlchemy, Alembic or the supervisor
(``tests/test_import_contract.py`` checks it statically and at run time).
"""
