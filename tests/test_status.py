"""``status`` against a real supervisor with real runs (a hung one in flight), on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json
import os

import pytest
from conftest import Driver, add_job, isolated_database

from mjsched_isolated.cli.app import main
from mjsched_isolated.store import Store

YEARLY = "0 0 1 1 *"
LATER = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)


def _status(capsys, url: str, *flags: str):
    capsys.readouterr()
    assert main(["status", "--db", url, *flags]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in flags else out


@pytest.mark.timeout(60)
def test_status_on_an_empty_database(db_url, capsys):
    Store.open(db_url).close()  # a read-only command does not create the database (test_cli.py)
    report = _status(capsys, db_url, "--json")
    assert {k: v for k, v in report.items() if k != "db_time"} == {
        "supervisors": [], "in_flight": [], "next_due": [], "recent_failures": [], "warnings": []}
    assert _status(capsys, db_url).count("(none)") == 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_status_shows_supervisors_in_flight_runs_next_due_and_failures(backend, tmp_path, capsys):
    with isolated_database(backend, tmp_path) as url:
        store = Store.open(url)
        driver = Driver(store, url, max_concurrent_jobs=2, lease_timeout_s=60)
        try:
            driver.start()
            store.register_supervisor("gone-recently", "elsewhere", 1, ttl_s=-600)  # expired 10 min ago: shown
            store.register_supervisor("gone-long-ago", "elsewhere", 2, ttl_s=-7200)  # 2 h ago: hidden
            now = store.db_now()
            add_job(store, "hung", "hang", YEARLY, now=now, configuration=json.dumps({"marker_dir": str(tmp_path)}))
            add_job(store, "bad", "fail", YEARLY, now=now)
            add_job(store, "later", "ok", YEARLY, now=now, next_run_at=LATER)
            driver.until(lambda: len(driver.supervisor.inflight) == 1 and len(store.list_runs()) == 2)
            instance = driver.settings.instance

            report = _status(capsys, url, "--json")
            sups = report["supervisors"]
            assert [(s["instance"], s["alive"]) for s in sups] == [(instance, True), ("gone-recently", False)]
            assert sups[0]["pid"] == os.getpid() and sups[0]["stopped_at"] is None
            [flight] = report["in_flight"]
            hung_run = store.list_runs(job_name="hung")[0]
            assert {k: flight[k] for k in ("id", "job_name", "job_type", "supervisor")} == {
                "id": hung_run["id"], "job_name": "hung", "job_type": "hang", "supervisor": instance}
            started = dt.datetime.fromisoformat(flight["started_at"])
            deadline = dt.datetime.fromisoformat(flight["deadline_at"])
            assert deadline == hung_run["deadline_at"]
            assert abs((deadline - started).total_seconds() - 60) < 2  # lease_timeout_s
            assert 0 <= flight["running_for_s"] < 30 and flight["cancel_requested_by"] is None
            store.request_cancel(hung_run["id"], "ops@console")  # the driver does not cycle: it stays Running
            assert _status(capsys, url, "--json")["in_flight"][0]["cancel_requested_by"] == "ops@console"
            assert [(j["name"], j["cron_expression"], j["timezone"]) for j in report["next_due"]] == [
                ("hung", YEARLY, "UTC"), ("bad", YEARLY, "UTC"), ("later", YEARLY, "UTC")]
            assert dt.datetime.fromisoformat(report["next_due"][2]["next_run_at"]) == LATER
            [failure] = report["recent_failures"]
            assert (failure["job_name"], failure["status"], failure["error_message"]) == (
                "bad", "Failed", "it did not work")
            assert failure["completed_at"] is not None

            text = _status(capsys, url)
            for line in ("Supervisors:", "In-flight runs:", "Next due jobs:", "Recent failures:"):
                assert line in text
            assert "gone-long-ago" not in text and "gone-recently" in text
            row = next(line for line in text.splitlines() if line.startswith(f"{hung_run['id']} ") and "hang" in line)
            assert "hung" in row and instance in row and deadline.strftime("%Y-%m-%dT%H:%M:%SZ") in row
        finally:
            driver.close()
            store.close()
