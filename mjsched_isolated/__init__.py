"""mjsched_isolated: a cron-job scheduler whose plugins run in pooled, killable child processes.

Public names for plugin authors and embedders. Importing this package never imports plugins, and never
imports SQLAlchemy either: :class:`Client` (the Python API over the database) is loaded on first use, so
a worker child that imports the plugin API stays small.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mjsched_isolated._version import __version__
from mjsched_isolated.api import BaseScheduledJob, JobContext, NotificationContent, ScheduledJobResult
from mjsched_isolated.enums import (
    ConcurrencyMode,
    DstFoldPolicy,
    DstGapPolicy,
    JobStatus,
    MissedRunPolicy,
    RunStatus,
)
from mjsched_isolated.errors import ConfigurationError, CronError, InputError, MjschedError, NotFoundError

if TYPE_CHECKING:
    from mjsched_isolated.client import Client
    from mjsched_isolated.cron import next_run_time

_LAZY = {"Client": "mjsched_isolated.client", "next_run_time": "mjsched_isolated.cron"}

__all__ = [
    "BaseScheduledJob",
    "Client",
    "ConcurrencyMode",
    "ConfigurationError",
    "CronError",
    "DstFoldPolicy",
    "DstGapPolicy",
    "InputError",
    "JobContext",
    "JobStatus",
    "MissedRunPolicy",
    "MjschedError",
    "NotFoundError",
    "NotificationContent",
    "RunStatus",
    "ScheduledJobResult",
    "__version__",
    "next_run_time",
]


def __getattr__(name: str) -> Any:
    """PEP 562: the heavy public names (:class:`Client` pulls in SQLAlchemy) are imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mjsched_isolated' has no attribute {name!r}")
