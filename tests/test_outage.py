"""Database outages and lost leases, with real processes and real servers.

* PostgreSQL is restarted under two supervisors with runs in flight: nothing crashes, failures are logged,
  results that could not be written are written afterwards, and no occurrence runs twice.
* A supervisor cut off from the database (a TCP proxy in this process, between it and PostgreSQL) kills
  its own run at 0.8 x TTL, before another supervisor may legally take the job; when it reconnects it does
  not overwrite the other supervisor's verdict.
* A job lease stolen under a live run (in process, SQLite) fences the run at the next renewal.

Every wait is bounded and waits on something (a log line, a process sentinel, a database row); nothing
sleeps to synchronise.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter

import psutil
import pytest
import sqlalchemy as sa
from conftest import add_job, isolated_database, serial
from procs import Serve
from waiting import wait_gone, wait_until

from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import jobs as jobs_table
from mjsched_isolated.supervisor.clock import utcnow

UTC = dt.UTC
PG_VERSION = min(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else "15"
PG_CLUSTER = ["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, "main"]
FAILURE = r"poll failed|lease renewal failed|not recorded yet"

pytestmark = serial  # fencing deadlines of a few seconds: one at a time (conftest)


# -- helpers -------------------------------------------------------------------------------------------
def _pg_ready() -> bool:
    return subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", "5432"], capture_output=True,
                          timeout=10, check=False).returncode == 0


def _ensure_pg_up(timeout_s: float = 45.0) -> None:
    """Bring PostgreSQL back if a test left it down (other tests need it); bounded."""
    if not _pg_ready():
        subprocess.run([*PG_CLUSTER, "start"], capture_output=True, timeout=60, check=False)  # raced by another test
        wait_until(_pg_ready, timeout_s, "PostgreSQL accepting connections again", interval_s=0.2)


def _log_time(line: str) -> dt.datetime:
    """The aware timestamp ``logging`` put at the start of a supervisor log line (local time)."""
    match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
    assert match is not None, line
    stamp = match.group(1)
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").astimezone(UTC)


def _no_duplicate_occurrences(store: Store) -> None:
    scheduled = [(r["job_id"], r["scheduled_at"]) for r in store.list_runs(limit=100_000) if r["scheduled_at"]]
    assert [k for k, n in Counter(scheduled).items() if n > 1] == []


def _instance(serve: Serve) -> str:
    """The serve's instance id (``<hostname>-<pid>-<random>``: unique per start), from its start line."""
    return serve.wait_for(r"supervisor (\S+) started:", seen=True).group(1)


def _stop_gracefully(sups: list[Serve], timeout_s: float = 25.0) -> list[int]:
    for s in sups:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    return [s.proc.wait(timeout_s) for s in sups]


