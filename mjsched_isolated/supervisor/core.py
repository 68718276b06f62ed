"""The supervisor: owns polling, leasing, deadlines, the sweep and shutdown. Never imports plugins.

The path from "job is due" to "run recorded", top to bottom:

1. :meth:`Supervisor.step` (given ``now``) kills runs past their deadline, sweeps orphaned runs, and
   :meth:`dispatch_due` claims each due job for an idle worker (``Store.claim``: lease + occurrence +
   Running run row, atomically) and sends it a ``RunRequest``. It returns how long the loop may sleep:
   until the next due time, the nearest deadline or the rescan interval, whichever is first.
2. :meth:`serve` (the only code that reads clocks) sleeps in ``Pool.wait`` on every child pipe, child
   sentinel and the signal pipe at once, so a result, a crash, a signal or a due time wakes it at once.
3. :meth:`on_events` turns child messages into records: ``RunFinished`` -> Completed/Failed, a dead
   child -> Failed with its exit code or signal, ``Heartbeat`` -> a token-checked deadline extension.
   The run's notices (:mod:`notices`) go into the outbox in the transaction that records it.

Beside the loop, owned elsewhere: :mod:`notifier` (a thread delivering the outbox), :mod:`metrics` (a thread
serving ``/metrics`` and ``/healthz``), :mod:`retention` (one pruning batch per step), :mod:`liveness` (the
supervisor's lease) and :mod:`pool` (children, recycling). The loop only calls them.
"""

from __future__ import annotations

import datetime as dt
import logging
import signal
import socket
import time
from typing import Any

from mjsched_isolated.supervisor import metrics as metrics_mod
from mjsched_isolated import notices
from mjsched_isolated import planner
from mjsched_isolated import protocol
from mjsched_isolated.config import Settings, redact_url
from mjsched_isolated.errors import CronError
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.supervisor.liveness import Liveness
from mjsched_isolated.supervisor.notifier import Notifier
from mjsched_isolated.supervisor.pool import ChildEvent, Pool, Worker, describe_exit
from mjsched_isolated.supervisor.retention import Pruner
from mjsched_isolated.store.core import Store, is_permanent_error

log = logging.getLogger("mjsched.supervisor")
UTC = dt.timezone.utc
CLOCK_JUMP_S = 1.0


def utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


class InFlight:
    """A run this supervisor is executing: which worker, under which lease token, until when."""

    def __init__(self, run_id: int, job: dict, token: str | None, worker: Worker, started_at: dt.datetime,
                 deadline: dt.datetime, timeout_s: float) -> None:
        self.run_id = run_id
        self.job_id: int = job["id"]
        self.job_name: str = job["name"]
        self.job_type: str = job["job_type"]
        self.token = token
        self.worker = worker
        self.started_at = started_at
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.last_extended: dt.datetime | None = None  # the first heartbeat is effective at once
        self.scheduled_at: dt.datetime | None = None  # the occurrence (None: a manual run)
        self.job = {k: job.get(k) for k in ("id", "name", "notify_on_success", "notify_on_failure",
                                            "notify_recipients")}  # what notices need


