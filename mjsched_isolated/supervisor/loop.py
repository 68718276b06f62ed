"""The supervisor's loop: :meth:`Supervisor.cycle` (step + wait + events), used by :meth:`Supervisor.serve`,
by manual runs (:meth:`Supervisor.run_now`) and by the tests' driver alike; signals, shutdown and drain.
The decisions live in the parts it calls (see the package docstring for the whole path)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

from mjsched_isolated import logs, proctree, protocol
from mjsched_isolated.config import Settings, redact_url
from mjsched_isolated.errors import InputError
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.store import Store
from mjsched_isolated.store.records import JobRow
from mjsched_isolated.supervisor import manual
from mjsched_isolated.supervisor import metrics as metrics_mod
from mjsched_isolated.supervisor.clock import Clock
from mjsched_isolated.supervisor.dispatch import Dispatcher
from mjsched_isolated.supervisor.guard import RunGuard
from mjsched_isolated.supervisor.inflight import InFlight, log_ctx
from mjsched_isolated.supervisor.liveness import Liveness, Renewer
from mjsched_isolated.supervisor.notifier import Notifier
from mjsched_isolated.supervisor.pool import ChildEvent, Pool
from mjsched_isolated.supervisor.recording import Recorder
from mjsched_isolated.supervisor.reload import PluginReloader
from mjsched_isolated.supervisor.retention import Pruner
from mjsched_isolated.supervisor.trouble import DatabaseFile, Trouble

log = logging.getLogger("mjsched.supervisor")


class Supervisor:
    """One supervisor process. ``store`` and ``pool`` are built by the caller (and closed by it); ``pool``
    is a :class:`~mjsched_isolated.supervisor.pool.Pool` or anything with its interface (the tests' fake)."""

    def __init__(self, settings: Settings, store: Store, pool: Pool,
                 metrics: metrics_mod.Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else metrics_mod.for_settings(settings)
        self.metrics.track_inflight(lambda: len(self.inflight))
        pool.on_respawn = self.metrics.worker_respawned
        self.store = store
        self.pool = pool
        self.inflight: dict[int, InFlight] = {}
        self.peak_inflight = 0  # the most runs in flight at once so far (seen between the loop's phases)
        self.accepting = True  # False once shutting down: no new runs
        self.scheduling = True  # False for a manual-run supervisor (`jobs run`): nothing is dispatched
        self.drain_deadline: dt.datetime | None = None
        self.done = False
        self.notifier: Notifier | None = None  # the notification sender, started by serve
        self.on_delivery_failure = self.metrics.notification_failed  # callable(channel: str), for the sender
        self.clock = Clock(settings.clock_skew_s,
                           hold_s=settings.lease_renew_interval_s + settings.rescan_interval_s + 1.0)
        self.liveness = Liveness(store, settings.instance, settings.lease_ttl_s, settings.lease_renew_interval_s,
                                 self.clock.local_now, max_concurrent_jobs=pool.size)
        self.liveness.on_renewal = self.metrics.lease_renewal
        self.renewer: Renewer | None = None  # serve's renewal thread; None: renewed inline by keep_lease
        self._renewals_seen = 0
        self.recorder = Recorder(settings, store, self.metrics, self._wake_sender)
        self.guard = RunGuard(settings, store, pool, self.metrics, self.recorder, self.inflight,
                              lease_lapsed=lambda flight: self.liveness.lapsed_during(flight.recorded_start,
                                                                                      self.clock.monotonic()))
        self.dispatcher = Dispatcher(settings, store, pool, self.metrics, self.clock, self.inflight,
                                     self._wake_sender)
        self.dispatcher.unrecorded = lambda: len(self.recorder.pending)
        self.dispatcher.cancel_flight = lambda flight, now, reason: self.guard.cancel(flight, now, reason, retry=False)
        # claim_ahead_s: a database instant on this machine's own clock (a worker's start_at), and whether
        # the liveness lease is still trusted claim_ahead_s from now
        self.dispatcher.local_epoch = lambda at: (at - self.liveness.db_offset).timestamp() - self.clock.skew_s
        self.dispatcher.lease_valid_ahead = lambda: self.liveness.valid(self.clock.monotonic()
                                                                        + settings.claim_ahead_s)
        self.pruner = Pruner(store, settings.retention)  # run retention: one batch per step at most
        self.poll_trouble = Trouble(log, "poll")  # a failing poll is logged once, then counted
        self.db_file = DatabaseFile.of(store.engine.url)  # a SQLite file deleted or replaced under us stops polls
        self.reloader = PluginReloader(pool, store.latest_plugin_reload, check_interval_s=settings.rescan_interval_s,
                                       request_interval_s=settings.lease_renew_interval_s)
        self._signals = 0
        self._reload_signal = False  # SIGHUP without a controlling terminal: reload the plugins
        self._hangup_stops = True  # SIGHUP with a controlling terminal: a hang-up, drain and stop (serve sets it)
        self._stop_at: float | None = None  # monotonic; serve(run_for_s)

    # -- the parts' state, under the names callers and tests use ----------------------------------
    @property
    def pending(self) -> list:
        return self.recorder.pending

    @property
    def bad_jobs(self) -> dict:
        return self.dispatcher.bad_jobs

    @property
    def next_rescan_at(self) -> dt.datetime | None:
        return self.dispatcher.next_rescan_at

    @property
    def takeover_hold_until(self) -> dt.datetime | None:
        return self.clock.takeover_hold_until

    def record(self, flight: InFlight, now: dt.datetime, **outcome: Any) -> None:
        """See :meth:`Recorder.record`."""
        self.recorder.record(flight, now, **outcome)

    def cancel_all(self, now: dt.datetime, reason: str) -> None:
        """See :meth:`RunGuard.cancel_all`."""
        self.guard.cancel_all(now, reason)

    # -- clocks: read only here, by the outer loop, and passed into everything else -----------------
    def local_now(self) -> dt.datetime:
        return self.clock.local_now()

    def read_clock(self) -> tuple[dt.datetime, float]:
        """(now in database time, monotonic seconds): what :meth:`step` takes. A wall clock that moved
        differently from the monotonic one (a step, a machine waking from suspend) makes this re-measure the
        database clock at once; a jump of database time is followed at once (:meth:`follow_time_jump`), so
        results and heartbeats before the next step are timed in the new frame."""
        local, mono = self.clock.local_now(), self.clock.monotonic()
        if self.notice_clock_jump(local, mono) and self.liveness.registered:
            self.keep_lease(local + self.liveness.db_offset, mono)
        now = local + self.liveness.db_offset
        self.follow_time_jump(now, mono)
        return now, mono

    def notice_clock_jump(self, local: dt.datetime, mono: float) -> bool:
        """True (and a renewal forced) if the wall clock jumped by more than 1 s against the monotonic one."""
        if not self.clock.notice_wall_jump(local, mono):
            return False
        self.liveness.next_renew = float("-inf")  # keep_lease re-measures the database clock in this step
        if self.renewer is not None:
            self.renewer.poke()
        return True

    def follow_time_jump(self, now: dt.datetime, mono: float) -> float:
        """When database time jumps against the monotonic clock, keep what is measured from *now*: in-flight
        runs keep the time they had left (:meth:`RunGuard.shift`), the shutdown bound likewise, the rescan
        and pruning timers restart, and takeovers are held after a forward jump (:mod:`.clock`). Returns the
        jump in seconds (0.0 when under 1 s)."""
        jump_s = self.clock.step_jump_s(now, mono)
        if not jump_s:
            return 0.0
        shift = dt.timedelta(seconds=jump_s)
        self.dispatcher.next_rescan_at = None
        self.pruner.next_pass_at = None if self.pruner.next_pass_at is None else self.pruner.next_pass_at + shift
        if self.drain_deadline is not None:
            self.drain_deadline += shift
        self.guard.shift(shift, now, jump_s)
        return jump_s

    def keep_lease(self, now: dt.datetime, mono: float) -> None:
        """Renew the liveness lease when due (or, under ``serve``, see whether the :class:`Renewer` thread
        renewed it); after a renewal, record the results the workers have already sent (so a run that
        finished before its cancel or fence took effect keeps its outcome), then fence (kill and fail) runs
        whose lease is lost and cancel those asked to be; fence every run once the lease can no longer be
        trusted locally."""
        if self.renewer is not None:
            if self.renewer.refused is not None:  # another live supervisor registered this name first
                raise self.renewer.refused
            renewed = self.renewer.renewals != self._renewals_seen
            self._renewals_seen = self.renewer.renewals
        else:
            renewed = self.liveness.maintain(mono)
            if renewed:
                self.pool.fence_at.value = self.liveness.valid_until  # busy workers enforce it themselves
        if renewed:
            if self.inflight:  # results already sent are recorded first: a run that ended keeps its outcome
                events, _ = self.pool.wait(0.0)
                self.on_events(events, now)
            self.guard.fence_unheld(now)
        if self.inflight and not self.liveness.valid(mono):
            self.guard.fence_all(now)

    # -- one cycle: step, wait, events ------------------------------------------------------------
    def cycle(self, extra: Sequence[Any] = (), *, max_wait_s: float | None = None) -> list[Any]:
        """Read the clocks, :meth:`step`, wait in ``Pool.wait`` (on every child pipe and sentinel and the
        ``extra`` handles) until the step's wake-up time (at most ``max_wait_s`` seconds), then
        :meth:`on_events`. Returns the ``extra`` handles that are ready. Never blocks past a due time,
        deadline or renewal: a result, a crash, a signal or a due time ends the wait at once. The log lines
        of the step and of the events are written in one batch each, before the wait
        (:func:`~mjsched_isolated.logs.batched`)."""
        with logs.batched():
            now, mono = self.read_clock()
            self._act_on_stop_requests(now, mono)
            wake = self.step(now, mono)
        if self.done:
            return []
        timeout_s = (wake - self.read_clock()[0]).total_seconds()  # step() time must not delay the wake
        if self._stop_at is not None and self.accepting:
            timeout_s = min(timeout_s, self._stop_at - time.monotonic())
        if max_wait_s is not None:
            timeout_s = min(timeout_s, max_wait_s)
        probe = self.reloader.handles()
        events, woken = self.pool.wait(max(0.0, timeout_s), [*extra, *probe])
        with logs.batched():
            self.on_events(events, self.read_clock()[0])
        if probe:
            self.reloader.poll(time.monotonic())
            woken = [h for h in woken if h not in probe]
        self.metrics.loop_completed(time.monotonic())
        return woken

    def step(self, now: dt.datetime, mono: float) -> dt.datetime:
        """Keep the liveness lease, record late results, enforce deadlines, rescan, dispatch. Returns when
        the loop must wake at the latest (next due time, deadline, renewal or rescan, whichever is first).
        ``now`` is database time; ``mono`` the monotonic clock (for the lease's local validity)."""
        wake = self._step(now, mono)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))
        return wake

    def _step(self, now: dt.datetime, mono: float) -> dt.datetime:
        now = self._settle(now, mono)
        self.recorder.retry_pending()
        self.guard.enforce_deadlines(now)
        self.guard.enforce_cpu_limits(now)
        if not self.accepting:
            return self._drain_step(now, mono)
        if not self.scheduling:
            return self._wake(now, mono)
        next_due = None
        if self.liveness.valid(mono):
            try:
                self.db_file.check()
                if self.dispatcher.next_rescan_at is None or now >= self.dispatcher.next_rescan_at:
                    self.dispatcher.rescan(now)
                self.dispatcher.dispatch_due(now)
                next_due = self.dispatcher.next_due_at(now)
                self.metrics.poll(None)
                self.poll_trouble.recovered(mono)
            except Exception as exc:  # noqa: BLE001 - a database outage must not kill the supervisor
                self.metrics.poll(_short(exc))
                self.poll_trouble.failed(_short(exc), mono,
                                         f"; retrying every {self.settings.rescan_interval_s:g} s")
                self.dispatcher.next_rescan_at = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
            self.pruner.step(now)
            self.reloader.step(mono)
        return self._wake(now, mono, next_due, self.dispatcher.next_rescan_at, self.pruner.wake_at(now))

    def _settle(self, now: dt.datetime, mono: float) -> dt.datetime:
        """Keep the liveness lease (a renewal re-measures the database clock, so ``now`` is corrected by the
        offset's change) and follow a time jump. Returns the corrected ``now``."""
        offset = self.liveness.db_offset
        self.keep_lease(now, mono)
        now += self.liveness.db_offset - offset
        self.follow_time_jump(now, mono)
        return now

    def _wake(self, now: dt.datetime, mono: float, *candidates: dt.datetime | None) -> dt.datetime:
        wake = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
        # under serve the renewal thread wakes the loop itself (see serve); inline, the loop renews
        renew_at = (None if self.renewer is not None
                    else now + dt.timedelta(seconds=max(0.0, self.liveness.next_renew - mono)))
        retry_at = now + dt.timedelta(seconds=1) if self.recorder.pending else None
        # the moment the lease stops being trustworthy locally: fencing must not wait for another wake-up
        fence_at = (now + dt.timedelta(seconds=max(0.0, self.liveness.valid_until - mono))
                    if self.inflight and self.liveness.valid(mono) else None)
        for when in (*candidates, renew_at, retry_at, fence_at, *(f.wake_at for f in self.inflight.values())):
            if when is not None and when < wake:
                wake = when
        return max(wake, now + dt.timedelta(milliseconds=1))

    def on_events(self, events: list[ChildEvent], now: dt.datetime) -> None:
        """Record results, crashes and heartbeats reported by the pool. The results of one wait are recorded
        together, in one transaction (:meth:`Recorder.record_many`), each with ``now`` as its end."""
        finished = []
        for event in events:
            if event.died:
                self.guard.on_death(event, now)
                continue
            message = event.message
            flight = self.inflight.get(getattr(message, "run_id", -1))
            if isinstance(message, protocol.RunFinished) and flight is not None and flight.kill_at is not None:
                self.guard.ended_after_sigterm(flight, now, "its plugin returned")
            elif isinstance(message, protocol.RunFinished) and flight is not None:
                del self.inflight[message.run_id]
                finished.append((flight, self.recorder.outcome(
                    flight, now, status="Completed" if message.success else "Failed", success=message.success,
                    error_message=message.error_message, details=message.details,
                    notification=message.notification, cpu_s=message.cpu_s, max_rss_mb=message.max_rss_mb)))
            elif isinstance(message, protocol.RunStarted) and flight is not None:
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("run %d: plugin started %.1f ms after the claim", flight.run_id,
                              (message.at - flight.started_at.timestamp()) * 1000,
                              extra={"job": flight.job_name, "run_id": flight.run_id})
            elif isinstance(message, protocol.Heartbeat) and flight is not None:
                self.guard.heartbeat(flight, now)
            elif isinstance(message, protocol.RunOutput) and flight is not None:
                self._store_output(flight, message.text, now)
            elif isinstance(message, protocol.Ready):
                self.dispatcher.advice.log_plugins(message)
        self.recorder.record_many(finished)

    def _store_output(self, flight: InFlight, text: str, now: dt.datetime) -> None:
        """Append a piece of the run's output (bounded by the worker) to its ``run_output`` rows. Output is
        not worth an outcome: a database that cannot take it loses that piece, said once per run."""
        if flight.output_seq < 0:  # an earlier piece was lost: a gap would read as complete output
            return
        try:
            flight.output_seq = self.store.append_run_output(flight.run_id, flight.output_seq, [text], now)
        except Exception as exc:  # noqa: BLE001 - an outage or a refused text must not stop the loop
            log.warning("run %d of job %s: its output could not be stored (%s); the rest of it is dropped",
                        flight.run_id, flight.job_name, _short(exc), extra=log_ctx(flight))
            flight.output_seq = -1

    def _wake_sender(self) -> None:
        """Tell the notification sender (if running) that rows were just committed; otherwise it polls."""
        if self.notifier is not None:
            self.notifier.wake()

    # -- serve: signals and the outer loop ----------------------------------------------------------
    def serve(self, run_for_s: float | None = None) -> int:
        """Run until SIGTERM/SIGINT (or ``run_for_s`` seconds), then drain and return exit code 0; 1 if it
        never managed to register with the database (a read-only database, say: it ran nothing). Raises
        :class:`InputError` (``/proc``) in a PID namespace without its own ``/proc``, before starting anything."""
        _require_own_proc()
        rsock, wsock = socket.socketpair()
        for sock in (rsock, wsock):
            sock.setblocking(False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        # SIGHUP: a closed terminal or a lost SSH session when serve has a controlling terminal (drain and
        # stop, as SIGTERM: issue 12); a reload request when it has none (systemd, a daemon: issue 14)
        self._hangup_stops = has_controlling_terminal()
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        old_wakeup = signal.set_wakeup_fd(wsock.fileno())
        try:
            self._stop_at = time.monotonic() + run_for_s if run_for_s is not None else None
            self.dispatcher.sweep_previous_life = True  # runs left under this name by a dead process
            self.metrics.start_server()
            self.pool.start()
            self.notifier = Notifier(self.store, self.settings.notifications, self.settings.instance,
                                     on_delivery_failure=self.on_delivery_failure).start()

            def renewed() -> None:  # on the renewal thread: publish the validity, wake the loop to act on it
                self.pool.fence_at.value = self.liveness.valid_until  # busy workers enforce it themselves
                with contextlib.suppress(OSError):  # full (the loop is already due to wake) or closed
                    wsock.send(b"\0")

            self.renewer = Renewer(self.liveness, renewed).start()
            log.info("supervisor %s started: %d workers, lease timeout %.0f s, database %s",
                     self.settings.instance, self.pool.size, self.settings.lease_timeout_s,
                     redact_url(self.store.engine.url.render_as_string(hide_password=False)))
            log.info("worker isolation: %s", self.pool.containment())
            while not self.done:
                if self.cycle([rsock]):
                    _drain_socket(rsock)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.renewer is not None:
                self.renewer.stop()  # before the sockets close and before the clean stop of the lease
            rsock.close()
            wsock.close()
            self.reloader.close()
            self.pool.close()
            if self.notifier is not None:
                self.notifier.stop()
            self.liveness.stop()
            self.metrics.stop_server()
        if not self.liveness.registered:
            log.error("supervisor %s stopped without ever registering with the database (%s): it ran nothing",
                      self.settings.instance, self.liveness.trouble.reason or "no renewal was attempted")
            return 1
        log.info("supervisor %s stopped", self.settings.instance)
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """Count SIGTERM/SIGINT (only a flag: the loop acts on it; logging is not signal-safe). A signal
        arriving before the loop has acted on the first one counts once with it: `timeout` and
        process-group kills deliver one stop request twice, and a second signal means "kill at once"."""
        if self._signals and self.accepting:
            return
        self._signals += 1

    def _on_hangup(self, signum: int, frame: Any) -> None:
        """SIGHUP: with a controlling terminal, a stop request like SIGTERM; without one, a plugin reload
        (only a flag: the loop acts on it)."""
        if self._hangup_stops:
            self._on_signal(signum, frame)
        else:
            self._reload_signal = True

    def _act_on_stop_requests(self, now: dt.datetime, mono: float) -> None:
        """A first signal (or the end of ``run_for_s``) starts the shutdown; a second kills the runs. A
        SIGHUP meaning reload is handed to the reloader."""
        if self._reload_signal:
            self._reload_signal = False
            self.reloader.request("SIGHUP")
        if self._signals >= 2 and self.inflight:
            log.warning("second signal: killing %d in-flight run(s) now", len(self.inflight))
            self.guard.cancel_all(now, "interrupted by shutdown (second signal)")
        if self._signals or (self._stop_at is not None and mono >= self._stop_at):
            self.begin_shutdown(now)

    # -- shutdown -----------------------------------------------------------------------------------
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
            self.guard.cancel_all(now, "interrupted by shutdown")
        if past_deadline:
            self.recorder.give_up()
        if not self.inflight and not self.recorder.pending:
            self.done = True
            return now
        return self._wake(now, mono, self.drain_deadline)

    # -- manual runs ------------------------------------------------------------------------------
    def run_now(self, job: JobRow, *, ready_timeout_s: float) -> int | None:
        """``jobs run NAME``: run ``job`` once now through a worker and wait until it is recorded; see
        :func:`mjsched_isolated.supervisor.manual.run_now`. Returns the run id (None: a live run refused it).
        Raises :class:`InputError` (``/proc``) as :meth:`serve` does."""
        _require_own_proc()
        return manual.run_now(self, job, ready_timeout_s=ready_timeout_s)


def _require_own_proc() -> None:
    """Workers are judged and signalled by the pids read in ``/proc``: one of another PID namespace
    (``unshare -pf`` without ``--mount-proc``) would have them judge strangers
    (:func:`~mjsched_isolated.proctree.foreign_proc`)."""
    if (foreign_proc := proctree.foreign_proc()) is not None:
        raise InputError("/proc", foreign_proc)


def has_controlling_terminal() -> bool:
    """True if this process has a controlling terminal (opening ``/dev/tty`` works): then SIGHUP is the
    terminal's hang-up, else (systemd, a daemon, a container) the conventional "reload" request."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return False
    os.close(fd)
    return True


def _drain_socket(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
