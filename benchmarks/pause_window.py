"""How close to an occurrence's instant a `jobs pause` still prevents its run (the bound of
docs/concepts/concurrency.md, "Pausing: which runs still start").

    python benchmarks/pause_window.py [--reps 5] [--offsets-ms 150,80,60,50,40,20,0]

A real ``serve`` on a fresh SQLite file (default ``claim_ahead_s`` 0.1 s, cap 2). For each trial a job due
once (``0 0 1 1 *``, ``next_run_at`` 2.5 s ahead) is added, and ``ops.pause_job`` is called so that it returns
``offset`` ms before the instant (by this machine's clock, the database's too on SQLite); the pause is
committed by then. Half a second after the instant the job's runs tell what happened: none (paused before
the claim), withdrawn (``never started``), or started. Offsets in a shuffled order; each row carries the
1-minute load average. A benchmark, not a test: it waits by the clock to place the pause.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner

from mjsched_isolated import ops
from mjsched_isolated.store import Store


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--offsets-ms", default="150,80,60,50,40,20,0")
    ns = ap.parse_args()
    offsets = [float(x) for x in ns.offsets_ms.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="pause-window-"))
    url = f"sqlite:///{tmp / 'mjsched.db'}"
    store = Store.open(url)
    cmd = [sys.executable, "-m", "mjsched_isolated", "serve", "--db", url, "--plugins", runner.PLUGINS_DIR,
           "--max-concurrent-jobs", "2", "--log-level", "WARNING"]
    with open(tmp / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    try:
        give_up = time.time() + 60
        while not store.list_supervisors():
            if time.time() > give_up or proc.poll() is not None:
                raise RuntimeError("serve did not register:\n" + (tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.05)
        trials = [o for o in offsets for _ in range(ns.reps)]
        random.shuffle(trials)
        rows: dict[float, list[str]] = {o: [] for o in offsets}
        loads: list[float] = []
        for k, offset in enumerate(trials):
            name = f"p{k}"
            instant = float(int(time.time()) + 3)  # a whole second, 2-3 s ahead (seen at a rescan, 1 s)
            now = _utc(time.time())
            store.add_job({"name": name, "job_type": "bench", "cron_expression": "0 0 1 1 *", "status": "Active",
                           "next_run_at": _utc(instant), "configuration": {"kind": "ok", "runtime_ms": 1.0}}, now)
            time.sleep(max(0.0, instant - offset / 1000 - 0.004 - time.time()))  # the pause's commit takes ~4 ms
            ops.pause_job(store, name, _utc(time.time()))
            returned_ms = (instant - time.time()) * 1000
            time.sleep(max(0.0, instant + 0.5 - time.time()))
            runs = store.list_runs(job_name=name, limit=5)
            if not runs:
                what = "none"
            elif all((r["error_message"] or "").startswith("never started") for r in runs):
                what = "withdrawn"
            else:
                what = "started"
            rows[offset].append(what)
            loads.append(os.getloadavg()[0])
            print(f"offset {offset:5.0f} ms  pause returned {returned_ms:6.1f} ms before the instant: {what}",
                  flush=True)
        print(f"\nload {min(loads):.1f}-{max(loads):.1f}")
        print("| pause returned before the instant | trials | no run (before the claim) | withdrawn | started |")
        print("|---|---|---|---|---|")
        for offset in offsets:
            r = rows[offset]
            print(f"| {offset:g} ms | {len(r)} | {r.count('none')} | {r.count('withdrawn')} | {r.count('started')} |")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        store.close()


if __name__ == "__main__":
    main()
