"""This supervisor's liveness lease: its row in ``supervisors``, renewed on a short period.

"The lease says my supervisor is alive; the run deadline says this run may still go on" (issue 3): the
two are kept apart. Every job lease and run of a supervisor is live only while its row's
``lease_expires_at`` is in the future by the **database** clock, so one statement renews all of them.

Fencing: the lease is counted as valid locally only until ``FENCE_FRACTION`` of the TTL after the
*start* of the last successful renewal (monotonic clock). The database's expiry is at least a whole TTL
after that start, so a supervisor that cannot renew stops its own runs before anyone else may take them.
The renewal also measures the database clock's offset from the local one, so scheduling decisions use
database time even on a machine whose clock is wrong.

``serve`` renews from a thread of its own (:class:`Renewer`), so a slow poll (a database 0.6 s away, a
large backlog) can never starve the renewal and fence the supervisor's own runs (issue 12). The thread
only renews and publishes (``valid_until``, ``db_offset``, the workers' ``fence_at``); fencing and
cancelling stay in the loop, which acts on each new renewal at its next step. Manual runs and the tests'
driver renew inline (:meth:`Liveness.maintain` from the loop), with time passed in.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from mjsched_isolated._version import __version__
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.store import Store
from mjsched_isolated.store.supervisors import InstanceInUseError
from mjsched_isolated.supervisor.trouble import Trouble, is_read_only_error

log = logging.getLogger("mjsched.liveness")

FENCE_FRACTION = 0.8
RETRY_S = 1.0
DB_CLOCK_RESOLUTION = dt.timedelta(milliseconds=1)  # SQLite's strftime('%f') reads whole milliseconds


class Liveness:
    """``ttl_s``: lease length; ``renew_interval_s``: period of renewals. ``local_clock`` returns the local
    wall time (aware UTC); it is the outer loop's clock, injected so tests can skew it."""

    def __init__(self, store: Store, instance: str, ttl_s: float, renew_interval_s: float,
                 local_clock: Callable[[], dt.datetime], max_concurrent_jobs: int | None = None) -> None:
        self.store = store
        self.max_concurrent_jobs = max_concurrent_jobs  # written on the row at registration (status, dashboard)
        self.instance = instance
        self.ttl_s = ttl_s
        self.renew_interval_s = renew_interval_s
        self.local_clock = local_clock
        self.registered = False
        self.valid_until = float("-inf")  # monotonic
        self.next_renew = 0.0  # monotonic
        self.db_offset = dt.timedelta(0)  # database time minus local time, measured at each renewal
        self._last_renewed: float | None = None  # monotonic start of the last successful renewal
        self.failing_since: float | None = None
        # database time of the renewal that ended the latest lapse (the lease had passed its local validity:
        # busy workers' watchdogs killed their runs meanwhile); None: never lapsed
        self.last_lapse_end: dt.datetime | None = None
        self.trouble = Trouble(log, f"supervisor {instance}: lease renewal")  # logged once, then counted
        # called after each renewal attempt with None (success) or a one-line error (metrics, /healthz)
        self.on_renewal: Callable[[str | None], None] | None = None

    def valid(self, mono: float) -> bool:
        """May this supervisor still act on its leases (claim, run, record)?"""
        return mono < self.valid_until

    def lapsed_during(self, started_at: dt.datetime, mono: float) -> bool:
        """Did the lease pass its local validity (a freeze, a long cut-off) while a run that started at
        ``started_at`` (database time) was in flight, or has it now (``mono``)? Then a busy worker's
        watchdog has killed that run's tree (see :mod:`mjsched_isolated.worker.watchdog`)."""
        return not self.valid(mono) or (self.last_lapse_end is not None and started_at < self.last_lapse_end)

    def due(self, mono: float) -> bool:
        return mono >= self.next_renew

    def maintain(self, mono: float) -> bool:
        """Register or renew if due. True if a renewal succeeded in this call."""
        if not self.due(mono):
            return False
        started, local_before = time.monotonic(), self.local_clock()
        try:
            if self.registered:
                db_now = self.store.renew_supervisor(self.instance, self.ttl_s, hostname=socket.gethostname(),
                                                     pid=os.getpid())
                if db_now is None:
                    log.error("supervisor %s: its row was removed, stopped or taken by someone else; registering again "
                              "(its runs may have been abandoned meanwhile)", self.instance)
            else:
                db_now = None
            if db_now is None:
                db_now = self.store.register_supervisor(self.instance, socket.gethostname(), os.getpid(), self.ttl_s,
                                                        max_concurrent_jobs=self.max_concurrent_jobs,
                                                        version=__version__)
                self.registered = True
        except InstanceInUseError:
            if not self.registered:  # a duplicate name at start: refuse to serve (exit 2)
                raise
            reason = "its name was taken by another live supervisor"  # this one froze past its TTL: fence
            self._failed(reason, mono)
            return False
        except Exception as exc:  # noqa: BLE001 - the database may be down: keep trying, fence if too long
            reason = _short(exc)
            if is_read_only_error(exc):
                reason = f"the database refuses writes (read-only): {reason}"
            self._failed(reason, mono)
            return False
        if self.on_renewal is not None:
            self.on_renewal(None)
        elapsed = time.monotonic() - started
        self._measure_offset(db_now, local_before, elapsed)
        if self._last_renewed is not None and started - self._last_renewed > self.ttl_s:
            log.warning("supervisor %s: renewed its lease %.1f s after the previous renewal, longer than the "
                        "%g s TTL (was it frozen or cut off?): other supervisors may have abandoned its runs "
                        "meanwhile", self.instance, started - self._last_renewed, self.ttl_s)
        self._last_renewed = started
        if started >= self.valid_until > float("-inf"):  # set before valid_until: the loop reads both
            self.last_lapse_end = db_now
        self.valid_until = started + self.ttl_s * FENCE_FRACTION
        self.next_renew = started + self.renew_interval_s
        if self.failing_since is not None:
            log.warning("supervisor %s: lease renewed again after %.1f s (%d failed tries)", self.instance,
                        mono - self.failing_since, self.trouble.reset())
            self.failing_since = None
        return True

    def _failed(self, reason: str, mono: float) -> None:
        if self.on_renewal is not None:
            self.on_renewal(reason)
        if self.failing_since is None:
            self.failing_since = mono
        self.trouble.failed(reason, mono, f"; retrying every {RETRY_S:.0f} s, fencing in "
                                          f"{max(0.0, self.valid_until - mono):.1f} s")
        self.next_renew = mono + RETRY_S

    def _measure_offset(self, db_now: dt.datetime, local_before: dt.datetime, elapsed_s: float) -> None:
        """The database read ``db_now`` somewhere within the round trip, so the true offset lies in
        ``[db_now - local_after, db_now - local_before]`` (widened by ``DB_CLOCK_RESOLUTION``: SQLite's
        clock has millisecond steps). The estimate is the point of that interval nearest to the previous
        estimate, starting from 0: so a database on this machine's clock (a SQLite file) measures exactly
        0 however slow the round trip, instead of half the round trip, which made runs start up to 18 ms
        early (issue 11: a cron run must never start before its instant); a slow renewal (a lock wait, a
        stalled server) widens the interval and leaves a good estimate alone; a real step of either clock
        moves it at the next renewal, to within that renewal's round trip. The offset is thus never more
        than the round trip that measured it away from the smallest offset the measurement proves."""
        latest = db_now - local_before + DB_CLOCK_RESOLUTION  # the database read no earlier than local_before
        earliest = db_now - local_before - dt.timedelta(seconds=elapsed_s)
        self.db_offset = min(max(self.db_offset, earliest), latest)

    def stop(self) -> None:
        """End the lease now (clean shutdown), so other supervisors need not wait for it."""
        if not self.registered:
            return
        try:
            self.store.stop_supervisor(self.instance)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown: the lease expires anyway
            log.warning("supervisor %s: could not mark itself stopped (%s); its lease will expire", self.instance,
                        _short(exc))



