"""The ``steps`` built-in plugin and the StepsJob driver (issue 14's multi-step driver): steps in order,
a heartbeat and a record per step, per-step timeouts, stop at the first failure, resume from a previous
run's details; and the manual's LLM-style loop example run in a real worker against a local http.server."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from plugin_helpers import make_context

from mjsched_isolated.errors import ConfigurationError
from mjsched_isolated.plugins.steps import CallStep, CommandStep, StepsPlugin, run_plan

TESTS_DIR = str(Path(__file__).parent)
DOCS = Path(__file__).parent.parent / "docs" / "plugins" / "builtin.md"


def _steps_job(config: dict, beats: list | None = None):
    cls = StepsPlugin
    context = make_context(cls, config, heartbeat=(lambda: beats.append(time.monotonic())) if beats is not None
                           else None)
    return cls().execute(context)


def test_steps_run_in_order_heartbeat_after_each_and_hand_outputs_on(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(TESTS_DIR)
    beats: list[float] = []
    marker = tmp_path / "ran"
    result = _steps_job({"steps": [
        {"name": "touch", "command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]},
        {"name": "sum", "callable": "callable_targets:add", "arguments": {"a": 2, "b": 40}},
        {"name": "see", "callable": "callable_targets:summary", "pass_outputs": True},
    ]}, beats)
    assert result.success is True and result.error_message is None
    steps = result.details["steps"]
    assert [(s["name"], s["kind"], s["status"]) for s in steps] == [
        ("touch", "command", "ok"), ("sum", "callable", "ok"), ("see", "callable", "ok")]
    assert all(isinstance(s["duration_ms"], int) for s in steps)
    assert marker.read_text() == "x" and steps[1]["output"] == 42
    assert steps[2]["output"] == {"outputs": {"touch": 0, "sum": 42}}  # pass_outputs: the earlier outputs
    assert len(beats) == 3  # one per step
    assert result.details["failed_step"] is None
    assert result.details["resume"]["completed"] == {"touch": 0, "sum": 42, "see": steps[2]["output"]}


def test_the_first_failing_step_ends_the_run_and_later_steps_do_not_run(tmp_path):
    later = tmp_path / "later"
    result = _steps_job({"steps": [
        {"name": "ok", "command": [sys.executable, "-c", "pass"]},
        {"name": "bad", "command": [sys.executable, "-c", "raise SystemExit(3)"]},
        {"name": "never", "command": [sys.executable, "-c", f"open({str(later)!r}, 'w')"]},
    ]})
    assert result.success is False and result.error_message == "step bad failed: exit code 3"
    assert [s["status"] for s in result.details["steps"]] == ["ok", "failed"]
    assert result.details["failed_step"] == "bad" and not later.exists()


@pytest.mark.timeout(30)
def test_per_step_timeouts_stop_a_command_and_a_callable():
    result = _steps_job({"steps": [{"name": "slow", "command": ["sleep", "30"], "timeout_s": 0.3}]})
    (step,) = result.details["steps"]
    assert (result.success, step["status"]) == (False, "timeout")
    assert result.error_message.startswith("step slow timeout: timed out after 0.3 s")

    context = make_context(StepsPlugin, {"steps": [{"name": "x", "command": ["true"]}]})
    outcome = run_plan(context, iter([CallStep("spin", lambda: time.sleep(30), timeout_s=0.3),
                                      CommandStep("never", ["true"])]))
    assert [(s["name"], s["status"]) for s in outcome.details["steps"]] == [("spin", "timeout")]


def test_resume_skips_the_steps_a_previous_run_completed(tmp_path):
    flag = tmp_path / "fixed"
    counter = tmp_path / "count"
    count = f"p = {str(counter)!r}; import os; open(p, 'a').write('x')"
    config = {"steps": [
        {"name": "first", "command": [sys.executable, "-c", count]},
        {"name": "flaky", "command": [sys.executable, "-c", f"import os, sys; sys.exit(0 if os.path.exists("
                                                             f"{str(flag)!r}) else 1)"]},
        {"name": "last", "command": [sys.executable, "-c", count]},
    ]}
    failed = _steps_job(config)
    assert failed.details["failed_step"] == "flaky" and counter.read_text() == "x"
    flag.touch()
    resumed = _steps_job({**config, "resume": json.loads(json.dumps(failed.details))})
    assert resumed.success is True
    assert [(s["name"], s["status"]) for s in resumed.details["steps"]] == [
        ("first", "resumed"), ("flaky", "ok"), ("last", "ok")]
    assert counter.read_text() == "xx"  # "first" did not run again; "last" ran once


@pytest.mark.parametrize(("config", "field"), [
    ({"steps": []}, "configuration.steps"),
    ({"steps": [{"name": "a"}]}, "configuration.steps[0]"),
    ({"steps": [{"name": "a", "command": ["true"], "callable": "m:f"}]}, "configuration.steps[0]"),
    ({"steps": [{"name": "a", "command": ["true"]}, {"name": "a", "command": ["true"]}]},
     "configuration.steps[1].name"),
    ({"steps": [{"name": "a", "http": {"url": "ftp://x"}}]}, "configuration.steps[0].http.url"),
    ({"steps": [{"name": "a", "command": ["true"], "timeout_s": 0}]}, "configuration.steps[0].timeout_s"),
])
def test_bad_configurations_name_the_field(config, field):
    with pytest.raises(ConfigurationError) as refused:
        make_context(StepsPlugin, config)
    assert str(refused.value).startswith(field + ":")


# -- the manual's example: an LLM-style loop in a real worker against a local http.server ------------------
class _Model(BaseHTTPRequestHandler):
    """A fake model: asks for add(2, 3), then multiply(<that>, 4), then answers. Fails once on the second
    call when ``fail_second_call`` is set (resume test)."""

    calls: ClassVar[list[list[dict]]] = []
    fail_second_call = False

    def do_POST(self) -> None:
        messages = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
        type(self).calls.append(messages)
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        if type(self).fail_second_call and len(type(self).calls) == 2:
            self.send_response(503)
            self.end_headers()
            return
        if not tools:
            reply = {"content": "adding", "tool": "add", "arguments": {"a": 2, "b": 3}}
        elif len(tools) == 1:
            reply = {"content": "multiplying", "tool": "multiply", "arguments": {"a": float(tools[0]), "b": 4}}
        else:
            reply = {"content": f"the answer is {tools[-1]}", "tool": None}
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def model():
    _Model.calls, _Model.fail_second_call = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/chat"
    server.shutdown()
    server.server_close()


@pytest.fixture
def agent_plugins(tmp_path):
    text = DOCS.read_text()
    code = re.search(r"<!-- example: toy_agent -->\n```python\n(.*?)```", text, re.S)
    assert code is not None, "the manual's toy_agent example is missing"
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "toy_agent.py").write_text(code.group(1))
    return str(folder)


@pytest.mark.timeout(60)
def test_the_manuals_agent_loop_example_runs_in_a_worker_and_resumes(agent_plugins, model):
    from worker_helpers import OneWorker

    from mjsched_isolated import protocol

    with OneWorker(agent_plugins) as one:
        config = {"endpoint": model, "task": "what is (2 + 3) * 4?"}
        messages = one.run("toy_agent", json.dumps(config))
        finished = messages[-1]
        assert isinstance(finished, protocol.RunFinished) and finished.success, finished
        steps = finished.details["steps"]
        assert [(s["name"], s["status"]) for s in steps] == [
            ("model-0", "ok"), ("tool-0", "ok"), ("model-1", "ok"), ("tool-1", "ok"), ("model-2", "ok")]
        assert steps[3]["output"] == 20.0 and steps[4]["output"]["content"] == "the answer is 20.0"
        output = "".join(m.text for m in messages if isinstance(m, protocol.RunOutput))
        assert "step model-0 (http): started" in output  # the driver's log lines are the run's output
        assert sum(isinstance(m, protocol.Heartbeat) for m in messages) >= 1

        _Model.calls, _Model.fail_second_call = [], True
        failed = one.run("toy_agent", json.dumps(config))[-1]
        assert not failed.success and failed.details["failed_step"] == "model-1"
        assert failed.error_message.startswith("step model-1 failed: HTTP 503")
        _Model.calls, _Model.fail_second_call = [], False
        resumed = one.run("toy_agent", json.dumps({**config, "resume": failed.details}))[-1]
        assert resumed.success, resumed
        assert [(s["name"], s["status"]) for s in resumed.details["steps"]] == [
            ("model-0", "resumed"), ("tool-0", "resumed"), ("model-1", "ok"), ("tool-1", "ok"), ("model-2", "ok")]
        assert len(_Model.calls) == 2  # the completed model call was not made again


@pytest.mark.timeout(30)
def test_a_retry_with_resume_true_runs_only_the_failed_step_and_those_after_it(store, driver_factory, tmp_path):
    """Real supervisor and worker on SQLite, max_retries 1: step "one" completes, "flaky" fails the first
    time (it leaves a marker), and the retry gets the failed attempt's details (context.attempt 2,
    context.previous_details), so it skips "one" and runs "flaky" and "three"."""
    from conftest import add_job

    def append(name: str) -> list[str]:
        return [sys.executable, "-c", f"open({str(tmp_path / name)!r}, 'a').write('x')"]

    marker = str(tmp_path / "marker")
    flaky = [sys.executable, "-c", f"import os, sys; seen = os.path.exists({marker!r}); open({marker!r}, 'w'); "
                                   "sys.exit(0 if seen else 1)"]
    config = {"resume": True, "steps": [{"name": "one", "command": append("one")},
                                        {"name": "flaky", "command": flaky},
                                        {"name": "three", "command": append("three")}]}
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "staged", "steps", "0 0 1 1 *", configuration=json.dumps(config), max_retries=1,
            retry_backoff_s=0.0)

    def runs() -> list[dict]:
        return sorted(store.list_runs(job_name="staged"), key=lambda r: r["id"])

    d.until(lambda: len(runs()) == 2 and runs()[1]["status"] != "Running", 20)
    first, retry = runs()
    assert (first["attempt"], first["status"], first["details"]["failed_step"]) == (1, "Failed", "flaky"), first
    assert [(s["name"], s["status"]) for s in first["details"]["steps"]] == [("one", "ok"), ("flaky", "failed")]
    assert (retry["attempt"], retry["status"]) == (2, "Completed"), retry
    assert [(s["name"], s["status"]) for s in retry["details"]["steps"]] == [
        ("one", "resumed"), ("flaky", "ok"), ("three", "ok")]
    assert (tmp_path / "one").read_text() == "x" and (tmp_path / "three").read_text() == "x"


def test_resume_true_starts_a_first_attempt_from_the_first_step():
    context = make_context(StepsPlugin, {"resume": True, "steps": [{"name": "a", "command": ["true"]}]})
    context.previous_details = {"resume": {"completed": {"a": 0}}}  # not a retry: ignored
    assert StepsPlugin().resume_details(context) is None
    context.attempt = 2
    assert StepsPlugin().resume_details(context) == {"resume": {"completed": {"a": 0}}}
