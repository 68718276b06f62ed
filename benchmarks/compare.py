"""Side by side, counted the same way: this engine against APScheduler 3.x on one workload, alternating.

    python benchmarks/compare.py --reps 3                       # SQLite and PostgreSQL, cap 10, saturate.toml
    python benchmarks/compare.py --reps 3 --caps 5,10 --backends sqlite --window-s 10
    python benchmarks/compare.py --fleet 1,2,3 --reps 1         # fleet scaling on PostgreSQL (engine only)

How each measurement is made, the same for both engines:

* **Same work.** The workload file (default ``saturate.toml``: 1000 jobs every second, 1 ms each) gives both
  the same jobs with the same configuration: the engine's ``bench`` plugin (``plugins/work.py``) and
  APScheduler's ``aps_jobs.bench_job`` do the same thing and both record, themselves, the instant their code
  began. Same pool size (``--max-concurrent-jobs`` = ``ProcessPoolExecutor(cap)``), same database (a fresh
  SQLite file in WAL mode with ``synchronous=NORMAL`` for both - the engine's own setting, and what an
  APScheduler user who cares about throughput configures - or a fresh PostgreSQL schema).
* **Jobs loaded before the clock starts.** The engine's jobs are written by ``mjsched jobs sync`` before
  ``serve`` starts; APScheduler's are added while it is paused, then it is resumed.
* **Window from the first run.** Every run's start is the instant the job's code began, as the job recorded
  it (the engine: ``details.plugin_started_at`` of its run row; APScheduler: the value the job returned, read
  from its EXECUTED event - its SUBMITTED event is sent only after its whole pass over the due jobs, so it
  would date every run of a pass at that pass's end). The first start is ``first``; ``--warmup-s`` after it
  (workers spawned, start-up catch-up over, caches warm) the window of ``--window-s`` begins. ``runs/s``:
  runs *started* in the window. ``done/s``: runs *ended* in it (the engine's ``completed_at``, the time
  APScheduler reported the execution), the count the independent black-box harness makes; in a steady state
  the two agree.
* **CPU per run.** psutil samples the scheduler process and every descendant (the workers) every 0.2 s;
  their CPU time (user + system) inside the window, interpolated at its edges, divided by the runs started in
  it: ``sup ms/run`` (the engine's supervisor; APScheduler's process, scheduler thread and pool management
  included) and ``wrk ms/run`` (all workers). ``busy %``: the whole machine's CPU use in the window.
* **Alternating, repeated.** Each repetition runs every (backend, cap) point on both engines, the engine
  first in even repetitions and APScheduler first in odd ones. The table gives min / median / max over the
  repetitions and each repetition's 1-minute load average.
* **Nothing left behind.** Each scheduler runs in its own session; when it has exited, every process the
  sampler ever saw under it that is still alive ``EXIT_GRACE_S`` later is counted (``left``) and SIGKILLed,
  and so is its process group. APScheduler's child leaves with ``os._exit`` (a hung pool process would block
  a graceful shutdown), so its pool processes are always among them; the engine's should never be.
* **Duplicates.** ``dup``: (job, scheduled instant) pairs with more than one run row (must be 0).

``--fleet 1,2,3``: the engine alone on PostgreSQL with 1, 2, 3 supervisors on one database (same workload,
cap per supervisor). Each run also measures, in its window, the CPU per run of the database backends serving
it (psutil, the backends found by their ``application_name`` in ``pg_stat_activity``), what those backends
were doing (``pg_stat_activity`` every 20 ms: on a CPU, waiting for a lock, for the WAL, ...), the other load
competing for the cores (runnable sessions), and before it the time to flush a commit (:func:`wal_flush_ms`).
:func:`fleet_model` calibrates :class:`simulator.Fleet` on those runs, replays each on this machine's cores
beside what it measured, and says what 1 to 16 supervisors would reach on cores of their own
(``--db-cores`` for the server). ``--fleet-from FILE`` runs only the model, on the rows of an earlier
``--fleet ... --json FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import runner
import simulator
import workload as wl

SAMPLE_S = 0.2
EXIT_GRACE_S = 1.0  # a descendant still alive this long after its scheduler exited is "left behind"
TAIL_S = 1.0  # the scheduler runs at least this long after the window's end
FIRST_RUN_WITHIN_S = 60.0  # serve's --run-for, a bound only: the parent stops it after the first run's window


# ---------------------------------------------------------------- pure parts (tests/test_benchmarks.py)

def window(starts: list[float], warmup_s: float, window_s: float) -> tuple[float, float]:
    """``(t0, t1)``: the window of ``window_s`` beginning ``warmup_s`` after the first start (epoch s)."""
    if not starts:
        raise ValueError("no run started: nothing to measure")
    t0 = min(starts) + warmup_s
    return t0, t0 + window_s


def in_window(times: list[float | None], t0: float, t1: float) -> int:
    """How many of ``times`` fall in ``[t0, t1)`` (None never does)."""
    return sum(t is not None and t0 <= t < t1 for t in times)


def at(series: list[tuple[float, ...]], t: float, column: int) -> float:
    """``series`` (rows sorted by their time, column 0) linearly interpolated at ``t`` in ``column``; clamped
    to the first / last row outside the sampled span."""
    if not series:
        raise ValueError("no samples")
    if t <= series[0][0]:
        return series[0][column]
    for a, b in itertools.pairwise(series):
        if a[0] <= t <= b[0]:
            return a[column] if b[0] == a[0] else a[column] + (b[column] - a[column]) * (t - a[0]) / (b[0] - a[0])
    return series[-1][column]


def cpu_in_window(series: list[tuple[float, ...]], t0: float, t1: float) -> dict:
    """From sampler rows ``(t, sup_cpu_s, workers_cpu_s, machine_busy_s, machine_total_s)``: seconds of
    supervisor and worker CPU in ``[t0, t1]``, and the machine's busy share of it in percent."""
    def delta(col: int) -> float:
        return at(series, t1, col) - at(series, t0, col)
    total = delta(4)
    return {"sup_cpu_s": delta(1), "wrk_cpu_s": delta(2), "busy_pct": 100 * delta(3) / total if total else None,
            "busy_cores": delta(3) / (t1 - t0) if t1 > t0 else None,
            "db_cpu_s": delta(5) if len(series[0]) > 5 else None}


