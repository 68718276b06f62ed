"""Issue 12 points 10-11, the time knobs of a job: the DST policies (``dst_gap_policy``,
``dst_fold_policy``), the missed-run grace (``missed_run_grace_s``) and the hard runtime cap
(``max_total_runtime_s``) through the planner, the supervisor (FakePool; one real worker for the cap),
jobspec, CLI and Client. The DST rules themselves are checked against a brute-force reference in
test_dst.py."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS, add_job
from hypothesis import given, settings
from hypothesis import strategies as st

from mjsched_isolated import Client, DstFoldPolicy, DstGapPolicy, InputError, planner
from mjsched_isolated.store import Store

UTC = dt.UTC
YEARLY = "0 0 1 1 *"  # never due again within a test


def utc(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


def job(**over) -> dict:
    base = {"name": "j", "cron_expression": "30 2 * * *", "timezone": "Europe/Berlin", "start_at": None,
            "end_at": None, "last_run_at": None, "run_immediately_if_never_run": False, "next_run_at": None,
            "missed_run_policy": "RunOnce", "max_jitter_s": None}
    return {**base, **over}


@pytest.fixture
def cli(db_url, tmp_path, capsys, monkeypatch) -> Cli:
    return Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})


# -- DST policies in the planner --------------------------------------------------------------------------
def test_planner_follows_the_jobs_gap_policy():
    before_gap = utc(2024, 3, 30, 12)
    assert planner.initial_next_run_at(job(), before_gap) == utc(2024, 3, 31, 1, 0)  # Shift: 03:00 CEST
    assert planner.initial_next_run_at(job(dst_gap_policy="Skip"), before_gap) == utc(2024, 4, 1, 0, 30)
    # the occurrence before the gap, claimed on time: the next one is after the gap (or the next day)
    due = utc(2024, 3, 30, 1, 30)
    assert planner.decide(job(next_run_at=due), due).next_run_at == utc(2024, 3, 31, 1, 0)
    assert planner.decide(job(next_run_at=due, dst_gap_policy="Skip"), due).next_run_at == utc(2024, 4, 1, 0, 30)


def test_planner_follows_the_jobs_fold_policy():
    first_copy = utc(2024, 11, 3, 5, 30)  # 01:30 EDT
    ny = {"cron_expression": "30 1 * * *", "timezone": "America/New_York", "next_run_at": first_copy}
    assert planner.decide(job(**ny), first_copy).next_run_at == utc(2024, 11, 4, 6, 30)
    assert planner.decide(job(**ny, dst_fold_policy="Both"), first_copy).next_run_at == utc(2024, 11, 3, 6, 30)
    hourly = {**ny, "cron_expression": "0 * * * *", "timezone": "America/Los_Angeles",
              "next_run_at": utc(2025, 11, 2, 8, 0)}
    assert planner.decide(job(**hourly), utc(2025, 11, 2, 8, 0)).next_run_at == utc(2025, 11, 2, 9, 0)
    assert planner.decide(job(**hourly, dst_fold_policy="Once"), utc(2025, 11, 2, 8, 0)).next_run_at == utc(
        2025, 11, 2, 10, 0)


def test_runall_catch_up_follows_the_policies():
    """RunAll's backlog walk uses the job's rules too: under Both, the second 01:30 is one of the catch-ups."""
    ny = job(cron_expression="30 1 * * *", timezone="America/New_York", missed_run_policy="RunAll",
             dst_fold_policy="Both", next_run_at=utc(2024, 11, 3, 5, 30))
    decision = planner.decide(ny, utc(2024, 11, 5, 12))
    assert decision.run and decision.next_run_at == utc(2024, 11, 3, 6, 30)


def test_a_bad_policy_edited_into_a_row_is_a_schedule_error():
    with pytest.raises(InputError) as err:
        planner.decide(job(next_run_at=utc(2024, 1, 1), dst_fold_policy="Twice"), utc(2024, 1, 1))
    assert err.value.field == "dst_fold_policy"


# -- CLI --------------------------------------------------------------------------------------------------
def test_jobs_add_update_show_the_dst_policies(cli):
    cli("jobs", "add", "nightly", "--type", "ok", "--cron", "30 2 * * *", "--tz", "Europe/Berlin",
        "--dst-gap-policy", "Skip")
    shown = json.loads(cli("jobs", "show", "nightly", "--json").stdout)
    assert (shown["dst_gap_policy"], shown["dst_fold_policy"]) == ("Skip", "OnceIfFixedHour")
    assert "dst_gap_policy" in cli("jobs", "show", "nightly").stdout
    cli("jobs", "update", "nightly", "--dst-fold-policy", "Both", "--dst-gap-policy", "Shift")
    shown = json.loads(cli("jobs", "show", "nightly", "--json").stdout)
    assert (shown["dst_gap_policy"], shown["dst_fold_policy"]) == ("Shift", "Both")
    line = error_line(cli("jobs", "update", "nightly", "--dst-fold-policy", "Twice", expect=2))
    assert line.startswith("mjsched jobs update: error: argument --dst-fold-policy: invalid choice"), line


def test_jobs_file_policies_are_validated_naming_the_field(cli, tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text('[[jobs]]\nname = "a"\njob_type = "ok"\ncron_expression = "0 2 * * *"\n'
                    'dst_gap_policy = "Later"\n')
    line = error_line(cli("jobs", "sync", str(path), expect=2))
    assert "jobs[0].dst_gap_policy: must be one of Shift, Skip, got 'Later'" in line, line


def test_a_policy_change_recomputes_next_run_at(cli):
    cli("jobs", "add", "j", "--type", "ok", "--cron", "30 2 31 3 *", "--tz", "Europe/Berlin",
        "--start-at", "2030-03-01T00:00:00Z")  # 2030-03-31 02:30 is in the gap
    assert json.loads(cli("jobs", "show", "j", "--json").stdout)["next_run_at"] == "2030-03-31T01:00:00Z"
    cli("jobs", "update", "j", "--dst-gap-policy", "Skip")
    assert json.loads(cli("jobs", "show", "j", "--json").stdout)["next_run_at"] == "2031-03-31T00:30:00Z"


def test_cron_next_shows_the_policies(cli):
    out = cli("cron", "next", "30 2 * * *", "--tz", "Europe/Berlin", "--after", "2024-03-30T12:00:00Z",
              "--count", "1", "--dst-gap", "Skip").stdout
    assert "2024-04-01T00:30:00Z  skipped before this: 2024-03-31 02:30 does not exist (DST gap)" in out
    rows = json.loads(cli("cron", "next", "30 1 * * *", "--tz", "America/New_York", "--after", "2024-11-02T12:00:00Z",
                          "--count", "2", "--dst-fold", "Both", "--json").stdout)
    assert [r["utc"] for r in rows] == ["2024-11-03T05:30:00Z", "2024-11-03T06:30:00Z"]
    line = error_line(cli("cron", "next", "30 1 * * *", "--dst-gap", "Later", expect=2))
    assert "argument --dst-gap-policy/--dst-gap: invalid choice" in line
    # h-fresh: the flags `jobs add` takes work here too (they were refused as unrecognized)
    same = cli("cron", "next", "30 2 * * *", "--tz", "Europe/Berlin", "--after", "2024-03-30T12:00:00Z",
               "--count", "1", "--dst-gap-policy", "Skip", "--dst-fold-policy", "Both").stdout
    assert same == out


# -- Client -----------------------------------------------------------------------------------------------
def test_client_takes_and_returns_the_policies(db_url):
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        made = client.add_job("j", job_type="ok", cron_expression="0 1 * * *", dst_fold_policy="Once")
        assert made.dst_fold_policy is DstFoldPolicy.ONCE and made.dst_gap_policy is DstGapPolicy.SHIFT
        assert client.update_job("j", dst_gap_policy=DstGapPolicy.SKIP).dst_gap_policy is DstGapPolicy.SKIP
        with pytest.raises(InputError) as err:
            client.update_job("j", dst_gap_policy="Sometimes")
        assert err.value.field == "dst_gap_policy"
    with Store.open(db_url) as store:
        assert store.get_job("j")["dst_gap_policy"] == "Skip"


# -- missed_run_grace_s -----------------------------------------------------------------------------------
def test_without_grace_an_occurrence_is_missed_once_the_next_is_due():
    daily = job(cron_expression="0 9 * * *", timezone="UTC", missed_run_policy="Skip", next_run_at=utc(2030, 1, 1, 9))
    assert planner.decide(daily, utc(2030, 1, 1, 20)).run  # 11 h late: still "on time" (reference rule)
    assert not planner.decide(daily, utc(2030, 1, 2, 9, 0, 1)).run


def test_grace_shorter_than_the_interval_skips_a_late_occurrence():
    daily = job(cron_expression="0 9 * * *", timezone="UTC", missed_run_policy="Skip", next_run_at=utc(2030, 1, 1, 9),
                missed_run_grace_s=600.0)
    assert planner.decide(daily, utc(2030, 1, 1, 9, 10)) == planner.Decision(
        run=True, next_run_at=utc(2030, 1, 2, 9))  # 600 s late: within the grace
    assert planner.decide(daily, utc(2030, 1, 1, 9, 10, 1)) == planner.Decision(
        run=False, next_run_at=utc(2030, 1, 2, 9), missed=True)
    late_once = planner.decide({**daily, "missed_run_policy": "RunOnce"}, utc(2030, 1, 1, 20))
    assert late_once == planner.Decision(run=True, next_run_at=utc(2030, 1, 2, 9), missed=True)


def test_grace_longer_than_the_interval_runs_a_late_occurrence_as_on_time():
    minutely = job(cron_expression="* * * * *", timezone="UTC", missed_run_policy="Skip",
                   next_run_at=utc(2030, 1, 1, 9), missed_run_grace_s=300.0)
    assert planner.decide({**minutely, "missed_run_grace_s": None}, utc(2030, 1, 1, 9, 2)).run is False
    assert planner.decide(minutely, utc(2030, 1, 1, 9, 2, 30)) == planner.Decision(
        run=True, next_run_at=utc(2030, 1, 1, 9, 3))  # the 09:01 and 09:02 ones fold into it, as RunOnce
    assert planner.decide(minutely, utc(2030, 1, 1, 9, 5, 1)).run is False
    runall = {**minutely, "missed_run_policy": "RunAll"}  # RunAll still runs every one, oldest first
    assert planner.decide(runall, utc(2030, 1, 1, 9, 2, 30)) == planner.Decision(
        run=True, next_run_at=utc(2030, 1, 1, 9, 1), missed=True)


@settings(max_examples=200, deadline=None)
@given(late_s=st.floats(min_value=0, max_value=4 * 3600), grace_s=st.floats(min_value=1, max_value=4 * 3600),
       policy=st.sampled_from(["Skip", "RunOnce", "RunAll"]))
def test_grace_decides_missed_by_lateness_alone(late_s, grace_s, policy):
    """Property: with missed_run_grace_s, an hourly occurrence found late_s after its instant is missed
    exactly when late_s > grace_s; Skip then does not run it, RunOnce runs it once, RunAll runs every
    occurrence in turn (the next one to run is the following hour's while that is due)."""
    scheduled = utc(2030, 1, 1, 9)
    now = scheduled + dt.timedelta(seconds=late_s)
    hourly = job(cron_expression="0 * * * *", timezone="UTC", next_run_at=scheduled, missed_run_policy=policy,
                 missed_run_grace_s=grace_s)
    decision = planner.decide(hourly, now)
    missed = (now - scheduled).total_seconds() > grace_s  # late_s as a datetime holds it (to the microsecond)
    assert decision.run == (policy != "Skip" or not missed)
    if policy != "RunAll":
        assert decision.missed == missed
        assert decision.next_run_at == now.replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)
    else:
        assert decision.next_run_at == utc(2030, 1, 1, 10)


