"""The operations (``mjsched_isolated.ops``) with time passed in: exact schedules, views, the status report
and its warnings, and that preparing a job touches no database."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated import ops
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import InputError, NotFoundError

UTC = dt.UTC
NOW = dt.datetime(2026, 3, 28, 12, 0, 7, tzinfo=UTC)


@pytest.fixture
def settings(db_url) -> Settings:
    return Settings(database_url=db_url, plugins_dir=FIXTURE_PLUGINS)


def test_add_and_update_compute_next_run_at_from_the_given_now(store, settings):
    job = ops.add_job(store, settings, {"name": "j", "job_type": "ok", "cron_expression": "0 2 * * *",
                                        "timezone": "Europe/Berlin"}, NOW)
    assert job["next_run_at"] == dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC)  # 02:00 CET, before the DST gap
    later = NOW + dt.timedelta(days=1)
    job = ops.update_job(store, settings, "j", {"cron_expression": "@hourly", "timezone": "UTC"}, later)
    assert job["next_run_at"] == dt.datetime(2026, 3, 29, 13, 0, tzinfo=UTC)
    assert job["created_at"] == NOW and job["updated_at"] == later
    job = ops.update_job(store, settings, "j", {"description": "no schedule change"}, later + dt.timedelta(hours=5))
    assert job["next_run_at"] == dt.datetime(2026, 3, 29, 13, 0, tzinfo=UTC)  # kept: not a schedule field
    job = ops.update_job(store, settings, "j", {"end_at": dt.datetime(2026, 3, 1, tzinfo=UTC)}, later)
    assert (job["status"], job["next_run_at"]) == ("Expired", None)
    with pytest.raises(InputError) as err:
        ops.update_job(store, settings, "j", {"name": "k"}, later)
    assert err.value.field == "name"
    with pytest.raises(NotFoundError):
        ops.update_job(store, settings, "ghost", {"description": "x"}, later)


def test_pause_and_resume_take_now(store, settings):
    ops.add_job(store, settings, {"name": "p", "job_type": "ok", "cron_expression": "*/10 * * * *"}, NOW)
    assert ops.pause_job(store, "p", NOW)["next_run_at"] is None
    assert ops.resume_job(store, "p", NOW + dt.timedelta(hours=1))["next_run_at"] == dt.datetime(
        2026, 3, 28, 13, 10, tzinfo=UTC)


def test_prepare_job_validates_without_a_database(tmp_path):
    missing = tmp_path / "never.db"
    settings = Settings(database_url=f"sqlite:///{missing}", plugins_dir=FIXTURE_PLUGINS)
    values = ops.prepare_job(settings, {"name": "j", "job_type": "ok", "cron_expression": "@daily"}, NOW)
    assert values["next_run_at"] == dt.datetime(2026, 3, 29, tzinfo=UTC) and values["status"] == "Active"
    with pytest.raises(InputError) as err:
        ops.prepare_job(settings, {"name": "j", "job_type": "ok", "cron_expression": "@daily",
                                   "configuration": {"seconds": "x"}}, NOW)
    assert err.value.field == "configuration.seconds"
    assert not missing.exists()


def test_views_decode_json_columns(store):
    add_job(store, "v", "ok", "@daily", configuration='{"a": [1, 2]}', notify_recipients='["ops@x.org"]')
    [job] = ops.list_jobs(store)
    assert job["configuration"] == {"a": [1, 2]} and job["notify_recipients"] == ["ops@x.org"]
    assert all(type(key) is str for key in job)
    with pytest.raises(InputError) as err:
        ops.list_runs(store, status="Sideways")
    assert err.value.field == "status"


def test_status_hides_stopped_manual_supervisors_and_warns_about_overdue_jobs(store):
    add_job(store, "late", "ok", "@hourly", next_run_at=store.db_now() - dt.timedelta(minutes=3))
    store.register_supervisor("jobs-run-host-1", "host", 1, ttl_s=60)
    store.stop_supervisor("jobs-run-host-1")  # a `jobs run` that ended cleanly
    store.register_supervisor("jobs-run-host-2", "host", 2, ttl_s=-60)  # one that crashed: still shown
    report = ops.status(store)
    assert [s["instance"] for s in report["supervisors"]] == ["jobs-run-host-2"]
    [warning] = report["warnings"]
    assert "no supervisor is alive and 1 job(s) are overdue (the oldest, late, since" in warning
    store.register_supervisor("server", "host", 3, ttl_s=60)
    assert ops.status(store)["warnings"] == []
