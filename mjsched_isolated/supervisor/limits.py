"""A run's resource limits: the job's own columns, field by field, else the settings' ``[limits]``.
Applied in the worker (:mod:`mjsched_isolated.worker.limits`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mjsched_isolated.config import LIMIT_RANGES, Limits
from mjsched_isolated.protocol import RunLimits


def run_limits(job: Mapping[str, Any], defaults: Limits) -> RunLimits | None:
    """The limits a run of ``job`` (a jobs row) gets; None when there is none. A value outside its range
    in a hand-edited row is ignored (the default applies), never sent to a worker."""
    values: dict[str, int] = {}
    for field, (low, high) in LIMIT_RANGES.items():
        value = job.get(field)
        if not (isinstance(value, int) and low <= value <= high):
            value = getattr(defaults, field)
        if value is not None:
            values[field] = value
    return RunLimits(**values) if values else None
