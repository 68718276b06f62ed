"""Run the real engine on a workload: ``python -m mjsched_isolated serve --run-for S`` subprocesses (real
worker children, a real SQLite file or PostgreSQL schema), sampled with psutil, then read back the runs.

    python benchmarks/runner.py benchmarks/workloads/mixed.toml --cap 5 --duration-s 20 [--backend postgresql]
        [--supervisors 2] [--lease-timeout-s 2] [--lease-ttl-s 6] [--hang 0.3] [--out results/x]

Prints one JSON object (the metrics of :func:`metrics.summarize` plus the process measurements) and, with
``--out``, writes ``<out>.json`` and ``<out>-runs.csv`` (one row per run).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import psutil
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import workload as wl

PLUGINS_DIR = str(HERE / "plugins")
POSTGRES_URL = os.environ.get("MJSCHED_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SAMPLE_S = 0.1


class Namespace:
    """A fresh database for one measurement: a SQLite file in a temp dir, or a PostgreSQL schema
    (selected via search_path; its connections carry the schema's name as their ``application_name``, so
    ``pg_stat_activity`` tells their backends from other clients'). ``url``; :meth:`drop` removes it."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.backend, self.admin, self.name = backend, None, None
        if backend == "sqlite":
            self.url = f"sqlite:///{tmp / 'bench.db'}"
            return
        self.name = f"bench_{uuid.uuid4().hex[:10]}"
        self.admin = sa.create_engine(POSTGRES_URL)
        with self.admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {self.name}")
        options = f"-csearch_path={self.name} -capplication_name={self.name}"
        self.url = sa.engine.make_url(POSTGRES_URL).update_query_dict(
            {"options": options}).render_as_string(hide_password=False)

    def drop(self) -> None:
        if self.admin is not None:
            with self.admin.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {self.name} CASCADE")
            self.admin.dispose()


def _epoch(value) -> float | None:
    return None if value is None else value.timestamp()


def read_runs(url: str, specs: list[dict]) -> tuple[list[dict], int]:
    """(runs as :mod:`metrics` dicts, total skipped_count) from the database at ``url``."""
    from mjsched_isolated.store import Store
    from mjsched_isolated.store.schema import jobs, runs
    kinds = {s["name"]: s["kind"] for s in specs}
    store = Store.open(url)
    try:
        with store.engine.connect() as conn:
            rows = conn.execute(sa.select(runs, jobs.c.name.label("job"))
                                .join(jobs, jobs.c.id == runs.c.job_id)).mappings().all()
            skipped = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(jobs.c.skipped_count), 0))).scalar_one()
    finally:
        store.close()
    out = []
    for r in rows:
        details = json.loads(r["details"]) if r["details"] else {}
        out.append({"job": r["job"], "kind": kinds.get(r["job"], "?"), "scheduled_at": _epoch(r["scheduled_at"]),
                    "started_at": _epoch(r["started_at"]), "exec_at": details.get("plugin_started_at"),
                    "completed_at": _epoch(r["completed_at"]), "status": r["status"],
                    "deadline_at": _epoch(r["deadline_at"]),
                    "crashed": r["status"] == "Failed" and "died during the run" in (r["error_message"] or ""),
                    "instance": r["executed_by_instance"]})
    return out, int(skipped)


