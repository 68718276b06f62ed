"""Issue 12 point 9 and "retry this run": ``jobs backfill`` and ``runs retry`` make occurrences pending in the
``backfills`` table (revision 0014), and the supervisors run them through the normal path (cap, mode, lease),
each run with its own ``scheduled_at``, without touching the regular schedule. Pure planning, the store on
all three databases, the supervisor on the FakePool with time passed in, the CLI; the real-process test is
test_backfill_serve.py."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import sqlalchemy as sa
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated import Client, ops, planner
from mjsched_isolated.errors import InputError, NotFoundError
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import audit_log, backfills, runs

UTC = dt.UTC
YEARLY = "0 0 1 1 *"  # never due again within a test
HOURLY = "0 * * * *"
T = dt.datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LONG = {"lease_ttl_s": 600.0, "lease_renew_interval_s": 300.0}


def hours(*hs: int) -> list[dt.datetime]:
    return [T + dt.timedelta(hours=h) for h in hs]


def job_row(**values) -> dict:
    return {"name": "j", "cron_expression": HOURLY, "timezone": "UTC", **values}


def _finished_run(store: Store, name: str, scheduled_at: dt.datetime, status: str = "Failed", attempt: int = 1
                  ) -> int:
    """A finished run of ``name``'s occurrence ``scheduled_at``, as the store records one."""
    with store.engine.begin() as conn:
        key = conn.execute(runs.insert().values(
            job_id=store.get_job(name)["id"], scheduled_at=scheduled_at, started_at=NOW, completed_at=NOW,
            status=status, success=status == "Completed", attempt=attempt)).inserted_primary_key
    return int(key[0])


# -- planning: window -> occurrences ---------------------------------------------------------------------
def test_window_gives_the_occurrences_in_it_both_ends_included_and_one_more_than_the_bound_at_most():
    assert planner.occurrences_in_window(job_row(), T, T + dt.timedelta(hours=3), 10) == hours(0, 1, 2, 3)
    assert planner.occurrences_in_window(job_row(), T + dt.timedelta(minutes=1), T + dt.timedelta(minutes=59),
                                         10) == []
    assert len(planner.occurrences_in_window(job_row(), T, T + dt.timedelta(days=30), 5)) == 6  # bound + 1
    bounded = job_row(start_at=T + dt.timedelta(hours=2), end_at=T + dt.timedelta(hours=4))
    assert planner.occurrences_in_window(bounded, T, T + dt.timedelta(hours=9), 10) == hours(2, 3, 4)


def test_window_follows_the_zone_and_dst_policies_like_the_schedule():
    """Europe/Berlin, 02:30 daily, across the spring gap (2026-03-29: 02:00 -> 03:00): Shift runs it at the
    first instant after the gap (01:00 UTC), Skip leaves that day out; and each instant is what the regular
    schedule's next_run_at would be."""
    job = job_row(cron_expression="30 2 * * *", timezone="Europe/Berlin")
    lo, hi = dt.datetime(2026, 3, 28, tzinfo=UTC), dt.datetime(2026, 3, 31, tzinfo=UTC)
    shift = planner.occurrences_in_window(job, lo, hi, 10)
    assert shift == [dt.datetime(2026, 3, 28, 1, 30, tzinfo=UTC), dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
                     dt.datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    skip = planner.occurrences_in_window({**job, "dst_gap_policy": "Skip"}, lo, hi, 10)
    assert skip == [shift[0], shift[2]]
    assert shift[1:] == [planner.occurrence_after(job, shift[0]), planner.occurrence_after(job, shift[1])]


def test_window_occurrences_carry_the_jobs_jitter_like_next_run_at():
    job = job_row(max_jitter_s=30.0)
    found = planner.occurrences_in_window(job, T, T + dt.timedelta(hours=2), 10)
    assert found == [t + dt.timedelta(seconds=planner.jitter_s(job, t)) for t in hours(0, 1, 2)]


# -- ops: bound, bad input, idempotence (on every database) -----------------------------------------------------
def test_backfill_adds_the_windows_occurrences_once_and_audits_each_request(any_store: Store):
    store = any_store
    add_job(store, "b", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1))
    _finished_run(store, "b", T + dt.timedelta(hours=1), attempt=2)  # 01:00 already has a run (a retry)
    first = ops.backfill_job(store, "b", T, T + dt.timedelta(hours=3), NOW, requested_by="ann")
    assert (first.occurrences, first.added, first.already_run, first.already_pending) == (
        4, hours(0, 2, 3), hours(1), [])
    again = ops.backfill_job(store, "b", T, T + dt.timedelta(hours=4), NOW, requested_by="bob")
    assert (again.added, again.already_run, again.already_pending) == (hours(4), hours(1), hours(0, 2, 3))
    view = ops.get_job(store, "b")
    assert view["pending_backfill_count"] == 4
    assert [(p["scheduled_at"], p["attempt"], p["kind"]) for p in view["pending_backfill"]] == [
        (t, 1, "Backfill") for t in hours(0, 2, 3, 4)]
    assert store.get_job("b")["next_run_at"] == NOW + dt.timedelta(hours=1)  # the schedule is untouched
    with store.engine.connect() as conn:
        audits = conn.execute(sa.select(audit_log.c.actor, audit_log.c.action, audit_log.c.target,
                                        audit_log.c.details).order_by(audit_log.c.id)).all()
    assert [(a, b, c) for a, b, c, _ in audits] == [("ann", "backfill", "b"), ("bob", "backfill", "b")]
    assert json.loads(audits[0][3])["occurrences"] == 4