def test_supervisor_skips_an_occurrence_found_after_its_grace(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    at = d.timeline()
    now = at(0)
    add_job(store, "strict", "ok", YEARLY, next_run_at=now - dt.timedelta(seconds=30), missed_run_policy="Skip",
            missed_run_grace_s=10.0)
    add_job(store, "lenient", "ok", YEARLY, next_run_at=now - dt.timedelta(seconds=30), missed_run_policy="Skip",
            missed_run_grace_s=60.0)
    at(0.1)
    at(0.2)
    assert [r["status"] for r in store.list_runs(job_name="lenient", limit=10)] == ["Completed"]
    assert store.list_runs(job_name="strict", limit=10) == []
    assert store.get_job("strict")["skipped_count"] == 1


# -- max_total_runtime_s ----------------------------------------------------------------------------------
def test_heartbeats_never_extend_a_run_past_max_total_runtime_s(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(lease_timeout_s=1.0, heartbeat_interval_s=0.2, heartbeat_lease_s=1.0, kill_grace_s=0)
    d.pool.hold()
    add_job(store, "capped", "ok", YEARLY, max_total_runtime_s=2.0)
    add_job(store, "uncapped", "ok", YEARLY)
    at = d.timeline()
    at(0)
    capped, uncapped = (store.list_runs(job_name=n, limit=1)[0]["id"] for n in ("capped", "uncapped"))
    flight = d.supervisor.inflight[capped]
    assert flight.hard_deadline == flight.started_at + dt.timedelta(seconds=2)
    for t in (0.5, 1.0, 1.5, 1.8, 1.9):
        d.pool.beat(capped)
        d.pool.beat(uncapped)
        at(t)
    assert flight.deadline == flight.hard_deadline  # capped, not 1.9 + 1
    assert store.get_run(capped)["deadline_at"] == flight.hard_deadline
    at(1.95)
    assert store.get_run(capped)["status"] == "Running"
    at(2.05)
    run = store.get_run(capped)
    assert run["status"] == "Timeout" and d.pool.killed == [capped]
    assert "max_total_runtime_s of 2 s (a hard cap no heartbeat extends)" in run["error_message"]
    assert store.get_run(uncapped)["status"] == "Running"  # its heartbeats did extend it
    d.pool.finish(uncapped)
    at(2.1)
    assert store.get_run(uncapped)["status"] == "Completed"


def test_the_cap_shortens_the_first_deadline_too(mem_store, fake_factory):
    assert planner.run_timeout_s({"max_runtime_minutes": 10, "max_total_runtime_s": 90.0}, 300.0) == 90.0
    assert planner.run_timeout_s({"max_total_runtime_s": 900.0}, 300.0) == 300.0  # a cap never lengthens
    store = mem_store
    d = fake_factory(lease_timeout_s=5.0, kill_grace_s=0)  # SIGKILL at once (the grace: tests/test_kills.py)
    d.pool.hold()
    add_job(store, "short", "ok", YEARLY, max_total_runtime_s=1.5)
    at = d.timeline()
    at(0)
    (run_id,) = d.pool.held
    at(1.4)
    assert store.get_run(run_id)["status"] == "Running"
    at(1.6)
    assert store.get_run(run_id)["status"] == "Timeout"
    assert "max_total_runtime_s of 1.5 s" in store.get_run(run_id)["error_message"]


@pytest.mark.timeout(60)
def test_a_real_worker_heartbeating_while_stuck_is_killed_at_the_cap(store, driver_factory):
    """The defect: a plugin heartbeating all the time ran far past its limit. With the cap, its worker is
    killed (a real child) and the run recorded Timeout naming the cap."""
    d = driver_factory(max_concurrent_jobs=1, lease_timeout_s=1.0, heartbeat_interval_s=0.1, heartbeat_lease_s=1.0)
    add_job(store, "stuck", "beat", YEARLY, configuration=json.dumps({"seconds": 50}), max_total_runtime_s=2.0)
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="stuck", limit=1)), 30)
    (run,) = store.list_runs(job_name="stuck", limit=1)
    assert run["status"] == "Timeout" and "max_total_runtime_s of 2 s" in run["error_message"]
    assert run["deadline_at"] - run["started_at"] < dt.timedelta(seconds=2.1)  # clock reads apart, never extended
    d.until(lambda: len(d.pool.idle_workers()) == 1, 30)  # the slot was refilled by a fresh worker


