"""A supervisor's name (``--instance``): one line of printable characters, and unique among live
supervisors: a second ``serve`` under a live supervisor's name is refused (exit 2), unless the row is its
own previous life (same host and pid: a container's PID 1 restarting)."""

from __future__ import annotations

import threading

import pytest
from clirun import Cli
from conftest import FIXTURE_PLUGINS
from waiting import wait_until

from mjsched_isolated.config import load_settings
from mjsched_isolated.errors import InputError
from mjsched_isolated.store.supervisors import InstanceInUseError
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.supervisor.liveness import Liveness, Renewer


def _holder(store, instance):
    return {r["instance"]: r for r in store.list_supervisors()}[instance]


def test_a_live_name_is_refused_to_another_process_and_nothing_is_written(any_store):
    store = any_store
    store.register_supervisor("same", "host-a", 41, 30.0)
    before = _holder(store, "same")
    with pytest.raises(InstanceInUseError) as err:
        store.register_supervisor("same", "host-b", 42, 30.0)
    assert err.value.field == "instance"
    message = str(err.value)
    assert message.startswith("instance: a live supervisor holds the name 'same'") and "\n" not in message
    assert "host host-a, pid 41, lease until " in message
    assert _holder(store, "same") == before  # nothing written
    with pytest.raises(InstanceInUseError):  # the same host with another pid is another process too
        store.register_supervisor("same", "host-a", 43, 30.0)
    assert store.instance_holder("same", "host-b", 42)["pid"] == 41


def test_its_own_previous_life_a_stopped_or_an_expired_row_may_be_taken(any_store):
    store = any_store
    store.register_supervisor("pid1", "host-a", 1, 30.0)
    store.register_supervisor("pid1", "host-a", 1, 30.0)  # a container's PID 1 restarted: the reference's takeover
    assert store.instance_holder("pid1", "host-a", 1) is None
    store.stop_supervisor("pid1")
    store.register_supervisor("pid1", "host-b", 7, 30.0)  # stopped cleanly: free
    assert _holder(store, "pid1")["hostname"] == "host-b"
    store.register_supervisor("gone", "host-a", 5, -1.0)  # a lease already expired (by the database clock)
    assert store.instance_holder("gone", "host-b", 6) is None
    store.register_supervisor("gone", "host-b", 6, 30.0)
    assert (_holder(store, "gone")["hostname"], _holder(store, "gone")["pid"]) == ("host-b", 6)


def test_a_supervisor_that_froze_past_its_ttl_cannot_renew_a_name_another_took(any_store):
    store = any_store
    store.register_supervisor("frozen", "host-a", 1, -1.0)  # its lease expired while it was frozen
    store.register_supervisor("frozen", "host-b", 2, 30.0)  # another took the name meanwhile
    assert store.renew_supervisor("frozen", 30.0, hostname="host-a", pid=1) is None  # the waking one: not its row
    with pytest.raises(InstanceInUseError):  # nor may it take the row back (its Liveness then fences)
        store.register_supervisor("frozen", "host-a", 1, 30.0)
    assert store.renew_supervisor("frozen", 30.0, hostname="host-b", pid=2) is not None
    assert (_holder(store, "frozen")["hostname"], _holder(store, "frozen")["pid"]) == ("host-b", 2)


def test_of_two_registering_one_name_at_once_exactly_one_wins(any_store):
    store = any_store
    barrier, results = threading.Barrier(2), {}

    def register(pid: int) -> None:
        barrier.wait(5)
        try:
            store.register_supervisor("race", "host", pid, 30.0)
            results[pid] = "won"
        except InstanceInUseError as exc:
            results[pid] = exc.holder["pid"]

    threads = [threading.Thread(target=register, args=(pid,)) for pid in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    winner = _holder(store, "race")["pid"]
    assert results == {winner: "won", 3 - winner: winner}


def test_serves_renewal_thread_hands_a_refused_first_registration_to_the_loop(store):
    """Under ``serve`` the first registration runs on the renewal thread: one that loses the race for a
    name (after ``serve``'s own check passed) ends the thread with :attr:`Renewer.refused` set and wakes the
    loop, which raises it (exit 2); a later loss (a frozen supervisor's name taken) only fences."""
    store.register_supervisor("taken", "elsewhere", 4242, 60.0)
    woken = threading.Event()
    liveness = Liveness(store, "taken", 30.0, 10.0, utcnow)
    renewer = Renewer(liveness, woken.set).start()
    try:
        assert woken.wait(10)
        refused = wait_until(lambda: renewer.refused, 5, "the renewal thread's refusal")
        assert refused.holder["pid"] == 4242 and not liveness.registered
    finally:
        renewer.stop()
    liveness.registered = True  # as if it had registered before freezing: the loss is a failed renewal
    liveness.next_renew = 0.0
    assert liveness.maintain(1.0) is False and "taken by another live supervisor" in liveness.trouble.reason


@pytest.mark.parametrize("value", ["", "two\nlines", "tab\there", "x" * 201])
def test_a_bad_instance_name_is_refused(value):
    with pytest.raises(InputError) as err:
        load_settings(environ={"MJSCHED_INSTANCE": value})
    assert err.value.field == "instance" and "\n" not in str(err.value)
    assert "1 to 200 printable characters" in str(err.value)
    assert load_settings(environ={"MJSCHED_INSTANCE": "é-" + "x" * 198}).instance.startswith("é-")


def test_serve_under_a_live_supervisors_name_exits_2_before_writing(store, db_url, tmp_path, capsys, monkeypatch):
    store.register_supervisor("same", "elsewhere", 4242, 60.0)
    (tmp_path / "jobs.toml").write_text('[[jobs]]\nname = "j"\njob_type = "ok"\ncron_expression = "0 0 1 1 *"\n')
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})
    result = cli("serve", "--instance", "same", "--jobs", "jobs.toml", "--run-for", "0", expect=2)
    (line,) = result.stderr.strip().splitlines()
    assert "instance: a live supervisor holds the name 'same' (host elsewhere, pid 4242" in line
    assert store.list_jobs() == []  # the jobs file was not synced
    assert [(r["instance"], r["pid"]) for r in store.list_supervisors()] == [("same", 4242)]
