"""The engine off saturation: dispatch of a burst, kills at the deadline, the idle loop with many jobs.

    python benchmarks/idle.py                    # ~2.5 min: all three parts, SQLite; prints a markdown table
    python benchmarks/idle.py --parts burst --instants 20 --backend postgresql

Three measurements of ``python -m mjsched_isolated serve`` (real workers, a fresh database each, jobs
written with ``mjsched jobs sync`` before it starts), for the figures issue 11 asks of an idle machine:

* ``burst``: ``--burst-jobs`` (20) jobs due at the same instant every second, cap = that many, 1 ms each,
  for ``--instants`` (60) instants from 3 s after the first run. Per instant, the lateness of the *last* of its runs
  to start (the job's own start, ``details.plugin_started_at``, minus ``scheduled_at``); p50 / p99 / max over
  the instants, and the same for the claim (``started_at``: 0 for runs claimed ahead, which serve's
  ``claim_ahead_s`` records as started at their instant). ``early``: runs whose code began before their
  scheduled instant (must be 0: a run never starts early, claimed ahead or not).
* ``kill``: 3 jobs that hang, every second, run deadline (``--lease-timeout-s``) 1 s, cap 3, for
  ``--kill-s`` (20 s) after the first run, ``kill_grace_s`` ``--kill-grace-s`` (0: SIGKILL at the deadline,
  no SIGTERM grace; serve's default grace is 5 s): ``completed_at - deadline_at`` of their Timeout runs, p50 /
  p99 / max: from the deadline to the kill being recorded.
* ``idle``: ``--idle-jobs`` (100,000) Active jobs none of which is due (``0 0 1 1 *``; one synced through
  the CLI, the rest copied from its row in one bulk INSERT), cap 10: the supervisor's CPU over the last
  ``--idle-s`` (30 s) of ``--idle-s`` + 10 s, as a share of one core (psutil), and how long after its launch
  serve registered (its start-up, which must end before the window).

The same caveat as every benchmark: on a loaded machine the figures are the machine's; each row carries
the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare
import metrics
import runner
import sqlalchemy as sa

WARMUP_S = 3.0


def _jobs_toml(names: list[str], cron: str, kind: str) -> str:
    return "".join(f'[[jobs]]\nname = "{n}"\njob_type = "bench"\ncron_expression = "{cron}"\n'
                   f'[jobs.configuration]\nkind = "{kind}"\nruntime_ms = 1.0\n\n' for n in names)


def last_of_instant_ms(runs: list[dict], field: str, t0: float, t1: float) -> list[float]:
    """Per scheduled instant in ``[t0, t1)``: ms from it to the latest ``field`` (``exec_at`` / ``started_at``)
    of its runs (pure; tests/test_benchmarks.py)."""
    by_instant: dict[float, float] = {}
    for r in runs:
        s, v = r["scheduled_at"], r.get(field)
        if s is not None and v is not None and t0 <= s < t1:
            by_instant[s] = max(by_instant.get(s, v), v)
    return [(v - s) * 1000 for s, v in sorted(by_instant.items())]


def _serve(tmp: Path, url: str, toml: str, cap: int, after_first_run_s: float, extra: list[str] = (),
           env: dict[str, str] | None = None) -> tuple:
    """Sync ``toml``, run serve until ``after_first_run_s`` after its first run row (then SIGTERM), sampled;
    ``env``: settings for serve (``MJSCHED_<KEY>``). Returns the sampler, the launch and stop times, and the
    processes it left behind."""
    (tmp / "jobs.toml").write_text(toml)
    common = ["--db", url, "--plugins", runner.PLUGINS_DIR]
    subprocess.run([sys.executable, "-m", "mjsched_isolated", "jobs", "sync", str(tmp / "jobs.toml"), *common,
                    "--log-level", "WARNING"], check=True, capture_output=True, timeout=600, cwd=tmp)
    return _run(tmp, common, cap, None, extra, url=url, after_first_run_s=after_first_run_s, env=env)


def _run(tmp: Path, common: list[str], cap: int, stop_after_s: float | None, extra=(), *, url: str | None = None,
         after_first_run_s: float | None = None, env: dict[str, str] | None = None) -> tuple:
    """serve, stopped (SIGTERM) ``stop_after_s`` after its launch, or ``after_first_run_s`` after its first run."""
    cmd = [sys.executable, "-m", "mjsched_isolated", "serve", *common, "--max-concurrent-jobs", str(cap),
           "--shutdown-timeout-s", "1", *extra]
    with open(tmp / "serve.log", "wb") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
                                env={**os.environ, **(env or {})})
    sampler = compare.Sampler([proc.pid])
    stopped = None
    try:
        if after_first_run_s is not None:
            assert url is not None
            stopped = compare._stop_after_first_run(url, [proc], sampler, after_first_run_s)
        while proc.poll() is None:
            sampler.sample()
            if stopped is None and stop_after_s is not None and time.time() - launched >= stop_after_s:
                proc.send_signal(signal.SIGTERM)
                stopped = time.time()
            if time.time() - launched > (stop_after_s or after_first_run_s or 0) + 180:
                proc.kill()
            time.sleep(compare.SAMPLE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = sampler.kill_leftovers([proc])
    if stopped is None:
        raise RuntimeError("serve exited by itself:\n" + (tmp / "serve.log").read_text()[-2000:])
    return sampler, launched, stopped, left


def burst(backend: str, jobs: int, instants: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="idle-burst-"))
    ns = runner.Namespace(backend, tmp)
    try:
        names = [f"burst-{i:03d}" for i in range(jobs)]
        _s, _l, _stop, left = _serve(tmp, ns.url, _jobs_toml(names, "* * * * * *", "ok"), jobs,
                                     WARMUP_S + instants + 1.5)
        runs, _ = runner.read_runs(ns.url, [{"name": n, "kind": "ok"} for n in names])
        t0 = min(r["started_at"] for r in runs) + WARMUP_S  # instants from 3 s after the first run
        t1 = t0 + instants
        exec_ms = last_of_instant_ms(runs, "exec_at", t0, t1)
        claim_ms = last_of_instant_ms(runs, "started_at", t0, t1)
        early = [r for r in runs if r.get("exec_at") is not None and r["exec_at"] < r["scheduled_at"]]
        shutil.rmtree(tmp, ignore_errors=True)
        return {"part": "burst", "backend": backend, "jobs": jobs, "instants": len(exec_ms),
                "last_start_p50_ms": metrics.pct(exec_ms, 50), "last_start_p99_ms": metrics.pct(exec_ms, 99),
                "last_start_max_ms": max(exec_ms, default=None), "last_claim_p99_ms": metrics.pct(claim_ms, 99),
                "early": len(early), "earliest_ms": min(((r["exec_at"] - r["scheduled_at"]) * 1000 for r in early),
                                                        default=None),
                "left": len(left), "loadavg_1m": os.getloadavg()[0]}
    finally:
        ns.drop()


def kill(backend: str, kill_s: float, lease_timeout_s: float, kill_grace_s: float = 0.0) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="idle-kill-"))
    ns = runner.Namespace(backend, tmp)
    try:
        names = [f"hang-{i}" for i in range(3)]
        _s, _l, _stop, left = _serve(tmp, ns.url, _jobs_toml(names, "* * * * * *", "hang"), 3, kill_s,
                                     ["--lease-timeout-s", str(lease_timeout_s)],
                                     env={"MJSCHED_KILL_GRACE_S": str(kill_grace_s)})
        runs, _ = runner.read_runs(ns.url, [{"name": n, "kind": "hang"} for n in names])
        after = [(r["completed_at"] - r["deadline_at"]) * 1000 for r in runs
                 if r["status"] == "Timeout" and r["completed_at"] and r["deadline_at"]]
        shutil.rmtree(tmp, ignore_errors=True)
        return {"part": "kill", "backend": backend, "kill_grace_s": kill_grace_s, "kills": len(after),
                "kill_after_deadline_p50_ms": metrics.pct(after, 50),
                "kill_after_deadline_p99_ms": metrics.pct(after, 99),
                "kill_after_deadline_max_ms": max(after, default=None), "left": len(left),
                "loadavg_1m": os.getloadavg()[0]}
    finally:
        ns.drop()


def idle(backend: str, jobs: int, idle_s: float, settle_s: float = 10.0) -> dict:
    from mjsched_isolated.store.schema import connect, supervisors
    from mjsched_isolated.store.schema import jobs as jobs_table
    tmp = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    ns = runner.Namespace(backend, tmp)
    try:
        (tmp / "jobs.toml").write_text(_jobs_toml(["idle-0000000"], "0 0 1 1 *", "ok"))
        common = ["--db", ns.url, "--plugins", runner.PLUGINS_DIR]
        subprocess.run([sys.executable, "-m", "mjsched_isolated", "jobs", "sync", str(tmp / "jobs.toml"), *common,
                        "--log-level", "WARNING"], check=True, capture_output=True, timeout=600, cwd=tmp)
        engine = connect(ns.url)
        try:
            with engine.begin() as conn:
                row = dict(conn.execute(sa.select(jobs_table)).mappings().one())
                row.pop("id")
                conn.execute(jobs_table.insert(), [{**row, "name": f"idle-{i:07d}"} for i in range(1, jobs)])
        finally:
            engine.dispose()
        sampler, launched, stopped, left = _run(tmp, common, 10, settle_s + idle_s)
        t1 = stopped
        t0 = t1 - idle_s
        cpu = compare.cpu_in_window(sampler.series, t0, t1)
        engine = connect(ns.url)
        try:
            with engine.connect() as conn:
                registered = conn.execute(sa.select(sa.func.min(supervisors.c.started_at))).scalar()
        finally:
            engine.dispose()
        started_after_s = registered.timestamp() - launched if registered else None
        if started_after_s is None or started_after_s > settle_s - 2:
            raise RuntimeError(f"serve registered {started_after_s} s after launch: the idle window would include "
                               "its start-up")
        shutil.rmtree(tmp, ignore_errors=True)
        return {"part": "idle", "backend": backend, "jobs": jobs, "idle_s": idle_s,
                "sup_core_pct": 100 * cpu["sup_cpu_s"] / idle_s, "workers_core_pct": 100 * cpu["wrk_cpu_s"] / idle_s,
                "registered_after_s": started_after_s, "left": len(left), "loadavg_1m": os.getloadavg()[0]}
    finally:
        ns.drop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="burst,kill,idle")
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--burst-jobs", type=int, default=20)
    ap.add_argument("--instants", type=int, default=60)
    ap.add_argument("--kill-s", type=float, default=20.0)
    ap.add_argument("--lease-timeout-s", type=float, default=1.0)
    ap.add_argument("--kill-grace-s", type=float, default=0.0,
                    help="serve's kill_grace_s for the kill part (default 0: SIGKILL at the deadline)")
    ap.add_argument("--idle-jobs", type=int, default=100_000)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if bad := set(parts) - {"burst", "kill", "idle"}:
        ap.error(f"--parts: burst, kill or idle, got {sorted(bad)}")
    for name in ("burst_jobs", "instants", "idle_jobs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be at least 1")
    began, rows = time.time(), []
    print(f"# load at start {os.getloadavg()[0]:.1f}", flush=True)
    if "burst" in parts:
        rows.append(burst(args.backend, args.burst_jobs, args.instants))
    if "kill" in parts:
        rows.append(kill(args.backend, args.kill_s, args.lease_timeout_s, args.kill_grace_s))
    if "idle" in parts:
        rows.append(idle(args.backend, args.idle_jobs, args.idle_s))
    for row in rows:
        print("\n| " + " | ".join(row) + " |\n|" + "---|" * len(row))
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    print(f"\ntotal {time.time() - began:.0f} s, load now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
