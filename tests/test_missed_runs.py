"""Missed-run policy (reference-engine-spec.md §5): the reference's worked examples, the RunAll bound, and
catch-up through a real supervisor."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import time

import pytest
from conftest import add_job

from mjsched_isolated import planner
from mjsched_isolated.store.schema import jobs
from mjsched_isolated.supervisor import utcnow
from mjsched_isolated.supervisor.advice import Advice

UTC = dt.UTC
SCHEDULED = dt.datetime(2026, 8, 8, 9, 0, tzinfo=UTC)
NEXT = dt.datetime(2026, 8, 8, 10, 0, tzinfo=UTC)


def at(h, m=0, s=0):
    return dt.datetime(2026, 8, 8, h, m, s, tzinfo=UTC)


@pytest.mark.parametrize("now, policy, expected", [
    (at(9, 0, 30), "Skip", ("Run", "Now")),
    (at(9, 0, 30), "RunOnce", ("Run", "Now")),
    (at(9, 0, 30), "RunAll", ("Run", "Now")),
    (at(9, 0, 1), "Skip", ("Run", "Now")),
    (at(10), "Skip", ("SkipAndAdvance", None)),  # exactly the next occurrence: missed (inclusive)
    (at(14), "RunOnce", ("Run", "Now")),
    (at(14), "Nonsense", ("Run", "Now")),
    (at(14), "Skip", ("SkipAndAdvance", None)),
    (at(14), "RunAll", ("Run", "MissedOccurrence")),
])
def test_reference_worked_examples(now, policy, expected):
    assert planner.decide_missed_run(policy, SCHEDULED, NEXT, now) == expected


def test_reference_runall_drain_consumes_the_backlog_oldest_first_then_stops():
    consumed = []
    scheduled = SCHEDULED
    for _ in range(6):
        following = scheduled + dt.timedelta(hours=1)
        _action, advance = planner.decide_missed_run("RunAll", scheduled, following, at(14))
        consumed.append(scheduled.hour)
        if advance == "Now":
            break
        scheduled = following
    assert consumed == [9, 10, 11, 12, 13, 14] and advance == "Now"


def hourly(policy, next_run_at=SCHEDULED):
    return {"cron_expression": "0 * * * *", "timezone": "UTC", "next_run_at": next_run_at,
            "missed_run_policy": policy, "end_at": None}


def test_decide_applies_each_policy_after_an_outage():
    assert planner.decide(hourly("RunOnce"), at(14, 5)) == planner.Decision(run=True, next_run_at=at(15), missed=True)
    assert planner.decide(hourly("Skip"), at(14, 5)) == planner.Decision(run=False, next_run_at=at(15), missed=True)
    assert planner.decide(hourly("RunAll"), at(14, 5)) == planner.Decision(run=True, next_run_at=at(10), missed=True)
    assert planner.decide(hourly("Skip"), at(9, 0, 2)) == planner.Decision(run=True, next_run_at=at(10))


def test_runall_backlog_is_bounded_without_enumerating_it():
    """A per-second job down for a week keeps only its newest max_catchup_runs occurrences, computed by
    walking back from now: a week of seconds would be 604,800 calls."""
    job = {"cron_expression": "* * * * * *", "timezone": "UTC", "next_run_at": SCHEDULED,
           "missed_run_policy": "RunAll", "end_at": None}
    now = SCHEDULED + dt.timedelta(days=7)
    started = time.perf_counter()
    decision = planner.decide(job, now, max_catchup_runs=100)
    elapsed = time.perf_counter() - started
    assert decision == planner.Decision(run=True, next_run_at=now - dt.timedelta(seconds=98), missed=True,
                                        skipped_older=True, scheduled_at=now - dt.timedelta(seconds=99))
    assert elapsed < 2.0  # generous; about 10 ms here, the point is that it is not 600,000 steps
    # a backlog shorter than the bound is left alone
    short = {**job, "next_run_at": now - dt.timedelta(seconds=50)}
    assert planner.decide(short, now, 100).next_run_at == now - dt.timedelta(seconds=49)


def test_nth_latest_occurrence_of_a_sparse_schedule():
    # twice a day, 08:00 and 20:00: the 3rd latest at or before 2026-08-08 09:00 is 2026-08-07 08:00
    got = planner.nth_latest_occurrence("0 8,20 * * *", "UTC", at(9), 3, not_before=at(9) - dt.timedelta(days=30))
    assert got == dt.datetime(2026, 8, 7, 8, 0, tzinfo=UTC)
    assert planner.nth_latest_occurrence("0 8,20 * * *", "UTC", at(9), 3, not_before=at(0)) is None


def _brute_nth_latest(cron, zone, now, n, not_before):
    found = []
    when = planner.next_run_time(cron, zone, not_before - dt.timedelta(microseconds=1))
    while when <= now:
        found.append(when)
        when = planner.next_run_time(cron, zone, when)
    return found[-n] if len(found) >= n else None


@pytest.mark.parametrize("cron, zone, down_days, n", [
    ("* * 1 * *", "UTC", 40, 100),          # every minute of the 1st: the backlog is one dense day long ago
    ("* 9 1 1 *", "UTC", 3 * 365, 100),     # 60 runs a year, all on one morning
    ("*/10 * * 1 *", "Europe/Berlin", 400, 50),  # every 10 minutes in January only
    ("0 8,20 * * *", "UTC", 30, 7),
    ("30 2 * * *", "Europe/Berlin", 60, 20),   # across a DST change
    ("* * * * *", "UTC", 1, 5),
    ("0 0 29 2 *", "UTC", 3000, 1),
    ("0 0 29 2 *", "UTC", 2500, 1000),  # n x the interval reaches back before year 1: must not overflow
])
def test_nth_latest_occurrence_matches_enumeration_even_for_uneven_schedules(cron, zone, down_days, n):
    """The bound must hold however unevenly a schedule fires: a window that jumps over a dense stretch is
    narrowed, never given up on (a fresh-user audit found `* * 1 * *` down 40 days running 1,441 times)."""
    now = dt.datetime(2026, 11, 30, 23, 15, tzinfo=UTC)
    not_before = now - dt.timedelta(days=down_days)
    assert planner.nth_latest_occurrence(cron, zone, now, n, not_before) == _brute_nth_latest(
        cron, zone, now, n, not_before)


def test_runall_catches_up_at_most_a_year_even_from_an_ancient_next_run_at():
    """A leap-day job whose next_run_at was left at year 4: catching up must neither walk 2,000 years of
    occurrences nor look back over them (an audit saw one such row block the poll for a minute)."""
    now = dt.datetime(2026, 12, 1, tzinfo=UTC)
    job = {"cron_expression": "0 0 29 2 *", "timezone": "UTC", "next_run_at": dt.datetime(4, 2, 29, tzinfo=UTC),
           "missed_run_policy": "RunAll", "end_at": None}
    decision = planner.decide(job, now, max_catchup_runs=1000)
    assert decision == planner.Decision(run=False, next_run_at=dt.datetime(2028, 2, 29, tzinfo=UTC), missed=True,
                                        skipped_older=True)  # no leap day in the last 366 days
    monthly = {**job, "cron_expression": "0 0 1 * *", "next_run_at": dt.datetime(1904, 1, 1, tzinfo=UTC)}
    decision = planner.decide(monthly, now, max_catchup_runs=1000)
    assert decision.next_run_at == dt.datetime(2025, 12, 1, tzinfo=UTC) and decision.skipped_older


def test_runall_bound_holds_for_an_uneven_schedule():
    now = dt.datetime(2026, 11, 30, 23, 15, tzinfo=UTC)
    job = {"cron_expression": "* * 1 * *", "timezone": "UTC", "next_run_at": now - dt.timedelta(days=40),
           "missed_run_policy": "RunAll", "end_at": None}
    decision = planner.decide(job, now, max_catchup_runs=100)
    assert decision == planner.Decision(run=True, next_run_at=dt.datetime(2026, 11, 1, 22, 21, tzinfo=UTC),
                                        missed=True, skipped_older=True,
                                        scheduled_at=dt.datetime(2026, 11, 1, 22, 20, tzinfo=UTC))
    # the oldest kept runs at once; from there on, exactly the newest 100 occurrences run, then the next future one
    job["next_run_at"], ran = decision.next_run_at, 1
    while True:
        decision = planner.decide(job, now, max_catchup_runs=100)
        if not decision.missed and decision.run:
            break
        assert decision.run
        ran += 1
        job["next_run_at"] = decision.next_run_at
    assert ran == 99 and job["next_run_at"] == dt.datetime(2026, 11, 1, 23, 59, tzinfo=UTC)


def _runs(store, name):
    return sorted(store.list_runs(job_name=name, limit=1000), key=lambda r: r["scheduled_at"])


def test_catch_up_after_downtime_goes_through_the_cap_and_is_visible(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(max_concurrent_jobs=2)
    now = utcnow().replace(minute=0, second=0, microsecond=0)
    five_hours_ago = now - dt.timedelta(hours=5)
    add_job(store, "all", "ok", "0 * * * *", next_run_at=five_hours_ago, missed_run_policy="RunAll")
    add_job(store, "once", "ok", "0 * * * *", next_run_at=five_hours_ago, missed_run_policy="RunOnce")
    add_job(store, "skip", "ok", "0 * * * *", next_run_at=five_hours_ago, missed_run_policy="Skip")
    d.until(lambda: len(_runs(store, "all")) >= 6 and len(_runs(store, "once")) >= 1
            and store.get_job("skip")["skipped_count"] >= 1)
    all_runs = _runs(store, "all")
    assert [r["scheduled_at"] for r in all_runs[:6]] == [five_hours_ago + dt.timedelta(hours=h) for h in range(6)]
    assert all(r["started_at"] - r["scheduled_at"] > dt.timedelta(minutes=-1) for r in all_runs)
    assert [r["scheduled_at"] for r in _runs(store, "once")] == [five_hours_ago]  # one catch-up run
    assert _runs(store, "skip") == []  # missed: not run
    for name in ("all", "once", "skip"):
        assert store.get_job(name)["next_run_at"] > utcnow() - dt.timedelta(seconds=1)
    assert d.max_inflight <= 2


# -- jitter --------------------------------------------------------------------------------------------------
def test_jitter_is_off_by_default_stable_per_occurrence_and_within_the_window():
    base = {"name": "report", "cron_expression": "0 * * * *", "timezone": "UTC", "end_at": None}
    assert planner.jitter_s(base, at(9)) == 0.0
    job = {**base, "max_jitter_s": 300.0}
    delays = [planner.jitter_s(job, at(h)) for h in range(24)]
    assert all(0.0 <= d < 300.0 for d in delays) and len(set(delays)) == 24
    assert planner.jitter_s(job, at(9)) == planner.jitter_s(dict(job), at(9))  # same on every supervisor
    other = {**job, "name": "other-report"}
    assert planner.jitter_s(other, at(9)) != planner.jitter_s(job, at(9))  # jobs on one schedule spread out
    first = planner.initial_next_run_at(job, at(8, 30))
    assert at(9) <= first < at(9, 5)
    nxt = planner.decide({**job, "next_run_at": first}, first).next_run_at
    assert at(10) <= nxt < at(10, 5)  # the following occurrence, with its own delay


# -- high-frequency warning ------------------------------------------------------------------------------------
def test_human_interval_wording():
    assert [planner.human_interval(s) for s in (60, 90, 30, 0.5, 300)] == [
        "1 minute", "1 minute 30 seconds", "30 seconds", "500 ms", "5 minutes"]


def test_high_frequency_jobs_are_listed_once_at_start_and_again_when_they_change(mem_store, fake_factory, caplog):
    store = mem_store
    add_job(store, "fast", "ok", "*/30 * * * * *", next_run_at=utcnow() + dt.timedelta(days=1))
    add_job(store, "slow", "ok", "*/5 * * * *", next_run_at=utcnow() + dt.timedelta(days=1))
    d = fake_factory(rescan_interval_s=0.1)
    at = d.timeline()
    at(0)
    assert "1 job(s) fire more often" in caplog.text
    assert "fast: '*/30 * * * * *' (UTC) every 30 seconds" in caplog.text and "slow:" not in caplog.text
    for t in (0.2, 0.4, 0.6):
        at(t)  # rescans
    assert caplog.text.count("fire more often") == 1  # not repeated while nothing changes
    add_job(store, "faster", "ok", "* * * * *", next_run_at=utcnow() + dt.timedelta(days=1))
    at(0.8)
    assert caplog.text.count("fire more often") == 2 and "2 job(s) fire more often" in caplog.text
    assert "faster: '* * * * *' (UTC) every 1 minute" in caplog.text


def test_high_frequency_advice_is_one_line_for_thousands_of_jobs(mem_store, fake_factory, caplog):
    """2,000 frequent jobs gave 2,000 lines of advice (issue 10): now one line, naming the shortest few."""
    store = mem_store
    later = utcnow() + dt.timedelta(days=1)
    now = utcnow()
    store.add_job({"name": "every-second", "job_type": "ok", "cron_expression": "* * * * * *", "status": "Active",
                   "next_run_at": later}, now)
    for i in range(300):
        store.add_job({"name": f"minutely-{i:03d}", "job_type": "ok", "cron_expression": "* * * * *",
                       "status": "Active", "next_run_at": later}, now)
    d = fake_factory()
    d.timeline()(0)
    (advice,) = [r.getMessage() for r in caplog.records if "fire more often" in r.getMessage()]
    assert "\n" not in advice and len(advice) < 600
    assert advice.startswith("301 job(s) fire more often than every 5 minutes")
    assert "every-second: '* * * * * *' (UTC) every 1 second" in advice  # the shortest comes first
    assert advice.count("every 1 minute") == 4 and advice.endswith("; and 296 more")


# -- clock jumps (time is passed in: step() is driven with chosen instants) -------------------------------
def _step_until_idle(d, now, mono):
    """One step at the given clock, then what the (fake) pool reports, at that clock."""
    d.at(now, mono)
    assert not d.supervisor.inflight


def test_forward_jump_applies_the_missed_run_policy_at_once(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    t = (utcnow() + dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)  # a future occurrence
    add_job(store, "hourly", "ok", "0 * * * *", next_run_at=t)
    add_job(store, "skipper", "ok", "0 * * * *", next_run_at=t, missed_run_policy="Skip")
    mono = time.monotonic()
    d.supervisor.step(t - dt.timedelta(minutes=30), mono)
    assert not d.supervisor.inflight  # nothing due yet
    jumped = t + dt.timedelta(hours=3)  # the machine woke from suspend 3 h later
    _step_until_idle(d, jumped, mono + 1)
    runs = store.list_runs(job_name="hourly")
    assert [r["scheduled_at"] for r in runs] == [t]  # one catch-up (RunOnce)
    assert store.get_job("hourly")["next_run_at"] > jumped
    assert store.list_runs(job_name="skipper") == [] and store.get_job("skipper")["skipped_count"] == 1


def test_backward_step_never_suppresses_the_next_due_run(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    t = (utcnow() + dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    add_job(store, "hourly", "ok", "0 * * * *", next_run_at=t)
    mono = time.monotonic()
    _step_until_idle(d, t + dt.timedelta(seconds=1), mono)
    assert len(store.list_runs(job_name="hourly")) == 1
    d.supervisor.step(t - dt.timedelta(hours=2), mono + 2)  # the wall clock was stepped back 2 h
    _step_until_idle(d, t + dt.timedelta(hours=1, seconds=1), mono + 3)  # the next occurrence still runs
    assert [r["scheduled_at"] for r in store.list_runs(job_name="hourly")] == [t + dt.timedelta(hours=1), t]


def _one_held_run_in_flight(d, store):
    """Start one run the fake pool holds; return (its InFlight, its deadline, the supervisor's clock reading)."""
    d.pool.hold("slow")
    add_job(store, "slow", "ok", "0 0 1 1 *")
    d.until(lambda: bool(d.supervisor.inflight))
    (flight,) = d.supervisor.inflight.values()
    return flight, flight.deadline, d.supervisor.read_clock()


def test_forward_jump_keeps_in_flight_runs_alive_with_the_time_they_had_left(mem_store, fake_factory):
    """A machine waking from suspend (or an NTP step forward) must not kill runs as Timeout for time they
    never used: each keeps its remaining time, in memory and in its run row and job lease."""
    store = mem_store
    d = fake_factory(lease_timeout_s=2.0)
    flight, before, (now, mono) = _one_held_run_in_flight(d, store)
    d.supervisor.step(now + dt.timedelta(hours=1), mono + 0.5)  # one hour of wall time, half a second lived
    assert flight.run_id in d.supervisor.inflight  # not killed
    moved = flight.deadline - before
    assert dt.timedelta(minutes=59) < moved < dt.timedelta(minutes=61)
    assert store.get_run(flight.run_id)["deadline_at"] == flight.deadline
    d.pool.finish(flight.run_id)
    d.until(lambda: not d.supervisor.inflight)  # back on the real clock: the deadline moves back too
    assert flight.deadline - before < dt.timedelta(seconds=5)
    assert store.get_run(flight.run_id)["status"] == "Completed"


def test_backward_step_neither_stretches_deadlines_nor_stops_the_sweep(mem_store, fake_factory):
    store = mem_store
    d = fake_factory()
    flight, before, (now, mono) = _one_held_run_in_flight(d, store)
    d.supervisor.step(now, mono)
    # a job activated behind the supervisor's back (no next_run_at), then the wall clock is stepped back 1 h
    job = add_job(store, "activated", "ok", "0 0 1 1 *")
    with store.engine.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.id == job["id"]).values(next_run_at=None))
    d.supervisor.step(now - dt.timedelta(hours=1), mono + 0.5)
    assert store.get_job("activated")["next_run_at"] is not None  # the rescan ran at once, not in an hour
    assert abs(flight.deadline + dt.timedelta(hours=1) - before) < dt.timedelta(seconds=2)  # same time left


