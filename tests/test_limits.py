"""Resource limits per job: columns set by the CLI and the Client, validated, defaults from [limits],
and applied to real runs (the worker side: tests/test_worker_isolation.py)."""

from __future__ import annotations

import json

import pytest
from clirun import Cli
from conftest import FIXTURE_PLUGINS, add_job

from mjsched_isolated.config import LIMIT_RANGES, Limits, Settings
from mjsched_isolated.errors import InputError
from mjsched_isolated.protocol import RunLimits
from mjsched_isolated.supervisor.limits import run_limits

YEARLY = "0 0 1 1 *"


@pytest.fixture
def cli(db_url, tmp_path, capsys, monkeypatch) -> Cli:
    return Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})


def test_limits_are_set_shown_changed_and_validated_by_the_cli(cli):
    cli("jobs", "add", "capped", "--type", "ok", "--cron", YEARLY, "--max-memory-mb", "200", "--max-cpu-s", "30",
        "--max-open-files", "64", "--max-processes", "50", "--nice", "5")
    shown = json.loads(cli("jobs", "show", "capped", "--json").stdout)
    assert {k: shown[k] for k in ("max_memory_mb", "max_cpu_s", "max_open_files", "max_processes", "nice")} == {
        "max_memory_mb": 200, "max_cpu_s": 30, "max_open_files": 64, "max_processes": 50, "nice": 5}
    cli("jobs", "update", "capped", "--max-memory-mb", "300")
    assert json.loads(cli("jobs", "show", "capped", "--json").stdout)["max_memory_mb"] == 300
    assert "max_memory_mb" in cli("jobs", "show", "capped").stdout
    bad = cli("jobs", "add", "bad", "--type", "ok", "--cron", YEARLY, "--nice", "40", expect=2)
    assert "nice: must be between -20 and 19, got 40" in bad.stderr
    bad = cli("jobs", "update", "capped", "--max-memory-mb", "0", expect=2)
    assert "max_memory_mb: must be between 1 and" in bad.stderr
    assert json.loads(cli("jobs", "show", "capped", "--json").stdout)["max_memory_mb"] == 300  # nothing written


def test_a_jobs_limits_win_field_by_field_over_the_settings_defaults():
    defaults = Limits(max_memory_mb=100, nice=10)
    assert run_limits({"max_memory_mb": 200}, defaults) == RunLimits(max_memory_mb=200, nice=10)
    assert run_limits({}, Limits()) is None
    assert run_limits({"max_memory_mb": -5, "nice": 99}, defaults) == RunLimits(max_memory_mb=100, nice=10)
    with pytest.raises(InputError, match=r"limits\.max_cpu_s"):
        Settings(limits=Limits(max_cpu_s=0))


HOG = '''
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Hog(BaseScheduledJob):
    job_type = "hog"

    def execute(self, context):
        block = bytearray(context.configuration["mb"] * 1024 * 1024)
        return ScheduledJobResult(success=True, details={"allocated_mb": len(block) >> 20})
'''


def test_a_200_mb_limit_stops_a_1_gb_allocation_and_the_next_job_on_the_slot_is_unaffected(
        store, driver_factory, tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "hog.py").write_text(HOG)
    d = driver_factory(plugins_dir=str(tmp_path / "plugins"), max_concurrent_jobs=1)
    add_job(store, "greedy", "hog", YEARLY, configuration=json.dumps({"mb": 1024}), max_memory_mb=200)
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="greedy")))
    (greedy,) = store.list_runs(job_name="greedy")
    assert (greedy["status"], greedy["error_message"]) == ("Failed", "memory limit 200 MB exceeded")
    add_job(store, "modest", "hog", YEARLY, configuration=json.dumps({"mb": 300}))
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="modest")))
    (modest,) = store.list_runs(job_name="modest")
    assert modest["status"] == "Completed" and modest["details"]["allocated_mb"] == 300


def test_the_smallest_open_files_limit_accepted_still_lets_a_shell_command_start(cli, store, driver_factory):
    """h-fresh: with ``--max-open-files 16`` (then the minimum) every run failed ``cannot start command: [Errno
    24] Too many open files``: the worker itself holds about 20 descriptors. The minimum accepted must work."""
    low = LIMIT_RANGES["max_open_files"][0]
    refused = cli("jobs", "add", "few", "--type", "ok", "--cron", YEARLY, "--max-open-files", str(low - 1), expect=2)
    assert f"max_open_files: must be between {low} and" in refused.stderr
    add_job(store, "tight", "shell", YEARLY, configuration=json.dumps({"command": ["sh", "-c", "ulimit -n"]}),
            max_open_files=low)
    d = driver_factory(max_concurrent_jobs=1)
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="tight")))
    (run,) = store.list_runs(job_name="tight")
    assert (run["status"], run["error_message"]) == ("Completed", None), run
    assert run["details"]["stdout_tail"] == f"{low}\n"


def test_a_shell_command_failing_at_its_memory_limit_is_recorded_naming_the_limit(store, driver_factory):
    """New-user review M3: a command refused memory (``MemoryError``, exit code 1) was recorded only as
    ``exit code 1``; it names the limit now."""
    import sys

    command = [sys.executable, "-c", "bytearray(8 << 30)"]  # 8 GiB: refused by RLIMIT_DATA at once
    add_job(store, "greedy-shell", "shell", YEARLY, configuration=json.dumps({"command": command}), max_memory_mb=50)
    add_job(store, "unlimited-fail", "shell", YEARLY,
            configuration=json.dumps({"command": ["sh", "-c", "echo 'Cannot allocate memory' >&2; exit 3"]}))
    d = driver_factory(max_concurrent_jobs=1)
    d.until(lambda: all(r["status"] != "Running" for name in ("greedy-shell", "unlimited-fail")
                        for r in store.list_runs(job_name=name) or [{"status": "Running"}]))
    (run,) = store.list_runs(job_name="greedy-shell")
    assert run["status"] == "Failed"
    assert run["error_message"].startswith("memory limit 50 MB probably exceeded (stderr: MemoryError")
    assert run["error_message"].endswith("; exit code 1")
    (plain,) = store.list_runs(job_name="unlimited-fail")  # no limit set: no guess
    assert plain["error_message"] == "exit code 3"


def test_limit_guesses_need_the_limit_set_and_its_usual_message():
    from mjsched_isolated.worker.limit_hints import guess

    fork = {"exit_code": 2, "stderr_tail": "sh: 1: Cannot fork\nsh: fork: Resource temporarily unavailable\n"}
    assert guess(RunLimits(max_processes=5), fork) == (
        "process limit 5 probably exceeded (stderr: sh: fork: Resource temporarily unavailable)")
    assert guess(RunLimits(max_memory_mb=5), fork) is None  # not the memory limit's message
    assert guess(None, fork) is None
    files = {"exit_code": 1, "stderr_tail": "OSError: [Errno 24] Too many open files: 'x'" + "y" * 500}
    assert guess(RunLimits(max_open_files=32), files).startswith("open files limit 32 probably exceeded (stderr: OSE")
    assert len(guess(RunLimits(max_open_files=32), files)) < 200
    assert guess(RunLimits(max_cpu_s=2), {"exit_code": -24}) == (
        "CPU time limit 2 s probably exceeded (killed by SIGXCPU)")
    assert guess(RunLimits(max_memory_mb=5), {"exit_code": 1}) is None  # no stderr_tail (not a shell run)
