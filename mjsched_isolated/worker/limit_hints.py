"""Which resource limit a failed command probably hit, from what it wrote to stderr.

A command the plugin starts (``shell``) inherits the run's limits (:mod:`~mjsched_isolated.worker.limits`)
but hitting one rarely ends it with a signal the worker can read: an allocation refused by
``RLIMIT_DATA`` ends a Python command with ``MemoryError`` and exit code 1, a ``fork`` refused by
``RLIMIT_NPROC`` or ``pids.max`` makes a shell say "Resource temporarily unavailable" and exit 2. The run
would be recorded only as ``exit code 1``. :func:`guess` reads the failed run's ``details["stderr_tail"]``
(the ``shell`` plugin's) and, when a limit of that kind was set for the run and the text carries its usual
message, names it: ``memory limit 50 MB probably exceeded (stderr: MemoryError)``. "Probably": the same
messages can have other causes (the machine itself out of memory, another process of the user).
"""

from __future__ import annotations

import re
import signal
from typing import Any

from mjsched_isolated.protocol import RunLimits

# (limit field, what the limit is called, the stderr texts that usually mean it was hit), first match wins
_PATTERNS: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    ("max_memory_mb", "memory limit {} MB", re.compile(
        r"MemoryError|Cannot allocate memory|out of memory|std::bad_alloc|memory exhausted|"
        r"cannot allocate \d+ bytes|failed to allocate|OutOfMemoryError|ENOMEM", re.IGNORECASE)),
    ("max_processes", "process limit {}", re.compile(
        r"Resource temporarily unavailable|fork: retry|cannot fork|can't fork|BlockingIOError|EAGAIN",
        re.IGNORECASE)),
    ("max_open_files", "open files limit {}", re.compile(r"Too many open files|EMFILE", re.IGNORECASE)),
)
_MATCH_CHARS = 120  # of the stderr line quoted in the error message


def guess(limits: RunLimits | None, details: dict[str, Any] | None) -> str | None:
    """``"<limit> probably exceeded (stderr: <the line>)"`` for a failed run whose ``details`` carry a
    ``stderr_tail`` (text) with the usual message of a limit set in ``limits``; ``"CPU time limit N s
    probably exceeded (killed by SIGXCPU)"`` for an ``exit_code`` of ``-SIGXCPU`` with ``max_cpu_s`` set;
    else None (no limit of that kind set, nothing recognised)."""
    if limits is None or not isinstance(details, dict):
        return None
    if limits.max_cpu_s is not None and details.get("exit_code") == -signal.SIGXCPU:
        return f"CPU time limit {limits.max_cpu_s} s probably exceeded (killed by SIGXCPU)"
    stderr = details.get("stderr_tail")
    if not isinstance(stderr, str) or not stderr:
        return None
    for field, name, pattern in _PATTERNS:
        value = getattr(limits, field)
        if value is None:
            continue
        lines = [line for line in stderr.splitlines() if pattern.search(line)]
        if lines:
            line = lines[-1].strip()
            if len(line) > _MATCH_CHARS:
                line = line[:_MATCH_CHARS - 3] + "..."
            return f"{name.format(value)} probably exceeded (stderr: {line})"
    return None
