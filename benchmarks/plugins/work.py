"""Benchmark plugin ``bench``: one job type whose configuration says how the run behaves.

``kind``: ``ok`` sleeps ``runtime_ms`` and succeeds; ``hang`` sleeps forever (until the supervisor kills it
at the deadline); ``crash`` sleeps ``runtime_ms`` then ``os._exit(3)`` (the worker dies mid-run);
``leak`` sleeps ``runtime_ms`` and keeps ``leak_mb`` MB allocated in the worker for good.
``details.plugin_started_at`` is when ``execute`` began (epoch seconds, worker clock).
"""

import os
import time

import msgspec

from mjsched_isolated import BaseScheduledJob, ScheduledJobResult

_LEAKED: list[bytearray] = []


class BenchConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: str = "ok"
    runtime_ms: float = 0.0
    leak_mb: float = 0.0


class Bench(BaseScheduledJob):
    job_type = "bench"
    configuration_type = BenchConfig
    description = "benchmark job: ok / hang / crash / leak"

    def execute(self, context):
        started = time.time()
        cfg = context.configuration
        if cfg.kind == "hang":
            while True:
                time.sleep(3600)
        time.sleep(cfg.runtime_ms / 1000.0)
        if cfg.kind == "crash":
            os._exit(3)
        if cfg.kind == "leak":
            _LEAKED.append(bytearray(int(cfg.leak_mb * 1024 * 1024)))
        return ScheduledJobResult(success=True, details={"plugin_started_at": started})
