"""Issue 12 points 10-11, the time knobs of a job: the DST policies (``dst_gap_policy``,
``dst_fold_policy``) through the planner, jobspec, CLI and Client. The rules themselves are checked
against a brute-force reference in test_dst.py."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS

from mjsched_isolated import Client, DstFoldPolicy, DstGapPolicy, InputError, planner
from mjsched_isolated.store import Store

UTC = dt.UTC


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
    assert "argument --dst-gap: invalid choice" in line


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