def test_after_a_forward_jump_other_supervisors_leases_are_left_alone_until_they_could_renew(mem_store, fake_factory):
    """After a forward step of the shared database clock every lease looks expired, the live ones too: a
    supervisor that noticed the jump must give the others one renewal interval before it abandons their
    runs or takes their job leases (a fresh-user audit saw a healthy run abandoned and fenced)."""
    store = mem_store
    d = fake_factory(lease_renew_interval_s=2.0, rescan_interval_s=0.5)
    sup = d.supervisor
    now, mono = sup.read_clock()
    sup.step(now, mono)  # registered, swept: the next sweep is 0.5 s away (explicit time from here on)
    store.register_supervisor("other-host-1", "other", 1, -10.0)  # its lease "looks" expired, as after the jump
    job = add_job(store, "theirs", "ok", "* * * * * *", next_run_at=utcnow() + dt.timedelta(days=1))
    claim = store.claim(job, now=utcnow(), next_run_at=job["next_run_at"] + dt.timedelta(seconds=1),
                        instance="other-host-1", lease_s=600, deadline_at=utcnow() + dt.timedelta(minutes=10),
                        scheduled_at=job["next_run_at"])
    sup.step(now, mono)
    jumped = job["next_run_at"] + dt.timedelta(seconds=2)  # its next occurrence is due, its lease is held
    sup.step(jumped, mono + 0.5)
    assert sup.takeover_hold_until == jumped + dt.timedelta(seconds=3.5)
    sup.step(jumped + dt.timedelta(seconds=1), mono + 1.5)
    assert store.get_run(claim.run_id)["status"] == "Running"  # not abandoned during the hold
    assert [r["id"] for r in store.list_runs(job_name="theirs")] == [claim.run_id]  # its lease not taken
    sup.step(jumped + dt.timedelta(seconds=5), mono + 5.5)  # past the hold, and the holder never renewed
    assert store.get_run(claim.run_id)["status"] == "Failed"