def duplicates(runs: list[dict]) -> int:
    """(job, scheduled_at) pairs with more than one run: an occurrence run twice."""
    return sum(n - 1 for n in Counter((r["job"], r["scheduled_at"]) for r in runs).values() if n > 1)


def db_in_window(rows: list[tuple], t0: float, t1: float) -> dict:
    """From :class:`DbActivity` rows: the mean number of backends in each state over the samples in
    ``[t0, t1)`` (backend-seconds per second), keyed by :data:`DB_STATES`; {} without samples there."""
    inside = [r for r in rows if t0 <= r[0] < t1]
    if not inside:
        return {}
    return {state: sum(r[i + 1] for r in inside) / len(inside) for i, state in enumerate(DB_STATES)}


def measure(runs: list[dict], series: list[tuple[float, ...]], warmup_s: float, window_s: float,
            activity: list[tuple] | None = None) -> dict:
    """The row of one measurement from its runs (``exec_at``: the job's own start; ``completed_at``) and the
    sampler's series: runs, runs_per_s, done_per_s, sup_ms_per_run, wrk_ms_per_run, busy_pct, busy_cores,
    late_p50_ms, dup, t0, t1; with a sixth series column (:class:`Sampler` given the backends) db_ms_per_run,
    the database backends' CPU; with ``activity`` (:class:`DbActivity` rows) ``db_wait``: per run, the
    backend-milliseconds spent in each of :data:`DB_STATES`."""
    starts = [r["exec_at"] for r in runs if r.get("exec_at")]
    t0, t1 = window(starts, warmup_s, window_s)
    n = in_window(starts, t0, t1)
    cpu = cpu_in_window(series, t0, t1) if series else {"sup_cpu_s": None, "wrk_cpu_s": None, "busy_pct": None,
                                                         "busy_cores": None, "db_cpu_s": None}
    states = db_in_window(activity or [], t0, t1)
    late = [(r["exec_at"] - r["scheduled_at"]) * 1000 for r in runs
            if r.get("exec_at") and r["scheduled_at"] is not None and t0 <= r["exec_at"] < t1]

    def per_run(cpu_s: float | None) -> float | None:
        return None if cpu_s is None or not n else 1000 * cpu_s / n
    return {"runs": n, "runs_per_s": n / window_s,
            "done_per_s": in_window([r.get("completed_at") for r in runs], t0, t1) / window_s,
            "sup_ms_per_run": per_run(cpu["sup_cpu_s"]), "wrk_ms_per_run": per_run(cpu["wrk_cpu_s"]),
            "db_ms_per_run": per_run(cpu["db_cpu_s"]), "busy_pct": cpu["busy_pct"], "busy_cores": cpu["busy_cores"],
            "db_wait": {k: 1000 * v * window_s / n for k, v in states.items()} if n and states else {},
            "late_p50_ms": metrics.pct(late, 50), "late_p99_ms": metrics.pct(late, 99),
            "dup": duplicates(runs), "t0": t0, "t1": t1}


def _mmm(values: list) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    f = (lambda v: f"{v:.0f}") if max(vals) >= 20 else (lambda v: f"{v:.2f}")
    return f"{f(statistics.median(vals))} ({f(min(vals))}–{f(max(vals))})"


