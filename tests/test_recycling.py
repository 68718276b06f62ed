"""Worker recycling with real children: by run count, by resident memory, never during a run."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging

import pytest
from conftest import add_job, wait_gone

from mjsched_isolated.config import Recycling
from mjsched_isolated.store import Store

YEARLY = "0 0 1 1 *"  # the schedule never fires during a test: each run is requested with queue_now
LATER = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)


def _run_n(driver, store: Store, job: dict, n: int) -> list[dict]:
    """Make ``job`` due ``n`` times, one run after the other, each on an idle worker; return the runs."""
    done = []
    for i in range(n):
        driver.until(lambda: len(driver.pool.idle_workers()) == driver.pool.size, 30)  # a refilled slot is ready
        assert store.queue_now(job["id"], driver.supervisor.read_clock()[0])
        driver.until(lambda want=i + 1: len(store.list_runs(job_name=job["name"])) == want
                     and not driver.supervisor.inflight, 30)
        done = store.list_runs(job_name=job["name"], limit=n)[::-1]
    return done


def _no_crash_noise(caplog) -> None:
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "exited while idle" not in text and "before it was ready" not in text and "killing it" not in text


@pytest.mark.timeout(60)
def test_max_tasks_per_child_rotates_workers_every_n_runs(store, driver_factory, caplog):
    caplog.set_level(logging.INFO)
    driver = driver_factory(max_concurrent_jobs=1, recycling=Recycling(max_tasks_per_child=2))
    job = add_job(store, "count", "ok", YEARLY, next_run_at=LATER)
    runs = _run_n(driver, store, job, 6)
    assert [r["status"] for r in runs] == ["Completed"] * 6
    pids = [r["details"]["pid"] for r in runs]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] == pids[5] and len(set(pids)) == 3
    assert wait_gone(pids[:4]) == []  # the recycled children exited
    recycled = [r.getMessage() for r in caplog.records if "recycled" in r.getMessage()]
    assert recycled[:2] == [f"worker {pids[0]} recycled after 2 runs (max_tasks_per_child 2)",
                            f"worker {pids[2]} recycled after 2 runs (max_tasks_per_child 2)"]
    assert driver.pool.recycled == 3  # the third worker too, after runs 5 and 6
    _no_crash_noise(caplog)


@pytest.mark.timeout(60)
def test_memory_limit_recycles_after_the_run_that_crossed_it(store, driver_factory, caplog):
    limit_mb = 100.0
    caplog.set_level(logging.INFO)
    driver = driver_factory(max_concurrent_jobs=1, recycling=Recycling(max_memory_per_child_mb=limit_mb))
    job = add_job(store, "leaky", "leak", YEARLY, next_run_at=LATER, configuration=json.dumps({"mb": 25}))
    runs = _run_n(driver, store, job, 7)
    assert [r["status"] for r in runs] == ["Completed"] * 7
    replaced = kept = 0
    for before, after in itertools.pairwise(runs):
        rss_mb = before["details"]["rss_mb"]  # measured by the plugin as it returned
        if abs(rss_mb - limit_mb) < 3:
            continue  # too close to the limit to say which side the pool's own reading fell on
        same = before["details"]["pid"] == after["details"]["pid"]
        assert same == (rss_mb <= limit_mb), (rss_mb, [r["details"] for r in runs])
        replaced += not same
        kept += same
    assert replaced >= 1 and kept >= 1  # both sides of the rule were exercised
    assert any("recycled after" in m and "MB > 100 MB" in m for m in (r.getMessage() for r in caplog.records))
    _no_crash_noise(caplog)


@pytest.mark.timeout(60)
def test_a_run_that_crosses_the_memory_limit_is_not_interrupted(store, driver_factory, tmp_path):
    driver = driver_factory(max_concurrent_jobs=1, recycling=Recycling(max_memory_per_child_mb=50))
    job = add_job(store, "big", "leak", YEARLY, next_run_at=LATER,
                  configuration=json.dumps({"mb": 120, "seconds": 1.0}))
    first_pid = driver.pool.idle_workers()[0].pid
    runs = _run_n(driver, store, job, 2)
    assert [r["status"] for r in runs] == ["Completed", "Completed"]  # over the limit for a second, not killed
    assert runs[0]["details"]["rss_mb"] > 50 and runs[0]["details"]["pid"] == first_pid
    assert runs[1]["details"]["pid"] != first_pid  # replaced between the runs
    assert runs[0]["duration_ms"] >= 1000
