"""``python_callable`` job type: import ``package.module:function`` and call it with keyword arguments
(the reference engine's Action driver, in Python).

Keyword arguments are ``arguments`` (static JSON values), plus for each ``sql_arguments`` entry the first
column of the first row of its query on ``database_url`` (None when it returns no rows), plus
``context=<JobContext>`` when ``pass_context`` is true. The module is imported at run time, in the worker,
so it must be importable there (installed, or on ``PYTHONPATH``).

Return value: a ``ScheduledJobResult`` is used as is; anything else gives ``success=True`` with
``details["return_value"]`` = the value if JSON-serialisable (dicts included), else its ``repr``
(truncated). ``SystemExit`` with code 0/None counts as success, any other code as failure. An exception
gives ``success=False``, ``error_message="ExcType: message"`` and ``details["traceback"]`` (its tail).

Details (besides those above): ``callable``, ``duration_ms`` (the call itself), ``sql_values`` (repr of
each SQL-derived argument, truncated), ``return_type``.
"""

import importlib
import json
import re
import time
import traceback
from typing import Any

import msgspec

from mjsched_isolated.api import BaseScheduledJob, JobContext, ScheduledJobResult
from mjsched_isolated.errors import ConfigurationError

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_TRACEBACK_CHARS = 4000
_MAX_RETURN_CHARS = 20000
_REPR_CHARS = 200


class PythonCallableConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``callable``: ``"package.module:function"`` (the part after ``:`` may be dotted, e.g.
    ``Class.method``). ``arguments``: keyword arguments passed as decoded from JSON. ``sql_arguments``:
    keyword name -> SQL query (first row, first column; None if no rows). ``database_url``: SQLAlchemy URL
    for ``sql_arguments`` (required when that is non-empty). ``pass_context``: also pass ``context=``."""

    callable: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    sql_arguments: dict[str, str] = msgspec.field(default_factory=dict)
    database_url: str | None = None
    pass_context: bool = False


class PythonCallableJob(BaseScheduledJob[PythonCallableConfiguration]):
    """Call a Python function; its exception or return value decides the outcome."""

    job_type = "python_callable"
    configuration_type = PythonCallableConfiguration
    description = "Import package.module:function and call it with static and SQL-derived keyword arguments"

    def validate_configuration(self, configuration: PythonCallableConfiguration) -> None:
        if not _TARGET.match(configuration.callable):
            raise ConfigurationError("configuration.callable: must look like 'package.module:function'")
        for field in ("arguments", "sql_arguments"):
            for name in getattr(configuration, field):
                if not name.isidentifier():
                    raise ConfigurationError(f"configuration.{field}.{name}: keyword name must be an identifier")
                if name == "context" and configuration.pass_context:
                    raise ConfigurationError(f"configuration.{field}.context: reserved when pass_context is true")
        for name in configuration.sql_arguments.keys() & configuration.arguments.keys():
            raise ConfigurationError(f"configuration.sql_arguments.{name}: also given in configuration.arguments")
        for name, query in configuration.sql_arguments.items():
            if not query.strip():
                raise ConfigurationError(f"configuration.sql_arguments.{name}: query must not be empty")
        if configuration.sql_arguments and not configuration.database_url:
            raise ConfigurationError("configuration.database_url: required when sql_arguments is non-empty")
        if configuration.database_url is not None:
            # only with database_url: workers stay free of SQLAlchemy
            from sqlalchemy.engine import make_url  # noqa: PLC0415 - see above
            from sqlalchemy.exc import ArgumentError  # noqa: PLC0415 - see above

            try:
                make_url(configuration.database_url)
            except ArgumentError:
                raise ConfigurationError("configuration.database_url: not a valid SQLAlchemy URL") from None

    def execute(self, context: JobContext[PythonCallableConfiguration]) -> ScheduledJobResult:
        cfg: PythonCallableConfiguration = context.configuration
        details: dict[str, Any] = {"callable": cfg.callable}
        try:
            func = _resolve(cfg.callable)
        except Exception as exc:  # noqa: BLE001 - anything raised while importing the user's module
            details["traceback"] = _tail(exc)
            return ScheduledJobResult(
                success=False, details=details,
                error_message=f"cannot load {cfg.callable}: {type(exc).__name__}: {exc}",
            )
        kwargs = dict(cfg.arguments)
        if cfg.sql_arguments:
            try:
                sql_values = _query_values(cfg.database_url, cfg.sql_arguments)
            except _SqlArgumentError as exc:
                details["traceback"] = _tail(exc.__cause__ or exc)
                return ScheduledJobResult(success=False, details=details, error_message=str(exc))
            details["sql_values"] = {k: _short_repr(v, _REPR_CHARS) for k, v in sql_values.items()}
            kwargs.update(sql_values)
        if cfg.pass_context:
            kwargs["context"] = context

        start = time.monotonic()
        try:
            value = func(**kwargs)
        except SystemExit as exc:
            details["duration_ms"] = _ms(start)
            if exc.code in (None, 0):
                return ScheduledJobResult(success=True, details=details)
            return ScheduledJobResult(success=False, details=details, error_message=f"SystemExit: {exc.code}")
        except Exception as exc:  # noqa: BLE001 - the callable's failure is the run's failure
            details["duration_ms"] = _ms(start)
            details["traceback"] = _tail(exc)
            return ScheduledJobResult(success=False, details=details, error_message=f"{type(exc).__name__}: {exc}")
        details["duration_ms"] = _ms(start)
        if isinstance(value, ScheduledJobResult):
            return value
        details["return_type"] = type(value).__qualname__
        details["return_value"] = _json_or_repr(value)
        return ScheduledJobResult(success=True, details=details)


class _SqlArgumentError(Exception):
    pass


def _resolve(target: str):
    """Import ``module:attr.path`` and return the attribute; raise if it is not callable."""
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{target} is a {type(obj).__name__}, not callable")
    return obj


def _query_values(database_url: str | None, queries: dict[str, str]) -> dict[str, Any]:
    """Run each query; value = first column of first row, or None. Raises _SqlArgumentError naming it."""
    from sqlalchemy import create_engine, text  # noqa: PLC0415 - only for sql_arguments: workers stay free of SQLAlchemy

    if database_url is None:
        raise _SqlArgumentError("database_url: required when sql_arguments is given")
    try:
        engine = create_engine(database_url)
    except Exception as exc:
        raise _SqlArgumentError(f"database_url: {type(exc).__name__}: {exc}") from exc
    values: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            for name, query in queries.items():
                try:
                    row = conn.execute(text(query)).first()
                except Exception as exc:
                    raise _SqlArgumentError(f"sql_arguments.{name}: {type(exc).__name__}: {exc}") from exc
                values[name] = row[0] if row is not None else None
    except _SqlArgumentError:
        raise
    except Exception as exc:
        raise _SqlArgumentError(f"database_url: cannot connect: {type(exc).__name__}: {exc}") from exc
    finally:
        engine.dispose()
    return values


def _json_or_repr(value: Any) -> Any:
    """``value`` itself when strict JSON can encode it (and it is not huge), else its truncated repr."""
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return _short_repr(value, _MAX_RETURN_CHARS)
    return value if len(encoded) <= _MAX_RETURN_CHARS else encoded[:_MAX_RETURN_CHARS] + "...(truncated)"


def _short_repr(value: Any, limit: int) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__
        text = f"<{type(value).__name__} (repr failed: {type(exc).__name__})>"
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:]


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
