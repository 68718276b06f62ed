"""A run's resource limits: the job's own columns, field by field, else the settings' ``[limits]``.
Applied in the worker (:mod:`mjsched_isolated.worker.limits`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from mjsched_isolated.config import LIMIT_RANGES, Limits
from mjsched_isolated.protocol import RunLimits


def run_limits(job: Mapping[str, Any], defaults: Limits) -> RunLimits | None:
    """The limits a run of ``job`` (a jobs row) gets; None when there is none. A value outside its range
    in a hand-edited row is ignored (the default applies), never sent to a worker."""
    return _run_limits(tuple(job.get(field) for field in _FIELDS), defaults)


_FIELDS = tuple(LIMIT_RANGES)


@functools.lru_cache(maxsize=256)
def _run_limits(columns: tuple[Any, ...], defaults: Limits) -> RunLimits | None:
    """:func:`run_limits` by the job's limit columns: the same few combinations at every run (issue 11:
    built once each, not per run; ``RunLimits`` is frozen, so one instance serves every run)."""
    values: dict[str, int] = {}
    for (field, (low, high)), value in zip(LIMIT_RANGES.items(), columns, strict=True):
        if not (isinstance(value, int) and low <= value <= high):
            value = getattr(defaults, field)
        if value is not None:
            values[field] = value
    return RunLimits(**values) if values else None
