"""Dispatch decisions around worker readiness and live runs, on the in-process fake pool: a job type is not
judged unavailable while workers are starting, and a Skip names whose live run it was."""

from __future__ import annotations

import datetime as dt

from conftest import add_job

from mjsched_isolated.supervisor import utcnow

NOT_AVAILABLE = "is not available on this supervisor"
YEARLY = "0 0 1 1 *"


def _held_by(store, name: str, instance: str) -> dict:
    """Job ``name``'s current occurrence claimed by supervisor ``instance`` (registered, alive for 600 s):
    its run is live elsewhere; the job's next occurrence is one second later."""
    store.register_supervisor(instance, "host", 1, 600)
    job = store.get_job(name)
    claim = store.claim(job, now=utcnow(), next_run_at=job["next_run_at"] + dt.timedelta(seconds=1),
                        instance=instance, lease_s=600, deadline_at=utcnow() + dt.timedelta(minutes=10),
                        scheduled_at=job["next_run_at"])
    assert claim is not None
    return store.get_job(name)


def test_a_job_type_is_not_judged_unavailable_while_the_workers_are_starting(mem_store, fake_factory, caplog):
    """This supervisor's only worker was killed and its refill is still importing the plugins when the next
    occurrence of a Skip job of type ``hang`` (its run live on a peer) comes due. No ready worker has ``hang``
    but the plugins folder does: the occurrence waits for the worker (not "not available", not set aside
    until the next rescan), and once the worker is ready it is skipped as usual, naming the peer."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=1, rescan_interval_s=60)
    add_job(store, "s", "hang", "* * * * * *")
    job = _held_by(store, "s", "peer-1")
    d.pool.hold_ready()
    d.pool.kill(d.pool.workers[0])  # refilled at once, not ready yet
    at = d.timeline()
    at(0)
    at(1.5)  # the next occurrence is due; the worker still starts
    dispatcher = d.supervisor.dispatcher
    assert NOT_AVAILABLE not in caplog.text
    assert job["id"] not in dispatcher.unrunnable and job["id"] in dispatcher.waiting_for_worker
    assert store.get_job("s")["skipped_count"] == 0
    d.pool.ready_all()
    at(1.6)  # no rescan between (60 s): the job was not excluded until then
    assert store.get_job("s")["skipped_count"] >= 1
    assert "the job's lease is held by supervisor peer-1 (concurrency_mode Skip)" in caplog.text
    assert NOT_AVAILABLE not in caplog.text


def test_a_type_the_plugins_folder_lacks_is_left_to_others_even_while_a_worker_starts(mem_store, fake_factory,
                                                                                      caplog):
    """A worker starting does not make every type "coming": one the newest Ready lacks (a rolling deploy) is
    still left to a supervisor that has it, said once, so it does not hold the due read's place (one per
    idle worker) while another job waits behind it."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2, rescan_interval_s=60)
    d.pool.hold_ready()
    d.pool.kill(d.pool.workers[1])  # refilled, starting; slot 0 stays idle
    missing = add_job(store, "missing", "no_such_type", "* * * * * *")
    add_job(store, "fine", "ok", YEARLY, next_run_at=missing["next_run_at"] + dt.timedelta(milliseconds=1))
    at = d.timeline()
    at(0.5)
    at(0.6)
    assert caplog.text.count("job_type 'no_such_type' " + NOT_AVAILABLE) == 1
    assert missing["id"] in d.supervisor.dispatcher.unrunnable
    assert [r.job_name for r in d.pool.submitted] == ["fine"]


def test_a_skip_of_this_supervisors_own_live_run_says_so(mem_store, fake_factory, caplog):
    """The Skip job's live run is this supervisor's: the skip line says it is its own run (with the run id),
    not "held by supervisor <itself> ... or that supervisor died"."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    d.pool.hold()
    add_job(store, "s", "ok", "* * * * * *")
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    at(1.5)  # the next occurrence: a worker is idle, the claim meets our own lease
    at(2.5)
    assert store.get_job("s")["skipped_count"] >= 1
    me = d.settings.instance
    assert f"its run {run_id} on this supervisor ({me}) is still live (concurrency_mode Skip)" in caplog.text
    assert f"held by supervisor {me}" not in caplog.text and "that supervisor died" not in caplog.text


def test_an_abandoned_runs_message_spells_its_times_with_z(mem_store):
    """The sweep's verdict on a dead supervisor's run names the lease expiry and the start in the one
    spelling of instants (``...Z``, as logs and notices), not ``+00:00``."""
    store = mem_store
    store.register_supervisor("dead-1", "host", 1, 0.001)  # its liveness lease lapses at once
    job = add_job(store, "j", "ok", "0 0 1 1 *")
    assert store.claim(job, now=utcnow(), next_run_at=None, instance="dead-1", lease_s=600,
                       deadline_at=utcnow() + dt.timedelta(minutes=10), scheduled_at=job["next_run_at"])
    (run,) = store.abandon_orphaned_runs()
    message = run["error_message"]
    assert message.startswith("abandoned: supervisor dead-1 stopped renewing its lease (expired 20"), message
    assert "+00:00" not in message and message.count("Z") == 2, message