def test_backfill_refuses_bad_windows_and_a_window_over_the_bound_writing_nothing(mem_store: Store):
    store = mem_store
    add_job(store, "b", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1))
    cases = [((T - dt.timedelta(days=5), T), {}, "max"),  # 121 occurrences > 100
             ((T, T + dt.timedelta(hours=5)), {"max_occurrences": 5}, "max"),
             ((T, T + dt.timedelta(hours=5)), {"max_occurrences": 0}, "max"),
             ((T, T - dt.timedelta(hours=1)), {}, "to"),
             ((T, NOW + dt.timedelta(hours=1)), {}, "to"),
             (("yesterday", T), {}, "from")]
    for (lo, hi), kw, field in cases:
        with pytest.raises(InputError) as err:
            ops.backfill_job(store, "b", lo, hi, NOW, **kw)
        assert err.value.field == field, (lo, hi, kw, str(err.value))
        assert "+00:00" not in str(err.value)  # times in the Z form, as everywhere else
    with pytest.raises(NotFoundError):
        ops.backfill_job(store, "nope", T, T, NOW)
    assert ops.backfill_job(store, "b", T, T + dt.timedelta(hours=4), NOW, max_occurrences=5).added == hours(
        0, 1, 2, 3, 4)  # exactly the bound is fine
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(audit_log)).scalar() == 1


def test_backfill_reads_naive_times_in_the_jobs_zone_and_leaves_the_schedules_own_occurrences_to_it(mem_store):
    store = mem_store
    add_job(store, "tz", "ok", HOURLY, now=NOW, next_run_at=T + dt.timedelta(hours=2), timezone="Asia/Tokyo")
    got = ops.backfill_job(store, "tz", dt.datetime(2026, 11, 30, 9, 0), dt.datetime(2026, 11, 30, 12, 0), NOW)
    assert got.window_start == T  # 09:00 in Tokyo
    assert (got.added, got.left_to_schedule) == (hours(0, 1), hours(2, 3))


def test_with_an_automatic_retry_pending_the_schedules_own_occurrences_are_still_left_to_it(mem_store):
    """A pending retry displaces next_run_at into retry_next_run_at: the occurrences from there on are the
    schedule's, not the backfill's."""
    store = mem_store
    retry_at = NOW + dt.timedelta(minutes=5)
    add_job(store, "rt", "ok", HOURLY, now=NOW, next_run_at=retry_at, retry_at=retry_at, retry_attempt=2,
            retry_scheduled_at=T, retry_next_run_at=T + dt.timedelta(hours=2))
    got = ops.backfill_job(store, "rt", T, T + dt.timedelta(hours=3), NOW)
    assert (got.added, got.left_to_schedule) == (hours(0, 1), hours(2, 3))


