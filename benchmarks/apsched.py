"""The same workload on APScheduler 3.x: BackgroundScheduler + ProcessPoolExecutor(cap) + SQLAlchemyJobStore
(SQLite file or PostgreSQL schema), ``coalesce=True`` (like RunOnce), ``max_instances=1`` (like Skip),
``misfire_grace_time=None`` (late runs still run, like the engine).

    python benchmarks/apsched.py benchmarks/workloads/mixed.toml --cap 5 --duration-s 20 [--backend postgresql]

:func:`run_aps` starts this file as a subprocess (so its CPU and memory are measured like a supervisor's,
with psutil) and computes the same metrics as runner.py. The child writes its runs and log counts as JSON:
a run's ``started_at`` is when the function began, as it recorded it itself (read from the EXECUTED event),
or, for a run that never reported (hung), when APScheduler submitted it - its SUBMITTED event is sent only
after its whole pass over the due jobs, so it is not used for runs that did report; ``exec_at`` is when the
function began, ``scheduled_at`` the trigger's scheduled time. A SQLite job store is in WAL mode with
``synchronous=NORMAL``, as the engine's own database (without it every update waits for a sync). The child
runs in a session of its own; its pool processes (one stuck in a hung job, forever) are killed with its
process group when it has exited. The side-by-side throughput comparison is ``compare.py``.
``aps_max_instances_skips`` counts the log lines
"Execution of job ... skipped: maximum number of running instances reached"; ``aps_log_sample`` keeps some.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import runner
import workload as wl

TRIGGERS = {"every_second": {"second": "*"}, "every_minute": {"second": "0"}, "hourly": {"minute": "0", "second": "0"}}


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.skips, self.sample, self.other = 0, [], []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "maximum number of running instances reached" in msg:
            self.skips += 1
            if len(self.sample) < 3 or self.skips % 50 == 0:
                self.sample.append(f"{time.strftime('%H:%M:%S')} {record.levelname} {record.name}: {msg}")
        elif len(self.other) < 10:
            self.other.append(f"{record.levelname} {record.name}: {msg}")


def child_main(workload_path: str, cap: int, duration_s: float, url: str, out: str) -> None:
    """Run APScheduler for ``duration_s`` and write {"runs": [...], "skips": n, ...} to ``out``."""
    import aps_jobs
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MISSED, EVENT_JOB_SUBMITTED
    from apscheduler.executors.pool import ProcessPoolExecutor
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.cron import CronTrigger
    counter = _Counter()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("apscheduler").addHandler(counter)
    w = wl.load(workload_path)
    specs = wl.job_specs(w)
    kinds = {s["name"]: s["kind"] for s in specs}
    submitted: dict[tuple[str, float], float] = {}
    runs: list[dict] = []
    lock = threading.Lock()
    missed = [0]

    finished: dict[tuple[str, float], tuple[float | None, float, bool]] = {}
    first_done = threading.Event()

    def on_event(event) -> None:  # called from APScheduler's threads; an execution may be reported first
        now = time.time()
        with lock:
            if event.code == EVENT_JOB_SUBMITTED:
                for when in event.scheduled_run_times:
                    submitted.setdefault((event.job_id, when.timestamp()), now)
            elif event.code == EVENT_JOB_MISSED:
                missed[0] += 1
            else:
                ok = event.code == EVENT_JOB_EXECUTED
                finished[(event.job_id, event.scheduled_run_time.timestamp())] = (event.retval if ok else None, now, ok)
                first_done.set()

    import sqlalchemy as sa
    engine = sa.create_engine(url)
    if url.startswith("sqlite"):
        @sa.event.listens_for(engine, "connect")
        def _wal(dbapi_conn, _record) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()
    scheduler = BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(engine=engine)}, executors={"default": ProcessPoolExecutor(cap)},
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None}, timezone="UTC")
    scheduler.add_listener(on_event, EVENT_JOB_SUBMITTED | EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED)
    for s in specs:
        scheduler.add_job(aps_jobs.bench_job, CronTrigger(timezone="UTC", **TRIGGERS[s["cron_kind"]]), id=s["name"],
                          name=s["name"], kwargs=s["configuration"], replace_existing=True)
    started = time.time()
    scheduler.start()
    first_done.wait(120)  # like the engine's serve: duration_s from (about) the first run, not from the start
    time.sleep(duration_s)
    stopped = time.time()
    with lock:  # submitted and never finished: still in flight (hung)
        for key in sorted(set(submitted) | set(finished)):
            exec_at, done_at, ok = finished.get(key, (None, None, None))
            runs.append({"job": key[0], "kind": kinds.get(key[0], "?"), "scheduled_at": key[1],
                         "started_at": exec_at or submitted.get(key, done_at), "exec_at": exec_at,
                         "completed_at": done_at, "crashed": False, "instance": "aps",
                         "status": "Running" if ok is None else "Completed" if ok else "Failed"})
        data = {"runs": runs, "skips": counter.skips, "sample": counter.sample, "other": counter.other,
                "missed_events": missed[0], "started": started, "stopped": stopped}
    Path(out).write_text(json.dumps(data))
    sys.stdout.flush()
    os._exit(0)  # a hung pool process would block a graceful shutdown forever: that is the point


def run_aps(w_path: str, *, cap: int, duration_s: float, backend: str = "sqlite", warmup_s: float = 3.0) -> dict:
    """Run APScheduler on the workload file in a subprocess; same metrics keys as ``runner.run_engine``
    plus ``aps_max_instances_skips`` and ``aps_log_sample``."""
    w = wl.load_or_exit(w_path)
    specs = wl.job_specs(w)
    tmp = Path(tempfile.mkdtemp(prefix="aps-bench-"))
    ns = runner.Namespace(backend, tmp)
    proc = None
    try:
        out = tmp / "aps.json"
        with open(tmp / "aps.log", "wb") as aps_log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, str(Path(__file__)), w_path, "--cap", str(cap), "--duration-s",
                                     str(duration_s), "--url", ns.url, "--child-out", str(out)],
                                    stdout=subprocess.DEVNULL, stderr=aps_log, start_new_session=True)
        sampler = runner.Sampler([proc.pid])
        while proc.poll() is None:
            sampler.sample()
            time.sleep(runner.SAMPLE_S)
        _kill_leftovers(proc.pid)
        if not out.exists():
            raise RuntimeError("APScheduler child failed:\n" + (tmp / "aps.log").read_text()[-3000:])
        data = json.loads(out.read_text())
        runs = data["runs"]
        # the first run that really began (a hung run never reports: its submission time is no start at all)
        first = min((r["exec_at"] for r in runs if r["exec_at"]),
                    default=min((r["started_at"] for r in runs if r["started_at"]), default=data["started"]))
        t0, t1 = first + warmup_s, min(first + duration_s - 1.0, data["stopped"] - 1.0)
        result = metrics.summarize(runs, specs, t0, t1, cap, data["stopped"])
        sup_cpu = sum(sampler.cpu_s.values())
        result.update({
            "engine": "apscheduler", "backend": backend, "workload": w.name, "jobs": w.jobs, "cap": cap,
            "hang": w.faults.hang, "duration_s": duration_s, "window_s": t1 - t0, "skipped": data["skips"],
            "aps_max_instances_skips": data["skips"], "aps_log_sample": data["sample"],
            "aps_other_log": data["other"], "aps_missed_events": data["missed_events"],
            "sup_cpu_s": sup_cpu, "sup_cpu_ms_per_run": 1000 * sup_cpu / max(1, len(runs)),
            "sup_peak_rss_mb": max(sampler.peak_rss_mb.values()), "all_runs": len(runs),
            "loadavg_1m": os.getloadavg()[0]})
        shutil.rmtree(tmp, ignore_errors=True)  # kept only when something failed (its log tells why)
        return result
    finally:
        if proc is not None:
            _kill_leftovers(proc.pid)
        ns.drop()


def _kill_leftovers(pgid: int) -> None:
    """The pool processes (one hung) outlive the os._exit of their parent: kill its process group (the child
    was started in a session of its own, so the group is exactly it and the pool it forked)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--cap", type=int, default=5)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--url", help=argparse.SUPPRESS)        # child mode
    ap.add_argument("--child-out", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args(argv)
    if args.child_out:
        child_main(args.workload, args.cap, args.duration_s, args.url, args.child_out)
        return 0
    print(json.dumps(run_aps(args.workload, cap=args.cap, duration_s=args.duration_s, backend=args.backend), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