class Sampler:
    """psutil samples of some processes every ``SAMPLE_S``: CPU time (user+system, own), RSS, and the PIDs
    and when each direct child (worker) was first seen. ``series``: [(t, pid, rss_mb, cpu_s)]."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.cpu_s = {pid: 0.0 for pid in pids}
        self.peak_rss_mb = {pid: 0.0 for pid in pids}
        self.first_seen: dict[int, float] = {}  # child pid -> when first sampled
        self.series: list[tuple[float, int, float, float]] = []

    def sample(self) -> None:
        now = time.time()
        for pid, proc in self.procs.items():
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    rss = proc.memory_info().rss / 2**20
                    kids = {c.pid for c in proc.children()}
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            self.cpu_s[pid] = cpu.user + cpu.system
            self.peak_rss_mb[pid] = max(self.peak_rss_mb[pid], rss)
            for kid in kids:
                self.first_seen.setdefault(kid, now)
            self.series.append((now, pid, rss, self.cpu_s[pid]))


MIN_DURATION_S = 8.0  # warm-up (3 s) + tail (1 s) + a window of at least 4 s
STARTUP_S = 5.0  # serve runs this much longer than duration_s: its workers start before its first run


def run_engine(w: wl.Workload, *, cap: int, duration_s: float, lease_timeout_s: float = 600.0,
               lease_ttl_s: float = 30.0, renew_s: float | None = None, backend: str = "sqlite",
               supervisors: int = 1, warmup_s: float = 3.0, kill_one_at_s: float | None = None,
               keep_runs: bool = False, log_dir: Path | None = None) -> dict:
    """Run ``supervisors`` ``serve`` processes for ``duration_s`` on ``w`` and return its metrics dict.

    Window: occurrences scheduled from the first run start + ``warmup_s`` (workers spawned, start-up
    catch-up done) to the first run start + ``duration_s`` - 1 s, never past the last claim (the jobs are
    synced before ``serve`` starts; it runs ``duration_s`` + ``STARTUP_S``: the first run comes after the
    workers have started, up to a few seconds on a loaded machine). ``kill_one_at_s``: SIGKILL the first
    supervisor that many seconds in (lease TTL experiments; adds ``recovery_s``). ``renew_s`` defaults to
    TTL / 3."""
    specs = wl.job_specs(w)
    tmp = Path(tempfile.mkdtemp(prefix="mjsched-bench-"))
    ns = Namespace(backend, tmp)
    renew_s = renew_s if renew_s is not None else lease_ttl_s / 3
    try:
        (tmp / "jobs.toml").write_text(wl.jobs_toml(w))
        # the jobs are written before serve starts: its --run-for counts from its start, and a sync of 1000 jobs
        # inside serve once took longer than the whole run (the window came out empty)
        subprocess.run([sys.executable, "-m", "mjsched_isolated", "jobs", "sync", str(tmp / "jobs.toml"), "--db",
                        ns.url, "--plugins", PLUGINS_DIR, "--log-level", "WARNING"],
                       check=True, capture_output=True, timeout=600, cwd=tmp)
        cmd = [sys.executable, "-m", "mjsched_isolated", "serve", "--db", ns.url, "--plugins", PLUGINS_DIR,
               "--max-concurrent-jobs", str(cap),
               "--lease-timeout-s", str(lease_timeout_s), "--lease-ttl-s", str(lease_ttl_s),
               "--lease-renew-interval-s", str(renew_s), "--run-for", str(duration_s + STARTUP_S),
               "--shutdown-timeout-s", "1", "--log-level", "WARNING"]
        with contextlib.ExitStack() as stack:  # each child keeps its own copy of its log's descriptor
            logs = [stack.enter_context(open(tmp / f"serve-{i}.log", "wb")) for i in range(supervisors)]
            launched = time.time()
            procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp) for log in logs]
        sampler = Sampler([p.pid for p in procs])
        killed_at = None
        while any(p.poll() is None for p in procs):
            sampler.sample()
            if kill_one_at_s is not None and killed_at is None and time.time() - launched >= kill_one_at_s:
                procs[0].send_signal(signal.SIGKILL)
                killed_at = time.time()
            if time.time() - launched > duration_s + STARTUP_S + 60:
                for p in procs:
                    p.kill()
            time.sleep(SAMPLE_S)
        stopped = time.time()
        if log_dir is not None:
            for i in range(supervisors):
                shutil.copy(tmp / f"serve-{i}.log", log_dir / f"serve-{i}.log")
        runs, skipped = read_runs(ns.url, specs)
        if not runs:
            raise RuntimeError(f"no runs recorded; see {tmp}/serve-0.log:\n"
                               + (tmp / "serve-0.log").read_text()[-2000:])
        first = min(r["started_at"] for r in runs if r["started_at"])
        # from the first run, not from the launch; and never past the last claim (serve had stopped claiming)
        t0 = first + warmup_s
        t1 = min(first + duration_s - 1.0, max(r["started_at"] for r in runs))
        if t1 <= t0:
            raise RuntimeError(f"nothing to measure: the window after the {warmup_s:g} s warm-up is empty "
                               f"({t1 - t0:.2f} s); run longer than {duration_s:g} s")
        result = metrics.summarize(runs, specs, t0, t1, cap, stopped)
        sup_cpu = sum(sampler.cpu_s.values())
        result.update({
            "engine": "mjsched", "backend": backend, "workload": w.name, "jobs": w.jobs, "cap": cap,
            "supervisors": supervisors, "lease_timeout_s": lease_timeout_s, "lease_ttl_s": lease_ttl_s,
            "renew_s": renew_s, "hang": w.faults.hang, "duration_s": duration_s, "window_s": t1 - t0,
            "skipped": skipped, "sup_cpu_s": sup_cpu, "sup_cpu_ms_per_run": 1000 * sup_cpu / max(1, len(runs)),
            "sup_peak_rss_mb": max(sampler.peak_rss_mb.values()),
            # children first seen once runs were under way: respawned workers (the initial pool, the throwaway
            # child of the jobs sync and multiprocessing's resource tracker all start before the first run)
            "respawns_observed": sum(seen > first + 0.5 for seen in sampler.first_seen.values()),
            "all_runs": len(runs), "loadavg_1m": os.getloadavg()[0],
        })
        if killed_at is not None:
            result.update(_recovery(runs, sampler, procs[0].pid, killed_at))
        if keep_runs:
            result["_runs"], result["_series"] = runs, sampler.series
        return result
    except BaseException:
        log_dir = log_dir or tmp  # keep the logs an error message points to
        raise
    finally:
        for p in locals().get("procs", []):
            if p.poll() is None:
                p.kill()
        ns.drop()
        if log_dir != tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _recovery(runs: list[dict], sampler: Sampler, dead_pid: int, killed_at: float) -> dict:
    """After SIGKILLing a supervisor at ``killed_at`` (seconds after it): ``lease_end_s``, when the runs it
    held were lost (their abandoned rows' completed_at is the end of its liveness lease); ``recovery_s`` /
    ``recovery_first_s``, when every / the first job it held ran again on another supervisor."""
    dead = [r for r in runs if r["instance"].endswith(f"-{dead_pid}")]
    held = {r["job"] for r in dead
            if r["started_at"] <= killed_at and (r["completed_at"] is None or r["completed_at"] > killed_at)}
    again = [min((r["started_at"] for r in runs if r["job"] == job and r["started_at"] > killed_at
                  and not r["instance"].endswith(f"-{dead_pid}")), default=None) for job in held]
    again = [a for a in again if a is not None]
    lost = [r["completed_at"] for r in dead
            if r["status"] == "Failed" and r["completed_at"] and r["started_at"] <= killed_at
            and r["completed_at"] > killed_at]
    return {"killed_held_jobs": len(held), "recovery_s": (max(again) - killed_at) if again else None,
            "recovery_first_s": (min(again) - killed_at) if again else None,
            "lease_end_s": (max(lost) - killed_at) if lost else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--cap", type=int, default=5)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--lease-timeout-s", type=float, default=600.0)
    ap.add_argument("--lease-ttl-s", type=float, default=30.0)
    ap.add_argument("--renew-s", type=float)
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--supervisors", type=int, default=1)
    ap.add_argument("--hang", type=float, help="override faults.hang")
    ap.add_argument("--kill-one-at-s", type=float)
    ap.add_argument("--out", help="write <out>.json and <out>-runs.csv")
    args = ap.parse_args(argv)
    if args.duration_s < MIN_DURATION_S:
        ap.error(f"--duration-s: must be at least {MIN_DURATION_S:g} s (3 s warm-up and a 1 s tail are not measured)")
    w = wl.load_or_exit(args.workload)
    if args.hang is not None:
        try:
            w = wl.check(msgspec.structs.replace(w, faults=msgspec.structs.replace(w.faults, hang=args.hang)))
        except wl.WorkloadError as exc:
            ap.error(f"--hang: {exc}")
    result = run_engine(w, cap=args.cap, duration_s=args.duration_s, lease_timeout_s=args.lease_timeout_s,
                        lease_ttl_s=args.lease_ttl_s, renew_s=args.renew_s, backend=args.backend,
                        supervisors=args.supervisors, kill_one_at_s=args.kill_one_at_s, keep_runs=bool(args.out))
    runs = result.pop("_runs", [])
    result.pop("_series", None)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        with open(args.out + "-runs.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(runs[0]) if runs else ["job"])
            writer.writeheader()
            writer.writerows(runs)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
