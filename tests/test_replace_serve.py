"""Issue 12, "Done when" (point 7, Replace), end to end across supervisors: two real ``serve`` processes on
one PostgreSQL database, a Replace job due every second whose runs never end by themselves. Whichever
supervisor sees an occurrence come due first replaces the live run (its own, or the other's through the
cancel request the holder acts on at its next renewal): at every moment at most one run is Running, and
it is the newest occurrence. The decisions are tested on the FakePool in test_overlap.py."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time
import uuid
from pathlib import Path

import pytest
from conftest import add_job, isolated_database
from procs import serves
from test_overlap import _check_replaced, _runs, _whole_second
from waiting import wait_until

from mjsched_isolated.store import Store

ARGS = ["--max-concurrent-jobs", "1", "--lease-ttl-s", "2", "--lease-renew-interval-s", "0.2",
        "--rescan-interval-s", "0.2", "--kill-grace-s", "0"]
REPLACED = 2
# a replacement through the other supervisor waits for the holder's next renewal (0.2 s), then the kill and
# the claim: the run of occurrence S may start a little after S, never a whole second late
LATE = dt.timedelta(milliseconds=600)


@pytest.mark.timeout(60)
def test_two_supervisors_keep_the_newest_occurrence_of_a_replace_job_running_and_never_two(tmp_path: Path):
    with isolated_database("postgresql", tmp_path) as url, serves() as start, Store.open(url) as store:
        sups = [start(url, *ARGS, "--instance", f"{name}-{uuid.uuid4().hex[:6]}") for name in ("s1", "s2")]
        for sup in sups:
            sup.wait_ready()
        add_job(store, "r", "sleep", "* * * * * *", concurrency_mode="Replace",
                configuration=json.dumps({"seconds": 600}))
        started = time.monotonic()
        peak, samples = 0, 0

        def replaced_enough() -> bool:
            nonlocal peak, samples
            now = store.db_now()
            running = [r for r in _runs(store, "r") if r["status"] == "Running"]
            samples += 1
            peak = max(peak, len(running))
            for run in running:  # none newer is due (beyond the replacement's own latency)
                assert run["scheduled_at"] >= _whole_second(now - LATE), (now, run)
            return sum(r["status"] == "Cancelled" for r in _runs(store, "r")) >= REPLACED

        wait_until(replaced_enough, 20, f"{REPLACED} runs replaced", interval_s=0.02,
                   diagnostic=lambda: "".join(sups[0].output[-10:] + sups[1].output[-10:]))
        took_s = time.monotonic() - started
        for sup in sups:
            sup.stop()
        assert peak == 1, peak
        runs = _check_replaced(store, None, "r", REPLACED)
        for before, after in itertools.pairwise(runs):
            assert before["completed_at"] <= after["started_at"], (before, after)  # never two at once
            assert after["scheduled_at"] >= _whole_second(after["started_at"] - LATE), after
        holders = {r["executed_by_instance"].split("-")[0] for r in runs}
        print(f"{len(runs)} runs ({samples} samples, peak Running {peak}), held by {sorted(holders)}; "
              f"{REPLACED} replaced in {took_s:.1f} s")
