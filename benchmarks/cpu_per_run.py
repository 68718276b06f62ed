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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import throughput

from mjsched_isolated import logs
from mjsched_isolated.store import jobs
from mjsched_isolated.supervisor import utcnow


def drive(k: int, cap: int, log_level: str, per_run_only: bool, mode: str, profile_top: int) -> dict:
    """One measurement in this process; ``mode``: ``rusage``, ``profile`` or ``callgrind`` (toggle only)."""
    log_file = tempfile.NamedTemporaryFile("w", prefix="cpu-per-run-", suffix=".log", delete=False)  # noqa: SIM115
    sys.stderr = log_file
    logs.configure(log_level)
    if per_run_only:
        throughput.Settings = functools.partial(throughput.Settings, rescan_interval_s=3600, lease_ttl_s=7200,
                                                lease_renew_interval_s=3600)
        # SQLite's due read-ahead is read afresh each second or each READ_AHEAD_ROWS claims, whichever comes
        # first: at the real pace (hundreds of runs a second) that is the row count, under valgrind the second
        jobs.READ_AHEAD_FOR = dt.timedelta(hours=1)
    bench = throughput.Bench(cap, k, None)
    try:
        bench.insert_jobs()
        bench.start_workers()
        bench.warm_up()
        due = utcnow()
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
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        result = bench.collect(due, cpu_s)
    finally:
        bench.close()
        sys.stderr = sys.__stderr__
        log_file.close()
        os.unlink(log_file.name)
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(profile_top)
    worker_ms = sum(workers_after.get(pid, cpu) - cpu for pid, cpu in workers_before.items()) * 1000 / k
    return {"runs": k, "cpu_ms_per_run": cpu_s * 1000 / k, "runs_per_s": result["runs_per_s"],
            "worker_ms_per_run": worker_ms}


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
    ap.add_argument("--inside-callgrind", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs is None:
        args.jobs = 500 if args.callgrind or args.inside_callgrind else 2000
    if args.jobs < 1 or args.cap < 1:
        ap.error("--jobs and --cap: must be at least 1")
    if args.callgrind:
        return under_callgrind(args)
    mode = "callgrind" if args.inside_callgrind else "profile" if args.profile else "rusage"
    row = drive(args.jobs, args.cap, args.log_level, bool(args.per_run_only), mode, args.profile or 0)
    if mode != "callgrind":
        print(f"supervisor CPU {row['cpu_ms_per_run']:.3f} ms per run, worker CPU (workers and their watchdogs) "
              f"{row['worker_ms_per_run']:.3f} ms per run, {row['runs_per_s']:.0f} runs/s ({args.jobs} "
              f"runs, cap {args.cap}, log level {args.log_level}, load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
