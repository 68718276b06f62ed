"""Engine settings: one frozen msgspec Struct, validated once, durations in seconds (``*_s``)."""

from __future__ import annotations

import math
import os
import socket

import msgspec

from .errors import InputError

MAX_SECONDS = 10 * 365 * 86400.0


def default_instance() -> str:
    """``<hostname>-<pid>``, the reference's ``LockedByInstance`` format (§2.5)."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the supervisor needs besides its store and pool.

    ``lease_timeout_s``: default run deadline and lease length (reference ``defaultLockTimeout``, 600 s);
    a job's ``max_runtime_minutes`` only lengthens it. ``heartbeat_interval_s`` / ``heartbeat_lease_s``:
    at most one effective extension per interval, to now + lease (reference: 5 min / 6 min).
    ``rescan_interval_s``: longest sleep before re-reading the jobs table for changes made by others and
    sweeping runs of dead supervisors; due times themselves wake the loop exactly.
    ``shutdown_timeout_s``: drain bound on SIGTERM/SIGINT. ``lease_ttl_s`` / ``lease_renew_interval_s``:
    the supervisor's liveness lease (see :mod:`liveness`); a dead supervisor's runs are recovered within
    ``lease_ttl_s + rescan_interval_s``. ``clock_skew_s``: added to the local clock reading; for tests
    that simulate a machine whose clock is wrong. ``max_catchup_runs``: RunAll's bound on a job's backlog.
    """

    database_url: str
    plugins_dir: str = "plugins"
    max_concurrent_jobs: int = 5
    lease_timeout_s: float = 600.0
    shutdown_timeout_s: float = 30.0
    rescan_interval_s: float = 1.0
    heartbeat_interval_s: float = 300.0
    heartbeat_lease_s: float = 360.0
    worker_ready_timeout_s: float = 60.0
    plugin_import_timeout_s: float = 10.0
    lease_ttl_s: float = 30.0
    lease_renew_interval_s: float = 10.0
    clock_skew_s: float = 0.0
    max_catchup_runs: int = 100
    instance: str = msgspec.field(default_factory=default_instance)

    def __post_init__(self) -> None:
        for name in ("lease_timeout_s", "shutdown_timeout_s", "rescan_interval_s", "heartbeat_interval_s",
                     "heartbeat_lease_s", "worker_ready_timeout_s", "plugin_import_timeout_s", "lease_ttl_s",
                     "lease_renew_interval_s", "clock_skew_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_SECONDS:
                raise InputError(name, f"must be a finite number of seconds up to {MAX_SECONDS:.0f}, got {value}")
        if not 1 <= self.max_catchup_runs <= 1_000_000:
            raise InputError("max_catchup_runs", f"must be between 1 and 1000000, got {self.max_catchup_runs}")
        if self.max_concurrent_jobs < 1:
            raise InputError("max_concurrent_jobs", f"must be a positive integer, got {self.max_concurrent_jobs}")
        for name in ("lease_timeout_s", "rescan_interval_s", "heartbeat_lease_s", "worker_ready_timeout_s",
                     "plugin_import_timeout_s", "lease_ttl_s", "lease_renew_interval_s"):
            if not getattr(self, name) > 0:
                raise InputError(name, f"must be a positive number of seconds, got {getattr(self, name)}")
        for name in ("shutdown_timeout_s", "heartbeat_interval_s"):
            if not getattr(self, name) >= 0:
                raise InputError(name, f"must be zero or more seconds, got {getattr(self, name)}")
        if self.lease_renew_interval_s >= self.lease_ttl_s * 0.8:
            raise InputError("lease_renew_interval_s", f"must be well below lease_ttl_s ({self.lease_ttl_s} s); "
                             f"got {self.lease_renew_interval_s}")
