"""Run retention inside the supervisor: prune old finished runs a batch at a time, never holding up dispatch.

Every ``retention.prune_interval_s`` a pass starts; each call of :meth:`Pruner.step` (one per loop step)
deletes at most one batch of ``retention.prune_batch_size`` runs (one short transaction) and asks the loop
to come back at once while more remain. The ids are read ``PREFETCH_BATCHES`` batches at a time: the read
ranks every finished run (about 0.2 s per 100,000 runs on SQLite), so it is not repeated for each batch.
When the pass ends it logs one summary line. ``keep_days = 0`` turns pruning off. The rules (keep
``keep_days`` days, and at least each job's newest ``keep_min_per_job``) are the store's. The reference
engine has no run retention (reference spec §1.3, TODO #20); the shape follows Oban's ``Pruner`` (age
limit) and Kubernetes CronJob's history limits (a per-job minimum), see peer-schedulers.md.
"""

from __future__ import annotations

import datetime as dt
import logging

from mjsched_isolated.config import Retention
from mjsched_isolated.errors import first_line
from mjsched_isolated.store import Store

log = logging.getLogger("mjsched.retention")
PREFETCH_BATCHES = 20
NOTIFICATION_BATCHES = 4


class Pruner:
    """Spreads one pruning pass over loop steps. Only :meth:`step` and :meth:`wake_at` are called, from the
    supervisor's thread, with ``now`` in database time."""

    def __init__(self, store: Store, retention: Retention) -> None:
        self.store = store
        self.retention = retention
        self.next_pass_at: dt.datetime | None = None  # None: a pass is due at the first step
        self.in_pass = False
        self.pass_deleted = 0
        self.queue: list[int] = []  # prunable run ids read but not yet deleted
        self.more = False  # the last read was full: more may be prunable after the queue

    @property
    def enabled(self) -> bool:
        return self.retention.keep_days > 0

    def step(self, now: dt.datetime) -> int:
        """Delete at most one batch if a pass is due or running. Returns the number deleted. Database
        errors are logged and the pass is retried after ``prune_interval_s`` (never raised)."""
        if not self.enabled or (not self.in_pass and self.next_pass_at is not None and now < self.next_pass_at):
            return 0
        r = self.retention
        if not self.in_pass:
            self.in_pass, self.pass_deleted, self.queue, self.more = True, 0, [], True
        try:
            if not self.queue and self.more:
                limit = r.prune_batch_size * PREFETCH_BATCHES
                self.queue = self.store.prunable_run_ids(now, r.keep_days, r.keep_min_per_job, limit)
                self.more = len(self.queue) == limit
            batch, self.queue = self.queue[:r.prune_batch_size], self.queue[r.prune_batch_size:]
            deleted = self.store.delete_finished_runs(batch)
        except Exception as exc:  # noqa: BLE001 - pruning must never stop the scheduler
            log.warning("pruning runs failed (%s); retrying in %.0f s", first_line(exc), r.prune_interval_s)
            self._end_pass(now)
            return 0
        self.pass_deleted += deleted
        if not self.queue and not self.more:
            if self.pass_deleted:
                log.info("pruned %d runs older than %g days (keeping the newest %d per job)",
                         self.pass_deleted, r.keep_days, r.keep_min_per_job)
            self._prune_notifications(now)
            self._end_pass(now)
        return deleted

    def _prune_notifications(self, now: dt.datetime) -> None:
        """Delivered or given-up notices past ``keep_days``: a few batches at the end of each pass (the
        outbox is small next to the runs table); the rest waits for the next pass."""
        try:
            count = self.store.prune_notifications(now, self.retention.keep_days, self.retention.prune_batch_size,
                                                   max_batches=NOTIFICATION_BATCHES)
        except Exception as exc:  # noqa: BLE001 - pruning must never stop the scheduler
            log.warning("pruning notifications failed (%s)", first_line(exc))
            return
        if count:
            log.info("pruned %d delivered notifications older than %g days", count, self.retention.keep_days)

    def wake_at(self, now: dt.datetime) -> dt.datetime | None:
        """When the loop should step again for pruning: now while a pass runs, else the next pass."""
        if not self.enabled:
            return None
        return now if self.in_pass else self.next_pass_at

    def _end_pass(self, now: dt.datetime) -> None:
        self.in_pass, self.queue = False, []
        self.next_pass_at = now + dt.timedelta(seconds=self.retention.prune_interval_s)