def test_a_wall_clock_jump_is_noticed_and_forces_a_fresh_database_clock_reading(mem_store, fake_factory):
    d = fake_factory()
    sup = d.supervisor
    local, mono = utcnow(), time.monotonic()
    sup.notice_clock_jump(local, mono)  # a baseline (the driver's own readings came before)
    assert sup.notice_clock_jump(local + dt.timedelta(seconds=5), mono + 5) is False  # wall and monotonic agree
    assert sup.notice_clock_jump(local + dt.timedelta(seconds=3605), mono + 6) is True  # +1 h jump
    assert sup.liveness.due(mono + 6)
    assert sup.notice_clock_jump(local - dt.timedelta(hours=2), mono + 7) is True  # stepped back


def test_runall_catch_up_runs_wait_for_each_other_even_in_skip_mode(mem_store, fake_factory):
    """A backlog is due all at once; each catch-up run must wait for the previous one, not be skipped."""
    store = mem_store
    d = fake_factory(max_concurrent_jobs=3)
    d.pool.hold()
    now = utcnow().replace(minute=0, second=0, microsecond=0)
    add_job(store, "slow-all", "ok", "0 * * * *", next_run_at=now - dt.timedelta(hours=3), missed_run_policy="RunAll")
    for _ in range(4):
        d.until(lambda: len(d.pool.held) == 1)
        d.until(lambda: d.supervisor.next_rescan_at is not None)  # at least one more step with the run live
        assert len(d.pool.held) == 1 and len(d.supervisor.inflight) == 1  # never two at once
        d.pool.finish(d.pool.held[0])
        d.until(lambda: not d.supervisor.inflight or len(d.pool.held) == 1)
    d.until(lambda: len([r for r in _runs(store, "slow-all") if r["status"] == "Completed"]) >= 4)
    runs = _runs(store, "slow-all")
    assert [r["scheduled_at"] for r in runs[:4]] == [now - dt.timedelta(hours=h) for h in (3, 2, 1, 0)]
    assert store.get_job("slow-all")["skipped_count"] == 0
    for a, b in itertools.pairwise(runs):
        assert a["completed_at"] <= b["started_at"]  # one at a time