def table(rows: list[dict]) -> str:
    """Markdown: one line per (backend, cap, supervisors, engine), median (min–max) over repetitions, and the
    load average of each repetition; then the engine/APScheduler ratio of the median runs/s per point."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["backend"], r["cap"], r.get("supervisors", 1), r["engine"]), []).append(r)
    out = ["| backend | cap | sup. | engine | reps | runs/s started | done/s | sup ms/run | wrk ms/run | "
           "late p50 ms | busy % | dup | left | load 1m |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (backend, cap, sups, engine), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        out.append(f"| {backend} | {cap} | {sups} | {engine} | {len(rs)} | {_mmm([r['runs_per_s'] for r in rs])} | "
                   f"{_mmm([r['done_per_s'] for r in rs])} | {_mmm([r['sup_ms_per_run'] for r in rs])} | "
                   f"{_mmm([r['wrk_ms_per_run'] for r in rs])} | {_mmm([r['late_p50_ms'] for r in rs])} | "
                   f"{_mmm([r['busy_pct'] for r in rs])} | {sum(r['dup'] for r in rs)} | "
                   f"{sum(r['left'] for r in rs)} | {' / '.join(format(r['loadavg_1m'], '.1f') for r in rs)} |")
    ratios = []
    for (backend, cap, sups, engine), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        other = groups.get((backend, cap, sups, "apscheduler"))
        if engine == "mjsched" and other:
            e = statistics.median(r["runs_per_s"] for r in rs)
            a = statistics.median(r["runs_per_s"] for r in other)
            ratios.append(f"{backend} cap {cap}: engine / APScheduler = " + (f"{e / a:.2f}" if a else "-"))
    return "\n".join(out + (["", *ratios] if ratios else []))


# ---------------------------------------------------------------- processes

def others_runnable(rows: list[tuple[float, int, int, int]], t0: float, t1: float) -> tuple[float, float] | None:
    """From :attr:`Sampler.runnable`: over ``[t0, t1)``, the mean number of sessions with a runnable process
    that is not the fleet's nor PostgreSQL's, and of PostgreSQL's runnable backends serving others (other load
    competing for the cores: the kernel shares them fairly between sessions, its autogroups; PostgreSQL's
    backends are all in the server's session)."""
    inside = [(others, pg) for t, others, pg, _ours in rows if t0 <= t < t1]
    if not inside:
        return None
    return sum(o for o, _ in inside) / len(inside), sum(p for _, p in inside) / len(inside)


def wal_flush_ms(url: str, commits: int = 60) -> float:
    """The database's time to make a commit durable, measured: the median of ``commits`` one-row INSERTs each
    committed on its own, through the bare driver, on a table made for it in ``url``'s schema (PostgreSQL:
    the WAL flush, fsync, every writing transaction waits for; a little CPU besides)."""
    import rawdb
    conn = rawdb.bare_connect(url)
    try:
        conn.execute("CREATE TABLE wal_probe (i integer)")
        conn.commit()
        times = []
        for i in range(commits):
            began = time.perf_counter()
            conn.execute("INSERT INTO wal_probe VALUES (%s)", (i,))
            conn.commit()
            times.append(1000 * (time.perf_counter() - began))
        conn.execute("DROP TABLE wal_probe")
        conn.commit()
    finally:
        conn.close()
    return statistics.median(times)


DB_SAMPLE_S = 0.02
# pg_stat_activity's wait_event_type of an active backend -> the column it is counted in (None: on a CPU or
# waiting for one; anything else: "wait")
WAITS = {None: "cpu", "Lock": "lock", "LWLock": "lwlock", "IO": "io"}
DB_STATES = ("cpu", "lock", "lwlock", "io", "wait", "intx")


class DbActivity:
    """The PostgreSQL backends of one benchmark's schema (their ``application_name``, :class:`runner.Namespace`)
    sampled every ``DB_SAMPLE_S`` from ``pg_stat_activity`` in a thread, on a connection of its own: ``rows``
    of ``(t, backends on a CPU or runnable, waiting for a heavyweight Lock, for an LWLock, for IO, for anything
    else, idle in a transaction)``, ``events`` (wait events counted over all samples) and ``pids`` (every
    backend seen: :class:`Sampler` reads their CPU)."""

    def __init__(self, name: str) -> None:
        import rawdb
        self.name = name
        self.conn = rawdb.bare_connect(runner.POSTGRES_URL)
        self.conn.autocommit = True  # each sample a statement, and a snapshot, of its own
        self.rows: list[tuple] = []
        self.events: Counter = Counter()
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> DbActivity:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.conn.close()

    def _loop(self) -> None:
        cur = self.conn.cursor()
        while not self._stop.wait(DB_SAMPLE_S):
            cur.execute("SELECT pid, state, wait_event_type, wait_event FROM pg_stat_activity "
                        "WHERE application_name = %s", (self.name,))
            t, counts = time.time(), dict.fromkeys(DB_STATES, 0)
            for pid, state, wtype, event in cur.fetchall():
                self.pids.add(pid)
                if state == "active":
                    counts[WAITS.get(wtype, "wait")] += 1
                    if wtype is not None:
                        self.events[f"{wtype}:{event}"] += 1
                elif state == "idle in transaction":
                    counts["intx"] += 1
            self.rows.append((t, *counts.values()))


