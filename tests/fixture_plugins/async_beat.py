"""An ``async def execute`` test plugin: awaits, heartbeats, reports its event loop.

asyncio is imported in ``execute``: every fixture worker of the suite loads this module, few run it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from mjsched_isolated import BaseScheduledJob, JobContext, ScheduledJobResult

if TYPE_CHECKING:
    import asyncio


class AsyncConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    beats: int = 2
    gap_s: float = 0.3
    fail: bool = False
    leave_task: bool = False


_left_behind: list[asyncio.Task[None]] = []  # tasks earlier runs left pending (the worker must cancel them)


class AsyncBeat(BaseScheduledJob[AsyncConfig]):
    job_type = "async_beat"
    description = "async def execute: awaits, heartbeats, reports its event loop"

    async def execute(self, context: JobContext[AsyncConfig]) -> ScheduledJobResult:
        import asyncio

        cfg = context.configuration
        earlier = [t.cancelled() for t in _left_behind]
        for _ in range(cfg.beats):
            await asyncio.sleep(cfg.gap_s)
            context.heartbeat()
        if cfg.leave_task:
            _left_behind.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))
        if cfg.fail:
            raise ValueError("async plugin failed on purpose")
        return ScheduledJobResult(success=True, details={
            "loop_id": id(asyncio.get_running_loop()), "pid": os.getpid(), "earlier_tasks_cancelled": earlier})
