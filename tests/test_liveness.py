"""The liveness lease's measurement of the database clock offset (a real SQLite store)."""

from __future__ import annotations

import datetime as dt
import time

from mjsched_isolated.store import Store
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.supervisor.liveness import Liveness


class SlowStore(Store):
    """A real store whose renewal answers ``delay_s`` after the database read its clock (a lock wait, a
    stalled server)."""

    delay_s = 0.0

    def renew_supervisor(self, instance: str, ttl_s: float):
        db_now = super().renew_supervisor(instance, ttl_s)
        time.sleep(self.delay_s)  # latency of the answer, not synchronisation
        return db_now


def _liveness(tmp_path, clock):
    store = SlowStore.open(f"sqlite:///{tmp_path / 'l.db'}")
    return store, Liveness(store, "host-1", ttl_s=30, renew_interval_s=0.0, local_clock=clock)


def test_a_slow_renewal_does_not_move_a_good_offset(tmp_path):
    store, lease = _liveness(tmp_path, utcnow)
    assert lease.maintain(time.monotonic())
    first = lease.db_offset
    assert abs(first) < dt.timedelta(seconds=0.1)  # SQLite's clock is this machine's
    store.delay_s = 0.6
    assert lease.maintain(time.monotonic())
    # The slow answer widens the interval to 0.6 s; a midpoint estimate would move by ~0.3 s. The estimate
    # may only be tightened by what the quick start of the measurement proves (a few ms under load).
    assert abs(lease.db_offset - first) < dt.timedelta(seconds=0.1)
    store.close()


def test_a_stepped_clock_moves_the_offset_at_the_next_renewal(tmp_path):
    skew = [dt.timedelta(0)]
    store, lease = _liveness(tmp_path, lambda: utcnow() + skew[0])
    assert lease.maintain(time.monotonic())
    skew[0] = dt.timedelta(seconds=90)  # the local clock is stepped 90 s ahead
    assert lease.maintain(time.monotonic())
    assert abs(lease.db_offset + dt.timedelta(seconds=90)) < dt.timedelta(seconds=0.1)
    store.close()


def test_a_renewal_after_more_than_a_ttl_says_runs_may_have_been_abandoned(tmp_path, caplog):
    store, lease = _liveness(tmp_path, utcnow)
    lease.ttl_s = 0.05
    assert lease.maintain(time.monotonic())
    store.delay_s = 0.1  # this renewal's answer comes late; the one after starts more than a TTL later
    assert lease.maintain(time.monotonic())
    store.delay_s = 0.0
    assert lease.maintain(time.monotonic())
    assert "longer than the 0.05 s TTL" in caplog.text
    store.close()
