"""Throughput and dispatch latency of the supervisor: K trivial jobs due at the same instant, on SQLite.

Usage::

    python benchmarks/throughput.py [--jobs K] [--caps 1,5,10] [--repeat N] [--db-dir DIR]

For each cap (``max_concurrent_jobs``) and each repetition, in this process:

1. a fresh SQLite file in a temporary directory (under ``--db-dir`` if given) gets K Active jobs of type
   ``noop`` (``benchmarks/plugins/noop.py``) with cron ``0 0 1 1 *``, so each job runs exactly once, all
   parked at a ``next_run_at`` one day away;
2. a real :class:`~mjsched_isolated.supervisor.Supervisor` with its :class:`~mjsched_isolated.supervisor.pool.Pool`
   is driven step by step (``step`` -> ``pool.wait`` -> ``on_events``, like ``serve`` without signals,
   like ``tests/conftest.py``'s ``Driver``) until every worker has said Ready, so spawn time is not
   measured;
3. a warm-up of ``cap`` extra noop jobs is run and discarded (it fills SQLAlchemy's statement cache and
   the workers' first-run paths, as in a supervisor that has been up for a while);
4. the K jobs are moved, in one UPDATE, to a common ``next_run_at`` = T = now + 0.5 s, and the loop is
   driven until all K runs have finished (bounded by a generous timeout); the runs are then read back.

Reported per cap (repetitions pooled; runs/s and CPU are the median over repetitions):

* runs/s = K / (last ``completed_at`` - T);
* dispatch latency = ``details.plugin_started_at`` (the worker's clock when ``execute`` began) - the run
  row's ``scheduled_at`` (= T): p50 / p99 / max in ms. At cap 1 the last run waits behind K-1 others,
  so latency grows with K: it measures queueing, not just the hand-off;
* supervisor CPU s: user + system CPU time of this process (the supervisor; the workers are separate
  processes) from just before T until the last run was recorded;
* peak RSS MB of this process during the measured window (sampled with psutil every 50 ms).

A second table splits the latency at the run row's ``started_at``, which is the ``now`` of the
``step()`` that claimed the run (one value for the whole batch a step dispatches): *noticed* =
``scheduled_at`` -> ``started_at`` (waiting for a free worker plus the supervisor's loop); *claim + hand-off*
= ``started_at`` -> ``plugin_started_at`` (the claims of the runs dispatched before it in the same step,
the pipe, the worker's decode and validation). *CPU ms / run* is supervisor CPU s / K.

Default K is 200: a full default run (caps 1, 5, 10, one repetition) takes about 10 s on a 2-core
machine, most of it spawning workers; K=2000 still finishes well under 3 minutes.
This is a benchmark, not a test: it prints tables and exits 0 (1 if a run did not complete).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import sqlalchemy as sa

from mjsched_isolated import logs, protocol
from mjsched_isolated.config import Settings
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import jobs, runs
from mjsched_isolated.supervisor import Supervisor, utcnow
from mjsched_isolated.supervisor.pool import Pool

PLUGINS_DIR = str(Path(__file__).resolve().parent / "plugins")
CRON_ONCE = "0 0 1 1 *"  # next occurrence after a claim is months away: each job runs once
LEAD_S = 0.5  # T = now + LEAD_S once every worker is ready
RSS_SAMPLE_S = 0.05


class BenchError(RuntimeError):
    pass


class Bench:
    """One (cap, repetition): its own database (a SQLite file, or ``db_url``), supervisor and pool, all in
    this process."""

    def __init__(self, cap: int, k: int, db_dir: str | None, db_url: str | None = None) -> None:
        self.cap = cap
        self.k = k
        self.tmp = tempfile.mkdtemp(prefix=f"mjsched-bench-cap{cap}-", dir=db_dir)
        # another database (an empty PostgreSQL schema, ``cpu_per_run.py --backend``): the caller drops it
        self.db_url = db_url or f"sqlite:///{Path(self.tmp, 'bench.db')}"
        self.store = Store.open(self.db_url)
        self.settings = Settings(database_url=self.db_url, plugins_dir=PLUGINS_DIR, max_concurrent_jobs=cap)
        self.pool = Pool(cap, PLUGINS_DIR, log_level=logging.WARNING,
                         ready_timeout_s=self.settings.worker_ready_timeout_s)
        self.supervisor = Supervisor(self.settings, self.store, self.pool)
        self.finished = 0  # terminal events seen (RunFinished or a death during a run)
        # counted at the pool, whoever waits: the supervisor itself reads the pipes after an inline lease
        # renewal (every lease_renew_interval_s), and a result it took there would otherwise never be counted
        pool_wait = self.pool.wait

        def counting_wait(*args, **kwargs):
            events, woken = pool_wait(*args, **kwargs)
            for event in events:
                if isinstance(event.message, protocol.RunFinished) or (event.died and event.run is not None):
                    self.finished += 1
            return events, woken

        self.pool.wait = counting_wait  # type: ignore[method-assign]
        self.proc = psutil.Process()
        self.peak_rss = 0
        self._next_rss_at = 0.0

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- driving the supervisor ------------------------------------------------------------------
    def drive(self, cond, timeout_s: float, what: str) -> None:
        """step -> pool.wait -> on_events until ``cond()``; every wait bounded by ``timeout_s``. The log lines
        of a step, and those of the events after a wait, are written in one batch each, as ``serve``'s
        ``Supervisor.cycle`` writes them (:func:`mjsched_isolated.logs.batched`)."""
        give_up = time.monotonic() + timeout_s
        sup, pool = self.supervisor, self.pool
        while not cond():
            left = give_up - time.monotonic()
            if left <= 0:
                raise BenchError(f"cap {self.cap}: {what} not done within {timeout_s:.0f} s "
                                 f"({self.finished} runs finished, {len(sup.inflight)} in flight)")
            with logs.batched():
                wake = sup.step(*sup.read_clock())
            wait_s = min(max(0.0, (wake - sup.read_clock()[0]).total_seconds()), left)
            events, _ = pool.wait(wait_s)
            with logs.batched():
                sup.on_events(events, sup.read_clock()[0])
            mono = time.monotonic()
            if mono >= self._next_rss_at:
                self._next_rss_at = mono + RSS_SAMPLE_S
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)

    # -- the phases --------------------------------------------------------------------------------
    def insert_jobs(self) -> None:
        now = utcnow()
        parked = now + dt.timedelta(days=1)
        rows = [{"name": name, "job_type": "noop", "cron_expression": CRON_ONCE, "timezone": "UTC",
                 "status": "Active", "next_run_at": parked, "created_at": now, "updated_at": now}
                for name in [f"bench-{i:06d}" for i in range(self.k)] + [f"warmup-{i:03d}" for i in range(self.cap)]]
        with self.store.engine.begin() as conn:
            conn.execute(jobs.insert(), rows)

    def set_due(self, prefix: str, when: dt.datetime) -> None:
        with self.store.engine.begin() as conn:
            conn.execute(jobs.update().where(jobs.c.name.like(f"{prefix}%")).values(next_run_at=when))

    def start_workers(self) -> None:
        self.pool.start()
        self.drive(lambda: len(self.pool.idle_workers()) == self.pool.size, 60, "worker start")
        ready = self.pool.last_ready
        if ready is None or "noop" not in {p.job_type for p in ready.plugins}:
            failures = "; ".join(f.error for f in ready.failures) if ready else "no Ready"
            raise BenchError(f"the noop plugin did not load from {PLUGINS_DIR}: {failures}")

    def warm_up(self) -> None:
        self.set_due("warmup-", utcnow())
        self.drive(lambda: self.finished >= self.cap, 60, "warm-up")
        self.finished = 0

    def measure(self, timeout_s: float) -> dict:
        t = utcnow() + dt.timedelta(seconds=LEAD_S)
        self.set_due("bench-", t)
        self.peak_rss = self.proc.memory_info().rss
        before = resource.getrusage(resource.RUSAGE_SELF)
        self.drive(lambda: self.finished >= self.k, timeout_s, f"{self.k} runs")
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return self.collect(t, cpu_s)

    def collect(self, t: dt.datetime, cpu_s: float) -> dict:
        query = (sa.select(runs.c.status, runs.c.scheduled_at, runs.c.started_at, runs.c.completed_at, runs.c.details,
                           runs.c.error_message)
                 .join(jobs, jobs.c.id == runs.c.job_id).where(jobs.c.name.like("bench-%")))
        with self.store.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        bad = [r for r in rows if r["status"] != "Completed" or r["scheduled_at"] != t]
        if len(rows) != self.k or bad:
            sample = bad[0] if bad else None
            raise BenchError(f"cap {self.cap}: expected {self.k} Completed runs scheduled at T, got {len(rows)} runs,"
                             f" {len(bad)} not as expected (e.g. {dict(sample) if sample else '-'})")
        t_epoch = t.timestamp()
        latency, claim, handoff = [], [], []
        for r in rows:
            plugin_started = json.loads(r["details"])["plugin_started_at"]
            started = r["started_at"].timestamp()
            latency.append((plugin_started - t_epoch) * 1000)
            claim.append((started - t_epoch) * 1000)
            handoff.append((plugin_started - started) * 1000)
        wall_s = (max(r["completed_at"] for r in rows) - t).total_seconds()
        return {"wall_s": wall_s, "runs_per_s": self.k / wall_s, "latency": latency, "claim": claim,
                "handoff": handoff, "cpu_s": cpu_s, "peak_rss": self.peak_rss}


def run_one(cap: int, k: int, db_dir: str | None, timeout_s: float) -> dict:
    bench = Bench(cap, k, db_dir)
    try:
        bench.insert_jobs()
        bench.start_workers()
        bench.warm_up()
        return bench.measure(timeout_s)
    finally:
        bench.close()


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, metavar="K", help="jobs due at the same instant (200)")
    parser.add_argument("--caps", default="1,5,10", help="comma-separated max_concurrent_jobs values (1,5,10)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="repetitions per cap, pooled (1)")
    parser.add_argument("--db-dir", metavar="DIR", help="where the temporary SQLite files go (default: $TMPDIR)")
    args = parser.parse_args(argv)
    try:
        caps = [int(c) for c in args.caps.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--caps: expected comma-separated integers, got {args.caps!r}")
    if args.jobs < 1 or args.repeat < 1 or not caps or min(caps) < 1:
        parser.error("--jobs, --repeat and every cap must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    timeout_s = 60 + 0.5 * args.jobs  # generous: a healthy run does hundreds of runs per second

    print(f"# mjsched_isolated throughput: K={args.jobs} noop jobs due at once, SQLite, repeat={args.repeat}")
    print(f"# Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, SQLAlchemy {sa.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    print("# load average before start: {:.2f} {:.2f} {:.2f} (other load on the machine skews every number)"
          .format(*os.getloadavg()))
    results: dict[int, list[dict]] = {}
    started = time.monotonic()
    for cap in caps:
        for rep in range(args.repeat):
            try:
                res = run_one(cap, args.jobs, args.db_dir, timeout_s)
            except BenchError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            results.setdefault(cap, []).append(res)
            print(f"# cap {cap} rep {rep + 1}: {res['runs_per_s']:.0f} runs/s, wall {res['wall_s']:.3f} s",
                  file=sys.stderr)

    print()
    print("| cap | jobs | runs/s | latency p50 ms | p99 ms | max ms | supervisor CPU s | peak RSS MB |")
    print("|----:|-----:|-------:|---------------:|-------:|-------:|-----------------:|------------:|")
    for cap, reps in results.items():
        lat = [v for r in reps for v in r["latency"]]
        print(f"| {cap} | {args.jobs} | {statistics.median(r['runs_per_s'] for r in reps):.0f} "
              f"| {percentile(lat, 50):.1f} | {percentile(lat, 99):.1f} | {max(lat):.1f} "
              f"| {statistics.median(r['cpu_s'] for r in reps):.2f} "
              f"| {max(r['peak_rss'] for r in reps) / 2**20:.0f} |")
    print()
    print("Latency breakdown (ms): noticed = scheduled_at -> run row started_at (the claiming step's now); "
          "claim + hand-off = started_at -> plugin_started_at")
    print()
    print("| cap | first run latency | noticed p50 | noticed p99 | claim + hand-off p50 | p99 | max | CPU ms / run |")
    print("|----:|------------------:|------------:|------------:|---------------------:|----:|----:|-------------:|")
    for cap, reps in results.items():
        claim = [v for r in reps for v in r["claim"]]
        handoff = [v for r in reps for v in r["handoff"]]
        cpu_per_run = statistics.median(r["cpu_s"] for r in reps) * 1000 / args.jobs
        first = statistics.median(min(r["latency"]) for r in reps)
        print(f"| {cap} | {first:.1f} | {percentile(claim, 50):.1f} | {percentile(claim, 99):.1f} "
              f"| {percentile(handoff, 50):.2f} | {percentile(handoff, 99):.2f} | {max(handoff):.2f} "
              f"| {cpu_per_run:.2f} |")
    print()
    print(f"# total {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":  # workers are spawned and re-import this file as __mp_main__
    sys.exit(main())
