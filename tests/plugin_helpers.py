"""Helpers for the plugin tests: import a built-in plugin module (mjsched_isolated/plugins/<name>.py) and
build a JobContext."""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

from mjsched_isolated.api import BaseScheduledJob, JobContext, ScheduledJobResult


@functools.cache
def load_plugin(name: str) -> type[BaseScheduledJob]:
    """Import the built-in ``mjsched_isolated.plugins.<name>`` and return its single BaseScheduledJob
    subclass (as the worker's loader names it, so both see the same classes)."""
    module_name = f"mjsched_isolated.plugins.{name}"
    module = importlib.import_module(module_name)
    classes = [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, BaseScheduledJob) and obj.__module__ == module_name
    ]
    assert len(classes) == 1, classes
    return classes[0]


def make_context(
    cls: type[BaseScheduledJob], config: dict[str, Any] | None, heartbeat: Callable[[], None] | None = None
) -> JobContext:
    """JSON-encode ``config``, parse and validate it as the worker would, and wrap it in a JobContext."""
    parsed = cls.parse_configuration(json.dumps(config))
    cls().validate_configuration(parsed)
    now = dt.datetime.now(dt.UTC)
    return JobContext(
        run_id=1, job_id=1, job_name=f"test-{cls.job_type}", job_type=cls.job_type, configuration=parsed,
        scheduled_at=now, deadline_at=now + dt.timedelta(minutes=5), heartbeat=heartbeat,
    )


def run_job(
    cls: type[BaseScheduledJob], config: dict[str, Any] | None, heartbeat: Callable[[], None] | None = None
) -> ScheduledJobResult:
    """make_context + execute, checking the result's details are strict JSON."""
    result = cls().execute(make_context(cls, config, heartbeat))
    assert isinstance(result, ScheduledJobResult)
    json.dumps(result.details, allow_nan=False)
    return result
