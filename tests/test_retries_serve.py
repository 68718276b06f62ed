"""Issue 12 point 5, end to end: a real ``serve`` on PostgreSQL runs a plugin that fails twice then succeeds
(max_retries 3); the supervisor is SIGKILLed while the first retry is pending and a second ``serve`` picks
the retry up from the database. The decisions themselves are tested on the FakePool in test_retries.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
from pathlib import Path

import pytest
from conftest import add_job, isolated_database
from procs import Serve

from mjsched_isolated.store import Store

BACKOFF_S, FACTOR = 1.0, 1.5  # the retries wait 1 s, then 1.5 s (no jitter)
POLL_S = 0.5  # --rescan-interval-s: a due retry starts within a poll (the loop also wakes at its time)
SPACING_SLACK_S = 1.0  # a loaded machine
ARGS = ["--lease-ttl-s", "3", "--lease-renew-interval-s", "0.5", "--rescan-interval-s", str(POLL_S),
        "--max-concurrent-jobs", "1"]


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
            spacing_s = [(after["started_at"] - before["completed_at"]).total_seconds()
                         for before, after in itertools.pairwise(runs)]
            print(f"attempts 1-3 spaced {spacing_s[0]:.2f} s (across the SIGKILL and restart) and {spacing_s[1]:.2f} s;"
                  f" configured {BACKOFF_S:g} s and {BACKOFF_S * FACTOR:g} s")
            assert spacing_s[0] >= BACKOFF_S  # the new supervisor's start-up may add to it, never take from it
            assert BACKOFF_S * FACTOR <= spacing_s[1] < BACKOFF_S * FACTOR + POLL_S + SPACING_SLACK_S
            job = store.get_job("flaky")
            assert (job["retry_at"], job["retry_attempt"], job["consecutive_failures"]) == (None, None, 0)
            assert (job["next_run_at"].month, job["next_run_at"].day) == (1, 1)  # back on its schedule
            assert len((tmp_path / "flaky.count").read_text().splitlines()) == 3
        finally:
            store.close()