@pytest.mark.parametrize(("flag", "value", "field"), [("--max-total-runtime-s", "0", "max_total_runtime_s"),
                                                      ("--max-total-runtime-s", "-5", "max_total_runtime_s"),
                                                      ("--missed-run-grace-s", "0", "missed_run_grace_s"),
                                                      ("--missed-run-grace-s", "1e12", "missed_run_grace_s")])
def test_bad_grace_or_cap_is_one_line_naming_the_field(cli, flag, value, field):
    line = error_line(cli("jobs", "add", "j", "--type", "ok", "--cron", "* * * * *", flag, value, expect=2))
    assert line.startswith(f"error: {field}: must be more than 0"), line


def test_grace_and_cap_in_show_json_and_the_client(cli, db_url):
    cli("jobs", "add", "j", "--type", "ok", "--cron", "* * * * *", "--missed-run-grace-s", "30",
        "--max-total-runtime-s", "90")
    shown = json.loads(cli("jobs", "show", "j", "--json").stdout)
    assert (shown["missed_run_grace_s"], shown["max_total_runtime_s"]) == (30.0, 90.0)
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        assert client.get_job("j").max_total_runtime_s == 90.0
        job = client.update_job("j", missed_run_grace_s=None, max_total_runtime_s=5.5)
        assert (job.missed_run_grace_s, job.max_total_runtime_s) == (None, 5.5)