# -- the store: claim, lease, cascade (on every database) -------------------------------------------------------
def test_a_claimed_backfill_becomes_a_running_run_of_its_occurrence_once_and_holds_the_lease(any_store: Store):
    store = any_store
    add_job(store, "c", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1))
    ops.backfill_job(store, "c", T, T + dt.timedelta(hours=1), NOW)
    due = store.backfills.due(10)
    assert [(e["scheduled_at"], j["name"]) for e, j in due] == [(T, "c"), (T + dt.timedelta(hours=1), "c")]
    entry = due[0][0]
    store.register_supervisor("sup-1", "host", 1, 60.0)  # a live holder: its lease counts
    claim = store.backfills.claim(entry, take_lease=True, instance="sup-1", lease_s=60, deadline_at=NOW,
                                  not_before=NOW)
    assert claim is not None and claim.lock_token
    assert store.backfills.claim(entry, take_lease=True, instance="sup-2", lease_s=60, deadline_at=NOW) is None
    run = store.get_run(claim.run_id)
    assert (run["scheduled_at"], run["attempt"], run["status"], run["queued_at"]) == (T, 1, "Running", NOW)
    assert store.backfills.due(10) == []  # the lease is held: the job's next entry waits
    job = store.get_job("c")
    assert (job["lock_token"], job["next_run_at"]) == (claim.lock_token, NOW + dt.timedelta(hours=1))
    store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Completed", success=True,
                     error_message=None, details=None, duration_ms=1.0)
    assert [e["scheduled_at"] for e, _ in store.backfills.due(10)] == [T + dt.timedelta(hours=1)]
    assert ops.backfill_job(store, "c", T, T + dt.timedelta(hours=1), NOW).already_run == [T]
    store.remove_job("c")  # pending entries go with their job
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(backfills)).scalar() == 0


def test_due_backfills_wait_while_the_job_is_paused_and_a_concurrent_job_needs_no_lease(mem_store: Store):
    store = mem_store
    add_job(store, "p", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1))
    add_job(store, "cc", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1), concurrency_mode="Concurrent")
    ops.backfill_job(store, "p", T, T, NOW)
    ops.backfill_job(store, "cc", T, T + dt.timedelta(hours=1), NOW)
    ops.pause_job(store, "p", NOW)
    due = store.backfills.due(10)
    assert [j["name"] for _, j in due] == ["cc", "cc"]
    claims = [store.backfills.claim(e, take_lease=False, instance="s", lease_s=60, deadline_at=NOW) for e, _ in due]
    assert all(c is not None and c.lock_token is None for c in claims)  # both run at once
    ops.resume_job(store, "p", NOW)
    assert [j["name"] for _, j in store.backfills.due(10)] == ["p"]


# -- retry this run ------------------------------------------------------------------------------------------
def test_retry_makes_the_next_attempt_of_the_occurrence_pending_and_refuses_what_it_must(any_store: Store):
    store = any_store
    add_job(store, "r", "ok", HOURLY, now=NOW, next_run_at=NOW + dt.timedelta(hours=1))
    run_id = _finished_run(store, "r", T)
    entry = ops.retry_run(store, run_id, NOW, requested_by="ann")
    assert (entry["job_name"], entry["scheduled_at"], entry["attempt"], entry["kind"], entry["retry_of_run_id"]) == (
        "r", T, 2, "Retry", run_id)
    with pytest.raises(InputError, match="already pending") as err:
        ops.retry_run(store, run_id, NOW)
    assert err.value.field == "id"
    (pending, job), = store.backfills.due(10)
    claim = store.backfills.claim(pending, take_lease=True, instance="x", lease_s=60, deadline_at=NOW)
    assert claim is not None and store.get_run(claim.run_id)["attempt"] == 2
    with pytest.raises(InputError, match="still running"):
        ops.retry_run(store, claim.run_id, NOW)
    with pytest.raises(InputError, match="has a live run"):  # Skip: one at a time
        ops.retry_run(store, run_id, NOW)
    store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Failed", success=False,
                     error_message=None, details=None, duration_ms=1.0)
    assert ops.retry_run(store, run_id, NOW)["attempt"] == 3  # after the highest attempt of the occurrence
    with pytest.raises(NotFoundError):
        ops.retry_run(store, 999_999, NOW)


