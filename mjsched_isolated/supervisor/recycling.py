"""Worker recycling rules: when a worker child has done enough runs, or grown too big, to be replaced.

Checked by the pool after each run, never during one (Celery's ``worker_max_tasks_per_child`` /
``worker_max_memory_per_child``, checked after a task; ``concurrent.futures.ProcessPoolExecutor``'s
``max_tasks_per_child``; see peer-schedulers.md). Memory is the child's own resident set size (psutil
``memory_info().rss``), not its descendants': plugin subprocesses end with their run.
"""

from __future__ import annotations

import psutil

MIB = 1024 * 1024


def resident_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB, or None if it cannot be read (gone, not ours)."""
    try:
        return psutil.Process(pid).memory_info().rss / MIB
    except psutil.Error:
        return None


def recycle_reason(pid: int, runs_done: int, max_tasks_per_child: int | None,
                   max_memory_per_child_mb: float | None) -> str | None:
    """Why the idle worker ``pid`` that has finished ``runs_done`` runs must be replaced, or None to keep it.
    A limit of None is off. The memory is measured only when that limit is set."""
    if max_tasks_per_child is not None and runs_done >= max_tasks_per_child:
        return f"after {runs_done} runs (max_tasks_per_child {max_tasks_per_child})"
    if max_memory_per_child_mb is not None:
        rss_mb = resident_mb(pid)
        if rss_mb is not None and rss_mb > max_memory_per_child_mb:
            return f"after {runs_done} runs: RSS {rss_mb:.0f} MB > {max_memory_per_child_mb:g} MB"
    return None