# -- RunAll with a slow poll (issue 12: "RunAll never catches up when one supervisor step takes over a second")
def _drive(d, step_s: float, steps: int, each=None) -> dt.datetime:
    at = d.timeline()
    now = at(0)
    for i in range(1, steps + 1):
        now = at(i * step_s)
        if each is not None:
            each(now)
    return now


def test_runall_runs_at_every_slow_poll_instead_of_cutting_its_backlog_for_ever(mem_store, fake_factory):
    """A per-second job 130 s behind, polled every 1.2 s (a database 0.2 s away): the bound (100) used to
    be cut again at each poll, since it had moved more than one occurrence past the kept one, with no run
    in between. Now each cut runs the oldest kept occurrence at once: a run at every poll, the backlog
    never above the bound. (A long lease TTL: the timeline runs ahead of the real clock, which the
    liveness lease's local validity follows.)"""
    store = mem_store
    d = fake_factory(max_catchup_runs=100, lease_ttl_s=3600.0)
    t0 = d.supervisor.read_clock()[0]
    add_job(store, "every-second", "ok", "* * * * * *", next_run_at=t0 - dt.timedelta(seconds=130),
            missed_run_policy="RunAll")
    behind: list[float] = []
    now = _drive(d, 1.2, 40, lambda now: behind.append((now - store.get_job("every-second")["next_run_at"])
                                                       .total_seconds()))
    runs = store.list_runs(job_name="every-second", limit=1000)
    assert len(runs) == 41  # one per poll (the first at 0)
    scheduled = sorted(r["scheduled_at"] for r in runs)
    assert scheduled == sorted(set(scheduled))  # each occurrence once, oldest first
    assert max(behind) <= 100  # bounded by max_catchup_runs
    assert all(r["scheduled_at"] >= now - dt.timedelta(seconds=100 + 40 * 1.2) for r in runs)