class CuttableProxy:
    """A TCP proxy (threads, 127.0.0.1, port 0) to ``upstream``. ``cut()`` closes every proxied connection
    and refuses new ones (accepted, then closed at once) until ``restore()``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.is_cut = False
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.is_cut:
                self.refused += 1
                _hard_close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _hard_close(client)
                continue
            with self.lock:
                if self.is_cut:
                    _hard_close(client)
                    _hard_close(server)
                    continue
                self.open |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open.discard(src)
                self.open.discard(dst)
            _hard_close(src)
            _hard_close(dst)

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            doomed, self.open = self.open, set()
        for sock in doomed:
            _hard_close(sock)

    def restore(self) -> None:
        self.is_cut = False

    def close(self) -> None:
        self.cut()
        _hard_close(self.listener)


def _hard_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    except OSError:
        pass
    sock.close()


# -- 1. PostgreSQL restarted under two supervisors -------------------------------------------------------
@pytest.mark.alone  # the shared PostgreSQL server goes down: no other test may run meanwhile
@pytest.mark.timeout(90)
def test_postgres_restart_while_runs_are_in_flight(tmp_path):
    # a lease long enough that a server stop + start, slow on a loaded machine (5.5 s seen), stays below the
    # fencing point (0.8 x TTL - one renewal): this test waits on no TTL, so the length costs nothing
    ttl_s, renew_s = 15.0, 2.0
    try:
        with isolated_database("postgresql", tmp_path) as url:
            store = Store.open(url)
            try:
                _restart_under_load(store, url, ttl_s, renew_s)
            finally:
                store.close()
    finally:
        _ensure_pg_up()


def _restart_under_load(store: Store, url: str, ttl_s: float, renew_s: float) -> None:
    slow = json.dumps({"seconds": 2.0})
    for i in range(4):
        add_job(store, f"sleep-{i}", "sleep", "*/3 * * * * *", configuration=slow)
    for i in range(8):
        add_job(store, f"ok-{i:02d}", "ok", "* * * * * *")
    args = ["--max-concurrent-jobs", "4", "--lease-ttl-s", str(ttl_s), "--lease-renew-interval-s", str(renew_s),
            "--shutdown-timeout-s", "10"]
    sups = [Serve(url, *args) for _ in range(2)]
    try:
        for s in sups:
            s.wait_for(r"run \d+ started: job ", timeout_s=30)

        sleep_ids = {store.get_job(f"sleep-{i}")["id"] for i in range(4)}

        def sleeping_runs():  # a */3 occurrence of the 2 s jobs has just started (not one about to end)
            fresh = utcnow() - dt.timedelta(seconds=0.5)
            live = [r for r in store.running_runs() if r["job_id"] in sleep_ids and r["started_at"] > fresh]
            return live if len(live) >= 2 else None

        fresh_sleepers = wait_until(sleeping_runs, 15, "sleep runs in flight", interval_s=0.05)
        in_flight = {r["id"]: r for r in store.running_runs()}
        # the most recently started 2 s run: it is sure to end while the server is down (an older one in
        # in_flight may end, and be recorded, before the server stops)
        sleeper = max(fresh_sleepers, key=lambda r: r["started_at"])
        keeper = next(s for s in sups if _instance(s) == sleeper["executed_by_instance"])
        down_at = utcnow()
        out_started = time.monotonic()
        subprocess.run([*PG_CLUSTER, "stop"], check=True, capture_output=True, timeout=30)
        try:
            # keep the server down until both supervisors have noticed (each polls at least every second)
            # and a 2 s run has ended while it was down, so that its result must wait to be recorded
            failures = [s.wait_for(FAILURE, timeout_s=5).string for s in sups]
            unrecorded = keeper.wait_for(rf"run {sleeper['id']} of job sleep-\d: Completed not recorded yet",
                                         timeout_s=3, seen=True).string
        finally:
            subprocess.run([*PG_CLUSTER, "start"], check=True, capture_output=True, timeout=30)
        with store.engine.connect() as conn:  # the outage ended when the new server started
            up_at = conn.execute(sa.text("SELECT pg_postmaster_start_time()")).scalar_one().astimezone(UTC)
        outage_s = time.monotonic() - out_started
        assert outage_s < 0.8 * ttl_s - renew_s, outage_s  # short enough that nobody may fence

        # keep going (~6 s): every supervisor renews again and two more */3 occurrences of the 2 s jobs run
        instances = {_instance(s) for s in sups}

        def renewed_and_worked():
            beats = {r["instance"]: r["heartbeat_at"] for r in store.list_supervisors()}
            done = {r["scheduled_at"] for r in store.list_runs(status="Completed", limit=1000)
                    if r["started_at"] > up_at and r["job_id"] in sleep_ids}
            return all(beats.get(i) and beats[i] > up_at for i in instances) and len(done) >= 2

        wait_until(renewed_and_worked, 30, "renewals and sleep runs after the outage", interval_s=0.2)
        for s in sups:  # each one records runs again
            s.wait_for(r"run \d+ finished: job \S+ Completed", timeout_s=10)
        assert _stop_gracefully(sups) == [0, 0], "".join(sups[0].output[-30:] + sups[1].output[-30:])
    finally:
        for s in sups:
            s.stop()

    logs = ["".join(s.output) for s in sups]
    for log, failure in zip(logs, failures):
        assert re.search(FAILURE, log), failure
        assert "fenced" not in log
        # recovery: something was recorded after the first failure
        assert re.search(r"run \d+ finished: job \S+ Completed", log[log.index(failure):])
    runs = store.list_runs(limit=100_000)
    _no_duplicate_occurrences(store)
    statuses = Counter(r["status"] for r in runs)
    assert statuses["Running"] == 0, statuses
    assert set(statuses) <= {"Completed", "Cancelled"}, [(r["id"], r["status"], r["error_message"])
                                                         for r in runs if r["status"] not in ("Completed", "Cancelled")]
    assert not [r for r in runs if (r["error_message"] or "").startswith("fenced")]
    by_id = {r["id"]: r for r in runs}
    for run_id in in_flight:
        assert by_id[run_id]["status"] == "Completed", by_id[run_id]
    # the result that ended during the outage was kept and written once the server was back (the log
    # below), and its completed_at is when it ended, inside the outage, not when it was written (issue 12)
    ended = by_id[sleeper["id"]]
    assert down_at < ended["completed_at"] < up_at, (down_at, ended["completed_at"], up_at)
    assert abs((ended["completed_at"] - ended["started_at"]).total_seconds() * 1000 - ended["duration_ms"]) < 5
    keeper_log = "".join(keeper.output)
    after_outage = keeper_log[keeper_log.index(unrecorded):]
    assert re.search(rf"run {sleeper['id']} finished: job sleep-\d Completed", after_outage)
    pending_recorded = sum(log.count("not recorded yet") for log in logs)
    down_s = (up_at - down_at).total_seconds()
    print(f"postgres outage {outage_s:.2f} s (server down {down_s:.2f} s); {len(in_flight)} run(s) in flight, "
          f"{pending_recorded} result(s) kept pending and written later; "
          f"{len(runs)} runs, {dict(statuses)}")
    for failure in failures:
        print("  first failure logged:", failure.strip()[:160])


# -- 2. a supervisor partitioned from the database ----------------------------------------------------------
@pytest.mark.timeout(90)
def test_partitioned_supervisor_fences_its_runs_and_another_takes_over(tmp_path):
    # the shortest lease a loaded machine still renews in time (as in test_multi), a 0.5 s poll, one worker each
    ttl_s, renew_s = 3.0, 0.5
    lease_args = ["--lease-ttl-s", str(ttl_s), "--lease-renew-interval-s", str(renew_s), "--rescan-interval-s", "0.5",
                  "--max-concurrent-jobs", "1", "--shutdown-timeout-s", "2"]
    with isolated_database("postgresql", tmp_path) as url:
        parsed = sa.engine.make_url(url)
        proxy = CuttableProxy((parsed.host or "127.0.0.1", parsed.port or 5432))
        url_a = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        store = Store.open(url)
        sups: list[Serve] = []
        try:
            add_job(store, "long", "hang", "* * * * * *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
            a = Serve(url_a, *lease_args)
            sups.append(a)
            started = a.wait_for(r"run (\d+) started: job long .* on worker (\d+)", timeout_s=30)
            run_id, worker = int(started.group(1)), int(started.group(2))
            grandchild = int(a.wait_for(rf"hang: run {run_id} grandchild (\d+)", timeout_s=10, seen=True).group(1))
            b = Serve(url, *lease_args)
            sups.append(b)
            b.wait_ready()
            assert store.get_run(run_id)["status"] == "Running"

            proxy.cut()
            cut_at, cut_wall = time.monotonic(), utcnow()
            fenced = a.wait_for(rf"run {run_id} of job long fenced: this supervisor could not renew",
                                timeout_s=0.8 * ttl_s + 2.0)
            fenced_s = time.monotonic() - cut_at
            # the whole tree of A's run is gone; when that happened relative to A's database lease is checked last
            assert wait_gone([worker, grandchild], timeout_s=2.0) == []
            a_row = next(r for r in store.list_supervisors() if r["instance"] == _instance(a))
            expires_at = a_row["lease_expires_at"]
            a.wait_for(rf"run {run_id} of job long: Failed not recorded yet", timeout_s=5, seen=True)

            abandoned = b.wait_for(rf"run {run_id} of job \S+ marked Failed: abandoned", timeout_s=ttl_s + 5)
            abandoned_s = time.monotonic() - cut_at
            b.wait_for(r"run \d+ started: job long", timeout_s=10, seen=True)
            fenced_t, abandoned_t = _log_time(fenced.string), _log_time(abandoned.string)
            assert abandoned_t >= expires_at  # B waited for A's lease (database clock = this machine's)
            margin_s = (expires_at - fenced_t).total_seconds()
            print(f"partition: cut -> A fenced {fenced_s:.2f} s, cut -> B abandoned {abandoned_s:.2f} s; "
                  f"A fenced {margin_s:.3f} s before its lease expired in the database "
                  f"(ttl {ttl_s} s, fence at {0.8 * ttl_s:g} s after the last renewal)")
            assert fenced_t < abandoned_t  # A killed its run before B judged it
            assert (expires_at - cut_wall).total_seconds() <= ttl_s + 0.1  # A did not renew after the cut

            proxy.restore()
            a.wait_for(r"lease renewed again after", timeout_s=5, seen=True)
            a.wait_for(rf"run {run_id} of job long: result Failed not recorded: its run row is no longer Running",
                       timeout_s=5, seen=True)
            run = store.get_run(run_id)
            assert run["status"] == "Failed" and run["error_message"].startswith("abandoned"), run
            assert _instance(a) in run["error_message"]
            later = [r for r in store.list_runs(job_name="long") if r["id"] != run_id]
            assert later and all(r["executed_by_instance"] == _instance(b) for r in later)

            # A lives on and claims runs again
            assert a.proc.poll() is None
            for i in range(4):
                add_job(store, f"tick-{i}", "ok", "* * * * * *")
            a.wait_for(r"run \d+ finished: job tick-\d Completed", timeout_s=15)
            assert _stop_gracefully(sups) == [0, 0]
            _no_duplicate_occurrences(store)
            assert not [r for r in store.list_runs(limit=10_000) if r["status"] == "Running"]
            assert "fenced" not in store.get_run(run_id)["error_message"]
            # Last, the timing guarantee itself: A fences FENCE_FRACTION (0.8) of the TTL after its last
            # renewal, i.e. 0.2 x TTL before its lease expires in the database, not just in time by luck.
            assert fenced_t < expires_at, f"A fenced {-margin_s:.3f} s after its lease had expired"
            assert margin_s >= 0.2 * ttl_s - 0.3, (
                f"A fenced only {margin_s:.3f} s before its database lease expired (expected >= "
                f"{0.2 * ttl_s - 0.3:.1f} s): the fence came {0.2 * ttl_s - margin_s:.2f} s after 0.8 x TTL")
            assert fenced_s <= 0.8 * ttl_s + 0.5, fenced_s
        finally:
            for s in sups:
                s.stop()
            proxy.close()
            store.close()


# -- 3. a stolen job lease, in process ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_stolen_lease_is_fenced_in_process(store, driver_factory, tmp_path):
    d = driver_factory(lease_ttl_s=3.0, lease_renew_interval_s=0.5)
    add_job(store, "hang1", "hang", "0 0 1 1 *", configuration=json.dumps({"marker_dir": str(tmp_path)}))
    d.until(lambda: list(tmp_path.glob("hang1.*.started")), 20)  # written after the grandchild's file
    grandchild = int(next(tmp_path.glob("hang1.*.grandchild")).read_text())
    child = int(next(tmp_path.glob("hang1.*.started")).read_text())
    (run,) = store.list_runs(job_name="hang1")
    assert run["status"] == "Running" and psutil.pid_exists(grandchild)

    store.register_supervisor("thief-1", "elsewhere", 1, 60.0)  # a live supervisor, as far as the database knows
    with store.engine.begin() as conn:
        stolen = conn.execute(jobs_table.update().where(jobs_table.c.name == "hang1").values(
            lock_token="stolen", locked_by_instance="thief-1")).rowcount
    assert stolen == 1
    d.until(lambda: store.get_run(run["id"])["status"] != "Running", 5)  # one renewal (0.5 s) is enough

    assert wait_gone([child, grandchild], timeout_s=2.0) == []
    after = store.get_run(run["id"])
    assert after["status"] == "Failed" and after["error_message"].startswith("fenced"), after
    assert "taken over" in after["error_message"]
    job = store.get_job("hang1")
    assert (job["lock_token"], job["locked_by_instance"]) == ("stolen", "thief-1")
    assert d.supervisor.inflight == {} and d.supervisor.pending == []
    assert job["failure_count"] == 1