class Supervisor:
    """One supervisor process. ``store`` and ``pool`` are built by the caller (and closed by it)."""

    def __init__(self, settings: Settings, store: Store, pool: Pool, metrics: metrics_mod.Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else metrics_mod.for_settings(settings)
        self.metrics.track_inflight(lambda: len(self.inflight))
        pool.on_respawn = self.metrics.worker_respawned
        self.store = store
        self.pool = pool
        self.inflight: dict[int, InFlight] = {}
        self.accepting = True
        self.drain_deadline: dt.datetime | None = None
        self.done = False
        self.bad_jobs: dict[int, tuple[dt.datetime, str]] = {}  # job id -> (updated_at seen, reason)
        self.next_rescan_at: dt.datetime | None = None
        self.pending: list[tuple[InFlight, dict]] = []  # results not yet recorded (database unreachable)
        self.pruner = Pruner(store, settings.retention)  # run retention: one batch per step at most
        self.liveness = Liveness(store, settings.instance, settings.lease_ttl_s, settings.lease_renew_interval_s,
                                 self.local_now)
        self.liveness.on_renewal = self.metrics.lease_renewal
        self._logged_failures: set[tuple[str, str]] = set()
        self._logged_types: tuple[str, ...] | None = None
        self._active_signature: tuple | None = None
        self._high_frequency_warned: tuple = ()
        self._signals = 0
        self._last_clock: tuple[dt.datetime, float] | None = None  # (local wall clock, monotonic)
        self._last_step_clock: tuple[dt.datetime, float] | None = None  # (database time, monotonic)
        self.takeover_hold_until: dt.datetime | None = None  # database time; see follow_time_jump
        self.notifier: Notifier | None = None  # the notification sender, started by serve
        self.on_delivery_failure = self.metrics.notification_failed  # callable(channel: str), for the sender

    # -- clocks: read only by the outer loops (serve, run_now) and passed into everything else -------
    def local_now(self) -> dt.datetime:
        """This machine's wall clock (plus ``clock_skew_s``, which only tests set)."""
        return utcnow() + dt.timedelta(seconds=self.settings.clock_skew_s)

    def read_clock(self) -> tuple[dt.datetime, float]:
        """(now in database time, monotonic seconds): what :meth:`step` takes. The loop sleeps on the
        monotonic clock; when it wakes it re-reads the wall clock, and a wall clock that moved differently
        from the monotonic one (a step, or a machine waking from suspend) makes the next step re-measure the
        database clock at once."""
        local, mono = self.local_now(), time.monotonic()
        if self.notice_clock_jump(local, mono) and self.liveness.registered:
            self.keep_lease(local + self.liveness.db_offset, mono)  # re-measure the database clock now
        now = local + self.liveness.db_offset
        self.follow_time_jump(now, mono)  # results and heartbeats before the next step are timed in the new frame
        return now, mono

    def notice_clock_jump(self, local: dt.datetime, mono: float) -> bool:
        """True (and a renewal forced) if the wall clock jumped by more than 1 s against the monotonic one."""
        previous, self._last_clock = self._last_clock, (local, mono)
        if previous is None:
            return False
        jump_s = (local - previous[0]).total_seconds() - (mono - previous[1])
        if abs(jump_s) <= CLOCK_JUMP_S:
            return False
        log.warning("wall clock jumped %+.1f s; re-reading the database clock now", jump_s)
        self.liveness.next_renew = float("-inf")  # keep_lease re-measures the database clock in this step
        return True

    def follow_time_jump(self, now: dt.datetime, mono: float) -> float:
        """Keep what is measured from *now* on the monotonic clock when database time jumps against it
        (a wall-clock step on SQLite, a machine waking from suspend, a stepped database server): each
        in-flight run keeps the time it had left (its deadline, run row and job lease are moved by the
        jump, token-checked), the shutdown bound likewise, and the rescan and pruning timers restart. So a
        forward step never kills a run for time it did not use, and a backward step neither stretches a
        deadline nor stops the sweep. After a forward jump every lease in the database looks older by the
        jump, so for one renewal interval (plus a poll) this supervisor neither abandons other supervisors'
        runs nor takes a lease that is not free (:meth:`_holding_takeovers`). Returns the jump in seconds
        (0.0 when under 1 s)."""
        previous, self._last_step_clock = self._last_step_clock, (now, mono)
        if previous is None:
            return 0.0
        jump_s = (now - previous[0]).total_seconds() - (mono - previous[1])
        if abs(jump_s) <= CLOCK_JUMP_S:
            return 0.0
        shift = dt.timedelta(seconds=jump_s)
        self.next_rescan_at = None
        self.pruner.next_pass_at = None if self.pruner.next_pass_at is None else self.pruner.next_pass_at + shift
        if self.drain_deadline is not None:
            self.drain_deadline += shift
        if self.takeover_hold_until is not None:
            self.takeover_hold_until += shift
        if jump_s > 0:  # every lease now looks older by the jump: let their holders renew before taking any
            self.takeover_hold_until = now + dt.timedelta(
                seconds=self.settings.lease_renew_interval_s + self.settings.rescan_interval_s + 1.0)
            log.warning("time jumped %+.1f s: no lease of another supervisor is taken and no run abandoned "
                        "until %s, so that live supervisors can renew theirs first", jump_s,
                        _iso(self.takeover_hold_until))
        for flight in self.inflight.values():
            flight.deadline += shift
            flight.started_at += shift
            if flight.last_extended is not None:
                flight.last_extended += shift
            lease_s = max(0.0, (flight.deadline - now).total_seconds()) + self.settings.lease_ttl_s
            try:
                self.store.extend(flight.job_id, flight.token, lease_s, flight.run_id, flight.deadline)
            except Exception as exc:  # noqa: BLE001 - the run keeps its local deadline; renewal checks the lease
                log.warning("run %d: deadline not moved in the database (%s)", flight.run_id, _short(exc))
        if self.inflight:
            log.warning("time jumped %+.1f s against the monotonic clock; %d in-flight run(s) keep the time "
                        "they had left", jump_s, len(self.inflight))
        return jump_s

    def _settle(self, now: dt.datetime, mono: float) -> dt.datetime:
        """Keep the liveness lease (a renewal re-measures the database clock, so ``now`` is corrected by the
        offset's change) and follow a time jump. Returns the corrected ``now``."""
        offset = self.liveness.db_offset
        self.keep_lease(now, mono)
        now += self.liveness.db_offset - offset
        self.follow_time_jump(now, mono)
        return now

    def _holding_takeovers(self, now: dt.datetime) -> bool:
        """True for a short while after a forward time jump (see :meth:`follow_time_jump`)."""
        return self.takeover_hold_until is not None and now < self.takeover_hold_until

    # -- the outer loop ------------------------------------------------------------------------------
    def serve(self, run_for_s: float | None = None) -> int:
        """Run until SIGTERM/SIGINT (or ``run_for_s`` seconds), then drain and return exit code 0."""
        rsock, wsock = socket.socketpair()
        for sock in (rsock, wsock):
            sock.setblocking(False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        old_wakeup = signal.set_wakeup_fd(wsock.fileno())
        try:
            stop_at = time.monotonic() + run_for_s if run_for_s is not None else None
            self.metrics.start_server()
            self.pool.start()
            self.notifier = Notifier(self.store, self.settings.notifications, self.settings.instance,
                                     on_delivery_failure=self.on_delivery_failure).start()
            log.info("supervisor %s started: %d workers, lease timeout %.0f s, database %s",
                     self.settings.instance, self.pool.size, self.settings.lease_timeout_s,
                     redact_url(self.store.engine.url.render_as_string(hide_password=False)))
            while not self.done:
                now, mono = self.read_clock()
                if self._signals >= 2 and self.inflight:
                    log.warning("second signal: killing %d in-flight run(s) now", len(self.inflight))
                    self.cancel_all(now, "interrupted by shutdown (second signal)")
                if self._signals or (stop_at is not None and mono >= stop_at):
                    self.begin_shutdown(now)
                wake = self.step(now, mono)
                if self.done:
                    break
                timeout_s = (wake - self.read_clock()[0]).total_seconds()  # step() time must not delay the wake
                if stop_at is not None and self.accepting:
                    timeout_s = min(timeout_s, stop_at - time.monotonic())
                events, woken = self.pool.wait(max(0.0, timeout_s), [rsock])
                if woken:
                    _drain_socket(rsock)
                self.on_events(events, self.read_clock()[0])
                self.metrics.loop_completed(time.monotonic())
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            rsock.close()
            wsock.close()
            self.pool.close()
            if self.notifier is not None:
                self.notifier.stop()
            self.liveness.stop()
            self.metrics.stop_server()
        log.info("supervisor %s stopped", self.settings.instance)
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """Count SIGTERM/SIGINT (only a flag: the loop acts on it; logging is not signal-safe). A signal
        arriving before the loop has acted on the first one counts once with it: `timeout` and
        process-group kills deliver one stop request twice, and a second signal means "kill at once"."""
        if self._signals and self.accepting:
            return
        self._signals += 1

    # -- one step of decisions at a given time --------------------------------------------------------
    def step(self, now: dt.datetime, mono: float) -> dt.datetime:
        """Keep the liveness lease, record late results, enforce deadlines, rescan, dispatch. Returns when
        the loop must wake at the latest (next due time, deadline, renewal or rescan, whichever is first).
        ``now`` is database time; ``mono`` the monotonic clock (for the lease's local validity)."""
        now = self._settle(now, mono)
        self.retry_pending(now)
        self.enforce_deadlines(now)
        if not self.accepting:
            return self._drain_step(now, mono)
        next_due = None
        if self.liveness.valid(mono):
            try:
                if self.next_rescan_at is None or now >= self.next_rescan_at:
                    self.rescan(now)
                self.dispatch_due(now)
                next_due = self.store.next_due_at(set(self.bad_jobs)) if self.pool.idle_workers() else None
                self.metrics.poll(None)
            except Exception as exc:  # noqa: BLE001 - a database outage must not kill the supervisor
                self.metrics.poll(_short(exc))
                log.warning("poll failed (%s); retrying in %.1f s", _short(exc), self.settings.rescan_interval_s)
                self.next_rescan_at = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
            self.pruner.step(now)
        return self._wake(now, mono, next_due, self.next_rescan_at, self.pruner.wake_at(now))

    def _wake(self, now: dt.datetime, mono: float, *candidates: dt.datetime | None) -> dt.datetime:
        wake = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
        renew_at = now + dt.timedelta(seconds=max(0.0, self.liveness.next_renew - mono))
        retry_at = now + dt.timedelta(seconds=1) if self.pending else None
        # the moment the lease stops being trustworthy locally: fencing must not wait for another wake-up
        fence_at = (now + dt.timedelta(seconds=max(0.0, self.liveness.valid_until - mono))
                    if self.inflight and self.liveness.valid(mono) else None)
        for when in (*candidates, renew_at, retry_at, fence_at, *(f.deadline for f in self.inflight.values())):
            if when is not None and when < wake:
                wake = when
        return max(wake, now + dt.timedelta(milliseconds=1))

    def keep_lease(self, now: dt.datetime, mono: float) -> None:
        """Renew the liveness lease when due; fence (kill and fail) runs whose lease is lost, and every run
        once the lease can no longer be trusted locally."""
        renewed = self.liveness.maintain(mono)
        if renewed:
            self.pool.fence_at.value = self.liveness.valid_until  # busy workers enforce it themselves
        if renewed and self.inflight:
            try:
                held = self.store.held_runs(set(self.inflight))
            except Exception:  # noqa: BLE001 - checked again at the next renewal
                held = set(self.inflight)
            for run_id in set(self.inflight) - held:
                self.fence(self.inflight[run_id], now,
                           "its lease was taken over, the run was abandoned, or its job was removed")
        if self.inflight and not self.liveness.valid(mono):
            for flight in list(self.inflight.values()):
                self.fence(flight, now, f"this supervisor could not renew its lease for "
                                        f"{self.settings.lease_ttl_s * 0.8:g} s (database unreachable?)")

    def fence(self, flight: InFlight, now: dt.datetime, why: str) -> None:
        """Kill a run this supervisor may no longer hold, before anyone else may legally take the job.
        Its outcome is recorded only if the run row is still Running (never over another's verdict)."""
        del self.inflight[flight.run_id]
        self.pool.kill(flight.worker)
        self.metrics.run_killed("fence")
        log.error("run %d of job %s fenced: %s", flight.run_id, flight.job_name, why, extra=_ctx(flight))
        self.record(flight, now, status="Failed", success=False, error_message=f"fenced: run killed because {why}")

    def rescan(self, now: dt.datetime) -> None:
        """Fail runs of dead supervisors, and give unscheduled Active jobs a next_run_at (e.g. a job activated
        while supervisors run). Both are indexed queries; this runs every ``rescan_interval_s``."""
        self.next_rescan_at = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
        self._forget_fixed_bad_jobs()
        self._warn_high_frequency(now)
        abandoned = [] if self._holding_takeovers(now) else self.store.abandon_orphaned_runs(
            exclude_run_ids=set(self.inflight), notices_for=lambda run: notices.outbox_rows(
                notices.for_abandoned(run), self.settings.notifications.channels()))
        if abandoned:
            self._wake_sender()
        for run in abandoned:
            log.error("run %d of job %s marked Failed: %s", run["id"], run["job_name"], run["error_message"],
                      extra={"job": run["job_name"], "run_id": run["id"]})
        for job in self.store.unreadable_next_run_at_jobs():  # edited by hand into a SQLite file
            if job["id"] not in self.bad_jobs:
                self._repair_unreadable(job, now)
        for job in self.store.unscheduled_active_jobs():
            if job["id"] in self.bad_jobs and self.bad_jobs[job["id"]][0] == job["updated_at"]:
                continue
            try:
                next_run_at = planner.initial_next_run_at(job, now)
            except (CronError, OverflowError, ValueError) as exc:  # a schedule no date arithmetic can follow
                self._mark_bad(job, str(exc))
                continue
            status = "Expired" if next_run_at is None else None
            if self.store.set_next_run_at(job["id"], None, next_run_at, now, status=status):
                log.info("job %s scheduled: next_run_at %s", job["name"], _iso(next_run_at) if next_run_at else
                         "none (end_at passed; status Expired)")

    def dispatch_due(self, now: dt.datetime) -> None:
        """Claim due jobs, earliest first, for idle workers, and hand them over. Does not wait for runs."""
        idle = self.pool.idle_workers()
        if not idle or self.pool.last_ready is None:
            return
        known = {p.job_type for p in self.pool.last_ready.plugins}
        for job in self.store.due_jobs(now, limit=len(idle), exclude=set(self.bad_jobs)):
            if not idle:
                break
            if self._dispatch_one(job, known, now, idle[-1]):
                idle.pop()

    def _dispatch_one(self, job: dict, known: set[str], now: dt.datetime, worker: Worker) -> bool:
        """Run, skip or set aside one due job. True if it took ``worker``."""
        seen = job["next_run_at"]
        if seen is None:  # due by SQL but unreadable here: a value edited by hand into a SQLite file
            return self._repair_unreadable(job, now)
        if planner.expired(job, now):
            if self.store.set_next_run_at(job["id"], seen, None, now, status="Expired"):
                log.warning("job %s expired: end_at %s has passed; occurrence %s not run",
                            job["name"], _iso(job["end_at"]), _iso(seen))
            return False
        try:
            if job["start_at"] is not None and job["start_at"] > now:  # edited outside the CLI: not yet
                return self._reschedule(job, planner.initial_next_run_at(job, now), now)
            decision = planner.decide(job, now, self.settings.max_catchup_runs)
        except (CronError, OverflowError, ValueError) as exc:  # one bad job must not stop the poll
            self._mark_bad(job, str(exc))
            return False
        next_run_at = decision.next_run_at
        if not decision.run:
            why = (f"RunAll backlog longer than max_catchup_runs ({self.settings.max_catchup_runs}) or older "
                   f"than a year; catching up from {_iso(next_run_at)}" if decision.skipped_older
                   else "missed and missed_run_policy is Skip")
            if self.store.set_next_run_at(job["id"], seen, next_run_at, now, skipped=True,
                                          notices=self._skip_notices(job, seen, "Missed", why)):
                self._wake_sender()
                self.metrics.occurrence_skipped("backlog" if decision.skipped_older else "missed")
                log.warning("job %s: occurrence %s skipped: %s", job["name"], _iso(seen), why, extra=_ctx(job))
            return False
        if job["job_type"] not in known:
            if self.store.set_next_run_at(job["id"], seen, next_run_at, now, skipped=True):
                self.metrics.occurrence_skipped("job_type_unavailable")
                log.error("job %s: occurrence %s skipped: job_type %r is not available (see `plugins list`)",
                          job["name"], _iso(seen), job["job_type"], extra=_ctx(job))
            return False
        if self._claim(job, now, next_run_at, worker, scheduled_at=seen) is not None:
            return True
        busy = "a run is still live (concurrency_mode Skip)"
        if job["concurrency_mode"] == "Skip" and job["missed_run_policy"] != "RunAll" and self.store.set_next_run_at(
                job["id"], seen, next_run_at, now, skipped=True,
                notices=self._skip_notices(job, seen, "Skipped", busy)):
            self._wake_sender()
            self.metrics.occurrence_skipped("concurrency")
            log.warning("job %s: occurrence %s skipped: a run is still live (concurrency_mode Skip)",
                        job["name"], _iso(seen), extra=_ctx(job))
        return False

    def _skip_notices(self, job: dict, seen: dt.datetime | None, event: str, why: str) -> list[dict]:
        """Outbox rows for an occurrence not run (written with the skip, in its transaction)."""
        return notices.outbox_rows(notices.for_skip(job, seen, event=event, reason=why),
                                   self.settings.notifications.channels())

    def _wake_sender(self) -> None:
        """Tell the notification sender (if running) that rows were just committed; otherwise it polls."""
        if self.notifier is not None:
            self.notifier.wake()

    def _repair_unreadable(self, job: dict, now: dt.datetime) -> bool:
        """Give a job whose stored ``next_run_at`` cannot be read a fresh one from ``now`` (logged)."""
        try:
            next_run_at = planner.initial_next_run_at(job, now)
        except (CronError, OverflowError, ValueError) as exc:
            self._mark_bad(job, str(exc))
            return False
        if self.store.repair_next_run_at(job["id"], next_run_at):
            log.error("job %s: its next_run_at could not be read (not a timestamp in the store's form; edited by "
                      "hand?); rescheduled to %s", job["name"], _iso(next_run_at), extra=_ctx(job))
        return False

    def _reschedule(self, job: dict, next_run_at: dt.datetime | None, now: dt.datetime) -> bool:
        if self.store.set_next_run_at(job["id"], job["next_run_at"], next_run_at, now):
            log.info("job %s: not before start_at %s; next_run_at moved to %s", job["name"], _iso(job["start_at"]),
                     _iso(next_run_at))
        return False

    def _claim(self, job: dict, now: dt.datetime, next_run_at: dt.datetime | None, worker: Worker,
               scheduled_at: dt.datetime | None) -> InFlight | None:
        """Claim the occurrence (or manual run) and hand it to ``worker``; None if the claim lost."""
        timeout_s = planner.run_timeout_s(job, self.settings.lease_timeout_s)
        deadline = now + dt.timedelta(seconds=timeout_s)
        claim = self.store.claim(
            # the job lease outlives the deadline by one TTL: time for this supervisor to kill and record
            job, now=now, next_run_at=next_run_at, instance=self.settings.instance,
            lease_s=timeout_s + self.settings.lease_ttl_s,
            deadline_at=deadline, take_lease=job["concurrency_mode"] != "Concurrent", scheduled_at=scheduled_at,
            only_free_lease=self._holding_takeovers(now),
            queued_at=planner.queued_at(job, scheduled_at),
            status="Expired" if next_run_at is None and scheduled_at is not None else None)
        if claim is None:
            return None
        flight = InFlight(claim.run_id, job, claim.lock_token, worker, now, deadline, timeout_s)
        flight.scheduled_at = scheduled_at
        self.inflight[claim.run_id] = flight
        request = protocol.RunRequest(
            run_id=claim.run_id, job_id=job["id"], job_name=job["name"], job_type=job["job_type"],
            configuration=job["configuration"], scheduled_at=scheduled_at.timestamp() if scheduled_at else None,
            deadline_at=deadline.timestamp())
        try:
            self.pool.submit(worker, request)
        except OSError:
            log.warning("worker %d died before run %d reached it; its death will be recorded", worker.pid, claim.run_id,
                        extra=_ctx(flight))
        self.metrics.run_started((now - scheduled_at).total_seconds() if scheduled_at else None)
        log.info("run %d started: job %s (%s) for %s on worker %d, deadline %s", claim.run_id, job["name"],
                 job["job_type"], _iso(scheduled_at) if scheduled_at else "a manual request", worker.pid, _iso(deadline),
                 extra=_ctx(flight))
        return flight

    # -- manual runs ------------------------------------------------------------------------------
    def run_now(self, job: dict, *, ready_timeout_s: float) -> int | None:
        """``jobs run NAME``: run ``job`` once now, through a worker, and wait for it to be recorded.

        Skip and Queue jobs need the job's lease, so a live run refuses the request (None is returned);
        Concurrent jobs always start. The schedule (``next_run_at``) is left as it is. Reads clocks: it is
        an outer loop, like :meth:`serve`. Returns the run id.
        """
        self.pool.start()
        try:
            return self._run_now(job, ready_timeout_s)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run is cancelled and its lease released
            self.cancel_all(self.read_clock()[0], "interrupted: `jobs run` was stopped")
            raise
        finally:
            self.liveness.stop()

    def _run_now(self, job: dict, ready_timeout_s: float) -> int | None:
        give_up = time.monotonic() + ready_timeout_s
        while not self.pool.idle_workers():
            if time.monotonic() >= give_up:
                raise TimeoutError(f"no worker became ready within {ready_timeout_s:.0f} s")
            events, _ = self.pool.wait(give_up - time.monotonic())
            self.on_events(events, self.read_clock()[0])
        known = {p.job_type for p in self.pool.last_ready.plugins} if self.pool.last_ready else set()
        if job["job_type"] not in known:
            raise LookupError(f"job_type {job['job_type']!r} is not available (see `plugins list`)")
        now, mono = self.read_clock()
        self.keep_lease(now, mono)
        if not self.liveness.valid(mono):
            raise TimeoutError("could not register with the database")
        flight = self._claim(job, now, job["next_run_at"], self.pool.idle_workers()[0], scheduled_at=None)
        if flight is None:
            return None
        while flight.run_id in self.inflight or self.pending:
            now, mono = self.read_clock()
            now = self._settle(now, mono)
            self.retry_pending(now)
            self.enforce_deadlines(now)
            wake = self._wake(now, mono)
            events, _ = self.pool.wait(max(0.0, (wake - self.read_clock()[0]).total_seconds()))
            self.on_events(events, self.read_clock()[0])
        return flight.run_id

    # -- events from children ---------------------------------------------------------------------
    def on_events(self, events: list[ChildEvent], now: dt.datetime) -> None:
        """Record results, crashes and heartbeats reported by the pool."""
        for event in events:
            if event.died:
                self._on_death(event, now)
                continue
            message = event.message
            flight = self.inflight.get(getattr(message, "run_id", -1))
            if isinstance(message, protocol.RunFinished) and flight is not None:
                del self.inflight[message.run_id]
                self.record(flight, now, status="Completed" if message.success else "Failed",
                            success=message.success, error_message=message.error_message,
                            details=message.details, notification=message.notification)
            elif isinstance(message, protocol.RunStarted) and flight is not None:
                log.debug("run %d: plugin started %.1f ms after the claim", flight.run_id,
                          (message.at - flight.started_at.timestamp()) * 1000, extra=_ctx(flight))
            elif isinstance(message, protocol.Heartbeat) and flight is not None:
                self.heartbeat(flight, now)
            elif isinstance(message, protocol.Ready):
                self._log_plugins(message)

    def _on_death(self, event: ChildEvent, now: dt.datetime) -> None:
        code = event.exitcode
        how = describe_exit(code)
        flight = self.inflight.pop(event.run.run_id, None) if event.run is not None else None
        if flight is None:
            if event.culprit is None:  # the pool has already named a plugin module that killed it at import
                log.warning("worker %d exited while idle (%s); slot refilled", event.worker.pid, how)
            return
        self.record(flight, now, status="Failed", success=False,
                    error_message=f"worker process {event.worker.pid} died during the run ({how})")

    def heartbeat(self, flight: InFlight, now: dt.datetime) -> None:
        """A plugin heartbeat: at most one effective extension per ``heartbeat_interval_s`` (the first one
        at once, unlike the reference, whose first beat can only count after 5 min), to
        ``max(deadline, now + heartbeat_lease_s)``, token-checked (reference §2.3 / §7.1)."""
        if flight.last_extended and (now - flight.last_extended).total_seconds() < self.settings.heartbeat_interval_s:
            return
        deadline = max(flight.deadline, now + dt.timedelta(seconds=self.settings.heartbeat_lease_s))
        lease_s = (deadline - now).total_seconds() + self.settings.lease_ttl_s
        try:
            extended = self.store.extend(flight.job_id, flight.token, lease_s, flight.run_id, deadline)
        except Exception as exc:  # noqa: BLE001 - the plugin keeps its current deadline
            log.warning("run %d: heartbeat not applied (%s)", flight.run_id, _short(exc), extra=_ctx(flight))
            return
        if extended:
            flight.deadline = deadline
            flight.last_extended = now
            log.debug("run %d: deadline extended to %s by heartbeat", flight.run_id, _iso(deadline), extra=_ctx(flight))
        else:
            log.warning("run %d of job %s: heartbeat could not extend the lease (token no longer holds it)",
                        flight.run_id, flight.job_name, extra=_ctx(flight))

    # -- deadlines, shutdown ----------------------------------------------------------------------
    def enforce_deadlines(self, now: dt.datetime) -> None:
        """Kill every run past its deadline (whole process tree) and record it as Timeout."""
        for flight in [f for f in self.inflight.values() if now >= f.deadline]:
            del self.inflight[flight.run_id]
            pid = flight.worker.pid
            self.pool.kill(flight.worker)
            self.metrics.run_killed("deadline")
            self.record(flight, now, status="Timeout", success=False,
                        error_message=(f"run exceeded its deadline of {flight.timeout_s:g} s "
                                       f"(started {_iso(flight.started_at)}); worker {pid} and its process tree "
                                       "were killed"))

    def begin_shutdown(self, now: dt.datetime) -> None:
        """Stop dispatching; in-flight runs get ``shutdown_timeout_s`` to finish."""
        if not self.accepting:
            return
        self.accepting = False
        self.pool.refill = False
        self.drain_deadline = now + dt.timedelta(seconds=self.settings.shutdown_timeout_s)
        log.info("shutting down: no new runs; waiting up to %.0f s for %d in-flight run(s)",
                 self.settings.shutdown_timeout_s, len(self.inflight))

    def _drain_step(self, now: dt.datetime, mono: float) -> dt.datetime:
        """One step of a shutdown: wait for in-flight runs until ``drain_deadline``, then cancel them. The
        liveness lease is still renewed meanwhile (the wake-up includes the renewal), or the workers'
        watchdogs would fence runs that are allowed to finish."""
        past_deadline = self.drain_deadline is None or now >= self.drain_deadline
        if self.inflight and past_deadline:
            self.cancel_all(now, "interrupted by shutdown")
        if self.pending and past_deadline:
            log.error("stopping with %d result(s) unrecorded (database unreachable): runs %s; they will be "
                      "marked abandoned when this supervisor's lease expires", len(self.pending),
                      ", ".join(str(f.run_id) for f, _ in self.pending))
            self.pending.clear()
        if not self.inflight and not self.pending:
            self.done = True
            return now
        return self._wake(now, mono, self.drain_deadline)

    def cancel_all(self, now: dt.datetime, reason: str) -> None:
        """Kill every in-flight run's process tree and record it Cancelled (lease released)."""
        for flight in list(self.inflight.values()):
            del self.inflight[flight.run_id]
            self.pool.kill(flight.worker)
            self.metrics.run_killed("shutdown")
            self.record(flight, now, status="Cancelled", success=False, error_message=reason, count=False)

    # -- recording --------------------------------------------------------------------------------
    def record(self, flight: InFlight, now: dt.datetime, *, status: str, success: bool,
               error_message: str | None = None, details: dict | None = None, count: bool = True,
               notification: protocol.NoticeText | None = None) -> None:
        """Write the run's terminal state, the job's statistics, the lease release and its notices (one
        transaction). ``duration_ms`` is the run row's ``completed_at - started_at``, as in the reference.
        ``notification``: the plugin's formatted notice (see :mod:`notices` for who is notified when)."""
        outcome = dict(status=status, success=success, error_message=error_message, details=details, count=count,
                       duration_ms=max(0.0, (now - flight.started_at).total_seconds() * 1000),
                       notices=notices.outbox_rows(
                           notices.for_run(flight.job, flight.run_id, status=status, error_message=error_message,
                                           text=notification, scheduled_at=flight.scheduled_at),
                           self.settings.notifications.channels()))
        if not self._store_outcome(flight, outcome):
            self.pending.append((flight, outcome))
            log.warning("run %d of job %s: %s not recorded yet (database unreachable); will retry",
                        flight.run_id, flight.job_name, status, extra=_ctx(flight))

    def retry_pending(self, now: dt.datetime) -> None:
        """Record results that arrived while the database was unreachable, oldest first."""
        while self.pending:
            flight, outcome = self.pending[0]
            if not self._store_outcome(flight, outcome):
                return
            self.pending.pop(0)

    def _store_outcome(self, flight: InFlight, outcome: dict, *, refused: bool = False) -> bool:
        """False if the database could not be reached (the caller keeps the outcome for later).
        ``refused``: this is the second try, without the plugin's text, of an outcome the database refused."""
        status, error_message, duration_ms = outcome["status"], outcome["error_message"], outcome["duration_ms"]
        try:
            recorded = self.store.finish_run(flight.run_id, flight.job_id, flight.token, **outcome)
        except Exception as exc:  # noqa: BLE001
            if is_permanent_error(exc) and not refused:
                # the database refused what the plugin reported (e.g. a NUL byte on PostgreSQL): retrying
                # cannot help, so record the outcome without the plugin's text rather than never
                log.error("run %d of job %s: the database refused its result (%s); recording %s without the "
                          "plugin's message, details and notices", flight.run_id, flight.job_name, _short(exc),
                          status, extra=_ctx(flight))
                outcome.update(details=None, notices=[], error_message=(
                    f"result refused by the database ({_short(exc, 300)}); the run ended {status}"))
                return self._store_outcome(flight, outcome, refused=True)
            log.debug("run %d: recording failed: %s", flight.run_id, _short(exc), extra=_ctx(flight))
            return False
        if not recorded:
            log.warning("run %d of job %s: result %s not recorded: its run row is no longer Running (abandoned by "
                        "another supervisor, or its job was removed)",
                        flight.run_id, flight.job_name, status, extra=_ctx(flight))
            return True
        self.metrics.run_finished(flight.job_type, status, duration_ms / 1000)
        if outcome["notices"]:
            self._wake_sender()
        level = logging.INFO if status == "Completed" else logging.ERROR
        log.log(level, "run %d finished: job %s %s in %.0f ms%s", flight.run_id, flight.job_name, status,
                duration_ms, f": {error_message}" if error_message and status != "Completed" else "", extra=_ctx(flight))
        return True

    # -- bad jobs and plugin reporting --------------------------------------------------------------
    def _mark_bad(self, job: dict, reason: str) -> None:
        if self.bad_jobs.get(job["id"], (None,))[0] != job["updated_at"]:
            log.error("job %s skipped until it is fixed: %s", job["name"], reason)
        self.bad_jobs[job["id"]] = (job["updated_at"], reason)

    def _warn_high_frequency(self, now: dt.datetime) -> None:
        """List jobs firing more often than every 5 minutes, once at start and again when that list
        changes (reference §6.4): advice, not a block. Recomputed only when an Active job changed."""
        signature = self.store.active_jobs_signature()
        if signature == self._active_signature:
            return
        self._active_signature = signature
        offenders, intervals = [], {}
        for job in self.store.active_jobs():
            key = (job["cron_expression"], job["timezone"])
            if key not in intervals:
                try:
                    intervals[key] = planner.high_frequency_interval_s(job, now)
                except CronError:
                    intervals[key] = None
            interval = intervals[key]
            if interval is not None:
                offenders.append((job["name"], job["cron_expression"], job["timezone"], interval))
        offenders.sort()
        if offenders and offenders != list(self._high_frequency_warned):
            lines = "\n".join(f"  - {name}: '{expr}' ({zone}) every {planner.human_interval(interval)}"
                               for name, expr, zone, interval in offenders)
            log.warning("%d job(s) fire more often than every 5 minutes. They will still run as configured; "
                        "this is advice, not a block:\n%s", len(offenders), lines)
        self._high_frequency_warned = tuple(offenders)

    def _forget_fixed_bad_jobs(self) -> None:
        """Give a bad job another chance once its row has changed (``updated_at`` moved)."""
        for job_id, (updated_at, _) in list(self.bad_jobs.items()):
            row = self.store.get_job_by_id(job_id)
            if row is None or row["updated_at"] != updated_at:
                del self.bad_jobs[job_id]

    def _log_plugins(self, ready: protocol.Ready) -> None:
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


def _ctx(item: InFlight | dict) -> dict:
    """``extra=`` for a log call about a run (an :class:`InFlight`) or a job (a row): the JSON log's
    ``job`` and ``run_id`` fields (see :mod:`logs`)."""
    if isinstance(item, InFlight):
        return {"job": item.job_name, "run_id": item.run_id}
    return {"job": item["name"]}


def _iso(when: dt.datetime | None) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z") if when else "-"


def _drain_socket(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
