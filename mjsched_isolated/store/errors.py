"""Telling refused data from an unreachable database, across the three drivers."""

from __future__ import annotations

import sqlalchemy as sa

# MySQL/MariaDB report a CHECK violation as OperationalError with one of these codes
_CHECK_VIOLATION_CODES = (3819, 4025)  # ER_CHECK_CONSTRAINT_VIOLATED (MySQL), ER_CONSTRAINT_FAILED (MariaDB)


def is_permanent_error(exc: BaseException) -> bool:
    """True if retrying the same statement cannot help: the data was refused (a NUL byte PostgreSQL will
    not store, a constraint, a value that cannot be bound), as opposed to a database that is unreachable
    or busy (``OperationalError``/``InterfaceError``), which is worth retrying."""
    if isinstance(exc, (sa.exc.DataError, sa.exc.IntegrityError, sa.exc.ProgrammingError)):
        return True
    if isinstance(exc, sa.exc.DBAPIError):
        return is_constraint_violation(exc)
    return isinstance(exc, (sa.exc.StatementError, TypeError, ValueError))  # failed while binding, client side


def is_constraint_violation(exc: sa.exc.DBAPIError) -> bool:
    """True for an ``IntegrityError``, or MySQL/MariaDB's CHECK violation, which PyMySQL reports as
    ``OperationalError`` (error codes 3819 and 4025)."""
    if isinstance(exc, sa.exc.IntegrityError):
        return True
    args = getattr(exc.orig, "args", None)
    if not args:
        return False
    return args[0] in _CHECK_VIOLATION_CODES
