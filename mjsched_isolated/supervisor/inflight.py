"""A run this supervisor is executing (:class:`InFlight`), and the log context of runs and jobs."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

from mjsched_isolated import planner

RETRY_FIELDS = ("max_retries", "retry_backoff_s", "retry_backoff_factor", "retry_backoff_max_s", "retry_max_jitter_s",
                "retry_on", "pause_after_failures")
JOB_FIELDS = ("id", "name", "notify_on_success", "notify_on_failure", "notify_recipients", "max_memory_mb",
              *RETRY_FIELDS)  # the job's fields an InFlight keeps (InFlight.job)


class InFlight:
    """A run this supervisor is executing: which worker, under which lease token, until when.

    ``started_at`` and ``deadline`` are database time (aware UTC); ``timeout_s`` the run's allowance in
    seconds; ``token`` the job lease's token (None for a Concurrent job, which runs without the lease);
    ``scheduled_at`` the occurrence (None: a manual run); ``job`` the few job fields notices need;
    ``hard_deadline`` the job's ``max_total_runtime_s`` cap (``started_at`` + it, None: no cap), past which
    no heartbeat moves ``deadline``."""

    def __init__(self, run_id: int, job: Mapping[str, Any], token: str | None, worker: Any, started_at: dt.datetime,
                 deadline: dt.datetime, timeout_s: float) -> None:
        self.run_id = run_id
        self.job_id: int = job["id"]
        self.job_name: str = job["name"]
        self.job_type: str = job["job_type"]
        self.token = token
        self.worker = worker
        self.started_at = started_at
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.last_extended: dt.datetime | None = None  # the first heartbeat is effective at once
        self.kill_at: dt.datetime | None = None  # past its deadline, sent SIGTERM: SIGKILL at this time
        self.scheduled_at: dt.datetime | None = None
        # claimed ahead (claim_ahead_s): the worker starts the plugin at this instant of this machine's clock
        # (epoch seconds), never before; None: at once
        self.start_at: float | None = None
        # claimed ahead: when to look for a cancel request (`runs cancel`) once more before the instant
        # (RunGuard.cancel_before_start; database time), None: not to
        self.cancel_check_at: dt.datetime | None = None
        # claimed ahead: the job's next_run_at as the claim wrote it; another value just before the instant
        # means the job was re-planned meanwhile (an edit of its schedule), None: not known
        self.planned_next: dt.datetime | None = None
        self.recorded_start = started_at  # the run row's started_at (the claim's database time; never shifted)
        self.hard_deadline = planner.hard_deadline(job, started_at)
        self.output_seq = 0  # the next run_output row's seq (RunOutput messages are stored as they come)
        self.attempt = 1  # the run's attempt number (a retry's: 2, 3, ...)
        # max_cpu_s, enforced by the supervisor too (see RunGuard.enforce_cpu_limits): the limit in seconds,
        # the worker tree's CPU seconds when the run was handed over, when to read it next (None: no check)
        self.cpu_limit_s: float | None = None
        self.cpu_base_s = 0.0
        self.cpu_check_at: dt.datetime | None = None
        self.job = dict(zip(JOB_FIELDS, map(job.get, JOB_FIELDS)))

    def unstarted(self, now: dt.datetime, at: float | None = None) -> bool:
        """True while a run claimed ahead cannot have started its plugin: neither the supervisor's ``now``
        (database time) has reached its instant nor this machine's clock (or ``at``, epoch seconds) its
        ``start_at`` (its worker waits for it by that clock). Asked once the worker is dead (``at``: when it
        was reaped; or its death seen), it says the plugin never started."""
        return (self.start_at is not None and now < self.recorded_start
                and (time.time() if at is None else at) < self.start_at)

    @property
    def wake_at(self) -> dt.datetime:
        """When the supervisor must act on this run next: its deadline, or once it was sent SIGTERM, the
        end of its grace; earlier if its CPU time is due to be checked (``cpu_check_at``), or a run claimed
        ahead its cancel requests (``cancel_check_at``)."""
        at = self.deadline if self.kill_at is None else self.kill_at
        if self.cancel_check_at is not None:
            at = min(at, self.cancel_check_at)
        return at if self.cpu_check_at is None or self.kill_at is not None else min(at, self.cpu_check_at)

    def shift(self, by: dt.timedelta) -> None:
        """Move every instant of the run by ``by`` (a time jump: the run keeps the time it had left)."""
        self.deadline += by
        self.started_at += by
        if self.hard_deadline is not None:
            self.hard_deadline += by
        if self.kill_at is not None:
            self.kill_at += by
        if self.last_extended is not None:
            self.last_extended += by
        if self.cpu_check_at is not None:
            self.cpu_check_at += by


def log_ctx(item: InFlight | Mapping[str, Any]) -> dict[str, Any]:
    """``extra=`` for a log call about a run (an :class:`InFlight`) or a job (a row): the JSON log's
    ``job`` and ``run_id`` fields (see :mod:`mjsched_isolated.logs`)."""
    if isinstance(item, InFlight):
        return {"job": item.job_name, "run_id": item.run_id}
    return {"job": item["name"]}
