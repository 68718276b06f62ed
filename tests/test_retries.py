"""Issue 12 points 5 and 8: retries with backoff (a retry is a new run of the same occurrence with the next
``attempt``, durable in the job row) and pause on repeated failure. Supervisor decisions on the in-memory
store with the FakePool and a timeline (time passed in); the real end-to-end test (a real ``serve`` on
PostgreSQL, SIGKILLed between attempts) is in test_retries_serve.py."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re

import pytest
import sqlalchemy as sa
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated import Client, ops, planner
from mjsched_isolated.errors import InputError
from mjsched_isolated.store import Store

UTC = dt.UTC
YEARLY = "0 0 1 1 *"  # never due again within a test
T = dt.datetime(2030, 1, 1, 12, tzinfo=UTC)
# timelines longer than a lease renewal: a renewal re-reads the database clock, which would pull "now" back
LONG = {"lease_ttl_s": 600.0, "lease_renew_interval_s": 300.0}


def steps(d):
    """``at(0)`` on the driver's timeline, then ``(at, to)``: ``to(instant, delta_s)`` steps to a database
    instant plus ``delta_s``. Recorded times are the database's (a claim's ``started_at`` is its clock, a
    little after the timeline's ``at(0)`` on a loaded machine), so retries are stepped to by their
    ``retry_at``, never by a fixed offset."""
    at = d.timeline()
    t0 = at(0)

    def to(instant: dt.datetime, delta_s: float = 0.0) -> dt.datetime:
        return at((instant - t0).total_seconds() + delta_s)

    return at, to


def runs_of(store: Store, name: str) -> list[dict]:
    return sorted(store.list_runs(job_name=name, limit=100), key=lambda r: r["id"])


# -- the planner ------------------------------------------------------------------------------------------
def test_backoff_grows_by_the_factor_up_to_the_cap():
    job = {"name": "j", "max_retries": 5, "retry_backoff_s": 10.0, "retry_backoff_factor": 2.0}
    assert [planner.retry_delay_s(job, a, T) for a in (1, 2, 3, 4)] == [10.0, 20.0, 40.0, 80.0]
    assert [planner.retry_delay_s({**job, "retry_backoff_max_s": 30.0}, a, T) for a in (1, 2, 3)] == [10, 20, 30]
    assert planner.retry_delay_s({**job, "retry_backoff_factor": 1.0}, 4, T) == 10.0
    jittered = {**job, "retry_max_jitter_s": 5.0}
    delays = [planner.retry_delay_s(jittered, 1, T + dt.timedelta(minutes=m)) for m in range(20)]
    assert all(10.0 <= d < 15.0 for d in delays) and len(set(delays)) > 1
    assert planner.retry_delay_s(jittered, 1, T) == planner.retry_delay_s(jittered, 1, T)  # same on every supervisor


def test_which_outcomes_retry():
    job = {"name": "j", "max_retries": 2, "retry_backoff_s": 10.0, "retry_backoff_factor": 2.0}
    ended = T + dt.timedelta(seconds=3)
    assert planner.retry_at(job, attempt=1, status="Failed", scheduled_at=T, ended_at=ended) == ended + dt.timedelta(
        seconds=10)
    assert planner.retry_at(job, attempt=2, status="Timeout", scheduled_at=T, ended_at=ended) is not None
    assert planner.retry_at(job, attempt=3, status="Failed", scheduled_at=T, ended_at=ended) is None  # used up
    assert planner.retry_at(job, attempt=1, status="Cancelled", scheduled_at=T, ended_at=ended) is None
    assert planner.retry_at(job, attempt=1, status="Completed", scheduled_at=T, ended_at=ended) is None
    assert planner.retry_at(job, attempt=1, status="Failed", scheduled_at=None, ended_at=ended) is None  # manual
    assert planner.retry_at({**job, "max_retries": 0}, attempt=1, status="Failed", scheduled_at=T,
                            ended_at=ended) is None
    only_cancel = {**job, "retry_on": "Cancelled"}
    assert planner.retry_at(only_cancel, attempt=1, status="Cancelled", scheduled_at=T, ended_at=ended) is not None
    assert planner.retry_at(only_cancel, attempt=1, status="Failed", scheduled_at=T, ended_at=ended) is None


# -- the supervisor (FakePool, time passed in) -------------------------------------------------------------
def test_fails_twice_then_succeeds_gives_three_attempts_of_one_occurrence_with_the_backoff(mem_store, fake_factory,
                                                                                        tmp_path):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "flaky", "flaky", YEARLY, max_retries=3, retry_backoff_s=10.0, retry_backoff_factor=2.0,
            configuration=json.dumps({"counter_dir": str(tmp_path), "fail_times": 2}))
    occurrence = store.get_job("flaky")["next_run_at"]
    _, to = steps(d)
    (first,) = runs_of(store, "flaky")
    assert (first["status"], first["attempt"]) == ("Failed", 1)
    job = store.get_job("flaky")
    assert job["retry_attempt"] == 2 and job["retry_scheduled_at"] == occurrence
    assert job["retry_at"] == job["next_run_at"] == first["completed_at"] + dt.timedelta(seconds=10)
    assert job["retry_next_run_at"] > first["started_at"]  # the yearly occurrence it displaced
    assert (job["retry_next_run_at"].month, job["retry_next_run_at"].day) == (1, 1)
    to(job["retry_at"], -0.5)
    assert len(runs_of(store, "flaky")) == 1  # not before its backoff
    to(job["retry_at"], 0.05)
    second = runs_of(store, "flaky")[1]
    assert (second["status"], second["attempt"], second["scheduled_at"]) == ("Failed", 2, occurrence)
    assert store.get_job("flaky")["retry_at"] == second["completed_at"] + dt.timedelta(seconds=20)  # factor 2
    retry_at = store.get_job("flaky")["retry_at"]
    to(retry_at, -0.5)
    assert len(runs_of(store, "flaky")) == 2
    to(retry_at, 0.05)
    runs = runs_of(store, "flaky")
    assert [(r["attempt"], r["status"], r["scheduled_at"]) for r in runs] == [
        (1, "Failed", occurrence), (2, "Failed", occurrence), (3, "Completed", occurrence)]
    job = store.get_job("flaky")
    assert (job["retry_at"], job["retry_attempt"], job["retry_scheduled_at"], job["retry_next_run_at"]) == (
        None, None, None, None)
    assert job["next_run_at"] == dt.datetime(job["next_run_at"].year, 1, 1, tzinfo=UTC)  # back to the schedule
    assert (job["run_count"], job["failure_count"], job["consecutive_failures"]) == (3, 2, 0)
    to(retry_at, 200)
    assert len(runs_of(store, "flaky")) == 3


def test_without_max_retries_a_failure_is_final_as_before(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "once", "fail", YEARLY)
    at = d.timeline()
    at(0)
    at(60)
    (run,) = runs_of(store, "once")
    job = store.get_job("once")
    assert run["attempt"] == 1 and run["status"] == "Failed"
    assert job["retry_at"] is None and job["retry_attempt"] is None
    assert job["next_run_at"] > run["started_at"] and (job["next_run_at"].month, job["next_run_at"].day) == (1, 1)
    assert job["consecutive_failures"] == 1
    (notice,) = [n for n in store.list_notifications() if n["run_id"] == run["id"]]
    assert "retry" not in notice["subject"]


def test_retries_used_up_give_one_final_failure_notice(mem_store, fake_factory, caplog):
    caplog.set_level(logging.WARNING, "mjsched.supervisor")
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "always", "fail", YEARLY, max_retries=2, retry_backoff_s=5.0, retry_backoff_factor=1.0)
    _, to = steps(d)
    for _ in range(2):
        to(store.get_job("always")["retry_at"], 0.05)
    to(runs_of(store, "always")[-1]["completed_at"], 60)
    runs = runs_of(store, "always")
    assert [(r["attempt"], r["status"]) for r in runs] == [(1, "Failed"), (2, "Failed"), (3, "Failed")]
    subjects = [n["subject"] for n in store.list_notifications() if n["job_id"] == runs[0]["job_id"]]
    assert subjects[0].startswith("Scheduled job 'always' failed, retry 1 of 2 at ")
    assert subjects[1].startswith("Scheduled job 'always' failed, retry 2 of 2 at ")
    assert subjects[2] == "Scheduled job 'always' failed"  # the final failure, once
    # times in the Z form, as in the notices: "retry 1 of 2 at 2026-12-03T05:40:01.5Z"
    lines = [r.getMessage() for r in caplog.records if "of job always: Failed, retry" in r.getMessage()]
    assert len(lines) == 2 and all(re.search(r" at \S+Z$", line) for line in lines), lines
    assert all(re.search(r" at \S+Z$", s) for s in subjects[:2]), subjects
    assert store.get_job("always")["consecutive_failures"] == 1 and store.get_job("always")["retry_at"] is None


def test_a_crashed_worker_and_a_timeout_retry_a_cancelled_run_does_not(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=2, lease_timeout_s=2.0, kill_grace_s=0)
    d.pool.hold()
    add_job(store, "crashy", "ok", YEARLY, max_retries=1, retry_backoff_s=5.0)
    add_job(store, "slow", "ok", YEARLY, max_retries=1, retry_backoff_s=5.0)
    at, to = steps(d)
    crashy, slow = (runs_of(store, n)[0]["id"] for n in ("crashy", "slow"))
    d.pool.crash(crashy)
    at(0.5)
    assert store.get_run(crashy)["status"] == "Failed"
    assert store.get_job("crashy")["retry_attempt"] == 2
    at(2.1)  # past the deadline: killed, Timeout
    assert store.get_run(slow)["status"] == "Timeout"
    assert store.get_job("slow")["retry_attempt"] == 2
    d.pool.release_holds()
    last_retry_at = max(store.get_job(n)["retry_at"] for n in ("crashy", "slow"))
    to(last_retry_at, 0.05)
    to(last_retry_at, 0.1)
    assert [r["attempt"] for r in runs_of(store, "crashy")] == [1, 2]
    assert [r["attempt"] for r in runs_of(store, "slow")] == [1, 2]
    assert runs_of(store, "crashy")[1]["status"] == "Completed"


def test_a_fenced_run_is_not_retried_unless_asked(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=2)
    d.pool.hold()
    add_job(store, "fenced", "ok", YEARLY, max_retries=2)
    add_job(store, "asked", "ok", YEARLY, max_retries=2, retry_on="Fenced")
    at = d.timeline()
    at(0)
    with store.engine.begin() as conn:  # another holder took both leases: the runs are fenced at a renewal
        conn.execute(sa.text("UPDATE jobs SET lock_token = 'theirs'"))
    d.supervisor.guard.fence_unheld(at(0.2))
    for name in ("fenced", "asked"):
        assert runs_of(store, name)[0]["error_message"].startswith("fenced: run killed because")
    assert store.get_job("fenced")["retry_attempt"] is None
    assert store.get_job("asked")["retry_attempt"] == 2


@pytest.mark.parametrize(("retry_on", "retried"), [(None, False), ("Failed,Cancelled", True)])
def test_a_cancelled_run_is_retried_only_when_asked(mem_store, fake_factory, retry_on, retried):
    store = mem_store
    d = fake_factory(lease_ttl_s=2.0, lease_renew_interval_s=0.2, rescan_interval_s=0.2)  # real clocks
    d.pool.hold()
    add_job(store, "long", "ok", YEARLY, max_retries=1, retry_backoff_s=600.0, retry_on=retry_on)
    d.until(lambda: bool(store.running_runs()))
    (run,) = store.running_runs()
    ops.cancel_run(store, run["id"], "alice@laptop")
    d.until(lambda: store.get_run(run["id"])["status"] != "Running", 10)
    assert store.get_run(run["id"])["status"] == "Cancelled"
    job = store.get_job("long")
    assert (job["retry_attempt"] == 2) is retried
    assert (job["run_count"], job["consecutive_failures"]) == (0, 0)  # a cancelled run is not counted


def test_the_retry_survives_its_supervisor_another_one_picks_it_up(mem_store, fake_factory):
    """Durable: the pending retry is in the job row, so a second supervisor (the first one gone) runs it."""
    store = mem_store
    first = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "j", "fail", YEARLY, max_retries=1, retry_backoff_s=3.0)
    first.timeline()(0)
    assert store.get_job("j")["retry_attempt"] == 2
    first.close()  # gone (its lease was released with the result: nothing to take over)
    second = fake_factory(**LONG, max_concurrent_jobs=1)
    _, to = steps(second)
    to(store.get_job("j")["retry_at"], 0.05)
    runs = runs_of(store, "j")
    assert [(r["attempt"], r["executed_by_instance"]) for r in runs] == [
        (1, first.settings.instance), (2, second.settings.instance)]


def test_an_occurrence_due_while_a_retry_is_pending_waits_behind_it(mem_store, fake_factory):
    """Skip: the occurrence that came due while the retry was pending meets the retry's live run and is
    skipped; Queue: it runs after the retry; neither runs before the retry."""
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=3)  # an idle worker: the skip is decided by a poll
    d.pool.hold()
    for mode in ("Skip", "Queue"):
        add_job(store, mode, "ok", "* * * * * *", concurrency_mode=mode, max_retries=1, retry_backoff_s=5.0)
    at, to = steps(d)
    for mode in ("Skip", "Queue"):
        d.pool.crash(runs_of(store, mode)[0]["id"])
    at(0.1)
    for t in (1, 2, 3, 4):  # every-second occurrences come due: the pending retry goes first
        at(t)
        assert [r["attempt"] for r in runs_of(store, "Skip")] == [1]
        assert [r["attempt"] for r in runs_of(store, "Queue")] == [1]
    retry_at = max(store.get_job(mode)["retry_at"] for mode in ("Skip", "Queue"))
    to(retry_at, 0.05)
    assert [r["attempt"] for r in runs_of(store, "Skip")] == [1, 2]
    assert [r["attempt"] for r in runs_of(store, "Queue")] == [1, 2]
    to(retry_at, 0.1)  # the displaced occurrence: Skip skips it (the retry is live), Queue waits
    assert store.get_job("Skip")["skipped_count"] >= 1
    assert len(runs_of(store, "Queue")) == 2
    d.pool.release_holds()
    for run_id in list(d.pool.held):
        d.pool.finish(run_id)
    to(retry_at, 0.2)
    to(retry_at, 0.3)
    queue_runs = runs_of(store, "Queue")
    assert [r["attempt"] for r in queue_runs][:3] == [1, 2, 1] and queue_runs[2]["scheduled_at"] > queue_runs[1][
        "scheduled_at"]


# -- pause on repeated failure ------------------------------------------------------------------------
def test_pause_after_consecutive_final_failures_with_reason_and_notice_resume_clears(mem_store, fake_factory):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "bad", "fail", "* * * * * *", pause_after_failures=2, max_retries=1, retry_backoff_s=0.5,
            retry_backoff_factor=1.0)
    _, to = steps(d)
    retry_at = store.get_job("bad")["retry_at"]
    to(retry_at, 0.05)  # attempt 2 of the first occurrence: its final failure (1 in a row)
    assert store.get_job("bad")["status"] == "Active" and store.get_job("bad")["consecutive_failures"] == 1
    to(max(retry_at, store.get_job("bad")["next_run_at"]), 0.1)  # the next occurrence runs and fails
    retry_at = store.get_job("bad")["retry_at"]
    assert store.get_job("bad")["retry_attempt"] == 2
    to(retry_at, 0.05)  # the second occurrence's final failure: 2 in a row
    job = store.get_job("bad")
    assert job["status"] == "Paused" and job["next_run_at"] is None
    assert job["paused_reason"].startswith("2 consecutive failed runs (pause_after_failures 2)")
    assert "it did not work" in job["paused_reason"]
    assert any("paused after repeated failures" in n["subject"] for n in store.list_notifications())
    count = len(runs_of(store, "bad"))
    to(retry_at, 5)
    assert len(runs_of(store, "bad")) == count  # paused: no more runs
    ops.resume_job(store, "bad", dt.datetime.now(UTC))
    job = store.get_job("bad")
    assert (job["status"], job["paused_reason"], job["consecutive_failures"]) == ("Active", None, 0)


def test_a_success_resets_the_failure_streak(mem_store, fake_factory, tmp_path):
    store = mem_store
    d = fake_factory(**LONG, max_concurrent_jobs=1)
    add_job(store, "flaky", "flaky", "* * * * * *", pause_after_failures=2,
            configuration=json.dumps({"counter_dir": str(tmp_path), "fail_times": 1}))
    _, to = steps(d)
    assert store.get_job("flaky")["consecutive_failures"] == 1
    to(store.get_job("flaky")["next_run_at"], 0.05)
    assert store.get_job("flaky")["consecutive_failures"] == 0 and store.get_job("flaky")["status"] == "Active"


# -- fields: jobspec, CLI, Client ---------------------------------------------------------------------------
@pytest.fixture
def cli(db_url, tmp_path, capsys, monkeypatch) -> Cli:
    return Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})


@pytest.mark.parametrize(("flags", "field"), [
    (["--max-retries", "-1"], "max_retries"), (["--retry-backoff-s", "-2"], "retry_backoff_s"),
    (["--retry-backoff-factor", "0.5"], "retry_backoff_factor"), (["--retry-on", "Completed"], "retry_on[0]"),
    (["--pause-after-failures", "0"], "pause_after_failures")])
def test_bad_retry_fields_are_refused_naming_the_field(cli, flags, field):
    result = cli("jobs", "add", "j", "--type", "ok", "--cron", "@daily", *flags, expect=2)
    assert error_line(result).startswith(f"error: {field}:")


def test_cli_and_client_carry_the_fields(cli, db_url):
    cli("jobs", "add", "j", "--type", "ok", "--cron", "@daily", "--max-retries", "3",
                     "--retry-backoff-s", "30", "--retry-backoff-factor", "3", "--retry-backoff-max-s", "600",
                     "--retry-max-jitter-s", "5", "--retry-on", "Failed,Cancelled", "--pause-after-failures", "4")
    shown = json.loads(cli("jobs", "show", "j", "--json").stdout)
    assert {k: shown[k] for k in ("max_retries", "retry_backoff_s", "retry_backoff_factor", "retry_backoff_max_s",
                                  "retry_max_jitter_s", "retry_on", "pause_after_failures", "paused_reason")} == {
        "max_retries": 3, "retry_backoff_s": 30.0, "retry_backoff_factor": 3.0, "retry_backoff_max_s": 600.0,
        "retry_max_jitter_s": 5.0, "retry_on": ["Failed", "Cancelled"], "pause_after_failures": 4,
        "paused_reason": None}
    assert "paused_reason" in cli("jobs", "show", "j").stdout
    cli("jobs", "update", "j", "--max-retries", "1")
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        job = client.get_job("j")
        assert (job.max_retries, job.retry_on, job.pause_after_failures) == (1, ["Failed", "Cancelled"], 4)
        job = client.update_job("j", retry_on=["Timeout"])
        assert job.retry_on == ["Timeout"]
        job = client.add_job("k", job_type="ok", cron_expression="@daily", max_retries=2)
        assert (job.max_retries, job.retry_backoff_s, job.consecutive_failures) == (2, 10.0, 0)


@pytest.mark.parametrize("text", ["", " ", ","])
def test_an_empty_retry_on_is_refused_by_update_as_by_the_api_and_the_jobs_file(cli, db_url, tmp_path, text):
    """``--retry-on ''`` meant the default where the API refused ``retry_on=[]`` and ``' '`` was another
    error: now one error naming ``retry_on``, exit 2, the job unchanged, from every door."""
    cli("jobs", "add", "j", "--type", "ok", "--cron", "@daily", "--retry-on", "Cancelled")
    line = error_line(cli("jobs", "update", "j", "--retry-on", text, expect=2))
    assert line.startswith(("error: retry_on: must list at least one status", "error: retry_on[0]: must be one of"))
    assert json.loads(cli("jobs", "show", "j", "--json").stdout)["retry_on"] == ["Cancelled"]  # nothing written
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client, pytest.raises(InputError) as refused:
        client.update_job("j", retry_on=[])
    assert str(refused.value).startswith("retry_on: must list at least one status")
    path = tmp_path / "jobs.toml"
    path.write_text('[[jobs]]\nname = "j"\njob_type = "ok"\ncron_expression = "@daily"\nretry_on = []\n')
    assert error_line(cli("jobs", "sync", str(path), expect=2)) == (
        f"error: {path}: jobs[0].retry_on: must list at least one status (to retry nothing, set max_retries 0)")


def test_jobs_file_carries_the_fields_and_a_second_sync_changes_nothing(cli, tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text('[[jobs]]\nname = "r"\njob_type = "ok"\ncron_expression = "@hourly"\nmax_retries = 2\n'
                    'retry_backoff_s = 5.0\nretry_on = ["Failed", "Cancelled"]\npause_after_failures = 3\n')
    assert "1 job(s) created, 0 updated" in cli("jobs", "sync", str(path)).stdout
    assert "0 job(s) created, 0 updated" in cli("jobs", "sync", str(path)).stdout  # idempotent
    shown = json.loads(cli("jobs", "show", "r", "--json").stdout)
    assert (shown["max_retries"], shown["retry_backoff_s"], shown["retry_on"], shown["pause_after_failures"]) == (
        2, 5.0, ["Failed", "Cancelled"], 3)
    path.write_text(path.read_text().replace('"Cancelled"', '"Later"'))
    assert "jobs[0].retry_on[1]" in error_line(cli("jobs", "sync", str(path), expect=2))


def test_runs_list_shows_the_attempt(cli, db_url):
    store = Store.open(db_url)
    try:
        job = add_job(store, "j", "ok", YEARLY)
        claim = store.claim(job, now=job["next_run_at"], next_run_at=None, instance="me", lease_s=60,
                            deadline_at=job["next_run_at"] + dt.timedelta(minutes=1), scheduled_at=job["next_run_at"])
        assert claim is not None
    finally:
        store.close()
    (row,) = json.loads(cli("runs", "list", "--json").stdout)
    assert row["attempt"] == 1
    assert "attempt" in cli("runs", "list").stdout.splitlines()[0]