def _due_occurrences(job) -> int:
    """The job's occurrences from its first (the test's ``first``) up to, not including, its next_run_at."""
    count, when = 0, job["first"]
    while when < job["next_run_at"]:
        count += 1
        when = planner.occurrence_after(job, when)
    return count


@pytest.mark.parametrize("cap", [2, 4])
def test_every_occurrence_is_run_skipped_or_missed_under_saturation(mem_store, fake_factory, cap, caplog):
    """Issue 12: per-second jobs of every policy and mode, runs of 0.5 to 2.5 s, more due than slots: for each
    job, occurrences due == runs of occurrences + skipped_count + missed_count, exactly; a catch-up run
    carries how many it folded, and its log line says so."""
    caplog.set_level(logging.INFO, "mjsched.supervisor")
    store = mem_store
    d = fake_factory(max_concurrent_jobs=cap)
    d.pool.hold()
    now = utcnow()
    first = now.replace(microsecond=0) + dt.timedelta(seconds=1)
    kinds = [(mode, policy) for mode in ("Skip", "Queue", "Concurrent") for policy in ("RunOnce", "Skip", "RunAll")]
    for i, (mode, policy) in enumerate(kinds):
        add_job(store, f"j{i}", "ok", "* * * * * *", now=now, next_run_at=first, concurrency_mode=mode,
                missed_run_policy=policy)
    at = d.timeline()
    length = {}  # run id -> how long it is held (1.5 to 3.5 s, by run id)
    started: dict[int, float] = {}
    for step in range(0, 120):  # 30 s, every 0.25 s
        t = step / 4
        for run_id, since in started.items():
            if t - since >= length[run_id] and run_id in d.pool.held:
                d.pool.finish(run_id)
        at(t)
        for run_id in d.pool.held:
            if run_id not in started:
                started[run_id], length[run_id] = t, 0.5 + (run_id % 5) / 2
    missed_total = 0
    for i, (mode, policy) in enumerate(kinds):
        job = dict(store.get_job(f"j{i}"), first=first)
        runs = [r for r in store.list_runs(job_name=f"j{i}", limit=1000) if r["scheduled_at"] is not None]
        due = _due_occurrences(job)
        assert due == len(runs) + job["skipped_count"] + job["missed_count"], (mode, policy, due, len(runs), job)
        assert sum(r["missed_count"] for r in runs) <= job["missed_count"]
        missed_total += job["missed_count"]
    assert missed_total > 0  # saturation folded occurrences, and they are counted
    assert "missed occurrence" in caplog.text
    assert any(r["missed_count"] > 0 for r in store.list_runs(limit=1000))