# -- the supervisor: FakePool, time passed in ------------------------------------------------------------------
def test_supervisor_runs_pending_backfills_one_at_a_time_under_the_lease_after_the_regular_schedule(mem_store,
                                                                                                 fake_factory):
    """Cap 2, a Skip job with three pending occurrences and a regular job due: the regular occurrence and
    ONE backfill run at once (the lease), the others follow one by one, each with its scheduled_at; the
    backfilled job's next_run_at is untouched and nothing is counted skipped."""
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=2)
    add_job(store, "bf", "ok", HOURLY, next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
    add_job(store, "reg", "ok", YEARLY)
    at = d.timeline()
    t0 = store.db_now()
    ops.backfill_job(store, "bf", t0 - dt.timedelta(hours=3), t0, t0, max_occurrences=5)
    d.pool.hold("bf", "reg")
    at(0.01)  # the regular occurrence (due) first, then one backfill with the remaining worker
    runs = sorted(store.list_runs(limit=10), key=lambda r: r["id"])
    assert [r["job_name"] for r in runs] == ["reg", "bf"]
    at(0.02)
    assert len(store.list_runs(limit=10)) == 2  # the lease holds the next backfill back
    d.pool.release_holds()
    for run_id in d.pool.held:
        d.pool.finish(run_id)
    for i in range(1, 6):
        at(0.02 + i * 0.01)
    bf = sorted(store.list_runs(job_name="bf", limit=10), key=lambda r: r["id"])
    occurrences = [t0.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=h) for h in (2, 1, 0)]
    assert [(r["scheduled_at"], r["attempt"], r["status"]) for r in bf] == [(o, 1, "Completed") for o in occurrences]
    job = store.get_job("bf")
    assert (job["next_run_at"], job["skipped_count"], job["run_count"]) == (
        dt.datetime(2099, 1, 1, tzinfo=UTC), 0, 3)
    assert store.backfills.pending(job["id"])[0] == 0


