"""Tests of the built-in shell plugin (mjsched_isolated/plugins/shell.py) with real subprocesses."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
from plugin_helpers import load_plugin, make_context, run_job
from waiting import wait_gone

from mjsched_isolated.errors import ConfigurationError

ShellJob = load_plugin("shell")


def _wait_gone(pid: int, timeout_s: float = 3.0) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie waiting for its reaper), within ``timeout_s``."""
    return wait_gone([pid], timeout_s) == []


def _read_pid(path) -> int:
    return int(path.read_text().strip())


def test_success_records_exit_code_and_output_tails():
    result = run_job(ShellJob, {"command": ["sh", "-c", "echo out; echo err >&2"]})
    assert result.success, result.error_message
    d = result.details
    assert d["exit_code"] == 0 and d["timed_out"] is False
    assert d["stdout_tail"] == "out\n" and d["stderr_tail"] == "err\n"
    assert d["stdout_bytes"] == 4 and isinstance(d["duration_ms"], int)
    assert d["leftover_pids"] == []


def test_non_zero_exit_is_a_failure_with_the_code():
    result = run_job(ShellJob, {"command": ["sh", "-c", "echo bad >&2; exit 3"]})
    assert not result.success
    assert result.error_message == "exit code 3"
    assert result.details["exit_code"] == 3 and result.details["stderr_tail"] == "bad\n"


def test_killed_by_signal_is_reported():
    result = run_job(ShellJob, {"command": ["sh", "-c", "kill -9 $$"]})
    assert not result.success
    assert result.details["exit_code"] == -signal.SIGKILL
    assert result.error_message == "killed by SIGKILL"


def test_command_not_found_is_a_failure_not_an_exception():
    result = run_job(ShellJob, {"command": ["mjsched-no-such-command-xyz", "arg"]})
    assert not result.success
    assert result.error_message.startswith("command not found")
    assert "mjsched-no-such-command-xyz" in result.error_message
    assert result.details["exit_code"] is None


def test_missing_cwd_is_a_failure(tmp_path):
    missing = str(tmp_path / "nope")
    result = run_job(ShellJob, {"command": ["true"], "cwd": missing})
    assert not result.success
    assert result.error_message == f"working directory not found: {missing}"


def test_cwd_and_env_merged_over_environ(tmp_path):
    result = run_job(
        ShellJob,
        {"command": ["sh", "-c", 'pwd; echo "$MJ_TEST_VAR"; test -n "$PATH" && echo has-path'],
         "cwd": str(tmp_path), "env": {"MJ_TEST_VAR": "hello"}},
    )
    assert result.success, result.error_message
    lines = result.details["stdout_tail"].splitlines()
    assert os.path.samefile(lines[0], tmp_path)
    assert lines[1:] == ["hello", "has-path"]


def test_output_tail_is_bounded():
    code = "import sys; sys.stdout.write('a' * 9000 + 'END'); sys.stderr.write('é' * 50)"
    result = run_job(ShellJob, {"command": [sys.executable, "-c", code], "output_tail_chars": 10})
    assert result.success, result.error_message
    assert result.details["stdout_tail"] == "aaaaaaaEND"
    assert result.details["stdout_bytes"] == 9003
    assert result.details["stderr_tail"] == "é" * 10


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "pid"
    result = run_job(
        ShellJob,
        {"command": ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], "timeout_s": 0.5, "kill_grace_s": 1},
    )
    assert not result.success
    assert result.details["timed_out"] is True
    assert result.error_message == "timed out after 0.5s"
    assert result.details["exit_code"] == -signal.SIGTERM
    assert _wait_gone(_read_pid(pidfile)), "grandchild survived the timeout"


def test_timeout_escalates_to_sigkill_for_processes_ignoring_sigterm(tmp_path):
    pidfile = tmp_path / "pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait"
    result = run_job(ShellJob, {"command": ["sh", "-c", script], "timeout_s": 0.3, "kill_grace_s": 0.2})
    assert result.details["timed_out"] is True
    assert result.details["exit_code"] == -signal.SIGKILL
    assert _wait_gone(_read_pid(pidfile))


def test_leftover_background_process_is_killed_after_exit(tmp_path):
    pidfile = tmp_path / "pid"
    script = f"sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}"
    result = run_job(ShellJob, {"command": ["sh", "-c", script]})
    assert result.success, result.error_message
    pid = _read_pid(pidfile)
    assert result.details["leftover_pids"] == [pid]
    assert _wait_gone(pid)


def test_leftover_holding_stdout_does_not_hang_and_can_be_kept(tmp_path):
    pidfile = tmp_path / "pid"
    script = f"sleep 300 & echo $! > {pidfile}; echo started"
    started = time.monotonic()
    result = run_job(ShellJob, {"command": ["sh", "-c", script], "kill_leftover_processes": False})
    pid = _read_pid(pidfile)
    try:
        assert result.success, result.error_message
        assert time.monotonic() - started < 3
        assert result.details["stdout_tail"] == "started\n"
        assert result.details["leftover_pids"] == [pid]
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    finally:
        os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)


def test_without_pidfd_the_exit_is_polled(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[ShellJob.__module__], "_pidfd_open", lambda pid: None)
    ok = run_job(ShellJob, {"command": ["sh", "-c", "echo hi; exec >&- 2>&-; sleep 0.1; exit 4"]})
    assert ok.error_message == "exit code 4" and ok.details["stdout_tail"] == "hi\n"
    pidfile = tmp_path / "pid"
    slow = run_job(ShellJob, {"command": ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], "timeout_s": 0.2})
    assert slow.details["timed_out"] is True
    assert _wait_gone(_read_pid(pidfile))


def test_heartbeat_is_sent_while_waiting():
    beats = []
    result = run_job(
        ShellJob, {"command": ["sleep", "0.4"], "heartbeat_interval_s": 0.05}, heartbeat=lambda: beats.append(1)
    )
    assert result.success, result.error_message
    assert len(beats) >= 2


@pytest.mark.parametrize(
    ("config", "prefix"),
    [
        ({"command": []}, "configuration.command"),
        ({"command": [""]}, "configuration.command[0]"),
        ({"command": ["true", 3]}, "configuration.command[1]"),
        ({"command": ["true"], "timeout_s": 0}, "configuration.timeout_s"),
        ({"command": ["true"], "timeout_s": "soon"}, "configuration.timeout_s"),
        ({"command": ["true"], "env": {"A=B": "x"}}, "configuration.env"),
        ({"command": ["true"], "output_tail_chars": -1}, "configuration.output_tail_chars"),
        ({"command": ["true"], "cwd": ""}, "configuration.cwd"),
    ],
)
def test_bad_configuration_names_the_field(config, prefix):
    with pytest.raises(ConfigurationError) as info:
        make_context(ShellJob, config)
    assert str(info.value).startswith(prefix + ":") or str(info.value).startswith(prefix + "."), str(info.value)


def test_missing_and_unknown_fields_are_rejected():
    with pytest.raises(ConfigurationError, match="command"):
        make_context(ShellJob, {})
    with pytest.raises(ConfigurationError, match="bogus"):
        make_context(ShellJob, {"command": ["true"], "bogus": 1})


def test_failure_notification_includes_stderr():
    job = ShellJob()
    context = make_context(ShellJob, {"command": ["sh", "-c", "echo boom >&2; exit 2"]})
    result = job.execute(context)
    note = job.format_notification(context, result)
    assert note.priority == "High"
    assert "exit code 2" in note.body and "boom" in note.body
