"""The CLI as a user runs it: real processes, a real SQLite file, the fixture plugins."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_PLUGINS, add_job
from mjsched_isolated.store.schema import jobs, runs
from mjsched_isolated.supervisor.core import utcnow


@pytest.fixture
def cli(db_url, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MJSCHED_")}
    env.update(MJSCHED_DATABASE_URL=db_url, MJSCHED_PLUGINS_DIR=FIXTURE_PLUGINS)

    def run(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "mjsched_isolated", *args], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)
        assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
        return proc

    return run


def _error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("args, field", [
    (["--type", "ok", "--cron", "61 * * * *"], "cron_expression"),
    (["--type", "ok", "--cron", "* * * *"], "cron_expression"),
    (["--type", "ok", "--cron", "* * * * *", "--tz", "Nowhere/Land"], "timezone"),
    (["--type", "nope", "--cron", "* * * * *"], "job_type"),
    (["--type", "ok", "--cron", "* * * * *", "--configuration", "{broken"], "--configuration"),
    (["--type", "ok", "--cron", "* * * * *", "--configuration", '{"seconds": "x"}'], "configuration.seconds"),
    (["--type", "ok", "--cron", "* * * * *", "--configuration", '{"nonsense": 1}'], "configuration.nonsense"),
    (["--type", "picky", "--cron", "* * * * *", "--configuration", '{"seconds": -1}'], "configuration.seconds"),
    (["--type", "ok", "--cron", "* * * * *", "--concurrency-mode", "Often"], "concurrency_mode"),
    (["--type", "ok", "--cron", "* * * * *", "--max-runtime-minutes", "0"], "max_runtime_minutes"),
    (["--type", "ok", "--cron", "* * * * *", "--max-runtime-minutes", "9999999999999"], "max_runtime_minutes"),
    (["--type", "ok", "--cron", "* * * * *", "--start-at", "9999-12-31T23:59:59Z"], "start_at"),
    (["--type", "ok", "--cron", "* * * * *", "--start-at", "tomorrow"], "--start-at"),
    (["--type", "ok", "--cron", "* * * * *", "--start-at", "2030-01-02", "--end-at", "2030-01-01"], "end_at"),
    (["--type", "ok", "--cron", "* * * * *", "--notify-recipients", "ops@x.org,nobody"], "notify_recipients[1]"),
    (["--type", "ok", "--cron", "0 0 30 2 *"], "cron_expression"),  # February 30th never comes
    (["--type", "ok", "--cron", "* * * * *", "--max-jitter-s", "60"], "max_jitter_s"),  # would swallow runs
    (["--type", "ok", "--cron", "*/5 * * * * *", "--max-jitter-s", "7.5"], "max_jitter_s"),
])
def test_bad_input_is_one_line_naming_the_field_exit_2_and_nothing_written(cli, args, field):
    proc = cli("jobs", "add", "j", *args, expect=2)
    assert _error_line(proc).startswith(f"error: {field}"), proc.stderr
    assert json.loads(cli("jobs", "list", "--json").stdout) == []


def test_add_list_show_pause_resume_remove(cli):
    out = cli("jobs", "add", "nightly", "--type", "ok", "--cron", "0 30 2 * * *", "--tz", "Europe/Berlin",
              "--max-runtime-minutes", "20", "--description", "a test").stdout
    assert "nightly" in out
    listed = json.loads(cli("jobs", "list", "--json").stdout)
    assert len(listed) == 1 and set(listed[0]) == set(jobs.columns.keys())
    job = json.loads(cli("jobs", "show", "nightly", "--json").stdout)
    assert job["status"] == "Active" and job["timezone"] == "Europe/Berlin" and job["max_runtime_minutes"] == 20
    next_run = dt.datetime.fromisoformat(job["next_run_at"])
    assert next_run.tzinfo is not None and job["next_run_at"].endswith("Z")
    assert next_run.astimezone(dt.timezone.utc).minute == 30  # 02:30:00 Berlin is hh:30 UTC
    cli("jobs", "pause", "nightly")
    paused = json.loads(cli("jobs", "show", "nightly", "--json").stdout)
    assert paused["status"] == "Paused" and paused["next_run_at"] is None
    cli("jobs", "resume", "nightly")
    assert json.loads(cli("jobs", "show", "nightly", "--json").stdout)["next_run_at"] is not None
    cli("jobs", "remove", "nightly")
    assert json.loads(cli("jobs", "list", "--json").stdout) == []
    assert _error_line(cli("jobs", "show", "nightly", expect=2)) == "error: name: no job named 'nightly'"
    assert "error: name:" in cli("jobs", "remove", "nightly", expect=2).stderr


def test_jobs_run_exit_codes_and_json_runs(cli):
    cli("jobs", "add", "good", "--type", "ok", "--cron", "0 0 1 1 *")
    cli("jobs", "add", "bad", "--type", "boom", "--cron", "0 0 1 1 *")
    before = json.loads(cli("jobs", "show", "good", "--json").stdout)["next_run_at"]
    run = json.loads(cli("jobs", "run", "good", "--json").stdout)
    assert run["status"] == "Completed" and run["scheduled_at"] is None
    assert json.loads(cli("jobs", "show", "good", "--json").stdout)["next_run_at"] == before  # schedule kept
    proc = cli("jobs", "run", "bad", expect=1)
    assert "kaboom" in proc.stdout
    listed = json.loads(cli("runs", "list", "--json").stdout)
    assert [r["job_name"] for r in listed] == ["bad", "good"]
    assert set(listed[0]) == set(runs.columns.keys()) | {"job_name"}
    failed = json.loads(cli("runs", "list", "--status", "Failed", "--job", "bad", "--json").stdout)
    assert len(failed) == 1 and failed[0]["status"] == "Failed"
    shown = json.loads(cli("runs", "show", str(failed[0]["id"]), "--json").stdout)
    assert "kaboom" in shown["error_message"] and "traceback" in shown["details"]
    assert _error_line(cli("runs", "show", "999", expect=2)).startswith("error: id:")
    assert _error_line(cli("runs", "list", "--job", "ghost", expect=2)).startswith("error: --job:")
    assert "Completed" in cli("runs", "list").stdout


def test_jobs_run_refuses_a_skip_job_whose_run_is_live(cli, store):
    job = add_job(store, "busy", "ok", "0 0 1 1 *", next_run_at=utcnow() + dt.timedelta(days=1))
    now = utcnow()
    store.register_supervisor("otherhost-7", "otherhost", 7, ttl_s=600)  # a live supervisor holds the lease
    assert store.claim(job, now=now, next_run_at=job["next_run_at"], instance="otherhost-7", lease_s=600,
                       deadline_at=now + dt.timedelta(minutes=10))
    proc = cli("jobs", "run", "busy", expect=1)
    assert "already running" in proc.stderr and "otherhost-7" in proc.stderr


def test_jobs_sync_creates_updates_and_rejects_bad_files(cli, tmp_path):
    good = tmp_path / "jobs.toml"
    good.write_text('[[jobs]]\nname = "a"\njob_type = "ok"\ncron_expression = "*/5 * * * *"\n'
                    '[jobs.configuration]\nseconds = 1.0\n\n'
                    '[[jobs]]\nname = "b"\njob_type = "fail"\ncron_expression = "0 * * * *"\nstatus = "Paused"\n')
    assert "2 job(s) created, 0 updated" in cli("jobs", "sync", str(good)).stdout
    assert "0 job(s) created, 0 updated" in cli("jobs", "sync", str(good)).stdout  # idempotent
    cli("jobs", "pause", "a")
    good.write_text(good.read_text().replace("*/5 * * * *", "*/7 * * * *"))
    assert "0 job(s) created, 1 updated" in cli("jobs", "sync", str(good)).stdout
    a = json.loads(cli("jobs", "show", "a", "--json").stdout)
    assert a["cron_expression"] == "*/7 * * * *" and a["status"] == "Paused"  # status kept: not in the file
    assert json.loads(a["configuration"]) == {"seconds": 1.0}
    bad = tmp_path / "bad.toml"
    for text, field in [('[[jobs]]\nname = "c"\njob_type = "ok"\ncron_expression = "nope"\n', "jobs[0].cron_expression"),
                        ('[[jobs]]\nname = "c"\njob_type = "ok"\ncron = "* * * * *"\n', "jobs[0]"),
                        ('[[jobs]]\nname = "c"\njob_type = "ghost"\ncron_expression = "* * * * *"\n', "jobs[0].job_type"),
                        ('[[jobs]]\nname = "c"\njob_type = "ok"\ncron_expression = "* * * * *"\n'
                         '[jobs.configuration]\nseconds = "slow"\n', "jobs[0].configuration.seconds"),
                        ("not toml [", "bad.toml")]:
        bad.write_text(text)
        line = _error_line(cli("jobs", "sync", str(bad), expect=2))
        assert field in line, line
    assert sorted(j["name"] for j in json.loads(cli("jobs", "list", "--json").stdout)) == ["a", "b"]


def test_plugins_list_reports_types_and_failures(cli):
    report = json.loads(cli("plugins", "list", "--json").stdout)
    assert {"ok", "hang", "segv"} <= {p["job_type"] for p in report["plugins"]}
    assert report["failures"][0]["module"] == "broken_import.py"
    assert "ImportError" in report["failures"][0]["error"]
    text = cli("plugins", "list").stdout
    assert "FAILED broken_import.py" in text


def test_a_plugin_ending_its_worker_at_import_is_reported_not_fatal_to_the_cli(cli, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "exits.py").write_text("import os\nos._exit(7)\n")
    (plugins / "fine.py").write_text((Path(FIXTURE_PLUGINS) / "behaviours.py").read_text())
    report = json.loads(cli("plugins", "list", "--json", "--plugins", str(plugins)).stdout)
    assert "ok" in {p["job_type"] for p in report["plugins"]}
    assert [f["module"] for f in report["failures"]] == ["exits.py"]
    assert "ended the worker process (exit code 7)" in report["failures"][0]["error"]
    cli("jobs", "add", "j", "--type", "ok", "--cron", "0 0 1 1 *", "--plugins", str(plugins))
    proc = cli("jobs", "add", "k", "--type", "exits", "--cron", "0 0 1 1 *", "--plugins", str(plugins), expect=2)
    assert "failed to load: exits.py (see `plugins list`)" in proc.stderr


def test_a_job_whose_end_at_has_passed_is_added_expired(cli):
    out = cli("jobs", "add", "late", "--type", "ok", "--cron", "* * * * *", "--end-at", "2020-01-01T00:00:00Z").stdout
    assert "added (Expired)" in out
    job = json.loads(cli("jobs", "show", "late", "--json").stdout)
    assert (job["status"], job["next_run_at"]) == ("Expired", None)
    assert "expired" in cli("jobs", "resume", "late").stdout
    assert json.loads(cli("jobs", "show", "late", "--json").stdout)["status"] == "Expired"


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "mjsched"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "serve" in proc.stdout


def test_interrupted_jobs_run_cancels_the_run_and_frees_the_job(db_url, tmp_path, store):
    add_job(store, "stuck", "hang", "0 0 1 1 *", next_run_at=utcnow() + dt.timedelta(days=1),
            configuration=json.dumps({"marker_dir": str(tmp_path)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MJSCHED_")}
    env.update(MJSCHED_DATABASE_URL=db_url, MJSCHED_PLUGINS_DIR=FIXTURE_PLUGINS)
    proc = subprocess.Popen([sys.executable, "-m", "mjsched_isolated", "jobs", "run", "stuck"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # the plugin announces itself on the shared output pipe
        if line.startswith("hang: run"):
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 130
    run = store.list_runs(job_name="stuck")[0]
    assert run["status"] == "Cancelled" and "interrupted" in run["error_message"]
    assert store.get_job("stuck")["lock_token"] is None


def test_jobs_run_of_a_queue_job_whose_run_is_live_queues_it(cli, store):
    job = add_job(store, "q", "ok", "0 0 1 1 *", next_run_at=utcnow() + dt.timedelta(days=1), concurrency_mode="Queue")
    now = utcnow()
    store.register_supervisor("otherhost-8", "otherhost", 8, ttl_s=600)
    assert store.claim(job, now=now, next_run_at=job["next_run_at"], instance="otherhost-8", lease_s=600,
                       deadline_at=now + dt.timedelta(minutes=10))
    proc = cli("jobs", "run", "q")
    assert "queued" in proc.stdout
    assert store.get_job("q")["next_run_at"] <= utcnow()  # the pending occurrence is due now
    assert [r["id"] for r in store.list_runs(job_name="q")] == [1]  # nothing started beside the live run


def test_cron_next_shows_local_and_utc_with_dst_notes(cli):
    out = cli("cron", "next", "30 2 * * *", "--tz", "Europe/Berlin", "--after", "2024-03-30T00:00:00Z",
              "--count", "3").stdout.splitlines()
    assert len(out) == 3
    assert "2024-03-31T01:00:00Z" in out[1] and "does not exist (DST gap)" in out[1]
    rows = json.loads(cli("cron", "next", "0 2 * * *", "--tz", "Europe/Berlin", "--after", "2023-10-28T12:00:00Z",
                          "--count", "2", "--json").stdout)
    assert rows[0]["utc"] == "2023-10-29T00:00:00Z" and rows[0]["note"] == "repeated hour: first copy"
    assert rows[1]["utc"] == "2023-10-30T01:00:00Z"
    for args, field in [(["61 * * * *"], "expression"), (["* * * * *", "--tz", "Nowhere/Land"], "--tz"),
                        (["* * * * *", "--after", "someday"], "--after"), (["* * * * *", "--count", "0"], "--count")]:
        assert _error_line(cli("cron", "next", *args, expect=2)).startswith(f"error: {field}")


def test_jobs_add_notify_flags_are_stored_and_shown(cli):
    cli("jobs", "add", "n", "--type", "ok", "--cron", "0 0 1 1 *", "--notify-on-missed",
        "--notify-recipients", "ops@x.org, dev@x.org")
    job = json.loads(cli("jobs", "show", "n", "--json").stdout)
    assert job["notify_on_missed"] is True and job["notify_on_failure"] is True
    assert json.loads(job["notify_recipients"]) == ["ops@x.org", "dev@x.org"]
    shown = cli("jobs", "show", "n").stdout
    assert "notify_on_missed" in shown and "dev@x.org" in shown
