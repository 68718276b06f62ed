"""Issue 12's accounting on a real ``serve`` under saturation: for every job, occurrences due = runs +
skipped + missed, exactly.

    python benchmarks/accounting.py [--workload benchmarks/workloads/saturate.toml] [--jobs N] [--cap 5]
        [--duration-s 10] [--backend sqlite|postgresql] [--mode Skip] [--policy RunOnce] [--show 10]

Syncs the workload's jobs, runs ``serve --run-for S`` (real workers, a fresh SQLite file or PostgreSQL
schema), then per job counts the occurrences due from its first ``next_run_at`` (read before ``serve``
starts) up to, not including, its ``next_run_at`` at the end (the cron schedule, counted one by one);
the occurrences run (run rows with a ``scheduled_at``, first attempts only: a retry is the same
occurrence); ``skipped_count`` and ``missed_count``. Prints the totals, the first ``--show`` jobs and
every job that is off (due != run + skipped + missed), and exits 1 if any is. Not a test: it asserts
nothing but the sum it exists to show.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workload as wl
from runner import PLUGINS_DIR, Namespace

from mjsched_isolated import planner
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import jobs, runs


def _due(job: dict, first, until) -> int:
    """The job's occurrences from ``first`` (itself an occurrence) up to, not including, ``until``."""
    count, when = 0, first
    while when is not None and until is not None and when < until:
        count += 1
        when = planner.occurrence_after(job, when)
    return count


def _read(url: str) -> tuple[dict[str, dict], dict[str, int]]:
    """(job rows by name, first-attempt runs with a scheduled_at by job name)."""
    store = Store.open(url)
    try:
        with store.engine.connect() as conn:
            rows = {r["name"]: dict(r) for r in conn.execute(sa.select(jobs)).mappings()}
            counted = conn.execute(
                sa.select(jobs.c.name, sa.func.count(runs.c.id)).join(jobs, jobs.c.id == runs.c.job_id)
                .where(runs.c.scheduled_at.is_not(None), runs.c.attempt == 1).group_by(jobs.c.name)).all()
    finally:
        store.close()
    return rows, {name: n for name, n in counted}


def measure(w: wl.Workload, *, cap: int, duration_s: float, backend: str) -> list[dict]:
    """Run ``serve`` on ``w`` for ``duration_s`` and return one dict per job: name, due, run, skipped, missed."""
    tmp = Path(tempfile.mkdtemp(prefix="mjsched-accounting-"))
    ns = Namespace(backend, tmp)
    try:
        (tmp / "jobs.toml").write_text(wl.jobs_toml(w))
        subprocess.run([sys.executable, "-m", "mjsched_isolated", "jobs", "sync", str(tmp / "jobs.toml"), "--db",
                        ns.url, "--plugins", PLUGINS_DIR, "--log-level", "WARNING"],
                       check=True, capture_output=True, timeout=600, cwd=tmp)
        first = {name: job["next_run_at"] for name, job in _read(ns.url)[0].items()}
        subprocess.run([sys.executable, "-m", "mjsched_isolated", "serve", "--db", ns.url, "--plugins", PLUGINS_DIR,
                        "--max-concurrent-jobs", str(cap), "--run-for", str(duration_s), "--shutdown-timeout-s", "1",
                        "--log-level", "WARNING"], check=True, capture_output=True, timeout=duration_s + 120, cwd=tmp)
        rows, ran = _read(ns.url)
        return [{"job": name, "due": _due(job, first[name], job["next_run_at"]), "run": ran.get(name, 0),
                 "skipped": job["skipped_count"], "missed": job["missed_count"]} for name, job in sorted(rows.items())]
    finally:
        ns.drop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=str(HERE / "workloads" / "saturate.toml"))
    ap.add_argument("--jobs", type=int, help="override the workload's job count")
    ap.add_argument("--cap", type=int, default=5)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--mode", help="override the workload's concurrency_mode (Skip, Queue, Concurrent, ...)")
    ap.add_argument("--policy", help="override the workload's missed_run_policy (RunOnce, Skip, RunAll)")
    ap.add_argument("--show", type=int, default=10, help="print this many jobs besides the ones that are off")
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs: must be at least 1, got {args.jobs}")
    if not 1 <= args.duration_s <= 3600:
        ap.error(f"--duration-s: must be from 1 to 3600 seconds, got {args.duration_s:g}")
    w = wl.load_or_exit(args.workload)
    overrides = {k: v for k, v in (("jobs", args.jobs), ("concurrency_mode", args.mode),
                                   ("missed_run_policy", args.policy)) if v is not None}
    try:
        w = wl.check(msgspec.structs.replace(w, **overrides))
    except wl.WorkloadError as exc:
        ap.error(str(exc))
    rows = measure(w, cap=args.cap, duration_s=args.duration_s, backend=args.backend)
    off = [r for r in rows if r["due"] != r["run"] + r["skipped"] + r["missed"]]
    print(f"workload {w.name}: {len(rows)} jobs ({w.concurrency_mode}, {w.missed_run_policy}), cap {args.cap}, "
          f"{args.duration_s:g} s on {args.backend}")
    print(f"{'job':<24} {'due':>6} {'run':>6} {'skipped':>8} {'missed':>7}")
    for r in rows[:args.show] + [r for r in off if r not in rows[:args.show]]:
        mark = "" if r not in off else "   <- off"
        print(f"{r['job']:<24} {r['due']:>6} {r['run']:>6} {r['skipped']:>8} {r['missed']:>7}{mark}")
    total = {k: sum(r[k] for r in rows) for k in ("due", "run", "skipped", "missed")}
    print(f"{'total':<24} {total['due']:>6} {total['run']:>6} {total['skipped']:>8} {total['missed']:>7}")
    print(f"jobs off (due != run + skipped + missed): {len(off)} of {len(rows)}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