def test_runall_backlog_drains_when_the_poll_is_faster_than_the_schedule(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_catchup_runs=10, lease_ttl_s=3600.0)
    t0 = d.supervisor.read_clock()[0]
    add_job(store, "every-3s", "ok", "*/3 * * * * *", next_run_at=t0 - dt.timedelta(seconds=120),
            missed_run_policy="RunAll")
    now = _drive(d, 1.5, 60)
    job = store.get_job("every-3s")
    assert job["next_run_at"] > now  # caught up: the next occurrence is in the future
    assert job["skipped_count"] == 1 and job["run_count"] >= 10 + 60 * 1.5 // 3 - 1


# -- catch-up runs honour max_jitter_s ---------------------------------------------------------------------
def test_a_runonce_catch_up_is_spread_by_the_jitter_once():
    hourly = job(name="h", cron_expression="0 * * * *", timezone="UTC", max_jitter_s=600.0)
    occurrence = utc(2030, 1, 1, 9) + dt.timedelta(seconds=planner.jitter_s(hourly, utc(2030, 1, 1, 9)))
    now = utc(2030, 1, 1, 11, 30)  # two hours down
    first = planner.decide({**hourly, "next_run_at": occurrence}, now)
    assert not first.run and first.deferred and now <= first.next_run_at < now + dt.timedelta(seconds=600)
    assert planner.decide({**hourly, "next_run_at": occurrence}, now) == first  # the same on every supervisor
    # at the deferred instant it runs, even when found late again (no second deferral, no loop)
    for at in (first.next_run_at, utc(2030, 1, 1, 13, 30)):
        again = planner.decide({**hourly, "next_run_at": first.next_run_at}, at)
        assert again.run and not again.deferred
    # not missed, no jitter, or another policy: not deferred
    assert planner.decide({**hourly, "next_run_at": occurrence}, occurrence).run
    plain = {**hourly, "max_jitter_s": None, "next_run_at": utc(2030, 1, 1, 9)}
    assert planner.decide(plain, now).run
    assert planner.decide({**hourly, "next_run_at": occurrence, "missed_run_policy": "RunAll"}, now).run


