"""The notification sender: daemon threads that deliver the durable outbox (``notifications`` table).

Off the poll loop: one thread per configured channel, with its own connections (from the store's engine),
so a slow or failing channel never delays dispatch, another channel, nor changes a recorded run. A row
whose channel is not configured on this supervisor is never claimed here: it waits, Pending, for a
supervisor that has that channel. Per due Pending row of its channel, oldest first:

1. claim it (:meth:`Store.claim_notification`: one conditional UPDATE judged by its row count; the claim
   is a lease until DB-now + ``claim_lease_s``, so several supervisors do not send one row at the same time, and a
   claim left by a dead sender expires and is taken again);
2. deliver it through its channel (every network call has the channel's ``timeout_s``);
3. mark it Sent, or Pending again after ``retry_backoff_s * 2**(attempts-1)`` (capped at
   ``retry_backoff_max_s``, plus up to 10 % jitter), or Failed with ``last_error`` after
   ``max_attempts`` attempts (or at once for a permanent error such as no recipients).

Rows are claimed one at a time, just before delivery, so stopping leaves every undelivered row Pending and
unclaimed (save the one in flight). A restarted supervisor picks them up. Delivery is at-least-once: a
sender killed between delivering and marking Sent, or a delivery that outlasts its claim, sends the notice
again, with the same id (webhook ``X-Mjsched-Delivery`` header and ``id`` field, email ``Message-ID``) so
the receiver can drop the duplicate. Peers: Celery's retry with exponential backoff and jitter; the
transactional-outbox pattern; GitHub's webhook delivery ids.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from mjsched_isolated.config import Notifications
from mjsched_isolated.errors import first_line
from mjsched_isolated.store import Store
from mjsched_isolated.store.records import NotificationRow
from mjsched_isolated.supervisor import channels as channels_mod
from mjsched_isolated.supervisor.channels import Channel, DeliveryError

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
    A row whose channel is not configured here is never claimed: it is left to a supervisor that has it.
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
        self._wakes = {name: threading.Event() for name in self.channels}
        self._threads: list[threading.Thread] = []
        self.delivered = 0

    def start(self) -> Notifier:
        """One daemon thread per configured channel (none when no channel is configured)."""
        if not self._threads:
            for name in self.channels:
                thread = threading.Thread(target=self._loop, args=(name,), name=f"mjsched-notifier-{name}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
            if self._threads:
                log.info("notification sender started: channels %s", ", ".join(self.channels))
        return self

    def wake(self) -> None:
        """Look for due rows now (called after a notice was written)."""
        for event in self._wakes.values():
            event.set()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the deliveries in flight (if any), waiting at most ``timeout_s`` in all. Undelivered
        rows stay Pending. True if every thread ended in time (they are daemons either way)."""
        self._stop.set()
        self.wake()
        give_up = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, give_up - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _loop(self, channel: str) -> None:
        wake = self._wakes[channel]
        while not self._stop.is_set():
            try:
                busy = self.run_once(channel)
            except Exception as exc:  # noqa: BLE001 - a database outage: retried at the next poll
                log.warning("notification sender (%s): %s; retrying in %.1f s", channel, first_line(exc),
                            self.poll_interval_s)
                busy = False
            if not busy:
                wake.wait(self.poll_interval_s)
                wake.clear()

    def run_once(self, channel: str | None = None) -> bool:
        """Deliver what is due now on ``channel`` (every configured channel in turn if None), up to
        ``batch_size`` rows each. True if it claimed at least one row."""
        claimed = False
        for name in [channel] if channel is not None else list(self.channels):
            for notification_id in self.store.due_notification_ids(self.batch_size, channel=name):
                if self._stop.is_set():
                    return claimed
                row = self.store.claim_notification(notification_id, self.instance, self.claim_lease_s)
                if row is None:
                    continue  # another sender won it, or it is no longer due
                claimed = True
                self.deliver(row)
        return claimed

    def deliver(self, row: NotificationRow) -> None:
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

    def _failed(self, row: NotificationRow, exc: Exception) -> None:
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
            except Exception:
                log.debug("on_delivery_failure callback raised", exc_info=True)
