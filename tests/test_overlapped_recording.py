"""Overlapped recording (issue 11, PostgreSQL): the results of a wait are sent to the recorder thread
(``Recorder.send``) and their commit is awaited (``Recorder.settle``) before whatever depends on it - a
claim, the live-Skip read, the rescan, another recording, the end of the step. A batch that fails in the
thread is judged as one recorded in place: kept pending (its workers' slots still taken), retried, or
found refused one row at a time."""

from __future__ import annotations

import datetime as dt
import logging
import threading

import pytest
import sqlalchemy as sa
from conftest import Driver, add_job, isolated_database

from mjsched_isolated.config import Settings
from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import Outcome
from mjsched_isolated.supervisor.inflight import InFlight
from mjsched_isolated.supervisor.metrics import Metrics
from mjsched_isolated.supervisor.recording import Recorder

UTC = dt.UTC
NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class FakeStore:
    """``finish_runs`` only: each call takes the next of ``answers`` (an exception is raised) and notes the
    thread it ran on."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[list[int], str]] = []
        self.release = threading.Event()
        self.release.set()

    def finish_runs(self, outcomes):
        self.calls.append(([o.run_id for o in outcomes], threading.current_thread().name))
        assert self.release.wait(10)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer(outcomes) if callable(answer) else answer


def _recorder(store) -> Recorder:
    return Recorder(Settings(database_url="sqlite://"), store, Metrics(), lambda: None)


def _items(*run_ids: int) -> list[tuple[InFlight, Outcome]]:
    items = []
    for run_id in run_ids:
        job = {"id": run_id, "name": f"j{run_id}", "job_type": "ok"}
        flight = InFlight(run_id, job, f"t{run_id}", None, NOW, NOW + dt.timedelta(minutes=1), 60.0)
        items.append((flight, Outcome(run_id, run_id, f"t{run_id}", "Completed", True, duration_ms=1.0,
                                      completed_at=NOW)))
    return items


def _outage() -> Exception:
    return sa.exc.OperationalError("UPDATE runs", {}, Exception("server closed the connection unexpectedly"))


def test_a_sent_batch_is_written_on_the_recorder_thread_and_judged_when_settled(caplog):
    store = FakeStore(lambda outcomes: [True] * len(outcomes))
    store.release.clear()  # the commit is "in flight" until released
    rec = _recorder(store)
    caplog.set_level(logging.INFO, "mjsched.supervisor")
    rec.send(_items(1, 2))
    assert rec.sent is not None and rec.outstanding and rec.pending == []
    assert not [r for r in caplog.records if "finished" in r.getMessage()]  # judged only once settled
    store.release.set()
    rec.settle()
    assert rec.sent is None and not rec.outstanding
    assert store.calls[0][0] == [1, 2] and store.calls[0][1].startswith("mjsched-recorder")
    assert [r.getMessage() for r in caplog.records if "finished" in r.getMessage()] == [
        "run 1 finished: job j1 Completed in 1 ms", "run 2 finished: job j2 Completed in 1 ms"]
    rec.close()


def test_a_sent_batch_that_fails_is_kept_pending_and_retried_in_place_like_any_unrecorded_result(caplog):
    store = FakeStore(_outage(), _outage())
    rec = _recorder(store)
    caplog.set_level(logging.WARNING, "mjsched.supervisor")
    rec.send(_items(1, 2))
    rec.settle()
    assert [f.run_id for f, _ in rec.pending] == [1, 2] and rec.sent is None
    assert [r.getMessage() for r in caplog.records] == [
        "run 1 of job j1: Completed not recorded yet (database unreachable); will retry",
        "run 2 of job j2: Completed not recorded yet (database unreachable); will retry"]
    # while they are pending, a new batch is not sent: recorded in place, behind them (oldest first)
    rec.send(_items(3))
    assert rec.sent is None and [f.run_id for f, _ in rec.pending] == [1, 2, 3]
    assert store.calls[1] == ([1, 2, 3], threading.current_thread().name)
    store.answers.append([True, True, True])
    rec.retry_pending()
    assert rec.pending == [] and not rec.outstanding
    rec.close()


def test_a_sent_batch_the_database_refuses_is_recorded_one_by_one_without_the_refused_text():
    refused = sa.exc.DataError("UPDATE runs", {}, Exception("invalid byte sequence for encoding UTF8: 0x00"))
    # the batch fails; then run 1 alone is written, run 2 alone is refused, then written without its text
    store = FakeStore(refused, [True], refused, [True])
    rec = _recorder(store)
    items = _items(1, 2)
    items[1][1].error_message = "bad \x00 text"
    rec.send(items)
    rec.settle()
    assert rec.pending == []
    assert [ids for ids, _ in store.calls] == [[1, 2], [1], [2], [2]]
    assert items[1][1].error_message.startswith("result refused by the database")
    rec.close()


def test_recording_in_place_settles_a_sent_batch_first():
    store = FakeStore([True], [True])
    rec = _recorder(store)
    rec.send(_items(1))
    rec.record_many(_items(2))  # a kill, a death...: behind the batch sent
    assert [ids for ids, _ in store.calls] == [[1], [2]] and not rec.outstanding
    rec.close()


@pytest.fixture
def pg_url(tmp_path):
    with isolated_database("postgresql", tmp_path) as url:
        yield url


@pytest.mark.timeout(60)
def test_overlapped_recording_keeps_every_occurrence_once_and_skips_none_of_its_own(pg_url):
    """Skip jobs due every second on a real pool: with the results sent and settled before the claims,
    no occurrence is run twice and none is skipped because of a run that had already ended (its lease
    released by a result not yet committed)."""
    store = Store.open(pg_url)
    d = Driver(store, pg_url, max_concurrent_jobs=2)
    try:
        d.start()
        sup = d.supervisor
        sup.overlap_recording = True
        sent = []
        send = sup.recorder.send
        sup.recorder.send = lambda items: (sent.append(len(items)), send(items))[1]  # type: ignore[method-assign]
        for name in ("a", "b"):
            add_job(store, name, "ok", "* * * * * *", concurrency_mode="Skip")
        d.until(lambda: all(store.get_job(n)["run_count"] >= 3 for n in ("a", "b")), 30)
        d.until(lambda: not sup.inflight and not sup.recorder.outstanding, 10)
        assert sum(sent) >= 6  # the results went through the recorder thread
        with store.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT job_id, scheduled_at, status FROM runs")).all()
        assert len(rows) == len({(j, s) for j, s, _ in rows})  # each occurrence once
        assert {s for _, _, s in rows} == {"Completed"}
        for name in ("a", "b"):
            job = store.get_job(name)
            assert job["skipped_count"] == 0 and job["lock_token"] is None
            assert job["run_count"] == job["success_count"] == sum(1 for j, _, _ in rows if j == job["id"])
    finally:
        d.close()
        d.supervisor.recorder.close()
        store.close()


@pytest.mark.timeout(60)
def test_a_sent_batch_that_fails_holds_its_workers_slots_until_it_is_recorded(pg_url, monkeypatch):
    """The recorder thread's transaction fails (an outage of that connection): the freed worker is not used
    for a new run while the result is pending (the cap counts it), and the result is recorded at a retry."""
    store = Store.open(pg_url)
    d = Driver(store, pg_url, max_concurrent_jobs=1)
    try:
        d.start()
        sup = d.supervisor
        sup.overlap_recording = True
        real = store.finish_runs
        failures = []

        def flaky(outcomes):
            if threading.current_thread().name.startswith("mjsched-recorder") and not failures:
                failures.append([o.run_id for o in outcomes])
                raise _outage()
            return real(outcomes)

        monkeypatch.setattr(store, "finish_runs", flaky)
        add_job(store, "a", "ok", "* * * * * *")
        claims = []
        claim_many = store.claim_many

        def counting(requests, **kw):
            claims.append((len(sup.recorder.pending), len(requests)))
            return claim_many(requests, **kw)

        monkeypatch.setattr(store, "claim_many", counting)
        d.until(lambda: bool(failures), 20)
        first = failures[0][0]
        d.until(lambda: store.get_run(first)["status"] == "Completed", 20)
        assert all(pending == 0 for pending, _ in claims)  # no claim while the result was pending
        d.until(lambda: store.get_job("a")["run_count"] >= 2, 20)
    finally:
        d.close()
        d.supervisor.recorder.close()
        store.close()
