"""A fleet divides the jobs (issue 11): each supervisor reads its own share of the due jobs (job id modulo the
live supervisors) and another's only when it is late, so a dead supervisor's share is taken over at once, not
after its TTL. On PostgreSQL and MariaDB (SQLite keeps one reader of everything)."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import add_job, isolated_database, serial
from procs import Serve
from waiting import wait_until

from mjsched_isolated.store import Store
from mjsched_isolated.store.jobs import Share
from mjsched_isolated.supervisor import utcnow

STEAL = dt.timedelta(milliseconds=10)


def test_live_instances_are_the_unexpired_unstopped_ones_sorted(server_store):
    store = server_store
    for name, ttl in (("b", 60.0), ("a", 60.0), ("gone", -5.0), ("stopped", 60.0)):
        store.register_supervisor(name, "host", 1, ttl)
    store.stop_supervisor("stopped")
    assert store.live_instances() == ["a", "b"]


def test_due_read_takes_its_share_and_the_late_jobs_of_others(server_store):
    store = server_store
    now = utcnow().replace(microsecond=0)
    ids = [add_job(store, f"j{i}", "ok", next_run_at=now)["id"] for i in range(6)]
    late = add_job(store, "late", "ok", next_run_at=now - dt.timedelta(seconds=1))["id"]
    for index in (0, 1):
        share = Share(index, 2, now - STEAL, STEAL)
        found = {j["id"] for j in store.due_jobs(now, limit=100, share=share)}
        mine = {i for i in [*ids, late] if i % 2 == index}
        assert found == mine | {late}  # the late job is everyone's, the others' on-time ones are not
        assert {j["id"] for j in store.due_jobs(now, limit=100, share=share, skip_locked=True)} == found
    # nothing of its own due: it wakes for another's job STEAL after that job's instant
    for job_id in [*ids, late]:
        if job_id % 2 == 0:
            store.set_next_run_at(job_id, store.get_job_by_id(job_id)["next_run_at"], now + dt.timedelta(hours=1), now)
    earliest_other = min(store.get_job_by_id(j)["next_run_at"] for j in [*ids, late] if j % 2 == 1)
    assert store.next_due_at(share=Share(0, 2, now, STEAL)) == earliest_other + STEAL
    assert store.next_due_at(share=Share(1, 2, now, STEAL)) == earliest_other
    assert store.next_due_at() == earliest_other


@serial
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_a_dead_supervisors_share_is_taken_over_at_once(name, tmp_path):
    """A supervisor that died without stopping keeps a live row until its TTL (here 300 s) and so its share of
    the jobs: the live one runs that share's occurrences anyway, late by the steal bound, not by the TTL."""
    with isolated_database(name, tmp_path) as url:
        store = Store.open(url)
        store.register_supervisor("a-dead-one", "elsewhere", 1, 300.0)  # sorts first: share 0 of 2
        jobs = [add_job(store, f"j{i}", "ok")["id"] for i in range(6)]
        serve = Serve(url, "--max-concurrent-jobs", "4", "--rescan-interval-s", "0.5")
        try:
            serve.wait_ready()
            assert wait_until(lambda: all(len(store.list_runs(job_name=f"j{i}", limit=100)) >= 3 for i in range(6)),
                              30, "three runs of every job")
        finally:
            serve.stop()
        assert len(store.live_instances()) >= 1
        runs = [r for r in store.list_runs(limit=10_000) if r["scheduled_at"] is not None]
        dead_share = [r for r in runs if r["job_id"] in jobs and r["job_id"] % 2 == 0]
        assert dead_share, runs
        # the steady state (from each job's third run): started within a bound far below the TTL
        by_job: dict[int, list[dict]] = {}
        for r in sorted(dead_share, key=lambda r: r["scheduled_at"]):
            by_job.setdefault(r["job_id"], []).append(r)
        lateness = [(r["started_at"] - r["scheduled_at"]).total_seconds() for rs in by_job.values() for r in rs[2:]]
        assert lateness and max(lateness) < 2.0, lateness
        scheduled = [(r["job_id"], r["scheduled_at"]) for r in runs]
        assert len(scheduled) == len(set(scheduled))
        store.close()