def test_pending_backfill_outlives_its_supervisor_and_another_one_takes_over(mem_store, fake_factory):
    """Supervisor a runs the first of two pending occurrences and dies (its liveness lease ends): supervisor
    b abandons a's run, as for any run, and runs the second occurrence: the pending work was in the
    database, not in a's memory."""
    store = mem_store
    a = fake_factory(**LONG, max_concurrent_jobs=1, instance="sup-a")
    b = fake_factory(**LONG, max_concurrent_jobs=1, instance="sup-b")
    add_job(store, "dur", "ok", HOURLY, next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
    now = store.db_now()
    ops.backfill_job(store, "dur", now - dt.timedelta(hours=2), now, now)
    a.pool.hold("dur")
    at_a, at_b = a.timeline(), b.timeline()
    at_a(0.01)
    at_b(0.01)  # b is idle, but the job's lease is a's: its second occurrence waits
    first, = store.list_runs(job_name="dur", limit=10)
    assert (first["executed_by_instance"], first["status"]) == ("sup-a", "Running")
    store.stop_supervisor("sup-a")  # a is gone (as after SIGKILL once its liveness lease has lapsed)
    at_b(1.1)  # b's rescan: a's run is abandoned, its lease freed; the next occurrence starts on b
    at_b(1.2)
    runs = sorted(store.list_runs(job_name="dur", limit=10), key=lambda r: r["id"])
    assert [(r["executed_by_instance"], r["status"]) for r in runs] == [("sup-a", "Failed"), ("sup-b", "Completed")]
    assert runs[0]["scheduled_at"] < runs[1]["scheduled_at"]
    assert store.backfills.pending(runs[0]["job_id"])[0] == 0


def test_supervisor_runs_a_retry_request_as_the_next_attempt(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "f", "fail", YEARLY)
    at = d.timeline()
    at(0)
    at(0.01)
    first, = store.list_runs(job_name="f", limit=10)
    assert first["status"] == "Failed"
    ops.retry_run(store, first["id"], at(0.02))
    at(0.03)
    assert len(store.list_runs(job_name="f", limit=10)) == 1  # a new request is seen at the next rescan
    at(1.1)  # rescan_interval_s (1 s) later
    at(1.2)
    runs = sorted(store.list_runs(job_name="f", limit=10), key=lambda r: r["id"])
    assert [(r["scheduled_at"], r["attempt"], r["status"]) for r in runs] == [
        (first["scheduled_at"], 1, "Failed"), (first["scheduled_at"], 2, "Failed")]


# -- CLI and Client ------------------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    return Cli(capsys, monkeypatch, tmp_path)


def test_cli_backfill_and_retry(cli, db_url):
    with Store.open(db_url) as store:
        add_job(store, "c", "ok", HOURLY, next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
        run_id = _finished_run(store, "c", T)
    out = cli("jobs", "backfill", "c", "--from", "2026-11-30T00:00:00Z", "--to", "2026-11-30T02:00:00Z",
              "--db", db_url, "--json")
    got = json.loads(out.stdout)
    assert (got["occurrences"], len(got["added"]), len(got["already_run"])) == (3, 2, 1)
    text = cli("jobs", "backfill", "c", "--from", "2026-11-30T00:00:00Z", "--to", "2026-11-30T02:00:00Z",
               "--db", db_url).stdout
    assert "0 occurrence(s) added" in text and "2 already pending" in text
    err = cli("jobs", "backfill", "c", "--from", "2026-11-01T00:00:00Z", "--to", "2026-11-30T00:00:00Z",
              "--db", db_url, expect=2)
    assert error_line(err).startswith("error: --max: ")
    err = cli("jobs", "backfill", "c", "--from", "nope", "--to", "2026-11-30T00:00:00Z", "--db", db_url, expect=2)
    assert error_line(err).startswith("error: --from: ")
    shown = cli("jobs", "show", "c", "--db", db_url).stdout
    assert "pending_backfill_count" in shown
    retried = json.loads(cli("runs", "retry", str(run_id), "--db", db_url, "--json").stdout)
    assert (retried["attempt"], retried["retry_of_run_id"]) == (2, run_id)
    err = cli("runs", "retry", str(run_id), "--db", db_url, expect=2)
    assert error_line(err).startswith("error: id: ")


def test_client_backfill_and_retry(db_url):
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        client.add_job("k", job_type="ok", cron_expression=HOURLY)
        with Store.open(db_url) as store:
            run_id = _finished_run(store, "k", T)
        result = client.backfill_job("k", T, T + dt.timedelta(hours=1), max_occurrences=2)
        assert result.added == [T + dt.timedelta(hours=1)] and result.already_run == [T]
        assert client.retry_run(run_id)["attempt"] == 2
        assert client.get_job("k").pending_backfill_count == 2


def test_backfill_of_an_expired_or_disabled_job_is_refused_naming_its_state(cli, db_url):
    """New-user review M4: the entries of an Expired or Disabled job would never run (only Active jobs run
    pending entries), so the request is refused, exit 2, one line, nothing written (CLI, Client, ops)."""
    with Store.open(db_url) as store:
        add_job(store, "gone", "ok", HOURLY, status="Expired", next_run_at=None)
        add_job(store, "off", "ok", HOURLY, status="Disabled")
        add_job(store, "napping", "ok", HOURLY, status="Paused", next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
    window = ("--from", "2026-11-30T00:00:00Z", "--to", "2026-11-30T02:00:00Z", "--db", db_url)
    for name, state in (("gone", "Expired"), ("off", "Disabled")):
        err = cli("jobs", "backfill", name, *window, expect=2)
        assert error_line(err).startswith(f"error: name: job {name!r} is {state}: a backfill of it would never run")
        assert len(err.stderr.strip().splitlines()) == 1
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client, pytest.raises(InputError, match="is Expired"):
        client.backfill_job("gone", T, T + dt.timedelta(hours=1))
    assert len(json.loads(cli("jobs", "backfill", "napping", *window, "--json").stdout)["added"]) == 3  # waits
    with Store.open(db_url) as store:
        assert [store.backfills.pending(store.get_job(n)["id"])[0] for n in ("gone", "off")] == [0, 0]
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(audit_log)).scalar() == 1  # napping only