def test_occurrences_between_counts_those_passed_over_with_jitter_end_and_bound():
    """The accounting's count: occurrences strictly between the decided one and the next ``next_run_at``."""
    job = {"name": "c", "cron_expression": "*/5 * * * *", "timezone": "UTC", "end_at": None, "max_jitter_s": None}
    assert planner.occurrences_between(job, at(9), at(9, 5)) == 0  # on time: nothing passed over
    assert planner.occurrences_between(job, at(9), at(10)) == 11
    assert planner.occurrences_between(job, at(9), at(9, 7)) == 1  # a non-occurrence next_run_at (a deferral)
    assert planner.occurrences_between(dict(job, end_at=at(9, 30)), at(9), None) == 6
    jittered = dict(job, max_jitter_s=60.0)  # next_run_at values are occurrences delayed by their jitter
    seen = at(9) + dt.timedelta(seconds=planner.jitter_s(jittered, at(9)))
    following = at(10) + dt.timedelta(seconds=planner.jitter_s(jittered, at(10)))
    assert planner.occurrences_between(jittered, seen, following) == 11
    every_second = dict(job, cron_expression="* * * * * *")
    assert planner.occurrences_between(every_second, at(9), at(12)) == planner.MAX_COUNTED_OCCURRENCES


def test_an_occurrence_after_end_at_is_counted_missed(mem_store, fake_factory):
    """A due occurrence after ``end_at`` (an ``end_at`` edited to before it): the job expires without
    running it; that one is missed, not lost."""
    store = mem_store
    d = fake_factory()
    now = utcnow()
    add_job(store, "late", "ok", "* * * * * *", now=now, next_run_at=now - dt.timedelta(seconds=1),
            end_at=now - dt.timedelta(seconds=2))
    d.timeline()(0)
    job = store.get_job("late")
    assert (job["status"], job["missed_count"], job["skipped_count"], store.list_runs(job_name="late")) == (
        "Expired", 1, 0, [])


