"""The APScheduler side's job function (a module of its own so ProcessPoolExecutor children can import it).
Same behaviours as ``plugins/work.py``; returns the epoch second at which it began."""

import os
import time

_LEAKED: list[bytearray] = []


def bench_job(kind: str = "ok", runtime_ms: float = 0.0, leak_mb: float = 0.0) -> float:
    started = time.time()
    if kind == "hang":
        while True:
            time.sleep(3600)
    time.sleep(runtime_ms / 1000.0)
    if kind == "crash":
        os._exit(3)
    if kind == "leak":
        _LEAKED.append(bytearray(int(leak_mb * 1024 * 1024)))
    return started
