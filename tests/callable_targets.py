"""Importable targets for tests/test_plugin_python_callable.py (the test puts tests/ on sys.path)."""

from __future__ import annotations

import datetime as dt
import math

from mjsched_isolated.api import ScheduledJobResult


def add(a: int, b: int) -> int:
    return a + b


def summary(**kwargs):
    """Returns its keyword arguments as a dict."""
    return dict(kwargs)


def returns_result(flag: bool) -> ScheduledJobResult:
    return ScheduledJobResult(success=flag, details={"flag": flag}, error_message=None if flag else "flag was false")


def returns_none():
    return None


def returns_datetime():
    return dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def returns_nan():
    return math.nan


def fails(message: str):
    raise ValueError(message)


def exits(code):
    raise SystemExit(code)


def uses_context(context, label: str):
    context.heartbeat()
    return {"job_name": context.job_name, "run_id": context.run_id, "label": label}


class Reports:
    @staticmethod
    def count(n: int) -> dict:
        return {"count": n}


NOT_CALLABLE = 42
