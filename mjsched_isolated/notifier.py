"""The notification sender: a daemon thread that delivers the durable outbox (``notifications`` table).

Off the poll loop: it has its own connections (from the store's engine) and its own thread, so a slow or
failing channel never delays dispatch nor changes a recorded run. Per due Pending row, oldest first:

1. claim it (:meth:`Store.claim_notification`: one conditional UPDATE judged by its row count; the claim
   is a lease until DB-now + ``claim_lease_s``, so several supervisors never send one row twice, and a
   claim left by a dead sender expires and is taken again);
2. deliver it through its channel (every network call has the channel's ``timeout_s``);
3. mark it Sent, or Pending again after ``retry_backoff_s * 2**(attempts-1)`` (capped at
   ``retry_backoff_max_s``, plus up to 10 % jitter), or Failed with ``last_error`` after
   ``max_attempts`` attempts (or at once for a permanent error such as no recipients).

Rows are claimed one at a time, just before delivery, so stopping leaves every undelivered row Pending and
unclaimed (save the one in flight). A restarted supervisor picks them up. Peers: Celery's retry with
exponential backoff and jitter; the transactional-outbox pattern.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable

from . import channels as channels_mod
from .channels import Channel, DeliveryError
from .config import Notifications
from .errors import first_line
from .store import Store

log = logging.getLogger("mjsched.notifier")


def backoff_s(attempts: int, base_s: float, max_s: float, jitter: float = 0.1,
              rand: Callable[[], float] = random.random) -> float:
    """Delay before attempt ``attempts + 1``: ``base_s * 2**(attempts-1)`` capped at ``max_s``, times
    ``1 + jitter * rand()``."""
    delay = min(max_s, base_s * 2 ** max(0, min(attempts - 1, 60)))
    return delay * (1.0 + jitter * rand())


class Notifier:
    """Delivers Pending notifications of ``store``'s database in a daemon thread.

    ``instance``: this sender's name in ``claimed_by``. ``poll_interval_s``: how often it looks for due
    rows when not woken (:meth:`wake` is called after a notice is written). ``on_delivery_failure(channel)``:
    called after every failed delivery attempt (e.g. to count it); its exceptions are logged and ignored.
    A row whose channel is not configured here is left to a supervisor that has it.
    """

    def __init__(self, store: Store, config: Notifications, instance: str, *, poll_interval_s: float = 1.0,
                 batch_size: int = 20, on_delivery_failure: Callable[[str], None] | None = None,
                 channels: dict[str, Channel] | None = None) -> None:
        self.store = Store(store.engine)  # same engine, its own connections from the pool
        self.config = config
        self.instance = instance
        self.poll_interval_s = poll_interval_s
        self.batch_size = batch_size
        self.on_delivery_failure = on_delivery_failure
        self.channels = channels if channels is not None else channels_mod.build(config)
        # a claim must outlive a delivery: SMTP makes a few round trips, each bounded by timeout_s
        self.claim_lease_s = 30.0 + 6 * max([c.timeout_s for c in self.channels.values()] or [0.0])
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0

    def start(self) -> "Notifier":
        if self.channels and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mjsched-notifier", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """Look for due rows now (called after a notice was written)."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the delivery in flight (if any), waiting at most ``timeout_s``. Undelivered rows stay
        Pending. True if the thread ended in time (it is a daemon either way)."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        log.info("notification sender started: channels %s", ", ".join(self.channels))
        while not self._stop.is_set():
            try:
                busy = self.run_once()
            except Exception as exc:  # noqa: BLE001 - a database outage: retried at the next poll
                log.warning("notification sender: %s; retrying in %.1f s", first_line(exc), self.poll_interval_s)
                busy = False
            if not busy:
                self._wake.wait(self.poll_interval_s)
                self._wake.clear()

    def run_once(self) -> bool:
        """Deliver what is due now (up to ``batch_size`` rows). True if it claimed at least one row."""
        claimed = False
        for notification_id in self.store.due_notification_ids(self.batch_size):
            if self._stop.is_set():
                break
            row = self.store.claim_notification(notification_id, self.instance, self.claim_lease_s)
            if row is None:
                continue  # another sender won it, or it is no longer due
            claimed = True
            self.deliver(row)
        return claimed

    def deliver(self, row: dict) -> None:
        """Deliver one claimed row and record the outcome."""
        channel = self.channels.get(row["channel"])
        try:
            if channel is None:
                raise DeliveryError(f"channel {row['channel']!r} is not configured on {self.instance}")
            channel.deliver(row)
        except Exception as exc:  # noqa: BLE001 - a channel bug is a failed delivery, never a crash
            self._failed(row, exc)
            return
        if self.store.notification_sent(row["id"], self.instance):
            self.delivered += 1
            log.debug("notification %d sent via %s", row["id"], row["channel"])
        else:
            log.warning("notification %d delivered via %s after its claim expired", row["id"], row["channel"])

    def _failed(self, row: dict, exc: Exception) -> None:
        if isinstance(exc, DeliveryError):
            error, permanent = str(exc), exc.permanent
        else:  # unexpected: the type only, since its text could carry anything
            error, permanent = f"{row['channel']} channel raised {type(exc).__name__}", False
        attempts = row["attempts"]
        give_up = permanent or attempts >= self.config.max_attempts
        retry_in_s = None if give_up else backoff_s(attempts, self.config.retry_backoff_s,
                                                   self.config.retry_backoff_max_s)
        self.store.notification_attempt_failed(row["id"], self.instance, error, retry_in_s)
        if give_up:
            log.error("notification %d (%s, job %s) via %s failed for good after %d attempt(s): %s", row["id"],
                      row["event"], row["job_name"], row["channel"], attempts, error)
        else:
            log.warning("notification %d via %s failed (attempt %d of %d): %s; retrying in %.1f s", row["id"],
                        row["channel"], attempts, self.config.max_attempts, error, retry_in_s)
        if self.on_delivery_failure is not None:
            try:
                self.on_delivery_failure(row["channel"])
            except Exception:  # noqa: BLE001
                log.debug("on_delivery_failure callback raised", exc_info=True)
