"""Recording a run's outcome: the last box of the path "job is due" -> "run recorded".

One transaction (``Store.finish_run``) writes the run's terminal state, the job's statistics, the lease
release and the run's notices (:mod:`mjsched_isolated.notices` decides who is notified). Two ways a
result can fail to land, each handled here and nowhere else:

- the database is unreachable: the outcome is kept in :attr:`Recorder.pending` and retried, oldest
  first, at every step (:meth:`Recorder.retry_pending`); a shutdown that cannot wait any longer drops
  them (:meth:`Recorder.give_up`) and the sweep of another supervisor marks those runs abandoned;
- the database refuses the plugin's text (a permanent error, e.g. a NUL byte on PostgreSQL): the
  outcome is recorded once more without the plugin's message, details and notices, never retried forever.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

from mjsched_isolated import notices, planner, protocol
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.isotime import iso
from mjsched_isolated.logs import one_line
from mjsched_isolated.store import Store, is_permanent_error
from mjsched_isolated.store.leases import Outcome
from mjsched_isolated.supervisor.inflight import InFlight, log_ctx
from mjsched_isolated.supervisor.metrics import Metrics

log = logging.getLogger("mjsched.supervisor")


class Recorder:
    """Writes outcomes of runs this supervisor executed. ``wake_sender()`` is called after notices were
    committed (the notification sender then delivers them without waiting for its poll)."""

    def __init__(self, settings: Settings, store: Store, metrics: Metrics, wake_sender: Callable[[], None]) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.wake_sender = wake_sender
        self.pending: list[tuple[InFlight, Outcome]] = []  # outcomes not yet recorded (database unreachable)

    def record(self, flight: InFlight, now: dt.datetime, *, status: str, success: bool,
               error_message: str | None = None, details: dict | None = None, count: bool = True,
               notification: protocol.NoticeText | None = None, fenced: bool = False, retryable: bool = True) -> None:
        """Write the run's terminal ``status`` (Completed, Failed, Timeout, Cancelled), the job's statistics
        (unless ``count`` is False: a cancelled run does not count), the lease release and its notices, in
        one transaction. ``now`` (database time) is when the run ended: its ``completed_at`` even when the
        write happens later (an outage), never before its ``started_at``; ``duration_ms`` is ``completed_at
        - started_at``, as the reference's. ``notification``: the plugin's formatted notice. ``fenced``: the
        run was killed because this supervisor lost its lease (retried only if the job's ``retry_on`` lists
        ``Fenced``). ``retryable`` False: never retried, whatever the job's ``retry_on`` (a run replaced by a newer
        occurrence). Never raises: an unreachable database keeps the outcome in :attr:`pending`."""
        self.record_many([(flight, self.outcome(flight, now, status=status, success=success,
                                                error_message=error_message, details=details, count=count,
                                                notification=notification, fenced=fenced, retryable=retryable))])

    def outcome(self, flight: InFlight, now: dt.datetime, *, status: str, success: bool,
                error_message: str | None = None, details: dict | None = None, count: bool = True,
                notification: protocol.NoticeText | None = None, cpu_s: float | None = None,
                max_rss_mb: float | None = None, fenced: bool = False, retryable: bool = True) -> Outcome:
        """The row values :meth:`record` writes for ``flight`` ended at ``now`` (see there), with the retry
        of a failure the job retries (:func:`planner.retry_at`) and, for a job with ``pause_after_failures``,
        the pause its final failure may cause (judged by the store on the job's counter); ``cpu_s`` and
        ``max_rss_mb``: the run's CPU seconds and peak memory (MiB) as the worker measured them."""
        completed_at = max(now, flight.recorded_start)
        job, channels = flight.job, self.settings.notifications.channels()
        retry_at = None if success or not retryable else planner.retry_at(job, attempt=flight.attempt,
                                                        status="Fenced" if fenced else status,
                                                        scheduled_at=flight.scheduled_at, ended_at=completed_at)
        retry = None if retry_at is None else (flight.attempt, int(job["max_retries"] or 0), retry_at)
        rows = (notices.outbox_rows(notices.for_run(job, flight.run_id, status=status, error_message=error_message,
                                                    text=notification, scheduled_at=flight.scheduled_at,
                                                    retry=retry), channels) if channels else [])
        outcome = Outcome(flight.run_id, flight.job_id, flight.token, status, success, error_message, details,
                          (completed_at - flight.recorded_start).total_seconds() * 1000, count, rows, completed_at,
                          cpu_s, max_rss_mb, scheduled_at=flight.scheduled_at, attempt=flight.attempt,
                          retry_at=retry_at, fenced=fenced)
        limit = job.get("pause_after_failures")
        if limit and not success and count and retry_at is None:
            outcome.pause_reason = (f"{limit} consecutive failed runs (pause_after_failures {limit}); the last, "
                                    f"run {flight.run_id}, ended {status}" + (f": {one_line(error_message)[:300]}"
                                                                            if error_message else ""))
            outcome.pause_notices = notices.outbox_rows(
                notices.for_pause(job, flight.run_id, outcome.pause_reason), channels) if channels else []
        return outcome

    def record_many(self, items: list[tuple[InFlight, Outcome]]) -> None:
        """Record several outcomes (results that arrived together) in one transaction (group commit), behind
        any still pending ones. Never raises: what cannot be written yet stays in :attr:`pending`."""
        if not items:
            return
        self.pending.extend(items)
        self.retry_pending()
        waiting = {id(outcome) for _, outcome in self.pending}
        for flight, outcome in items:
            if id(outcome) in waiting:
                log.warning("run %d of job %s: %s not recorded yet (database unreachable); will retry",
                            flight.run_id, flight.job_name, outcome.status, extra=log_ctx(flight))

    def retry_pending(self) -> None:
        """Record outcomes that arrived while the database was unreachable, oldest first, in one transaction;
        if that fails for a refused row, one at a time, stopping at the first that cannot be written."""
        if not self.pending:
            return
        batch = list(self.pending)
        try:
            recorded = self.store.finish_runs([outcome for _, outcome in batch])
        except Exception as exc:  # noqa: BLE001 - an outage keeps them; a refused row is found one by one
            if len(batch) > 1 and is_permanent_error(exc):
                while self.pending and self._store_outcome(*self.pending[0]):
                    self.pending.pop(0)
            elif len(batch) == 1 and self._store_outcome(*batch[0], error=exc):
                self.pending.pop(0)
            else:
                log.debug("recording %d outcome(s) failed: %s", len(batch), _short(exc))
            return
        del self.pending[:len(batch)]
        for (flight, outcome), done in zip(batch, recorded, strict=True):
            self._after(flight, outcome, done)

    def give_up(self) -> None:
        """Drop the unrecorded outcomes (a shutdown past its bound), saying which runs they were."""
        if self.pending:
            log.error("stopping with %d result(s) unrecorded (database unreachable): runs %s; they will be "
                      "marked abandoned when this supervisor's lease expires", len(self.pending),
                      ", ".join(str(f.run_id) for f, _ in self.pending))
            self.pending.clear()

    def _store_outcome(self, flight: InFlight, outcome: Outcome, *, error: Exception | None = None) -> bool:
        """Write one outcome alone. False if the database could not be reached (the caller keeps it).
        ``error``: the failure of a first try already made; a refused outcome is recorded once more
        without the plugin's message, details and notices, never retried forever."""
        for attempt in (0, 1):
            if error is None:
                try:
                    done = self.store.finish_runs([outcome])[0]
                except Exception as exc:  # noqa: BLE001 - judged below
                    error = exc
                else:
                    self._after(flight, outcome, done)
                    return True
            if attempt == 1 or not is_permanent_error(error):
                log.debug("run %d: recording failed: %s", flight.run_id, _short(error), extra=log_ctx(flight))
                return False
            log.error("run %d of job %s: the database refused its result (%s); recording %s without the "
                      "plugin's message, details and notices", flight.run_id, flight.job_name, _short(error),
                      outcome.status, extra=log_ctx(flight))
            outcome.details, outcome.notices = None, []
            outcome.error_message = (f"result refused by the database ({_short(error, 300)}); "
                                     f"the run ended {outcome.status}")
            error = None
        return False

    def _keep_late(self, flight: InFlight, outcome: Outcome) -> bool:
        """The run's row is no longer Running: if another supervisor recorded it abandoned, keep this true
        outcome beside that verdict (``late_*`` columns; nothing un-fenced), with a notice to whoever got
        the failure notice. False if it was not abandoned (its job was removed, ...) or cannot be written."""
        channels = self.settings.notifications.channels()
        try:
            kept = self.store.keep_late_result(outcome, self.settings.instance, notices_for=lambda result: (
                notices.outbox_rows(notices.for_late_result(result), channels) if channels else []))
        except Exception as exc:  # noqa: BLE001 - the abandonment stands; the truth is at least in this log
            log.warning("run %d of job %s: its late result %s could not be kept (%s)", flight.run_id,
                        flight.job_name, outcome.status, _short(exc), extra=log_ctx(flight))
            return False
        if kept is None:
            return False
        if channels and kept["notify_on_failure"]:
            self.wake_sender()
        log.warning("job %s: %s; kept on the run as its late result (it stays Failed: abandoned)%s",
                    flight.job_name, notices.late_result_text(kept),
                    f": {one_line(outcome.error_message)}" if outcome.error_message else "", extra=log_ctx(flight))
        return True

    def _after(self, flight: InFlight, outcome: Outcome, recorded: bool) -> None:
        """Metrics, the sender's wake-up and the log line of one outcome once its transaction committed."""
        status = outcome.status
        if not recorded:
            if not outcome.fenced and self._keep_late(flight, outcome):
                return
            log.warning("run %d of job %s: result %s not recorded: its run row is no longer Running (abandoned by "
                        "another supervisor, or its job was removed)",
                        flight.run_id, flight.job_name, status, extra=log_ctx(flight))
            return
        duration_ms = outcome.duration_ms or 0.0
        self.metrics.run_finished(flight.job_type, status, duration_ms / 1000)
        if outcome.notices:
            self.wake_sender()
        if outcome.retry_set and outcome.retry_at is not None:
            log.warning("run %d of job %s: %s, retry %d of %d at %s", flight.run_id, flight.job_name, status,
                        outcome.attempt, flight.job["max_retries"], iso(outcome.retry_at), extra=log_ctx(flight))
        elif outcome.retry_at is not None:
            log.warning("run %d of job %s: %s; not retried: another retry of the job is pending", flight.run_id,
                        flight.job_name, status, extra=log_ctx(flight))
        if outcome.paused:
            log.error("job %s paused: %s", flight.job_name, outcome.pause_reason, extra=log_ctx(flight))
        level = logging.INFO if status == "Completed" else logging.ERROR
        if log.isEnabledFor(level):
            error_message = outcome.error_message
            log.log(level, "run %d finished: job %s %s in %.0f ms%s", flight.run_id, flight.job_name, status,
                    duration_ms, f": {one_line(error_message)}" if error_message and status != "Completed" else "",
                    extra=log_ctx(flight))