def test_after_an_outage_jittered_catch_ups_do_not_all_start_at_once(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=4, lease_ttl_s=3600.0)
    at = d.timeline()
    now = at(0)
    # leap-day jobs missed since 2020 (a schedule whose next occurrence cannot fall inside this test's
    # ten simulated minutes), each due at its jittered occurrence, as the planner set it
    old = utc(2020, 2, 29)
    for i in range(12):
        jittered = old + dt.timedelta(seconds=planner.jitter_s({"name": f"spread-{i}", "max_jitter_s": 600.0}, old))
        add_job(store, f"spread-{i}", "ok", "0 0 29 2 *", next_run_at=jittered, max_jitter_s=600.0)
    add_job(store, "unjittered", "ok", "0 0 29 2 *", next_run_at=old)
    for t in (0.1, 0.2, 0.3, 0.4, 0.5):  # four due jobs read per poll (one per idle worker)
        at(t)
    assert [r["status"] for r in store.list_runs(job_name="unjittered", limit=5)] == ["Completed"]
    delayed = [store.get_job(f"spread-{i}")["next_run_at"] for i in range(12)]
    assert all(now < when < now + dt.timedelta(seconds=601) for when in delayed)
    assert max(delayed) - min(delayed) > dt.timedelta(seconds=120)  # spread, not a burst
    assert not any(store.list_runs(job_name=f"spread-{i}", limit=5) for i in range(12))
    for t in range(10, 620, 10):
        at(t)
    for i in range(12):
        (run,) = store.list_runs(job_name=f"spread-{i}", limit=5)  # each once, at its delayed instant
        assert run["status"] == "Completed" and run["scheduled_at"] == delayed[i]
        assert store.get_job(f"spread-{i}")["skipped_count"] == 0
