"""The liveness lease: its measurement of the database clock offset (a real SQLite store), and the
supervisor's identity."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import FIXTURE_PLUGINS, add_job
from fakes import FakePool
from procs import Serve
from waiting import LogLines

from mjsched_isolated.config import Settings
from mjsched_isolated.store import Store
from mjsched_isolated.supervisor import Supervisor, utcnow
from mjsched_isolated.supervisor.liveness import Liveness


class SlowStore(Store):
    """A real store whose renewal answers ``delay_s`` after the database read its clock (a lock wait, a
    stalled server)."""

    delay_s = 0.0

    def renew_supervisor(self, instance: str, ttl_s: float, **owner):
        db_now = super().renew_supervisor(instance, ttl_s, **owner)
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
    started = time.monotonic()
    assert lease.maintain(time.monotonic())
    # the offset moves to the nearest value the renewal proves: within its round trip (and SQLite's 1 ms)
    round_trip = dt.timedelta(seconds=time.monotonic() - started) + dt.timedelta(milliseconds=1)
    assert abs(lease.db_offset + dt.timedelta(seconds=90)) <= round_trip
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


def test_a_restart_with_the_same_hostname_and_pid_recovers_the_crashed_run(mem_store, fake_factory):
    """A container's entrypoint is PID 1 at every start and its hostname survives a restart. Two
    supervisors made in this one process have the same hostname and pid, as the two lives of such a
    container do: the first is "SIGKILLed" (it stops renewing and says nothing), the second starts. The
    crashed run must be recorded Failed within the TTL plus a poll, not kept "live" under a shared name."""
    store = mem_store
    timing = {"lease_ttl_s": 1.0, "lease_renew_interval_s": 0.2, "rescan_interval_s": 0.2}
    first = fake_factory(**timing)
    first.pool.hold()
    add_job(store, "long", "ok", "0 0 1 1 *")
    first.until(lambda: bool(store.running_runs()))
    (run,) = store.running_runs()

    second = fake_factory(**timing)  # the first is never cycled again: its lease lapses
    assert second.settings.instance != first.settings.instance
    second.until(lambda: store.get_run(run["id"])["status"] != "Running", 10)
    recorded = store.get_run(run["id"])
    assert recorded["status"] == "Failed" and "abandoned" in recorded["error_message"]
    assert first.settings.instance in recorded["error_message"]
    rows = {r["instance"]: r for r in store.list_supervisors()}
    assert {(rows[d.settings.instance]["hostname"], rows[d.settings.instance]["pid"]) for d in (first, second)} == {
        (socket.gethostname(), os.getpid())}  # hostname and pid kept, as labels


class SlowPollStore(Store):
    """A real store whose every rescan takes ``delay_s`` (a database far away, a large backlog)."""

    delay_s = 0.0

    def abandon_orphaned_runs(self, *args, **kwargs):
        time.sleep(self.delay_s)  # latency of the poll's database work, not synchronisation
        return super().abandon_orphaned_runs(*args, **kwargs)


def test_a_slow_poll_does_not_starve_the_renewal_under_serve(tmp_path, caplog):
    """Each rescan takes 2 s, longer than the 1.5 s TTL: renewed from the loop between polls, the lease
    would lapse at every poll (another supervisor may then abandon the run, and a real worker's watchdog
    fences itself at 0.8 x TTL). Under serve the renewal thread renews every 0.3 s whatever the loop is
    doing: no gap longer than the TTL, and the held run lives until the shutdown cancels it."""
    url = f"sqlite:///{tmp_path / 'slow.db'}"
    store = SlowPollStore.open(url)
    add_job(store, "long", "ok", "0 0 1 1 *")
    settings = Settings(database_url=url, plugins_dir=FIXTURE_PLUGINS, max_concurrent_jobs=1, lease_ttl_s=1.5,
                        lease_renew_interval_s=0.3, rescan_interval_s=0.2, shutdown_timeout_s=0)
    pool = FakePool(1, FIXTURE_PLUGINS)
    pool.hold()
    sup = Supervisor(settings, store, pool)
    store.delay_s = 2.0
    try:
        assert sup.serve(run_for_s=4.0) == 0
        (run,) = store.list_runs(job_name="long")
        assert run["status"] == "Cancelled" and "shutdown" in run["error_message"], run["error_message"]
        assert "longer than the 1.5 s TTL" not in caplog.text
        assert sup.renewer is not None and sup.renewer.renewals >= 6
    finally:
        store.close()


def _unshare_works() -> bool:
    try:
        probe = subprocess.run(["unshare", "-pf", "--kill-child", "--mount-proc", "true"], capture_output=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


RECOVERY_SLACK_S = 1.5


class Pid1Serve(Serve):
    """``serve`` as PID 1 of a new PID namespace (``unshare -pf``), as a container's entrypoint: its pid is
    1 at every start. SIGKILLing the ``unshare`` process kills that PID 1, and with it the namespace. With
    the namespace's own ``/proc``, as a container has: under the host's, a worker's watchdog read the host
    process that has the worker's pid, found a parent other than PID 1 and killed the worker 0.1 s after
    it started (a worker killed while importing ``behaviours.py`` cost the job type ``hang``)."""

    def __init__(self, db_url: str, *args: str) -> None:
        cmd = ["unshare", "-pf", "--kill-child=SIGKILL", "--mount-proc", sys.executable, "-m", "mjsched_isolated",
               "serve", "--db", db_url, "--plugins", FIXTURE_PLUGINS, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.log_lines = LogLines(self.proc.stdout)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -pf --mount-proc (a new PID namespace, root)")
def test_a_container_pid_1_sigkilled_and_restarted_has_its_crashed_run_failed_within_ttl_plus_a_poll(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    ttl_s, poll_s = 3.0, 0.5
    args = ["--lease-ttl-s", str(ttl_s), "--lease-renew-interval-s", "0.5", "--rescan-interval-s", str(poll_s),
            "--max-concurrent-jobs", "1"]
    with Store.open(url) as store:
        add_job(store, "long", "hang", "0 0 1 1 *")
        first = Pid1Serve(url, *args)
        second = None
        try:
            run_id = int(first.wait_for(r"run (\d+) started: job long").group(1))
            os.kill(first.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            first.proc.wait(10)
            second = Pid1Serve(url, *args)
            second.wait_for(rf"run {run_id} of job long marked Failed: abandoned", ttl_s + 15)
            recovered_s = time.monotonic() - killed_at
            print(f"PID 1 restarted: crashed run recorded Failed {recovered_s:.2f} s after the SIGKILL (ttl {ttl_s} s)")
            # issue 12: within the TTL plus one poll of the crash, as with a new pid (the restart's own start-up,
            # ~1.5 s, runs inside the TTL); slack for a loaded machine
            assert recovered_s < ttl_s + poll_s + RECOVERY_SLACK_S, recovered_s
            rows = store.list_supervisors()
            assert len(rows) == 2 and {(r["hostname"], r["pid"]) for r in rows} == {(socket.gethostname(), 1)}
            run = store.get_run(run_id)
            assert run["status"] == "Failed" and run["executed_by_instance"] in run["error_message"]
            # its workers live (none killed from outside, so every job type stays available)
            trouble = [line for line in second.log_lines.output if "exited while idle" in line or "ended the worker"
                       in line or "not available on this supervisor" in line]
            assert trouble == [], trouble
        finally:
            for s in (first, second):
                if s is not None:
                    s.stop()


def test_serve_under_a_crashed_supervisors_fixed_name_fails_the_runs_it_left(tmp_path):
    """A crashed ``serve --instance web-1`` restarted under the same name (once the dead one's lease
    expired): the new row kept the dead process's Running run alive forever (abandonment judged the name
    only), its job lease renewed with the new supervisor's. The first sweep of serve fails such runs."""
    url = f"sqlite:///{tmp_path / 'named.db'}"
    store = Store.open(url)
    try:
        job = add_job(store, "long", "ok", "0 0 1 1 *", next_run_at=utcnow())
        store.register_supervisor("web-1", "gone-host", 4242, 0.2)  # the crashed life: lease ends at once
        now = utcnow()
        claim = store.claim(job, now=now, next_run_at=now + dt.timedelta(days=365), instance="web-1",
                            lease_s=600.0, deadline_at=now + dt.timedelta(minutes=5), scheduled_at=job["next_run_at"])
        assert claim is not None
        deadline = time.monotonic() + 10
        while store.instance_holder("web-1", "here", 1) is not None:  # the dead life's lease runs out
            assert time.monotonic() < deadline, "the crashed supervisor's lease never expired"
            time.sleep(0.05)  # polling the database for a lease expiry, bounded
        settings = Settings(database_url=url, plugins_dir=FIXTURE_PLUGINS, max_concurrent_jobs=1, instance="web-1",
                            lease_ttl_s=5.0, lease_renew_interval_s=1.0, rescan_interval_s=0.2, shutdown_timeout_s=0)
        assert Supervisor(settings, store, FakePool(1, FIXTURE_PLUGINS)).serve(run_for_s=0.5) == 0
        run = store.get_run(claim.run_id)
        assert run["status"] == "Failed" and "web-1" in run["error_message"], run
        assert store.get_job("long")["lock_token"] is None
    finally:
        store.close()
