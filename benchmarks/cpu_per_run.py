"""Supervisor CPU per run, measured so that a loaded machine does not move it: instructions per run.

    python benchmarks/cpu_per_run.py                       # CPU ms per run (getrusage), 2000 runs
    python benchmarks/cpu_per_run.py --callgrind           # instructions per run under valgrind (~30 s)
    python benchmarks/cpu_per_run.py --profile 30          # cProfile (CPU time), the 30 costliest functions

K trivial ``noop`` jobs (``0 0 1 1 *``: each runs once) are due at the same instant; the real
:class:`~mjsched_isolated.supervisor.Supervisor` and :class:`~mjsched_isolated.supervisor.pool.Pool` (real
worker children) are driven in this process as ``serve`` drives them (``throughput.py``'s ``Bench``),
logging at ``--log-level`` (INFO, serve's default: two lines per run) to a file, until all K are recorded.
Only that drive is measured (not the start-up, the warm-up or the reading back of the runs).

``--callgrind`` runs this script under ``valgrind --tool=callgrind --instr-atstart=no`` and switches the
instrumentation on (``callgrind_control -i on``) just for the drive: the instructions executed by the
supervisor process (its workers are not traced) divided by K. Instruction counts are repeatable on a shared
machine where CPU times are not (issue 11's figures: 3.07 M instructions per run before, see
``benchmarks/README.md``). Under valgrind the supervisor runs ~50x slower, so its once-a-second work (the
rescan, the lease renewal) would be counted ~50 times too often: ``--per-run-only`` (the default with
``--callgrind``) sets the rescan and renewal intervals to an hour so only the per-run path is counted.
The profile file is kept (``--out``) for ``callgrind_annotate``.

``--backend postgresql`` runs the same drive on a fresh schema of the server at
``$MJSCHED_BENCH_POSTGRES_URL`` (``runner.py``'s, dropped afterwards). ``--statements`` (PostgreSQL) also
counts the supervisor's round trips to the server during the drive, per run: libpq's protocol trace of each
of its connections (opened anew for the drive), one round trip per ``ReadyForQuery`` the server sends, split
into ``BEGIN``, ``COMMIT``, ``ROLLBACK`` and statements. The trace costs CPU of its own: read the CPU figures
of a run without ``--statements``. ``KEEP_TRACE=1`` keeps the trace files (their folder is printed).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import functools
import os
import pstats
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner
import sqlalchemy as sa
import throughput

from mjsched_isolated import logs
from mjsched_isolated.store import jobs
from mjsched_isolated.supervisor import utcnow


class RoundTrips:
    """Round trips of ``engine``'s psycopg connections opened from now on (see the module's docstring):
    each connection traces to a file of its own, read by :meth:`counts` once every trace is flushed."""

    def __init__(self, engine) -> None:
        self.dir = tempfile.mkdtemp(prefix="cpu-per-run-trace-")
        self.live: dict[int, object] = {}  # id(pgconn) -> pgconn, traced and not yet untraced
        self.files: list[int] = []
        engine.dispose()  # the drive's connections are new, and traced
        sa.event.listen(engine, "connect", self._connect)
        sa.event.listen(engine, "close", self._close)
        sa.event.listen(engine, "close_detached", self._close)
        self.engine = engine

    def _connect(self, dbapi_conn, _record) -> None:
        from psycopg import pq
        fd = os.open(os.path.join(self.dir, f"{len(self.files)}.trace"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.files.append(fd)
        pgconn = dbapi_conn.pgconn
        pgconn.trace(fd)
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        self.live[id(pgconn)] = pgconn

    def _close(self, dbapi_conn, *_args) -> None:
        pgconn = self.live.pop(id(dbapi_conn.pgconn), None)
        if pgconn is not None:
            pgconn.untrace()  # flushes the trace

    def counts(self) -> dict[str, int]:
        """{"BEGIN": n, "COMMIT": n, "ROLLBACK": n, "statements": n, "total": n} so far; stops tracing."""
        sa.event.remove(self.engine, "connect", self._connect)
        for pgconn in list(self.live.values()):
            pgconn.untrace()
        self.live.clear()
        out = {"BEGIN": 0, "COMMIT": 0, "ROLLBACK": 0, "statements": 0}
        for name in sorted(os.listdir(self.dir)):
            sent = None
            with open(os.path.join(self.dir, name)) as f:
                for line in f:
                    parts = line.rstrip("\n").split("\t")
                    if len(parts) < 3:
                        continue
                    if parts[0] == "F" and parts[2] in ("Query", "Parse", "Bind") and sent is None:
                        text = parts[3].strip().strip('"').upper() if parts[2] == "Query" and len(parts) > 3 else ""
                        sent = next((word for word in ("BEGIN", "COMMIT", "ROLLBACK") if text.startswith(word)),
                                    "statements")  # BEGIN ISOLATION LEVEL ... too
                    elif parts[0] == "B" and parts[2] == "ReadyForQuery":
                        out[sent or "statements"] += 1
                        sent = None
        for fd in self.files:
            os.close(fd)
        if not os.environ.get("KEEP_TRACE"):
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(self.dir)
        out["total"] = sum(out.values())
        return out


class ServerCPU:
    """CPU time (user + system) of the PostgreSQL backend processes serving ``engine``'s connections opened
    from now on (the pool is emptied first), read with psutil: the server's side of each run."""

    def __init__(self, engine) -> None:
        self.procs: dict[int, tuple[psutil.Process, float]] = {}
        engine.dispose()
        sa.event.listen(engine, "connect", self._connect)
        self.engine = engine

    @staticmethod
    def _cpu(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    def _connect(self, dbapi_conn, _record) -> None:
        proc = psutil.Process(dbapi_conn.info.backend_pid)
        self.procs[proc.pid] = (proc, self._cpu(proc))

    def seconds(self) -> float:
        """CPU seconds used since each connection opened (a backend gone meanwhile is not counted)."""
        sa.event.remove(self.engine, "connect", self._connect)
        total = 0.0
        for proc, start in self.procs.values():
            try:
                total += self._cpu(proc) - start
            except psutil.NoSuchProcess:
                pass
        return total


def drive(k: int, cap: int, log_level: str, per_run_only: bool, mode: str, profile_top: int,
          db_url: str | None = None, statements: bool = False) -> dict:
    """One measurement in this process; ``mode``: ``rusage``, ``profile`` or ``callgrind`` (toggle only);
    ``db_url``: the database (default a SQLite file); ``statements``: count PostgreSQL round trips."""
    log_file = tempfile.NamedTemporaryFile("w", prefix="cpu-per-run-", suffix=".log", delete=False)  # noqa: SIM115
    sys.stderr = log_file
    logs.configure(log_level)
    if per_run_only:
        throughput.Settings = functools.partial(throughput.Settings, rescan_interval_s=3600, lease_ttl_s=7200,
                                                lease_renew_interval_s=3600)
        # SQLite's due read-ahead is read afresh each second or each READ_AHEAD_ROWS claims, whichever comes
        # first: at the real pace (hundreds of runs a second) that is the row count, under valgrind the second
        jobs.READ_AHEAD_FOR = dt.timedelta(hours=1)
    bench = throughput.Bench(cap, k, None, db_url)
    trips = server_s = None
    try:
        bench.insert_jobs()
        bench.start_workers()
        bench.warm_up()
        due = utcnow()
        server = ServerCPU(bench.store.engine) if db_url is not None and db_url.startswith("postgresql") else None
        if statements:
            trips = RoundTrips(bench.store.engine)
        bench.set_due("bench-", due)
        profiler = cProfile.Profile(time.process_time) if mode == "profile" else None
        workers_before = workers_cpu_s(bench)  # outside what is measured of the supervisor (it scans /proc)
        if mode == "callgrind":
            subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
        if profiler is not None:
            profiler.enable()
        before = resource.getrusage(resource.RUSAGE_SELF)
        bench.drive(lambda: bench.finished >= k, 60 + 2.0 * k, f"{k} runs")
        after = resource.getrusage(resource.RUSAGE_SELF)
        if profiler is not None:
            profiler.disable()
        if mode == "callgrind":
            subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True, capture_output=True)
        workers_after = workers_cpu_s(bench)
        sys_s = after.ru_stime - before.ru_stime
        cpu_s = (after.ru_utime - before.ru_utime) + sys_s
        switches = ((after.ru_nvcsw - before.ru_nvcsw) / k, (after.ru_nivcsw - before.ru_nivcsw) / k)
        counted = trips.counts() if trips is not None else None
        server_s = server.seconds() if server is not None else None
        result = bench.collect(due, cpu_s)
    finally:
        bench.close()
        sys.stderr = sys.__stderr__
        log_file.close()
        os.unlink(log_file.name)
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(profile_top)
    worker_ms = sum(workers_after.get(pid, cpu) - cpu for pid, cpu in workers_before.items()) * 1000 / k
    return {"runs": k, "cpu_ms_per_run": cpu_s * 1000 / k, "sys_ms_per_run": sys_s * 1000 / k,
            "switches_per_run": switches, "runs_per_s": result["runs_per_s"],
            "worker_ms_per_run": worker_ms, "round_trips": counted,
            "server_ms_per_run": None if server_s is None else server_s * 1000 / k}


