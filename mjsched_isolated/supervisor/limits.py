"""A run's resource limits: the job's own columns, field by field, else the settings' ``[limits]``.
Applied in the worker (:mod:`mjsched_isolated.worker.limits`); ``max_cpu_s`` is also watched here, by the
supervisor, for code that does not stop at SIGXCPU (:func:`watch_cpu`,
:meth:`~mjsched_isolated.supervisor.guard.RunGuard.enforce_cpu_limits`)."""

from __future__ import annotations

import datetime as dt
import functools
import os
from collections.abc import Mapping
from typing import Any

from mjsched_isolated.config import LIMIT_RANGES, Limits
from mjsched_isolated.protocol import RunLimits

CPU_KILL_MARGIN_S = 1.5  # the supervisor kills a run's tree at max_cpu_s + this many CPU seconds
CPU_CHECK_MIN_S = 0.1  # the run tree's CPU time is read at most this often (wall seconds) ...
CPU_CHECK_MAX_S = 5.0  # ... and at least this often while the run lasts
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def next_cpu_check_s(left_s: float) -> float:
    """Wall seconds until the run tree's CPU time must be read again, when it may use ``left_s`` more CPU
    seconds before it is killed: the soonest every CPU of this process's affinity could use them, within
    [:data:`CPU_CHECK_MIN_S`, :data:`CPU_CHECK_MAX_S`]."""
    return min(CPU_CHECK_MAX_S, max(CPU_CHECK_MIN_S, left_s / _CPUS))


def watch_cpu(flight: Any, base_s: float | None, max_cpu_s: float, now: dt.datetime) -> None:
    """Have the supervisor watch ``flight``'s (an :class:`~mjsched_isolated.supervisor.inflight.InFlight`)
    CPU time: ``base_s``, its worker tree's CPU seconds when the run is handed over (None: not readable,
    nothing is watched), ``max_cpu_s`` the run's limit; the first check falls due at ``now`` plus the
    soonest the tree could use ``max_cpu_s`` + :data:`CPU_KILL_MARGIN_S`."""
    if base_s is None:
        return
    flight.cpu_limit_s, flight.cpu_base_s = float(max_cpu_s), base_s
    flight.cpu_check_at = now + dt.timedelta(seconds=next_cpu_check_s(max_cpu_s + CPU_KILL_MARGIN_S))
