"""Drive one real worker child (through the supervisor's Pool) without a database: bounded waits only."""

from __future__ import annotations

import time
from typing import Any, Self

from mjsched_isolated import protocol
from mjsched_isolated.supervisor.pool import Pool, Worker


class OneWorker:
    """A pool of one real worker child loading ``plugins_dir``; ``run()`` sends a request and returns
    every message up to its RunFinished."""

    def __init__(self, plugins_dir: str | None, timeout_s: float = 30.0, **pool_options: Any) -> None:
        self.pool = Pool(1, plugins_dir, ready_timeout_s=timeout_s, **pool_options)
        self.timeout_s = timeout_s
        self._next_run_id = 0

    def __enter__(self) -> Self:
        self.pool.start()
        self.ready = self._until(lambda m: isinstance(m, protocol.Ready))[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.close()

    @property
    def worker(self) -> Worker:
        worker = self.pool.workers[0]
        assert worker is not None
        return worker

    def run(self, job_type: str, configuration: str | None = None) -> list[Any]:
        self._next_run_id += 1
        request = protocol.RunRequest(run_id=self._next_run_id, job_id=1, job_name=f"test-{job_type}",
                                      job_type=job_type, configuration=configuration)
        self.pool.submit(self.worker, request)
        return self._until(lambda m: isinstance(m, protocol.RunFinished) and m.run_id == request.run_id)

    def _until(self, done: Any) -> list[Any]:
        seen: list[Any] = []
        give_up = time.monotonic() + self.timeout_s
        while True:
            left = give_up - time.monotonic()
            assert left > 0, f"no answer from the worker within {self.timeout_s} s: {seen}"
            events, _ = self.pool.wait(left)
            for event in events:
                assert not event.died, f"the worker died: exit code {event.exitcode}"
                seen.append(event.message)
                if done(event.message):
                    return seen
