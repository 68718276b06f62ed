"""Driver-level execution of the hot path's prebuilt statements (issue 11).

A :class:`Prepared` statement is a SQLAlchemy Core construct compiled ONCE for the engine's dialect: its SQL
string, the order of its parameters, and the bind and result processors of its types (``UTCDateTime``,
``Boolean``, SQLite's text timestamps) are kept, and each execution goes straight to the DBAPI cursor of
the SQLAlchemy connection it is given (so it joins that connection's transaction). What SQLAlchemy's
``Connection.execute`` does per call on top of the driver - the compiled-cache lookup, an execution
context, parameter processing through the generic path, a ``CursorResult`` - cost about as much as the
SQLite statement itself (measured with callgrind: see ``benchmarks/README.md``, "Supervisor CPU per run").

Semantics kept from ``Connection.execute``: the same SQL and the same type conversions, in and out; a
DBAPI error is raised as SQLAlchemy's wrapper (``sqlalchemy.exc.IntegrityError``, ``OperationalError``...,
what :func:`mjsched_isolated.store.errors.is_permanent_error` judges), and a lost connection is
invalidated so the pool does not hand it out again, nor any connection opened before it. Not supported
(refused when prepared): expanding ``IN`` parameters and statements whose SQL depends on the parameters.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect


class Prepared:
    """``stmt`` compiled once for ``dialect``; run with :meth:`execute` / :meth:`executemany` / :meth:`rows`
    on a SQLAlchemy ``Connection``. Parameters are given by their ``bindparam`` names; the statement's
    literal values are bound once here. Raises ``ValueError`` for an expanding (``IN``) parameter."""

    def __init__(self, stmt: sa.Executable, dialect: Dialect) -> None:
        compiled = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
        if getattr(compiled, "insert_prefetch", None) or getattr(compiled, "update_prefetch", None):
            raise ValueError("columns with Python-side defaults are not supported by Prepared")
        self.sql: str = compiled.string
        self.dialect = dialect
        self.positional: bool = bool(compiled.positional)
        names: Sequence[str] = (compiled.positiontup or []) if self.positional else list(compiled.binds)
        escaped = compiled.escaped_bind_names or {}
        # per parameter slot: (name given by the caller or None, fixed value, bind processor or None)
        self._slots: list[tuple[str | None, Any, Callable[[Any], Any] | None]] = []
        for name in names:
            bind = compiled.binds[name]
            if bind.expanding:
                raise ValueError(f"{name}: expanding parameters are not supported by Prepared")
            processor = bind.type._cached_bind_processor(dialect)
            is_param = name.startswith("p_")  # the store's convention for caller-given parameters
            value = None if is_param else bind.effective_value
            if isinstance(value, enum.Enum):  # the store's StrEnum literals, bound as their text
                value = value.value
            if not is_param and processor is not None:
                value, processor = processor(value), None
            self._slots.append((name if is_param else None, value, processor))
        self._keys = [escaped.get(n, n) for n in names]
        # result processors: resolved at the first execution, from the driver's type codes (as SQLAlchemy does)
        self._result: list[tuple[int, Callable[[Any], Any]]] | None = None
        self._result_types: list[Any] = []
        self.columns: list[str] = []
        selected = (stmt.selected_columns if isinstance(stmt, (sa.Select, sa.TextualSelect))
                    else getattr(stmt, "_returning", None) or ())
        self._result_types = [c.type for c in selected]
        self.columns = [str(c.key) for c in selected]

    def _bind(self, params: Mapping[str, Any]) -> tuple | dict:
        values = [value if name is None else params[name] if processor is None else processor(params[name])
                  for name, value, processor in self._slots]
        return tuple(values) if self.positional else dict(zip(self._keys, values, strict=True))

    def _cursor(self, conn: sa.Connection, bound: Any, many: bool) -> Any:
        cursor = conn.connection.cursor()
        if conn._has_events or conn.engine._has_events:  # listeners (tracing, the tests' log) still see it
            conn.dispatch.before_cursor_execute(conn, cursor, self.sql, bound, None, many)
        return cursor

    def _after(self, conn: sa.Connection, cursor: Any, bound: Any, many: bool) -> None:
        if conn._has_events or conn.engine._has_events:
            conn.dispatch.after_cursor_execute(conn, cursor, self.sql, bound, None, many)

    def _fail(self, conn: sa.Connection, exc: Exception, params: Any, cursor: Any) -> BaseException:
        """The DBAPI error ``exc`` as SQLAlchemy's wrapper; a lost connection is invalidated."""
        dbapi = self.dialect.loaded_dbapi
        if not isinstance(exc, dbapi.Error):
            return exc
        disconnect = self.dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
        if disconnect:
            # as Connection.execute does: the pool's other connections are as stale (the pool pings only
            # those idle a while, schema._ping_when_idle), so every one opened before is replaced at checkout
            conn.engine.pool._invalidate(conn.connection, exc, _checkin=False)
            conn.invalidate(exc)
        return sa.exc.DBAPIError.instance(self.sql, params, exc, dbapi.Error, connection_invalidated=disconnect,
                                          dialect=self.dialect)

    def execute(self, conn: sa.Connection, params: Mapping[str, Any] | None = None) -> int:
        """Run the statement once; returns the DBAPI row count (matched rows, on every supported driver)."""
        bound = self._bind(params or {})
        cursor = self._cursor(conn, bound, False)
        try:
            cursor.execute(self.sql, bound)
            self._after(conn, cursor, bound, False)
            return cursor.rowcount
        except Exception as exc:  # re-raised as SQLAlchemy's wrapper
            raise self._fail(conn, exc, bound, cursor) from exc
        finally:
            cursor.close()

    def executemany(self, conn: sa.Connection, params: Sequence[Mapping[str, Any]]) -> None:
        """Run the statement once per parameter set, in one DBAPI ``executemany``."""
        bound = [self._bind(p) for p in params]
        cursor = self._cursor(conn, bound, True)
        try:
            cursor.executemany(self.sql, bound)
            self._after(conn, cursor, bound, True)
        except Exception as exc:  # re-raised as SQLAlchemy's wrapper
            raise self._fail(conn, exc, bound, cursor) from exc
        finally:
            cursor.close()

    def insert(self, conn: sa.Connection, params: Mapping[str, Any]) -> int:
        """Run an INSERT of one row; returns its primary key: the value of the statement's RETURNING
        (PostgreSQL: prepare the INSERT with ``.returning(table.c.id)``) or else the cursor's ``lastrowid``
        (SQLite, MySQL/MariaDB)."""
        if self._result_types:
            return int(self.rows(conn, params)[0][0])
        bound = self._bind(params)
        cursor = self._cursor(conn, bound, False)
        try:
            cursor.execute(self.sql, bound)
            self._after(conn, cursor, bound, False)
            return int(cursor.lastrowid)
        except Exception as exc:  # re-raised as SQLAlchemy's wrapper
            raise self._fail(conn, exc, bound, cursor) from exc
        finally:
            cursor.close()

    def rows(self, conn: sa.Connection, params: Mapping[str, Any] | None = None) -> list[tuple]:
        """Run a SELECT (or a statement with RETURNING); its rows as tuples, each value converted by its
        column's type as SQLAlchemy would."""
        bound = self._bind(params or {})
        cursor = self._cursor(conn, bound, False)
        try:
            cursor.execute(self.sql, bound)
            self._after(conn, cursor, bound, False)
            raw = cursor.fetchall()
            processors = self._result
            if processors is None:
                processors = self._result = [
                    (i, proc) for i, (t, desc) in enumerate(zip(self._result_types, cursor.description, strict=True))
                    if (proc := t._cached_result_processor(self.dialect, desc[1])) is not None]
        except Exception as exc:  # re-raised as SQLAlchemy's wrapper
            raise self._fail(conn, exc, bound, cursor) from exc
        finally:
            cursor.close()
        if not processors:
            return [tuple(r) for r in raw]
        out = []
        for r in raw:
            row = list(r)
            for i, proc in processors:
                row[i] = proc(row[i])
            out.append(tuple(row))
        return out

    def mappings(self, conn: sa.Connection, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """:meth:`rows` as dicts keyed by column name."""
        cols = self.columns
        return [dict(zip(cols, r, strict=True)) for r in self.rows(conn, params)]
