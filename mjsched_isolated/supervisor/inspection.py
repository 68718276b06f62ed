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
VALIDATE_TIMEOUT_S = 5.0
"""How long a plugin's ``validate_configuration`` may take for one configuration (``jobs add``, ``jobs update``,
``jobs sync``, ``check``) before the worker is killed and that configuration reported as not checked."""


HUNG = "configuration:"  # the field of a configuration whose validation did not answer


def inspect_plugins(settings: Settings, checks: Sequence[tuple[str, str | None]] = (),
                    timeout_s: float | None = None, *, borrow_good_plugins: bool = False,
                    validate_timeout_s: float | None = None) -> PluginReport:
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
    module is left out and reported in ``failures``; a fresh child answers). A ``validate_configuration``
    that does not answer within ``validate_timeout_s`` (:data:`VALIDATE_TIMEOUT_S`) is an error naming
    ``configuration``, the job type and the step; the worker is killed and the checks after it are errors
    too (not checked).
    """
    if timeout_s is None:
        timeout_s = min(settings.worker_ready_timeout_s, CLI_READY_TIMEOUT_S)
    if validate_timeout_s is None:
        validate_timeout_s = VALIDATE_TIMEOUT_S
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
            if len(errors) and errors[-1] is not None and errors[-1].startswith(HUNG):
                errors.append(f"{HUNG} not checked: the plugin worker was killed after a validate_configuration "
                              "hung before it")
                continue
            protocol.send(worker.conn, protocol.ValidateRequest(job_type=job_type, configuration=configuration))
            replies: list[protocol.ValidateReply] = []
            given_up = min(deadline, time.monotonic() + validate_timeout_s)
            while not replies:
                try:
                    replies = [e.message for e in _next_events(pool, given_up)
                               if isinstance(e.message, protocol.ValidateReply)]
                except TimeoutError:
                    pool.refill = False
                    pool.kill(worker)  # hung in the plugin's code: nothing else will come from it
                    errors.append(f"{HUNG} the {job_type!r} plugin's validate_configuration did not answer within "
                                  f"{validate_timeout_s:g} s (does it hang?); the plugin worker was killed")
                    break
            else:
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
