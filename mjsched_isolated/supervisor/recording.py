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

from mjsched_isolated import notices, protocol
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.logs import one_line
from mjsched_isolated.store import Store, is_permanent_error
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
        self.pending: list[tuple[InFlight, dict]] = []  # outcomes not yet recorded (database unreachable)

    def record(self, flight: InFlight, now: dt.datetime, *, status: str, success: bool,
               error_message: str | None = None, details: dict | None = None, count: bool = True,
               notification: protocol.NoticeText | None = None) -> None:
        """Write the run's terminal ``status`` (Completed, Failed, Timeout, Cancelled), the job's statistics
        (unless ``count`` is False: a cancelled run does not count), the lease release and its notices, in
        one transaction. ``duration_ms`` is ``now - started_at``, as the reference's ``completed_at -
        started_at``. ``notification``: the plugin's formatted notice. Never raises: an unreachable
        database keeps the outcome in :attr:`pending`."""
        notice = notices.for_run(flight.job, flight.run_id, status=status, error_message=error_message,
                                 text=notification, scheduled_at=flight.scheduled_at)
        rows = notices.outbox_rows(notice, self.settings.notifications.channels())
        outcome = {"status": status, "success": success, "error_message": error_message, "details": details,
                   "count": count, "duration_ms": max(0.0, (now - flight.started_at).total_seconds() * 1000),
                   "notices": rows}
        if not self._store_outcome(flight, outcome):
            self.pending.append((flight, outcome))
            log.warning("run %d of job %s: %s not recorded yet (database unreachable); will retry",
                        flight.run_id, flight.job_name, status, extra=log_ctx(flight))

    def retry_pending(self) -> None:
        """Record outcomes that arrived while the database was unreachable, oldest first; stops at the
        first that still cannot be written."""
        while self.pending:
            flight, outcome = self.pending[0]
            if not self._store_outcome(flight, outcome):
                return
            self.pending.pop(0)

    def give_up(self) -> None:
        """Drop the unrecorded outcomes (a shutdown past its bound), saying which runs they were."""
        if self.pending:
            log.error("stopping with %d result(s) unrecorded (database unreachable): runs %s; they will be "
                      "marked abandoned when this supervisor's lease expires", len(self.pending),
                      ", ".join(str(f.run_id) for f, _ in self.pending))
            self.pending.clear()

    def _store_outcome(self, flight: InFlight, outcome: dict, *, refused: bool = False) -> bool:
        """False if the database could not be reached (the caller keeps the outcome for later).
        ``refused``: this is the second try, without the plugin's text, of an outcome the database refused."""
        status, error_message, duration_ms = outcome["status"], outcome["error_message"], outcome["duration_ms"]
        try:
            recorded = self.store.finish_run(flight.run_id, flight.job_id, flight.token, **outcome)
        except Exception as exc:  # noqa: BLE001 - any failure to record keeps the outcome (or retries it bare)
            if is_permanent_error(exc) and not refused:
                log.error("run %d of job %s: the database refused its result (%s); recording %s without the "
                          "plugin's message, details and notices", flight.run_id, flight.job_name, _short(exc),
                          status, extra=log_ctx(flight))
                outcome.update(details=None, notices=[], error_message=(
                    f"result refused by the database ({_short(exc, 300)}); the run ended {status}"))
                return self._store_outcome(flight, outcome, refused=True)
            log.debug("run %d: recording failed: %s", flight.run_id, _short(exc), extra=log_ctx(flight))
            return False
        if not recorded:
            log.warning("run %d of job %s: result %s not recorded: its run row is no longer Running (abandoned by "
                        "another supervisor, or its job was removed)",
                        flight.run_id, flight.job_name, status, extra=log_ctx(flight))
            return True
        self.metrics.run_finished(flight.job_type, status, duration_ms / 1000)
        if outcome["notices"]:
            self.wake_sender()
        level = logging.INFO if status == "Completed" else logging.ERROR
        log.log(level, "run %d finished: job %s %s in %.0f ms%s", flight.run_id, flight.job_name, status,
                duration_ms, f": {one_line(error_message)}" if error_message and status != "Completed" else "",
                extra=log_ctx(flight))
        return True
