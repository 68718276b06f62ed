"""Issue 12 point 5, end to end: a real ``serve`` on PostgreSQL runs a plugin that fails twice then succeeds
(max_retries 3); the supervisor is SIGKILLed while the first retry is pending and a second ``serve`` picks
the retry up from the database. The decisions themselves are tested on the FakePool in test_retries.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import add_job, isolated_database
from procs import Serve

from mjsched_isolated.store import Store

ARGS = ["--lease-ttl-s", "3", "--lease-renew-interval-s", "0.5", "--rescan-interval-s", "0.5",
        "--max-concurrent-jobs", "1"]
BACKOFF_S, FACTOR = 2.0, 1.5  # the retries wait 2 s, then 3 s


@pytest.mark.timeout(60)
def test_a_retry_pending_when_its_supervisor_is_killed_is_run_by_the_next_one(tmp_path: Path):
    with isolated_database("postgresql", tmp_path) as url:
        store = Store.open(url)
        try:
            add_job(store, "flaky", "flaky", "0 0 1 1 *", max_retries=3, retry_backoff_s=BACKOFF_S,
                    retry_backoff_factor=FACTOR,
                    configuration=json.dumps({"counter_dir": str(tmp_path), "fail_times": 2}))
            s1 = Serve(url, *ARGS)
            try:
                s1.wait_for(r"run \d+ of job flaky: Failed, retry 1 of 3 at ")
                os.kill(s1.proc.pid, signal.SIGKILL)  # the retry is pending: only the database knows it
                s1.proc.wait(10)
            finally:
                s1.stop()
            job = store.get_job("flaky")
            assert job["retry_attempt"] == 2 and job["next_run_at"] == job["retry_at"]
            s2 = Serve(url, *ARGS)
            try:
                s2.wait_for(r"run \d+ finished: job flaky Completed", timeout_s=40)
            finally:
                s2.stop()
            runs = sorted(store.list_runs(job_name="flaky", limit=10), key=lambda r: r["id"])
            assert [(r["attempt"], r["status"]) for r in runs] == [(1, "Failed"), (2, "Failed"), (3, "Completed")]
            assert len({r["scheduled_at"] for r in runs}) == 1  # one occurrence, three attempts
            assert runs[0]["executed_by_instance"] != runs[1]["executed_by_instance"] == runs[2][
                "executed_by_instance"]  # the second supervisor ran the retries
            for before, after, delay_s in ((runs[0], runs[1], BACKOFF_S), (runs[1], runs[2], BACKOFF_S * FACTOR)):
                assert (after["started_at"] - before["completed_at"]).total_seconds() >= delay_s
            job = store.get_job("flaky")
            assert (job["retry_at"], job["retry_attempt"], job["consecutive_failures"]) == (None, None, 0)
            assert (job["next_run_at"].month, job["next_run_at"].day) == (1, 1)  # back on its schedule
            assert len((tmp_path / "flaky.count").read_text().splitlines()) == 3
        finally:
            store.close()
