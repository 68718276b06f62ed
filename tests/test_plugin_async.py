"""``async def execute`` plugins in a real worker child: run to completion in the worker's one event loop,
reused across runs; heartbeats, results and failures as for sync plugins."""

from __future__ import annotations

import json

from conftest import FIXTURE_PLUGINS
from worker_helpers import OneWorker

from mjsched_isolated import protocol


def test_async_execute_runs_heartbeats_and_reuses_one_loop_per_worker():
    with OneWorker(FIXTURE_PLUGINS) as worker:
        first = worker.run("async_beat", json.dumps({"beats": 2, "gap_s": 0.3, "leave_task": True}))
        second = worker.run("async_beat", json.dumps({"beats": 0}))
    beats = [m for m in first if isinstance(m, protocol.Heartbeat)]
    done, again = first[-1], second[-1]
    assert len(beats) == 2  # 0.3 s apart: above the worker's 0.25 s throttle (RunStarted: only at DEBUG)
    assert beats[0].at < beats[1].at
    assert done.success and again.success, (done.error_message, again.error_message)
    assert again.details["pid"] == done.details["pid"]  # the same worker ...
    assert again.details["loop_id"] == done.details["loop_id"]  # ... and the same loop, reused
    assert again.details["earlier_tasks_cancelled"] == [True]  # a task the first run left pending was cancelled


def test_an_async_plugin_that_raises_is_a_failure_with_its_traceback_and_the_worker_goes_on():
    with OneWorker(FIXTURE_PLUGINS) as worker:
        failed = worker.run("async_beat", json.dumps({"beats": 0, "fail": True}))[-1]
        fine = worker.run("async_beat", json.dumps({"beats": 0}))[-1]
    assert not failed.success
    assert failed.error_message == "plugin raised ValueError: async plugin failed on purpose"
    assert "async plugin failed on purpose" in failed.details["traceback"]
    assert failed.notification is not None and failed.notification.priority == "High"
    assert fine.success