class Renewer:
    """Renews ``liveness`` on a daemon thread whenever due (its own database connection from the engine's
    pool), so renewals never wait behind the loop's database work. ``on_renewed()`` is called on that
    thread after each successful renewal (publish ``fence_at``, wake the loop). :attr:`renewals` counts
    them: the loop compares it with what it saw to run its post-renewal checks (fences, cancels)."""

    def __init__(self, liveness: Liveness, on_renewed: Callable[[], None]) -> None:
        self.liveness = liveness
        self.on_renewed = on_renewed
        self.renewals = 0
        # set (and the thread ends) if the first registration found the name held by a live supervisor
        self.refused: InstanceInUseError | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mjsched-liveness", daemon=True)

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def poke(self) -> None:
        """Renew now (``liveness.next_renew`` was moved, e.g. after a clock jump)."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop renewing (before ``liveness.stop()``, so no renewal follows the clean stop)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            mono = time.monotonic()
            if self.liveness.due(mono):
                try:
                    renewed = self.liveness.maintain(mono)
                except InstanceInUseError as exc:  # the loop raises it: serve exits 2
                    self.refused = exc
                    self.on_renewed()
                    return
                except Exception:  # never let the renewal thread die: log and keep going
                    log.exception("supervisor %s: renewal thread error", self.liveness.instance)
                    renewed = False
                    self.liveness.next_renew = time.monotonic() + RETRY_S
                if renewed:
                    self.renewals += 1
                    self.on_renewed()
                continue
            self._wake.wait(max(0.0, self.liveness.next_renew - mono))
            self._wake.clear()
