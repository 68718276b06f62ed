"""Plugin reload (issue 14): a run goes to a worker that has its job type; workers are replaced when the
plugin files change, on ``plugins reload`` (through the database) or on SIGHUP without a terminal, once
their run ends; a module that no longer imports keeps the current workers; SIGHUP with a controlling
terminal is a hang-up (drain and stop, issue 12)."""

from __future__ import annotations

import msgspec
from conftest import add_job

from mjsched_isolated import protocol

YEARLY = "0 0 1 1 *"


def _without(ready: protocol.Ready, job_type: str) -> protocol.Ready:
    return msgspec.structs.replace(ready, plugins=[p for p in ready.plugins if p.job_type != job_type])


# -- dispatch: a run goes to a worker that has its type ------------------------------------------------------
def test_a_run_goes_to_an_idle_worker_that_has_its_type_not_to_the_last_one(mem_store, fake_factory):
    """The defect: dispatch took the job types of the most recently started worker and handed the job to any
    idle worker, so a worker started before a plugin was added got its runs ("unknown job type")."""
    d = fake_factory(max_concurrent_jobs=2)
    old, new = d.pool.workers[1], d.pool.workers[0]
    old.ready = _without(old.ready, "ok")  # started before the plugin of "ok" was added; idle_workers()[-1]
    d.pool.last_ready = new.ready
    d.pool.hold()
    add_job(mem_store, "j", "ok", YEARLY)
    d.until(lambda: bool(d.supervisor.inflight))
    (flight,) = d.supervisor.inflight.values()
    assert flight.worker is new


def test_a_job_whose_type_only_a_busy_worker_has_waits_for_it_without_spinning(mem_store, fake_factory):
    d = fake_factory(max_concurrent_jobs=2)
    with_type, without = d.pool.workers[0], d.pool.workers[1]
    without.ready = _without(without.ready, "ok")
    d.pool.hold("first")
    add_job(mem_store, "first", "ok", YEARLY)
    d.until(lambda: bool(d.supervisor.inflight))
    add_job(mem_store, "second", "ok", YEARLY)
    now, mono = d.supervisor.read_clock()
    d.supervisor.step(now, mono)
    assert [f.job_name for f in d.supervisor.inflight.values()] == ["first"]  # not handed to `without`
    next_due = d.supervisor.dispatcher.next_due_at()  # the loop waits for a result, no 1 ms spin on "second"
    assert next_due is None or (next_due - now).days >= 1
    assert mem_store.get_job("second")["skipped_count"] == 0  # not skipped as unavailable either
    d.pool.hold("second")
    (first_run,) = d.pool.held
    d.pool.finish(first_run)  # the worker that has the type is free again: "second" goes to it
    d.until(lambda: len(mem_store.list_runs(job_name="second")) == 1)
    (flight,) = d.supervisor.inflight.values()
    assert (flight.job_name, flight.worker) == ("second", with_type)