class Sampler:
    """psutil samples of a root process and all its descendants every ``SAMPLE_S``: rows ``(t, root CPU s,
    descendants' CPU s, machine busy CPU s, machine total CPU s)``; a descendant's CPU is its last sampled
    value (it keeps counting after it exits). ``seen``: every descendant ever sampled (psutil.Process)."""

    def __init__(self, root_pids: list[int], backends: DbActivity | None = None) -> None:
        self.roots = [psutil.Process(pid) for pid in root_pids]
        self.root_cpu = {p.pid: 0.0 for p in self.roots}
        self.seen: dict[int, psutil.Process] = {}
        self.kid_cpu: dict[int, float] = {}
        self.series: list[tuple[float, ...]] = []
        self.backends = backends  # with it, a sixth column: the CPU s of the database backends serving them
        self.db_procs: dict[int, psutil.Process] = {}
        self.db_cpu: dict[int, float] = {}
        # with the backends: (t, sessions of other load with a runnable process, runnable backends serving
        # others, runnable processes of the fleet)
        self.runnable: list[tuple[float, int, int, int]] = []

    def sample(self) -> None:
        now = time.time()
        for root in self.roots:
            try:
                cpu = root.cpu_times()
                self.root_cpu[root.pid] = cpu.user + cpu.system
                for kid in root.children(recursive=True):
                    self.seen.setdefault(kid.pid, kid)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        for pid, kid in self.seen.items():
            try:
                cpu = kid.cpu_times()
                self.kid_cpu[pid] = cpu.user + cpu.system
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass
        machine = psutil.cpu_times()
        total = sum(machine)
        idle = machine.idle + getattr(machine, "iowait", 0.0)
        row = (now, sum(self.root_cpu.values()), sum(self.kid_cpu.values()), total - idle, total)
        if self.backends is not None:
            for pid in self.backends.pids - self.db_procs.keys():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    self.db_procs[pid] = psutil.Process(pid)
            for pid, proc in self.db_procs.items():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    cpu = proc.cpu_times()
                    self.db_cpu[pid] = cpu.user + cpu.system
            row += (sum(self.db_cpu.values()),)
        self.series.append(row)
        if self.backends is not None:
            self.runnable.append((now, *self._runnable()))

    def _runnable(self) -> tuple[int, int, int]:
        """Runnable now: (sessions of other processes - the kernel shares the cores fairly between sessions, its
        autogroups -, PostgreSQL's backends serving others, the fleet's processes); this one left out."""
        mine = {p.pid for p in self.roots} | self.seen.keys() | self.db_procs.keys()
        sessions: set[int] = set()
        pg = ours = 0
        for proc in psutil.process_iter(["name", "status"]):
            if proc.info["status"] != psutil.STATUS_RUNNING or proc.pid == os.getpid():
                continue
            if proc.pid in mine:
                ours += 1
            elif proc.info["name"] == "postgres":
                pg += 1
            else:
                with contextlib.suppress(OSError):
                    sessions.add(os.getsid(proc.pid))
        return len(sessions), pg, ours

    def follow(self, procs: list[subprocess.Popen], timeout_s: float) -> None:
        """Sample until every process in ``procs`` has exited (SIGKILL them after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            self.sample()
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
            time.sleep(SAMPLE_S)

    def kill_leftovers(self, procs: list[subprocess.Popen]) -> list[str]:
        """SIGKILL every sampled descendant still alive (same process, by its start time) and each root's process
        group; return those descendants ("pid name: command line", shortened). A descendant gets
        ``EXIT_GRACE_S`` to finish exiting on its own first (one already on its way out is not left behind)."""
        alive = []
        for kid in self.seen.values():
            try:
                if kid.is_running() and kid.status() != psutil.STATUS_ZOMBIE:
                    alive.append(kid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        _gone, alive = psutil.wait_procs(alive, timeout=EXIT_GRACE_S)
        left = []
        for kid in alive:
            try:
                left.append(f"{kid.pid} {kid.name()}: {' '.join(kid.cmdline())[:160]}")
                kid.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # started with start_new_session: its group id is its pid
        return left


def run_engine(w: wl.Workload, *, cap: int, backend: str, warmup_s: float, window_s: float,
               supervisors: int = 1, log_level: str = "INFO") -> dict:
    """One measurement of this engine: ``jobs sync`` then ``supervisors`` ``serve`` processes on a fresh
    database; returns the row of :func:`measure` plus engine, backend, cap, supervisors, left, loadavg_1m.
    ``log_level``: serve's (INFO, its default, logs a line per run started; to a file here)."""
    specs = wl.job_specs(w)
    tmp = Path(tempfile.mkdtemp(prefix="mjsched-compare-"))
    ns = runner.Namespace(backend, tmp)
    procs: list[subprocess.Popen] = []
    try:
        (tmp / "jobs.toml").write_text(wl.jobs_toml(w))
        common = ["--db", ns.url, "--plugins", runner.PLUGINS_DIR]
        subprocess.run([sys.executable, "-m", "mjsched_isolated", "jobs", "sync", str(tmp / "jobs.toml"), *common,
                        "--log-level", "WARNING"], check=True, capture_output=True, timeout=600, cwd=tmp)
        flush_ms = wal_flush_ms(ns.url) if backend == "postgresql" else None
        cmd = [sys.executable, "-m", "mjsched_isolated", "serve", *common, "--log-level", log_level,
               "--max-concurrent-jobs", str(cap),
               "--lease-timeout-s", "60", "--run-for", str(FIRST_RUN_WITHIN_S + warmup_s + window_s + TAIL_S),
               "--shutdown-timeout-s", "1"]
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(open(tmp / f"serve-{i}.log", "wb")) for i in range(supervisors)]
            procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
                     for log in logs]
        with DbActivity(ns.name) if backend == "postgresql" else contextlib.nullcontext() as activity:
            sampler = Sampler([p.pid for p in procs], activity)
            stopped_at = _stop_after_first_run(ns.url, procs, sampler, warmup_s + window_s + TAIL_S)
            sampler.follow(procs, 120)
        left = sampler.kill_leftovers(procs)
        if left:
            print(f"  left behind by serve (killed): {left}", flush=True)
        runs, _ = runner.read_runs(ns.url, specs)
        if not any(r.get("exec_at") for r in runs):
            raise RuntimeError(f"no run recorded; serve's log:\n{(tmp / 'serve-0.log').read_text()[-2000:]}")
        row = measure(runs, sampler.series, warmup_s, window_s, activity.rows if activity else None)
        row["wal_flush_ms"] = flush_ms
        row["others_runnable"], row["db_others_runnable"] = (
            others_runnable(sampler.runnable, row["t0"], row["t1"]) or (None, None))
        if activity:
            row["db_events"] = dict(activity.events.most_common(8))
        if stopped_at is None or row["t1"] > stopped_at:
            raise RuntimeError("the window ends after serve was stopped (its first run came too late?)")
        shutil.rmtree(tmp, ignore_errors=True)
        return {"engine": "mjsched", "backend": backend, "cap": cap, "supervisors": supervisors, **row,
                "left": len(left), "left_procs": left, "loadavg_1m": os.getloadavg()[0]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        ns.drop()


def _stop_after_first_run(url: str, procs: list[subprocess.Popen], sampler: Sampler, after_s: float) -> float | None:
    """Sample while waiting for the first run row (one light query every ``SAMPLE_S``), then SIGTERM ``procs``
    (a graceful stop, as ``--run-for`` does) ``after_s`` after its ``started_at``; returns when the signal was
    sent (None if they exited first)."""
    import sqlalchemy as sa

    from mjsched_isolated.store.schema import connect, runs
    engine, stop_at = connect(url), None
    try:
        while any(p.poll() is None for p in procs):
            sampler.sample()
            if stop_at is None:
                with engine.connect() as conn:
                    first = conn.execute(sa.select(sa.func.min(runs.c.started_at))).scalar()
                if first is not None:
                    stop_at = first.timestamp() + after_s
                    engine.dispose()
            elif time.time() >= stop_at:
                for p in procs:
                    p.send_signal(signal.SIGTERM)
                return time.time()
            time.sleep(SAMPLE_S)
        return None
    finally:
        engine.dispose()


def aps_child(w_path: str, cap: int, url: str, warmup_s: float, window_s: float, out: str,
              jobs: int | None = None) -> None:
    """APScheduler 3.x: BackgroundScheduler + SQLAlchemyJobStore + ProcessPoolExecutor(cap), ``coalesce=True``,
    ``max_instances=1``, ``misfire_grace_time=None`` (like Skip / RunOnce). Writes {"runs": [...], "stopped"}
    to ``out`` once the window after its first execution has passed, then leaves with os._exit."""
    import aps_jobs
    import apsched
    import sqlalchemy as sa
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
    from apscheduler.executors.pool import ProcessPoolExecutor
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.cron import CronTrigger

    w = wl.load(w_path)
    if jobs is not None:  # compare.py --jobs: the same override as the engine's
        w = msgspec.structs.replace(w, jobs=jobs)
    engine = sa.create_engine(url)
    if url.startswith("sqlite"):
        @sa.event.listens_for(engine, "connect")
        def _wal(dbapi_conn, _record) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()
    done: list[tuple] = []
    first = threading.Event()

    def on_event(event) -> None:
        ok = event.code == EVENT_JOB_EXECUTED
        done.append((event.job_id, event.scheduled_run_time.timestamp(), event.retval if ok else None, time.time(),
                     ok))
        first.set()

    scheduler = BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(engine=engine)}, executors={"default": ProcessPoolExecutor(cap)},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None}, timezone="UTC")
    scheduler.add_listener(on_event, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    scheduler.start(paused=True)
    for s in wl.job_specs(w):
        scheduler.add_job(aps_jobs.bench_job, CronTrigger(timezone="UTC", **apsched.TRIGGERS[s["cron_kind"]]),
                          id=s["name"], kwargs=s["configuration"])
    scheduler.resume()
    if first.wait(120):
        time.sleep(warmup_s + window_s + TAIL_S)
    snapshot = list(done)
    Path(out).write_text(json.dumps({"runs": snapshot, "stopped": time.time()}))
    os._exit(0)  # a hung pool process would block a graceful shutdown forever; the parent kills the pool


def run_aps(w: wl.Workload, w_path: str, *, cap: int, backend: str, warmup_s: float, window_s: float) -> dict:
    """One measurement of APScheduler (:func:`aps_child` in a subprocess); the same row as :func:`run_engine`."""
    tmp = Path(tempfile.mkdtemp(prefix="aps-compare-"))
    ns = runner.Namespace(backend, tmp)
    proc = None
    try:
        out = tmp / "aps.json"
        with open(tmp / "aps.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--aps-child", w_path, "--caps", str(cap), "--url",
                                     ns.url, "--warmup-s", str(warmup_s), "--window-s", str(window_s),
                                     "--child-out", str(out), "--jobs", str(w.jobs)],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = Sampler([proc.pid])
        sampler.follow([proc], 180 + warmup_s + window_s)
        left = sampler.kill_leftovers([proc])
        if not out.exists():
            raise RuntimeError("APScheduler child failed:\n" + (tmp / "aps.log").read_text()[-2000:])
        data = json.loads(out.read_text())
        runs = [{"job": job, "scheduled_at": sched, "exec_at": began, "completed_at": ended}
                for job, sched, began, ended, _ok in data["runs"]]
        if not any(r["exec_at"] for r in runs):
            raise RuntimeError("APScheduler ran nothing:\n" + (tmp / "aps.log").read_text()[-2000:])
        row = measure(runs, sampler.series, warmup_s, window_s)
        if row["t1"] > data["stopped"]:
            raise RuntimeError("the window ends after APScheduler stopped")
        shutil.rmtree(tmp, ignore_errors=True)
        return {"engine": "apscheduler", "backend": backend, "cap": cap, "supervisors": 1, **row, "left": len(left),
                "left_procs": left, "pgid": proc.pid, "loadavg_1m": os.getloadavg()[0]}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        ns.drop()


# ---------------------------------------------------------------- fleet: the simulator calibrated on a real run

def fleet_costs(row: dict, w: wl.Workload, flush_ms: float) -> simulator.FleetCosts:
    """The model's costs per run from one measured fleet row: the supervisors', workers' and database backends'
    CPU per run, the plugin's run time (the workload's mean) and ``flush_ms`` for one WAL flush."""
    return simulator.FleetCosts(sup_ms=row["sup_ms_per_run"], db_ms=row["db_ms_per_run"] or 0.0,
                                wrk_ms=row["wrk_ms_per_run"], run_ms=w.runtime.mean_ms or 0.0, flush_ms=flush_ms)


def commit_wait_ms(row: dict) -> float:
    """A row's backend time per run waiting for commits to be flushed (WAL IO and the WAL write lock), ms."""
    return row["db_wait"].get("io", 0.0) + row["db_wait"].get("lwlock", 0.0)


def grown(rows: list[dict], key: str) -> tuple[float, float]:
    """(value at one supervisor, growth per added supervisor) of ``key``, least squares over ``rows``' medians
    by supervisor count, the growth not negative: how contention raises a cost with the fleet's size."""
    by_n: dict[int, list[float]] = {}
    for r in rows:
        by_n.setdefault(r["supervisors"], []).append(r[key] or 0.0)
    pts = [(n, statistics.median(v)) for n, v in sorted(by_n.items())]
    if len(pts) < 2:
        return pts[0][1], 0.0
    mx, my = statistics.fmean(n for n, _ in pts), statistics.fmean(v for _, v in pts)
    slope = max(0.0, sum((n - mx) * (v - my) for n, v in pts) / sum((n - mx) ** 2 for n, _ in pts))
    return my - slope * (mx - 1), slope


def fleet_model(rows: list[dict], w: wl.Workload, cap: int, sizes: list[int], db_cores: float,
                horizon_s: float = 3.0) -> dict:
    """The simulator (:class:`simulator.Fleet`) calibrated on the measured fleet ``rows`` (PostgreSQL, one per
    supervisor count and repetition):

    * ``check``: each measured row replayed on this machine's cores, with its own costs per run and the other
      load that competed for the cores in its window (runnable processes: :func:`others_runnable`), beside
      what it measured;
    * ``dedicated``: ``sizes`` supervisors each on a core of its own (and each worker), the database server's
      backends on ``db_cores``, with the costs of the one-supervisor runs (``flat``) and with each cost grown
      with the fleet's size as measured (``grown``, :func:`grown`), a workload more due runs than any of them
      starts; with the busy share of each resource at that throughput.

    The WAL flush is the median of the rows' measured ones (:func:`wal_flush_ms`); each check row also gives
    the backends' commit wait per run, measured and simulated."""
    flush_ms = statistics.median(r["wal_flush_ms"] or 0.0 for r in rows)
    check = []
    for r in rows:
        costs = fleet_costs(r, w, flush_ms)
        spec = simulator.FleetSpec(supervisors=r["supervisors"], cap=cap, cores=float(os.cpu_count() or 1),
                                   others=r.get("others_runnable") or 0.0, db_others=r.get("db_others_runnable") or 0.0,
                                   horizon_s=horizon_s)
        sim = simulator.Fleet(costs, spec).run()
        check.append({"supervisors": r["supervisors"], "measured": r["runs_per_s"], "loadavg_1m": r["loadavg_1m"],
                      "others_runnable": spec.others, "db_others_runnable": spec.db_others,
                      "predicted": sim["runs_per_s"], "commit_wait_ms": commit_wait_ms(r),
                      "sim_commit_wait_ms": sim["commit_wait_ms_per_run"]})
    base = {k: grown(rows, k) for k in ("sup_ms_per_run", "db_ms_per_run", "wrk_ms_per_run")}
    dedicated = []
    for n in sizes:
        row = {"supervisors": n}
        for label, extra in (("flat", 0), ("grown", n - 1)):
            costs = simulator.FleetCosts(sup_ms=base["sup_ms_per_run"][0] + extra * base["sup_ms_per_run"][1],
                                         db_ms=base["db_ms_per_run"][0] + extra * base["db_ms_per_run"][1],
                                         wrk_ms=base["wrk_ms_per_run"][0] + extra * base["wrk_ms_per_run"][1],
                                         run_ms=w.runtime.mean_ms or 0.0, flush_ms=flush_ms)
            x = simulator.Fleet(costs, simulator.FleetSpec(supervisors=n, cap=cap, db_cores=db_cores,
                                                           horizon_s=horizon_s)).run()
            row[label] = x["runs_per_s"]
            row[f"{label}_busy"] = {"supervisor": x["runs_per_s"] * costs.sup_ms / 1000 / n,
                                    "database_cpu": x["runs_per_s"] * costs.db_ms / 1000 / db_cores,
                                    "wal_flush": x["flushes_per_s"] * flush_ms / 1000}
        dedicated.append(row)
    return {"flush_ms": flush_ms, "costs_1": {k: v[0] for k, v in base.items()},
            "growth_per_supervisor": {k: v[1] for k, v in base.items()}, "db_cores": db_cores,
            "check": check, "dedicated": dedicated}


def fleet_report(model: dict) -> str:
    """Markdown: the calibration, the check against the measured runs, the dedicated-core estimate."""
    c, g = model["costs_1"], model["growth_per_supervisor"]
    out = [f"calibration (per run, one supervisor; growth per added supervisor): supervisor CPU "
           f"{c['sup_ms_per_run']:.2f} ms (+{g['sup_ms_per_run']:.2f}), database backend CPU "
           f"{c['db_ms_per_run']:.2f} ms (+{g['db_ms_per_run']:.2f}), worker CPU {c['wrk_ms_per_run']:.2f} ms "
           f"(+{g['wrk_ms_per_run']:.2f}); a WAL flush {model['flush_ms']:.2f} ms (median of the runs' probes)",
           "", "simulator on this machine's cores (each run's own costs and competing load) against the measurement:",
           "", "| supervisors | measured runs/s | simulated | commit wait ms/run, measured | simulated | "
           "other sessions runnable (PostgreSQL backends) | load 1m |", "|---|---|---|---|---|---|---|"]
    for r in model["check"]:
        out.append(f"| {r['supervisors']} | {r['measured']:.0f} | {r['predicted']:.0f} | {r['commit_wait_ms']:.2f} | "
                   f"{r['sim_commit_wait_ms']:.2f} | {r['others_runnable']:.1f} ({r['db_others_runnable']:.1f}) | "
                   f"{r['loadavg_1m']:.1f} |")
    out += ["", f"simulator, each supervisor and worker on a core of its own, the database server on "
            f"{model['db_cores']:g} cores (costs of one supervisor / grown with the fleet as measured; busy share "
            "of a supervisor's core, the server's cores and the WAL flush at the grown figure):", "",
            "| supervisors | runs/s | runs/s, costs grown | supervisor | database CPU | WAL flush |",
            "|---|---|---|---|---|---|"]
    for r in model["dedicated"]:
        b = r["grown_busy"]
        out.append(f"| {r['supervisors']} | {r['flat']:.0f} | {r['grown']:.0f} | {100 * b['supervisor']:.0f} % | "
                   f"{100 * b['database_cpu']:.0f} % | {100 * b['wal_flush']:.0f} % |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(HERE / "workloads" / "saturate.toml"))
    ap.add_argument("--jobs", type=int, help="override the workload's job count (both engines; e.g. 3000 jobs "
                    "every second: more due runs per second than the engines can start)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--caps", default="10", help="comma-separated pool sizes (default 10)")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--engines", default="mjsched,apscheduler")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--serve-log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                    help="the engine's log level (default INFO, serve's own default)")
    ap.add_argument("--fleet", help="instead: comma-separated supervisor counts on PostgreSQL, engine only")
    ap.add_argument("--fleet-from", help="instead: the simulator on the fleet rows of earlier --fleet --json FILEs "
                    "(comma-separated)")
    ap.add_argument("--db-cores", type=float, default=2.0,
                    help="--fleet: the database server's cores in the dedicated-core estimate (default 2)")
    ap.add_argument("--json", help="also write every row to this file")
    ap.add_argument("--aps-child", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        caps = [int(c) for c in args.caps.split(",")]
        if min(caps) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--caps: must be positive integers separated by commas, got {args.caps!r}")
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs: must be at least 1, got {args.jobs}")
    if args.aps_child:
        aps_child(args.aps_child, caps[0], args.url, args.warmup_s, args.window_s, args.child_out, args.jobs)
        return 0
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    if args.warmup_s < 0 or args.window_s <= 0:
        ap.error("--window-s: must be positive (and --warmup-s not negative)")
    backends = args.backends.split(",")
    if bad := set(backends) - {"sqlite", "postgresql"}:
        ap.error(f"--backends: sqlite or postgresql, got {sorted(bad)}")
    engines = args.engines.split(",")
    if bad := set(engines) - {"mjsched", "apscheduler"}:
        ap.error(f"--engines: mjsched or apscheduler, got {sorted(bad)}")
    w = wl.load_or_exit(args.workload)
    if args.jobs is not None:
        w = msgspec.structs.replace(w, jobs=args.jobs)
    if args.fleet_from:
        try:
            measured = [r for path in args.fleet_from.split(",") for r in json.loads(Path(path).read_text())
                        if r.get("engine") == "mjsched" and r.get("wal_flush_ms") is not None]
        except (OSError, ValueError) as exc:
            ap.error(f"--fleet-from: {exc}")
        if not measured:
            ap.error(f"--fleet-from: no fleet rows with the database's figures in {args.fleet_from}")
        print(fleet_report(fleet_model(measured, w, caps[0], sorted({1, 2, 3, 4, 6, 8, 12, 16}), args.db_cores)))
        return 0
    if "postgresql" in backends or args.fleet:
        try:
            runner.Namespace("postgresql", Path(tempfile.gettempdir())).drop()
        except Exception as exc:  # noqa: BLE001 - any failure to reach the server is the same answer
            ap.error(f"--backends: PostgreSQL at $MJSCHED_BENCH_POSTGRES_URL ({runner.POSTGRES_URL}) does not answer: "
                     f"{str(exc).splitlines()[0]}")
    began, rows = time.time(), []
    print(f"# {w.name}: {w.jobs} jobs; window {args.window_s:g} s after a {args.warmup_s:g} s warm-up; "
          f"load at start {os.getloadavg()[0]:.1f}", flush=True)

    def note(row: dict) -> None:
        rows.append(row)
        print(f"  {row['engine']:11} {row['backend']:10} cap {row['cap']:>3} x{row['supervisors']}: "
              f"{row['runs_per_s']:7.1f} runs/s, {row['done_per_s']:7.1f} done/s, sup {row['sup_ms_per_run'] or 0:.2f} "
              f"wrk {row['wrk_ms_per_run'] or 0:.2f} ms/run, "
              + (f"db {row['db_ms_per_run']:.2f} ms/run (waits " + ", ".join(
                  f"{k} {v:.2f}" for k, v in row["db_wait"].items()) + "), " if row.get("db_ms_per_run") else "")
              + f"busy {row['busy_pct'] or 0:.0f} %, dup {row['dup']}, left {row['left']}, "
              f"load {row['loadavg_1m']:.1f} ({time.time() - began:.0f} s)", flush=True)

    if args.fleet:
        sizes = [int(n) for n in args.fleet.split(",")]
        for rep in range(args.reps):
            for n in sizes:
                note({**run_engine(w, cap=caps[0], backend="postgresql", warmup_s=args.warmup_s,
                                   window_s=args.window_s, supervisors=n, log_level=args.serve_log_level),
                      "rep": rep})
        print("\n" + table(rows))
        model = fleet_model([r for r in rows if r.get("wal_flush_ms") is not None], w, caps[0],
                            sorted({*sizes, 1, 2, 3, 4, 6, 8, 12, 16}), args.db_cores)
        print("\n" + fleet_report(model))
        rows.append({"fleet_model": model})
    else:
        for rep in range(args.reps):
            order = engines if rep % 2 == 0 else engines[::-1]
            for backend in backends:
                for cap in caps:
                    for engine in order:
                        if engine == "mjsched":
                            note({**run_engine(w, cap=cap, backend=backend, warmup_s=args.warmup_s,
                                               window_s=args.window_s, log_level=args.serve_log_level), "rep": rep})
                        else:
                            note({**run_aps(w, args.workload, cap=cap, backend=backend, warmup_s=args.warmup_s,
                                            window_s=args.window_s), "rep": rep})
        print("\n" + table(rows))
    print(f"\ntotal {time.time() - began:.0f} s, load now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
