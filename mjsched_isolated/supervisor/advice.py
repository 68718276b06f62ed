"""What the supervisor tells the operator about the job set and the plugins, without acting on it:
the high-frequency advice (reference §6.4) and which job types and plugin failures the workers report.
Each is logged once, and again only when what it says changes."""

from __future__ import annotations

import datetime as dt
import logging

from mjsched_isolated import planner, protocol
from mjsched_isolated.errors import CronError
from mjsched_isolated.store import Store

log = logging.getLogger("mjsched.supervisor")
SHORTEST_LISTED = 5  # the advice names this many of the most frequent jobs, not every one


class Advice:
    """Logs advice about ``store``'s Active jobs and the workers' plugins."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._active_signature: tuple | None = None
        self._high_frequency_warned: tuple = ()
        self._logged_types: tuple[str, ...] | None = None
        self._logged_failures: set[tuple[str, str]] = set()

    def warn_high_frequency(self, now: dt.datetime) -> int:
        """One summary line for the jobs firing more often than every 5 minutes (reference §6.4: advice,
        not a block): how many, and the ``SHORTEST_LISTED`` shortest with their intervals, at start and
        again when that set changes. Recomputed only when an Active job changed (its signature). Returns
        the number of Active jobs."""
        signature = self.store.active_jobs_signature()
        if signature == self._active_signature:
            return signature[0]
        self._active_signature = signature
        # (interval, cron, zone, jobs, first names) per schedule: counts and names from ONE read, so a job
        # changed meanwhile cannot leave a counted schedule without names (an empty advice line)
        offending: list[tuple[float, str, str, int, list[str]]] = []
        for expr, zone, count, names in self.store.active_schedules_named(SHORTEST_LISTED):
            try:
                interval = planner.high_frequency_interval_s({"cron_expression": expr, "timezone": zone}, now)
            except CronError:
                interval = None
            if interval is not None:
                offending.append((interval, expr, zone, count, names))
        offending.sort()
        shortest: list[tuple[float, str, str, str]] = []  # (interval, name, cron, zone), the first few
        for interval, expr, zone, _, names in offending:
            if len(shortest) >= SHORTEST_LISTED and interval > shortest[SHORTEST_LISTED - 1][0]:
                break
            shortest += [(interval, name, expr, zone) for name in names]
            shortest.sort()
        shortest = shortest[:SHORTEST_LISTED]
        total = sum(count for *_, count, _ in offending)
        state = (tuple((i, e, z, c) for i, e, z, c, _ in offending), tuple(shortest))
        if offending and state != self._high_frequency_warned:
            listed = "; ".join(f"{name}: '{expr}' ({zone}) every {planner.human_interval(interval)}"
                               for interval, name, expr, zone in shortest)
            more = total - len(shortest)
            log.warning("%d job(s) fire more often than every 5 minutes (they still run as configured; this is "
                        "advice, not a block). Shortest intervals: %s%s", total, listed,
                        f"; and {more} more" if more > 0 else "")
        self._high_frequency_warned = state
        return signature[0]

    def log_plugins(self, ready: protocol.Ready) -> None:
        """The available job types when they change; each plugin load failure once."""
        types = tuple(sorted(p.job_type for p in ready.plugins))
        if types != self._logged_types:
            self._logged_types = types
            log.info("job types available: %s", ", ".join(types) or "none")
        for failure in ready.failures:
            key = (failure.module, failure.error)
            if key not in self._logged_failures:
                self._logged_failures.add(key)
                log.error("plugin module %s failed to load; its job types are unavailable:\n%s",
                          failure.module, failure.error.rstrip())