def workers_cpu_s(bench: throughput.Bench) -> dict[int, float]:
    """CPU seconds (user + system) of each worker child of ``bench``'s pool and of its watchdog, by pid (a
    worker replaced meanwhile is not counted: none is, with trivial runs)."""
    out = {}
    for worker in bench.pool.workers.values():
        if worker is None:
            continue
        try:
            proc = psutil.Process(worker.pid)
            for p in (proc, *proc.children(recursive=True)):
                times = p.cpu_times()
                out[p.pid] = times.user + times.system
        except psutil.Error:
            continue
    return out


def under_callgrind(args: argparse.Namespace) -> int:
    out = args.out or tempfile.mktemp(prefix="callgrind-", suffix=".out", dir=".")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable,
           __file__, "--inside-callgrind", "--jobs", str(args.jobs), "--cap", str(args.cap), "--log-level",
           args.log_level, *(["--per-run-only"] if args.per_run_only is not False else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        print(proc.stdout + proc.stderr[-3000:], file=sys.stderr)
        return 1
    instructions = int(found.group(1).replace(",", ""))
    print(f"{instructions / args.jobs / 1e6:.2f} M instructions per run ({instructions:,} for {args.jobs} runs, cap "
          f"{args.cap}, log level {args.log_level}, once-a-second work "
          f"{'left out' if args.per_run_only is not False else 'included'}); profile: {out} (callgrind_annotate)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="runs measured (default 2000; 500 with --callgrind)")
    ap.add_argument("--cap", type=int, default=10)
    ap.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"))
    ap.add_argument("--callgrind", action="store_true", help="instructions per run under valgrind")
    ap.add_argument("--per-run-only", action="store_true", default=None,
                    help="rescan and lease renewal once an hour (the default with --callgrind)")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile (CPU time), the N costliest functions")
    ap.add_argument("--out", help="--callgrind: the profile file (default ./callgrind-*.out)")
    ap.add_argument("--backend", default="sqlite", choices=("sqlite", "postgresql"),
                    help="the database: a SQLite file (default) or a fresh schema at $MJSCHED_BENCH_POSTGRES_URL")
    ap.add_argument("--statements", action="store_true",
                    help="PostgreSQL: also count the supervisor's round trips per run (protocol trace)")
    ap.add_argument("--inside-callgrind", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs is None:
        args.jobs = 500 if args.callgrind or args.inside_callgrind else 2000
    if args.jobs < 1 or args.cap < 1:
        ap.error("--jobs and --cap: must be at least 1")
    if args.statements and args.backend != "postgresql":
        ap.error("--statements: needs --backend postgresql")
    if args.callgrind:
        if args.backend != "sqlite":
            ap.error("--callgrind: SQLite only")
        return under_callgrind(args)
    mode = "callgrind" if args.inside_callgrind else "profile" if args.profile else "rusage"
    ns = runner.Namespace(args.backend, Path(tempfile.gettempdir())) if args.backend != "sqlite" else None
    try:
        row = drive(args.jobs, args.cap, args.log_level, bool(args.per_run_only), mode, args.profile or 0,
                    ns.url if ns is not None else None, args.statements)
    finally:
        if ns is not None:
            ns.drop()
    if mode != "callgrind":
        print(f"supervisor CPU {row['cpu_ms_per_run']:.3f} ms per run (system {row['sys_ms_per_run']:.3f}; "
              f"context switches per run {row['switches_per_run'][0]:.2f} voluntary, "
              f"{row['switches_per_run'][1]:.2f} involuntary), worker CPU (workers and their watchdogs) "
              f"{row['worker_ms_per_run']:.3f} ms per run, {row['runs_per_s']:.0f} runs/s ({args.jobs} "
              f"runs, cap {args.cap}, {args.backend}, log level {args.log_level}, load average "
              f"{os.getloadavg()[0]:.1f})")
        if row["server_ms_per_run"] is not None:
            print(f"server CPU {row['server_ms_per_run']:.3f} ms per run (its backend processes)")
        trips = row["round_trips"]
        if trips is not None:
            per = {key: n / args.jobs for key, n in trips.items()}
            print(f"round trips per run: {per['total']:.2f} (statements {per['statements']:.2f}, BEGIN "
                  f"{per['BEGIN']:.2f}, COMMIT {per['COMMIT']:.2f}, ROLLBACK {per['ROLLBACK']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
