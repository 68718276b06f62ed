"""The Python API (``Client``): typed results, the CLI's validation and errors, real workers and databases,
and the documented example (docs/python-api.md) run as written."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pytest
from clirun import Cli, error_line
from conftest import FIXTURE_PLUGINS

from mjsched_isolated import (
    Client,
    ConcurrencyMode,
    InputError,
    JobStatus,
    MissedRunPolicy,
    NotFoundError,
    RunStatus,
)
from mjsched_isolated.client import Job, Run
from mjsched_isolated.ops import AlreadyRunningError
from mjsched_isolated.store import Store

ROOT = Path(__file__).parents[1]
UTC = dt.UTC


@pytest.fixture
def client(shared_backend_url):
    with Client(shared_backend_url, plugins_dir=FIXTURE_PLUGINS) as c:
        yield c


def test_add_get_update_pause_resume_remove_with_typed_results(client):
    job = client.add_job("nightly", job_type="ok", cron_expression="0 30 2 * * *", timezone="Europe/Berlin",
                         configuration={"seconds": 0.0}, concurrency_mode="Queue", max_runtime_minutes=20,
                         start_at=dt.datetime(2020, 1, 1), description="a test")
    assert isinstance(job, Job) and job.status is JobStatus.ACTIVE
    assert job.concurrency_mode is ConcurrencyMode.QUEUE and job.missed_run_policy is MissedRunPolicy.RUN_ONCE
    assert job.configuration == {"seconds": 0.0} and job.start_at == dt.datetime(2019, 12, 31, 23, tzinfo=UTC)
    assert job.next_run_at is not None and job.next_run_at.minute == 30 and job.next_run_at.tzinfo is not None
    assert client.get_job("nightly") == job and client.jobs() == [job]

    run_id = client.run_job("nightly")
    assert isinstance(run_id, int)
    run = client.get_run(run_id)
    assert isinstance(run, Run) and run.status is RunStatus.COMPLETED and run.job_name == "nightly"
    assert run.scheduled_at is None and isinstance(run.details, dict) and run.duration_ms is not None

    updated = client.update_job("nightly", cron_expression="@hourly", timezone="UTC", notify_on_failure=False)
    assert (updated.id, updated.run_count, updated.success_count) == (job.id, 1, 1)  # history kept
    assert updated.cron_expression == "@hourly" and updated.next_run_at.minute == 0 and not updated.notify_on_failure
    assert updated.description == "a test"
    assert [r.id for r in client.runs(job="nightly")] == [run_id]

    paused = client.pause_job("nightly")
    assert paused.status is JobStatus.PAUSED and paused.next_run_at is None
    assert client.resume_job("nightly").next_run_at is not None
    client.remove_job("nightly")
    assert client.jobs() == []
    with pytest.raises(NotFoundError) as err:
        client.get_job("nightly")
    assert (err.value.field, err.value.message) == ("name", "no job named 'nightly'")


@pytest.mark.parametrize("kwargs, field", [
    ({"cron_expression": "5-1 * * * *"}, "cron_expression"),
    ({"cron_expression": "* * *"}, "cron_expression"),
    ({"timezone": "localtime"}, "timezone"),
    ({"name": "x" * 201}, "name"),
    ({"name": "two\nlines"}, "name"),
    ({"job_type": "ghost"}, "job_type"),
    ({"configuration": {"seconds": "slow"}}, "configuration.seconds"),
    ({"configuration": {"nonsense": 1}}, "configuration.nonsense"),
    ({"concurrency_mode": "Often"}, "concurrency_mode"),
    ({"max_runtime_minutes": 0}, "max_runtime_minutes"),
    ({"max_runtime_minutes": "ten"}, "max_runtime_minutes"),
    ({"notify_recipients": ["ops@x.org", "nobody"]}, "notify_recipients[1]"),
    ({"colour": "red"}, "colour"),
    ({"name": "trail "}, "name"),
    ({"retry_on": ["Failed", "Failed"]}, "retry_on[1]"),
    ({"configuration": {"seconds": json.loads("[" * 200 + "]" * 200)}}, "configuration"),
])
def test_bad_input_raises_the_error_the_cli_prints_and_writes_nothing(client, kwargs, field):
    values = {"name": "j", "job_type": "ok", "cron_expression": "@daily", **kwargs}
    with pytest.raises(InputError) as err:
        client.add_job(values.pop("name"), **values)
    assert err.value.field == field, str(err.value)
    assert "\n" not in str(err.value).replace("two\nlines", "")
    assert client.jobs() == []


def test_the_client_and_the_cli_refuse_alike(db_url, tmp_path, capsys, monkeypatch):
    cli = Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})
    line = error_line(cli("jobs", "add", "j", "--type", "ok", "--cron", "0 22-2 * * *", expect=2))
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client, pytest.raises(InputError) as err:
        client.add_job("j", job_type="ok", cron_expression="0 22-2 * * *")
    assert line == f"error: {err.value}"


def test_run_job_refuses_a_second_run_of_a_running_skip_job_and_reports_a_failed_run(client):
    client.add_job("bad", job_type="fail", cron_expression="@yearly")
    run = client.get_run(client.run_job("bad"))
    assert run.status is RunStatus.FAILED and run.error_message == "it did not work" and run.success is False
    assert [r.id for r in client.runs(status="Failed")] == [run.id] and client.runs(status=RunStatus.COMPLETED) == []
    client.add_job("busy", job_type="ok", cron_expression="@yearly")
    store = client._store
    store.register_supervisor("otherhost-9", "otherhost", 9, ttl_s=600)
    job = store.get_job("busy")
    now = store.db_now()
    assert store.claim(job, now=now, next_run_at=job["next_run_at"], instance="otherhost-9", lease_s=600,
                       deadline_at=now + dt.timedelta(minutes=10))
    with pytest.raises(AlreadyRunningError, match="otherhost-9"):
        client.run_job("busy")
    with pytest.raises(InputError) as err:
        client.runs(limit=0)
    assert err.value.field == "limit"
    with pytest.raises(NotFoundError) as err:
        client.get_run(10**6)
    assert err.value.field == "id"


def test_a_database_that_cannot_be_used_is_an_error_naming_db_url(tmp_path):
    with pytest.raises(InputError) as err:
        Client(f"sqlite:///{tmp_path}/no/such/dir/x.db")
    assert err.value.field == "db_url" and "cannot connect" in err.value.message


def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    page = (ROOT / "docs" / "python-api.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    monkeypatch.chdir(ROOT)  # the shell plugin: built in (or ./plugins in a checkout)
    exec(compile(code, "docs/python-api.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "refused: cron_expression - descending range '5-1'" in out
    assert re.search(r"run \d+ Completed \d+ ms", out) and "[('hello', 'Paused')]" in out


def test_a_job_and_its_runs_carry_the_occurrence_accounting(client, shared_backend_url):
    """Issue 12: ``missed_count`` (job and run) and ``skipped_count`` reach the Python API."""
    job = client.add_job("counted", job_type="ok", cron_expression="* * * * *")
    assert (job.skipped_count, job.missed_count) == (0, 0)
    store = Store.open(shared_backend_url)
    try:
        assert store.set_next_run_at(job.id, job.next_run_at, job.next_run_at + dt.timedelta(minutes=9),
                                     job.next_run_at, skipped=2, missed=6)
    finally:
        store.close()
    after = client.get_job("counted")
    assert (after.skipped_count, after.missed_count) == (2, 6)
    run = client.get_run(client.run_job("counted"))
    assert run.missed_count == 0  # a manual run folds nothing


@pytest.mark.parametrize("limit", [0, -1, 10**30, 2**31, 2**63, True, 1.5, "10"])
def test_runs_limit_out_of_range_is_an_input_error_naming_limit(client, limit):
    """As the CLI's --limit: an integer from 1 to 2**31 - 1 (10**30 overflowed SQLite's INTEGER)."""
    with pytest.raises(InputError) as err:
        client.runs(limit=limit)
    assert err.value.field == "limit" and "from 1 to 2147483647" in err.value.message


@pytest.mark.parametrize("run_id", [0, -1, 10**30, 2**63])
def test_run_ids_out_of_range_are_not_found_not_an_overflow(client, run_id):
    for call in (client.get_run, client.cancel_run, client.retry_run, client.run_logs):
        with pytest.raises(InputError) as err:
            call(run_id)
        assert err.value.field == "id"


def test_backfill_job_errors_name_its_parameters(client):
    """Not the CLI's --from/--to/--max words: start, end, max_occurrences."""
    client.add_job("b", job_type="ok", cron_expression="0 * * * *")
    now = dt.datetime.now(dt.UTC)
    for kwargs, field in (({"start": "yesterday", "end": now}, "start"),
                          ({"start": now - dt.timedelta(hours=2), "end": "now"}, "end"),
                          ({"start": now - dt.timedelta(hours=1), "end": now - dt.timedelta(hours=2)}, "end"),
                          ({"start": dt.datetime(1960, 1, 1, tzinfo=dt.UTC), "end": now}, "start"),
                          ({"start": now - dt.timedelta(hours=1), "end": now, "max_occurrences": 0},
                           "max_occurrences"),
                          ({"start": now - dt.timedelta(days=30), "end": now, "max_occurrences": 3},
                           "max_occurrences")):
        with pytest.raises(InputError) as err:
            client.backfill_job("b", **kwargs)
        assert err.value.field == field, (kwargs, err.value)
