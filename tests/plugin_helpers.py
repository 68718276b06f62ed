"""Helpers for the plugin tests: load a plugin module from plugins/<name>.py and build a JobContext."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

from mjsched_isolated.api import BaseScheduledJob, JobContext, ScheduledJobResult

PLUGINS_DIR = Path(__file__).resolve().parent.parent / "plugins"


@functools.cache
def load_plugin(name: str) -> type[BaseScheduledJob]:
    """Import ``plugins/<name>.py`` by path and return its single BaseScheduledJob subclass."""
    module_name = f"_mjsched_test_plugin_{name}"
    spec = importlib.util.spec_from_file_location(module_name, PLUGINS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # msgspec resolves the Struct's string annotations through it
    spec.loader.exec_module(module)
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
    now = dt.datetime.now(dt.timezone.utc)
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
