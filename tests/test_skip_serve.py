"""Issue 12, "Done when" (point 1, Skip decided on time), end to end: the repro of the soak with a real
``serve`` on SQLite and real worker processes. Cap 1 (no idle worker while the run is live), a Skip job due
every second whose runs take longer than two seconds: every occurrence that comes due while the run is live
is skipped (counted in ``skipped_count``, logged), so no run carries an occurrence that fell due during the
run before it. The decisions themselves are tested on the FakePool in test_overlap.py / test_missed_runs.py."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time
from pathlib import Path

import pytest
from conftest import add_job
from procs import Serve
from waiting import wait_until

from mjsched_isolated.store import Store

ARGS = ["--max-concurrent-jobs", "1", "--lease-ttl-s", "3", "--lease-renew-interval-s", "0.5",
        "--rescan-interval-s", "0.5"]
RUN_S = 2.2  # each run outlasts two occurrences of the every-second schedule
# the decision at an occurrence's instant can see a run that ended a moment before it as still live (the
# result is read on the next wake-up), never the reverse: an occurrence is run only once nothing is live
RESULT_LATENCY = dt.timedelta(milliseconds=100)


@pytest.mark.timeout(60)
def test_a_skip_job_with_every_worker_busy_skips_the_occurrences_due_during_its_run(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'skip.db'}"
    with Store.open(url) as store:
        add_job(store, "slow", "sleep", "* * * * * *", concurrency_mode="Skip",
                configuration=json.dumps({"seconds": RUN_S}))
        serve = Serve(url, *ARGS)
        try:
            started = time.monotonic()
            # the second run's start: by then the first run lived through two occurrences or more
            for _ in range(2):
                serve.wait_for(r"run \d+ started: job slow", 20)
            skip = serve.wait_for(r"job slow: occurrence \S+ skipped: .*concurrency_mode Skip", 20, seen=True)
            wait_until(lambda: sum(r["status"] == "Completed" for r in store.list_runs(job_name="slow")) >= 1, 10,
                       "the first run recorded Completed")
        finally:
            serve.stop()
        took_s = time.monotonic() - started
        runs = sorted(store.list_runs(job_name="slow", limit=100), key=lambda r: r["id"])
        job = store.get_job("slow")
    assert len(runs) >= 2 and runs[0]["status"] == "Completed", runs
    for before, after in itertools.pairwise(runs):
        # the occurrence a run carries came due after the run before it had ended
        assert after["scheduled_at"] >= before["completed_at"] - RESULT_LATENCY, (before, after)
        assert after["started_at"] >= before["completed_at"]  # never two at once
    # every occurrence (a whole second) that came due while a run was live was skipped, and counted
    during = sum(_whole_seconds_between(r["started_at"], r["completed_at"] - RESULT_LATENCY)
                 for r in runs if r["status"] == "Completed")
    assert during >= 2
    assert job["skipped_count"] >= during, (job["skipped_count"], during)
    # nothing folded into a catch-up run but the occurrences that came due before serve was up (the first run)
    assert job["missed_count"] == runs[0]["missed_count"] and all(r["missed_count"] == 0 for r in runs[1:])
    print(f"{len(runs)} runs, skipped_count {job['skipped_count']} ({skip.group(0)!r}); took {took_s:.1f} s")


def _whole_seconds_between(start: dt.datetime, end: dt.datetime) -> int:
    """How many instants on a whole second lie strictly between ``start`` and ``end``."""
    first = start.replace(microsecond=0) + dt.timedelta(seconds=1)
    return max(0, int((end - first).total_seconds()) + 1) if first < end else 0
