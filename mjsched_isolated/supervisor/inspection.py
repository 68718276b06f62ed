"""Questions about plugins, answered by a throwaway worker child (the asking process never imports them).

Used by the CLI: ``plugins list`` and the configuration checks of ``jobs add`` / ``jobs sync``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mjsched_isolated import protocol
from mjsched_isolated.errors import WorkerError
from mjsched_isolated.supervisor.pool import ChildEvent, Pool, describe_exit

if TYPE_CHECKING:
    from mjsched_isolated.config import Settings


class PluginReport:
    """What one worker child found in the plugins folder, plus its answers to validation requests."""

    def __init__(self, ready: protocol.Ready, errors: list[str | None]) -> None:
        self.plugins = ready.plugins
        self.failures = ready.failures
        self.warnings = ready.warnings  # e.g. a local plugin overriding a built-in job type
        # local modules whose file no longer imports, imported from a live serve's last good copy instead
        self.fallbacks = ready.fallbacks
        self.errors = errors


CLI_READY_TIMEOUT_S = 30.0  # a CLI check waits less than serve's workers (worker_ready_timeout_s, 60 s)


def inspect_plugins(settings: Settings, checks: Sequence[tuple[str, str | None]] = (),
                    timeout_s: float | None = None, *, borrow_good_plugins: bool = False) -> PluginReport:
    """Start one worker built like ``serve``'s (:meth:`Pool.from_settings`: the same plugins folder and
    import timeout), wait for its Ready, and validate each ``(job_type, configuration JSON)`` in
    ``checks``. ``timeout_s``: the worker's ready timeout (default the smaller of
    ``worker_ready_timeout_s`` and 30 s). ``errors[i]`` is None or a one-line message naming the field.
    ``borrow_good_plugins``: the worker starts from the last good plugin copies of the live ``serve`` of the
    same plugins folder on this machine, as ``jobs run``'s does (a module whose file no longer imports is
    imported from the copy serve keeps running, and named in ``fallbacks``).
    Raises ``TimeoutError`` if no child answers within ``2 * timeout_s + 10`` (a worker whose import hangs
    past ``timeout_s`` is killed and the module left out, once),
    :class:`WorkerError` if it dies for a reason other than a plugin module ending it at import (such a
    module is left out and reported in ``failures``; a fresh child answers).
    """
    if timeout_s is None:
        timeout_s = min(settings.worker_ready_timeout_s, CLI_READY_TIMEOUT_S)
    pool = Pool.from_settings(settings, size=1, ready_timeout_s=timeout_s, borrow_good_plugins=borrow_good_plugins)
    # a worker stuck importing is killed at timeout_s and its module left out: leave time for a second one
    deadline = time.monotonic() + 2 * timeout_s + 10
    try:
        pool.start()
        while not pool.idle_workers():
            _next_events(pool, deadline)
        worker = pool.idle_workers()[0]
        errors: list[str | None] = []
        for job_type, configuration in checks:
            protocol.send(worker.conn, protocol.ValidateRequest(job_type=job_type, configuration=configuration))
            replies: list[protocol.ValidateReply] = []
            while not replies:
                replies = [e.message for e in _next_events(pool, deadline)
                           if isinstance(e.message, protocol.ValidateReply)]
            errors.append(replies[0].error)
        assert pool.last_ready is not None  # a worker is idle only once its Ready has arrived
        return PluginReport(pool.last_ready, errors)
    finally:
        pool.close()


def _next_events(pool: Pool, deadline: float) -> list[ChildEvent]:
    """One bounded wait on the pool; a dead child or the deadline is an error."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the plugin worker did not answer in time (does a plugin hang at import?)")
    events, _ = pool.wait(remaining)
    for event in events:
        if event.died and event.culprit is None:  # a culprit is left out and the pool starts a new worker
            raise WorkerError(f"the plugin worker died ({describe_exit(event.exitcode)}) while loading plugins")
    return events
