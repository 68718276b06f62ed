"""Manual runs (``jobs run NAME``): one job, now, through a worker, on a supervisor that dispatches
nothing else (``Supervisor.scheduling`` off), driven by the same :meth:`Supervisor.cycle` as ``serve``."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mjsched_isolated.errors import NotFoundError

log = logging.getLogger("mjsched.supervisor")

if TYPE_CHECKING:
    from mjsched_isolated.store.records import JobRow
    from mjsched_isolated.supervisor.loop import Supervisor


def run_now(sup: Supervisor, job: JobRow, *, ready_timeout_s: float) -> int | None:
    """Run ``job`` (a job row) once now, through a worker of ``sup.pool``, and wait for it to be recorded.

    Skip and Queue jobs need the job's lease, so a live run refuses the request (None is returned);
    Concurrent jobs always start. The schedule (``next_run_at``) is left as it is. Raises ``TimeoutError``
    if no worker is ready within ``ready_timeout_s`` seconds or the database cannot be registered with,
    :class:`NotFoundError` (field ``job_type``) for a job type no worker has. A ``KeyboardInterrupt``
    (Ctrl-C, or SIGTERM turned into one by the CLI) cancels the run and releases its lease, then
    propagates. Reads clocks: it is an outer loop, like ``serve``. Returns the run id."""
    sup.scheduling = False
    sup.pool.start()
    try:
        return _run(sup, job, ready_timeout_s)
    except KeyboardInterrupt:
        with _deaf_to_stop_signals():  # a second Ctrl-C must not cut the cleanup short (row Running, lease held)
            sup.cancel_all(sup.read_clock()[0], "interrupted: `jobs run` was stopped")
            sup.recorder.retry_pending()
        raise
    finally:
        sup.liveness.stop()


@contextlib.contextmanager
def _deaf_to_stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM ignored (counted in the log) while the block runs, then the previous handlers
    back. Only the main thread can set handlers: elsewhere (a Client in a thread) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: heard.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if heard:
            log.warning("%d more stop signal(s) while the interrupted run was being cancelled and recorded: "
                        "ignored until that was done", len(heard))


def _run(sup: Supervisor, job: JobRow, ready_timeout_s: float) -> int | None:
    give_up = time.monotonic() + ready_timeout_s
    while not sup.pool.idle_workers():
        if time.monotonic() >= give_up:
            raise TimeoutError(f"no worker became ready within {ready_timeout_s:.0f} s")
        sup.cycle(max_wait_s=give_up - time.monotonic())
    known = {p.job_type for p in sup.pool.last_ready.plugins} if sup.pool.last_ready else set()
    if job["job_type"] not in known:
        raise NotFoundError("job_type", f"{job['job_type']!r} is not available (see `plugins list`)")
    now, mono = sup.read_clock()
    sup.keep_lease(now, mono)
    if not sup.liveness.valid(mono):
        raise TimeoutError("could not register with the database")
    # a dead supervisor's run is recorded Failed before its lease is taken over, never left Running
    sup.dispatcher.abandon_orphans(now)
    flight = sup.dispatcher.claim(job, now, job["next_run_at"], sup.pool.idle_workers()[0], scheduled_at=None)
    if flight is None:
        return None
    while flight.run_id in sup.inflight or sup.recorder.pending:
        sup.cycle()
    return flight.run_id
