"""The database's limit for this engine: the statements one run needs, issued back to back by one
process with no supervisor, pool, planner or cron around them.

    python benchmarks/rawdb.py [--runs 2000] [--backend sqlite|postgresql] [--jobs 50]

One run = ``Store.claim`` (claim UPDATE of the job with the lease and occurrence compare-and-set + run
INSERT, one transaction) then ``Store.finish_run`` (run UPDATE + statistics UPDATE + lease release, one
transaction): exactly the statements store.py issues for a run, through its own methods. The due-jobs
poll is not included. Prints runs/s and per-run latency in ms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import runner

from mjsched_isolated.store import Store

UTC = dt.UTC


def raw_limit(runs: int = 2000, backend: str = "sqlite", jobs: int = 50) -> dict:
    """Claim + finish ``runs`` times, cycling over ``jobs`` jobs. Returns runs_per_s, ms_per_run_p50/p99."""
    tmp = Path(tempfile.mkdtemp(prefix="rawdb-"))
    ns = runner.Namespace(backend, tmp)
    store = Store.open(ns.url)
    try:
        now = store.db_now()
        instance = "rawdb-1"
        store.register_supervisor(instance, "rawdb", os.getpid(), 3600.0)
        base = dt.datetime(2020, 1, 1, tzinfo=UTC)
        ids = [store.add_job({"name": f"raw-{i}", "job_type": "bench", "cron_expression": "* * * * * *",
                              "status": "Active", "next_run_at": base}, now) for i in range(jobs)]
        rows = {i: store.get_job_by_id(i) for i in ids}
        lat_ms, begin = [], time.perf_counter()
        for n in range(runs):
            job = rows[ids[n % jobs]]
            nxt = job["next_run_at"] + dt.timedelta(seconds=1)
            t = time.perf_counter()
            claim = store.claim(job, now=now, next_run_at=nxt, instance=instance, lease_s=600.0,
                                deadline_at=now + dt.timedelta(seconds=600), scheduled_at=job["next_run_at"])
            if claim is None:
                raise RuntimeError(f"claim {n} refused")
            store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Completed", success=True,
                             error_message=None, details={"plugin_started_at": 0.0}, duration_ms=1.0)
            lat_ms.append((time.perf_counter() - t) * 1000)
            job["next_run_at"] = nxt
        elapsed = time.perf_counter() - begin
        return {"backend": backend, "runs": runs, "runs_per_s": runs / elapsed,
                "ms_per_run_p50": metrics.pct(lat_ms, 50), "ms_per_run_p99": metrics.pct(lat_ms, 99),
                "loadavg_1m": os.getloadavg()[0]}
    finally:
        store.close()
        ns.drop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    args = ap.parse_args(argv)
    print(json.dumps(raw_limit(args.runs, args.backend, args.jobs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