def test_the_occurrence_at_end_at_runs_when_found_after_it(mem_store, fake_factory):
    """A new user's finding: ``end_at`` on an occurrence (``0 * * * *`` ending on the hour) always lost that
    last run, found a few ms after its instant. It runs (the job's missed-run policy decides, as for any late
    occurrence) and the job then expires: nothing after ``end_at``."""
    store = mem_store
    d = fake_factory()
    now = utcnow()
    end_at = now - dt.timedelta(seconds=1)
    add_job(store, "last", "ok", "* * * * * *", now=now, next_run_at=end_at, end_at=end_at)
    d.timeline()(0)
    job = store.get_job("last")
    runs = store.list_runs(job_name="last")
    assert [r["scheduled_at"] for r in runs] == [end_at]
    assert (job["status"], job["next_run_at"], job["missed_count"]) == ("Expired", None, 0)


def test_high_frequency_advice_reads_the_jobs_once_so_a_change_meanwhile_cannot_empty_it(mem_store, caplog,
                                                                                          monkeypatch):
    """The jobs change right after each read the advice makes: with a count read then a read of names, the
    line came out naming nobody; one read keeps counts and names together."""
    store = mem_store
    add_job(store, "fast", "ok", "*/30 * * * * *", next_run_at=utcnow() + dt.timedelta(days=1))
    reads = []
    def pausing(name, original):
        def read(*args, **kwargs):
            reads.append(name)
            out = original(*args, **kwargs)
            store.update_job("fast", {"status": "Paused"}, utcnow())  # paused just after the read
            return out
        return read

    for name in ("active_schedules_named", "active_jobs"):
        monkeypatch.setattr(store, name, pausing(name, getattr(store, name)))
    Advice(store).warn_high_frequency(utcnow())
    (advice,) = [r.getMessage() for r in caplog.records if "fire more often" in r.getMessage()]
    assert advice.startswith("1 job(s)") and "fast: '*/30 * * * * *' (UTC) every 30 seconds" in advice, advice
    assert len(reads) == 1
