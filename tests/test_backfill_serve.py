"""Issue 12 point 9, end to end: a real ``serve`` runs a backfill of five past occurrences of a job due every
second, next to its regular schedule: five runs, each with its own ``scheduled_at``, one at a time (the
job's lease), and a second backfill of the same window adds nothing. The decisions themselves are tested on
the FakePool in test_backfill.py."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from conftest import add_job
from procs import Serve, serves
from waiting import wait_until

from mjsched_isolated import ops
from mjsched_isolated.store import Store

ARGS = ["--rescan-interval-s", "0.5", "--max-concurrent-jobs", "2"]


@pytest.mark.timeout(60)
def test_serve_runs_a_backfill_of_five_occurrences_once(db_url):
    with Store.open(db_url) as store, serves() as serve_factory:
        now = store.db_now()
        add_job(store, "tick", "ok", "* * * * * *", now=now, next_run_at=now.replace(microsecond=0)
                + dt.timedelta(seconds=1))
        start = now.replace(microsecond=0) - dt.timedelta(seconds=10)
        window = [start + dt.timedelta(seconds=i) for i in range(5)]
        s: Serve = serve_factory(db_url, *ARGS)
        s.wait_ready()
        result = ops.backfill_job(store, "tick", window[0], window[-1], store.db_now(), max_occurrences=5)
        assert result.added == window

        def backfilled() -> list[dict]:
            done = [r for r in store.list_runs(job_name="tick", limit=200) if r["scheduled_at"] in window]
            return done if len(done) == 5 and all(r["status"] != "Running" for r in done) else []

        runs = sorted(wait_until(backfilled, 20, "the five backfilled runs recorded",
                                 diagnostic=lambda: "\n".join(s.output[-20:])), key=lambda r: r["scheduled_at"])
        assert [(r["scheduled_at"], r["attempt"], r["status"]) for r in runs] == [(w, 1, "Completed") for w in window]
        assert all(r["executed_by_instance"] for r in runs)
        spans = sorted((r["started_at"], r["completed_at"]) for r in store.list_runs(job_name="tick", limit=500))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "two runs of a Skip job overlapped"
        again = ops.backfill_job(store, "tick", window[0], window[-1], store.db_now(), max_occurrences=5)
        assert (again.added, again.already_run) == ([], window)
        s.wait_for(r"backfill of occurrence .* requested by .* starts as run \d+", seen=True)
        assert store.get_job("tick")["next_run_at"] > window[-1]  # the regular schedule went on meanwhile
