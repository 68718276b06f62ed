"""The vocabularies of the data model as ``StrEnum`` s: job and run statuses, concurrency modes, missed-run
policies, daylight-saving policies, notification events, statuses and priorities.

The values are the reference engine's spelling (reference-engine-spec.md §1.2, §1.3), stored as text, so
a member compares equal to its string (``RunStatus.RUNNING == "Running"``). Standard library only: the
worker, the store and the CLI all import it.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """``jobs.status``. Only Active jobs are scheduled; Expired: ``end_at`` has passed."""

    PENDING = "Pending"
    ACTIVE = "Active"
    PAUSED = "Paused"
    DISABLED = "Disabled"
    EXPIRED = "Expired"


class RunStatus(StrEnum):
    """``runs.status``. Running until one terminal state is recorded."""

    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    TIMEOUT = "Timeout"


class ConcurrencyMode(StrEnum):
    """``jobs.concurrency_mode``: what an occurrence does while a run of its job is live (reference §3; the
    last two from issue 12 point 7, Temporal's overlap policies)."""

    SKIP = "Skip"  # Temporal Skip, Kubernetes Forbid
    QUEUE = "Queue"  # Temporal BufferOne: one occurrence waits
    CONCURRENT = "Concurrent"  # Temporal AllowAll, Kubernetes Allow
    REPLACE = "Replace"  # Temporal TerminateOther, Kubernetes Replace: the live run is cancelled
    QUEUE_ALL = "QueueAll"  # Temporal BufferAll: up to max_queued occurrences wait, run in order


class MissedRunPolicy(StrEnum):
    """``jobs.missed_run_policy``: what a missed occurrence does (reference §5 ``DecideMissedRun``)."""

    SKIP = "Skip"
    RUN_ONCE = "RunOnce"
    RUN_ALL = "RunAll"


class DstGapPolicy(StrEnum):
    """``jobs.dst_gap_policy``: an occurrence whose local time does not exist (spring forward)."""

    SHIFT = "Shift"  # runs once at the first valid instant after the gap (the default)
    SKIP = "Skip"  # does not run


class DstFoldPolicy(StrEnum):
    """``jobs.dst_fold_policy``: occurrences whose local time occurs twice (fall back)."""

    ONCE_IF_FIXED_HOUR = "OnceIfFixedHour"  # fixed hour field: first copy only; wildcard/step hour: both (default)
    ONCE = "Once"  # every expression: first copy only
    BOTH = "Both"  # every expression: both copies


class NotificationEvent(StrEnum):
    """``notifications.event``: the cause of a notice."""

    SUCCESS = "Success"
    FAILURE = "Failure"
    SKIPPED = "Skipped"
    MISSED = "Missed"


class NotificationStatus(StrEnum):
    """``notifications.status`` of an outbox row."""

    PENDING = "Pending"
    SENT = "Sent"
    FAILED = "Failed"


class Priority(StrEnum):
    """A notice's priority (reference ``NotificationContent.Priority``)."""

    LOW = "Low"
    NORMAL = "Normal"
    HIGH = "High"


def values(enum: type[StrEnum]) -> tuple[str, ...]:
    """The stored spellings of ``enum``'s members, in declaration order (for CHECK constraints, choices)."""
    return tuple(member.value for member in enum)
