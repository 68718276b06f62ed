"""A saturated PostgreSQL poll with its results recorded in place or overlapped (issue 11, ``Recorder.send``).

The store calls a saturated supervisor makes per poll, ``--cycles`` times on a fresh schema with ``--jobs``
jobs all due, in the order the loop makes them: the previous poll's results (``finish_runs``), the due read,
the claim of ``--batch`` jobs (``claim_many`` with ``busy``) and the live-Skip read. Two modes, alternated
block by block (``--block`` polls each) so that both meet the same disk and load:

* ``inplace``: the results' transaction is waited for, then the due read (main before overlapped recording);
* ``overlap``: the results go to a thread (as ``Recorder.send``), the due read is made meanwhile, the results'
  commit is awaited before the claim (``Recorder.settle``);
* ``claim-too`` (an upper bound, not what the supervisor may do: its claims depend on the results' leases and
  slots): the results' commit is awaited only after the claim, which overlaps it too.

Per mode: wall ms per run, median and range over its blocks, with the load average.

    python benchmarks/pg_overlap.py [--jobs 3000] [--batch 10] [--cycles 1200] [--block 100]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner

from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import ClaimRequest, Outcome
from mjsched_isolated.store.schema import jobs

INSTANCE = "pgoverlap-1"
MODES = ("inplace", "overlap", "claim-too")


def run(jobs_n: int, batch: int, cycles: int, block: int, warmup: int) -> dict[str, list[float]]:
    tmp = Path(tempfile.mkdtemp(prefix="pgoverlap-"))
    ns = runner.Namespace("postgresql", tmp)
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
    try:
        store = Store.open(ns.url)
        now = start = store.db_now()
        store.register_supervisor(INSTANCE, "pgoverlap", os.getpid(), 3600.0)
        base = (now - dt.timedelta(days=1)).replace(microsecond=0)
        with store.engine.begin() as conn:
            conn.execute(jobs.insert(), [{
                "name": f"pg-{i}", "job_type": "bench", "cron_expression": "* * * * * *", "status": "Active",
                "timezone": "UTC", "next_run_at": base, "created_at": now, "updated_at": now}
                for i in range(jobs_n)])
        deadline = now + dt.timedelta(days=2)
        per_block: dict[str, list[float]] = {m: [] for m in MODES}
        phases = {m: [0.0, 0.0, 0.0] for m in MODES}  # results (in place or sent), due read, wait for the results
        results: list[Outcome] = []
        started = time.monotonic()
        block_start, mode = time.perf_counter(), MODES[0]
        for cycle in range(warmup + cycles):
            if cycle >= warmup and (cycle - warmup) % block == 0:
                if cycle > warmup:
                    per_block[mode].append((time.perf_counter() - block_start) * 1000 / (block * batch))
                mode = MODES[((cycle - warmup) // block) % len(MODES)]
                block_start = time.perf_counter()
            now = start + dt.timedelta(seconds=time.monotonic() - started)
            sent = None
            t0 = time.perf_counter()
            if results and mode != "inplace":
                sent = thread.submit(store.finish_runs, results)
            elif results:
                store.finish_runs(results)
            t1 = time.perf_counter()
            due = store.due_jobs(now, limit=batch)
            t2 = time.perf_counter()
            if sent is not None and mode == "claim-too" and {j["id"] for j in due} & {o.job_id for o in results}:
                sent.result()  # a job of those results is due again (the backlog went round): its row waits
            if sent is not None and mode == "overlap":
                sent.result()
            t3 = time.perf_counter()
            if cycle >= warmup:
                phases[mode][0] += t1 - t0
                phases[mode][1] += t2 - t1
                phases[mode][2] += t3 - t2
            if len(due) != batch:
                raise RuntimeError(f"cycle {cycle}: {len(due)} due jobs, not {batch}")
            busy: set[int] = set()
            claims = store.claim_many([ClaimRequest(
                job=j, next_run_at=j["next_run_at"] + dt.timedelta(seconds=1), lease_s=600.0, deadline_at=deadline,
                scheduled_at=j["next_run_at"]) for j in due], now=now, instance=INSTANCE, not_before=now, busy=busy)
            if sent is not None and mode == "claim-too":
                sent.result()
            if any(c is None for c in claims) or busy:
                raise RuntimeError(f"cycle {cycle}: a claim lost")
            store.due_live_skip_jobs(now, 100)
            results = [Outcome(run_id=c.run_id, job_id=j["id"], token=c.lock_token, status="Completed", success=True,
                               details={"plugin_started_at": 0.0}, duration_ms=1.0,
                               completed_at=dt.datetime.now(dt.UTC))
                       for c, j in zip(claims, due, strict=True) if c is not None]
        per_block[mode].append((time.perf_counter() - block_start) * 1000 / (block * batch))
        store.close()
        runs = cycles * batch / len(MODES)
        return {**per_block, **{f"{m} phases": [v * 1000 / runs for v in phases[m]] for m in MODES}}
    finally:
        thread.shutdown()
        ns.drop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=1200)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=50)
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    out = run(a.jobs, a.batch, a.cycles, a.block, a.warmup)
    load1 = os.getloadavg()[0]
    print(f"{a.cycles} polls of {a.batch}, {a.jobs} jobs, blocks of {a.block} alternated; "
          f"load {load0:.1f} -> {load1:.1f}")
    for mode in MODES:
        results, due, wait = out.pop(f"{mode} phases")
        print(f"{mode:9} ms/run: results {'in place' if mode == 'inplace' else 'sent'} {results:.3f}, due read "
              f"{due:.3f}, then waiting for the results {wait:.3f}")
    for mode, walls in out.items():
        print(f"{mode:9} wall ms/run median {statistics.median(walls):.3f} (range {min(walls):.3f}-{max(walls):.3f}, "
              f"{len(walls)} blocks): {' '.join(f'{w:.3f}' for w in walls)}")


if __name__ == "__main__":
    main()
