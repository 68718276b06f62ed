"""Per-run resource limits in the worker: rlimits and nice set before the plugin runs, put back after.

A job's limits (:class:`~mjsched_isolated.protocol.RunLimits`) apply to the worker process for one run and
are inherited by the commands it starts (rlimits are per process: a child gets its own allowance, not a
share; a cgroup is what bounds a whole tree):

- ``max_memory_mb``: ``RLIMIT_DATA`` (heap and private mappings; Linux >= 4.7) set to what the worker uses
  when the run starts plus ``max_memory_mb``, so an allocation beyond it fails (``MemoryError`` in Python)
  and the run is recorded ``memory limit N MB exceeded``; ``RLIMIT_AS`` is not used (it counts reserved
  address space: thread stacks, arenas). systemd's ``MemoryMax=``, Kubernetes' memory limit.
- ``max_cpu_s``: ``RLIMIT_CPU`` soft limit at the worker's CPU time so far plus ``max_cpu_s``; the kernel
  sends SIGXCPU there, which raises :class:`CpuLimitExceeded` in the plugin (``CPU time limit N s
  exceeded``). systemd's ``LimitCPU=``.
- ``max_open_files``: ``RLIMIT_NOFILE`` (``LimitNOFILE=``); ``max_processes``: ``RLIMIT_NPROC`` (per user,
  and not enforced for root: ``TasksMax=``/``pids.max`` need a cgroup); ``nice``: the scheduling priority.

Only soft limits are changed (raising a soft limit back up to the hard one needs no privilege). A limit
that cannot be put back (nice lowered again without privilege) makes the worker retire after the run.

Rlimits are per process and a command the run starts inherits the worker's *soft* values, which are
relative to what the worker had used: on an old worker a command could use more than on a fresh one
(issue 14). Where the worker has a cgroup (:mod:`mjsched_isolated.cgroups`) the two tree-wide limits do not
depend on the worker's age:

- ``max_memory_mb``: the cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) is set to
  what the cgroup holds when the run starts plus ``max_memory_mb``, for the whole tree together; the kernel
  kills a process of the tree at it (the run is recorded ``memory limit N MB exceeded``).
- ``max_processes``: the cgroup's ``pids.max`` (v2 ``pids`` controller, else the v1 ``pids`` hierarchy) is
  set to the tasks (processes and threads) in it when the run starts plus ``max_processes``: a fork past it
  fails (``EAGAIN``), also for root, whom ``RLIMIT_NPROC`` does not bind (systemd's ``TasksMax=``).
- ``max_cpu_s``: the worker's watchdog reads the cgroup's CPU time (v2 ``cpu.stat``, every
  :data:`~mjsched_isolated.worker.watchdog.PARENT_CHECK_INTERVAL_S`) and at ``max_cpu_s`` of the whole tree
  since the run started sends SIGXCPU to every process of it (the kernel's signal for ``RLIMIT_CPU``), so
  the plugin raises :class:`CpuLimitExceeded` and its commands end.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
from typing import Any

from mjsched_isolated import cgroups
from mjsched_isolated.protocol import RunLimits

_RLIMITS = {"max_memory_mb": resource.RLIMIT_DATA, "max_cpu_s": resource.RLIMIT_CPU,
            "max_open_files": resource.RLIMIT_NOFILE, "max_processes": resource.RLIMIT_NPROC}


class CpuLimitExceeded(Exception):  # noqa: N818 - named as what the run's record says happened
    """Raised in the plugin by SIGXCPU: the run used its ``max_cpu_s``."""


class Applied:
    """Limits set for one run and what they replaced (see :func:`apply`)."""

    def __init__(self, limits: RunLimits) -> None:
        self.limits = limits
        self.rlimits: dict[int, tuple[int, int]] = {}
        self.nice: int | None = None
        self.xcpu_handler: Any = None
        self.errors: list[str] = []
        self.cgroup: cgroups.WorkerCgroup | None = None  # its memory limit was set for this run
        self.pids_cgroup: cgroups.WorkerCgroup | None = None  # its pids.max was set for this run
        self.oom_kills = 0  # the cgroup's count when the run started


def apply(limits: RunLimits | None, cgroup: cgroups.WorkerCgroup | None = None,
          cpu_budget: Any = None) -> Applied | None:
    """Set ``limits`` on this process (None: nothing to do), and on its ``cgroup`` (memory) where there is
    one. ``cpu_budget``: a shared array of two doubles the watchdog reads, set here to the cgroup's CPU
    seconds now and the limit (``inf``: none). A limit the platform refuses is noted in ``errors`` (logged
    by the caller) and the run goes on without it."""
    if cpu_budget is not None:
        cpu_budget[1] = math.inf
    if limits is not None and limits.max_cpu_s is not None and cgroup is not None and cpu_budget is not None:
        start = cgroup.cpu_s()
        if start is not None:
            cpu_budget[0], cpu_budget[1] = start, float(limits.max_cpu_s)
    if limits is None or not any(getattr(limits, f) is not None for f in limits.__struct_fields__):
        return None
    applied = Applied(limits)
    for field, which in _RLIMITS.items():
        value = getattr(limits, field)
        if value is None:
            continue
        soft, hard = resource.getrlimit(which)
        if field == "max_memory_mb":
            value = _data_bytes() + value * 1024 * 1024
        elif field == "max_cpu_s":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            value = int(usage.ru_utime + usage.ru_stime) + 1 + value
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(which, (value, hard))
        except (OSError, ValueError) as exc:
            applied.errors.append(f"{field}: {exc}")
            continue
        applied.rlimits[which] = (soft, hard)
    if limits.max_cpu_s is not None:
        applied.xcpu_handler = signal.signal(signal.SIGXCPU, _on_xcpu(limits.max_cpu_s))
    if limits.max_memory_mb is not None and cgroup is not None and cgroup.memory_dir is not None:
        now = cgroup.memory_now()
        if now is not None and cgroup.set_memory_limit(now + limits.max_memory_mb * 1024 * 1024):
            applied.cgroup = cgroup
            applied.oom_kills = cgroup.oom_kills() or 0
        else:
            applied.errors.append(f"max_memory_mb: the cgroup memory limit could not be set ({cgroup.memory_dir})")
    if limits.max_processes is not None and cgroup is not None and cgroup.pids_dir is not None:
        tasks = cgroup.pids_now()
        if tasks is not None and cgroup.set_pids_limit(tasks + limits.max_processes):
            applied.pids_cgroup = cgroup
        else:
            applied.errors.append(f"max_processes: the cgroup's pids.max could not be set ({cgroup.pids_dir})")
    if limits.nice is not None:
        try:
            applied.nice = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, limits.nice)
        except OSError as exc:
            applied.errors.append(f"nice: {exc}")
            applied.nice = None
    return applied


def restore(applied: Applied | None) -> str | None:
    """Put back what :func:`apply` changed. None when all is back; else why this worker must retire."""
    if applied is None:
        return None
    failed = []
    if applied.cgroup is not None and not applied.cgroup.set_memory_limit(None):
        failed.append("cgroup memory limit")
    if applied.pids_cgroup is not None and not applied.pids_cgroup.set_pids_limit(None):
        failed.append("cgroup pids.max")
    for which, previous in applied.rlimits.items():
        try:
            resource.setrlimit(which, previous)
        except (OSError, ValueError):
            failed.append(f"rlimit {which}")
    if applied.xcpu_handler is not None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            signal.signal(signal.SIGXCPU, applied.xcpu_handler)
    if applied.nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, applied.nice)
        except OSError:  # lowering the nice value back needs privilege (CAP_SYS_NICE)
            failed.append(f"nice {applied.nice}")
    return f"could not restore {', '.join(failed)} after the run's limits" if failed else None


def describe(exc: BaseException, applied: Applied | None) -> str | None:
    """The run's error when ``exc`` is a limit being hit (``memory limit 200 MB exceeded``), else None."""
    if applied is None:
        return None
    if isinstance(exc, MemoryError) and applied.limits.max_memory_mb is not None:
        return f"memory limit {applied.limits.max_memory_mb} MB exceeded"
    if isinstance(exc, CpuLimitExceeded):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno == 24 and applied.limits.max_open_files is not None:  # EMFILE
        return f"open files limit {applied.limits.max_open_files} exceeded ({exc})"
    if isinstance(exc, OSError) and exc.errno == 11 and applied.limits.max_processes is not None:  # EAGAIN fork
        return f"process limit {applied.limits.max_processes} exceeded ({exc})"
    return None


def memory_verdict(applied: Applied | None) -> str | None:
    """``memory limit N MB exceeded (...)`` when the kernel killed a process of the run at the cgroup's
    memory limit during it (a command the plugin started), else None. Called before :func:`restore`."""
    if applied is None or applied.cgroup is None:
        return None
    killed = (applied.cgroup.oom_kills() or 0) - applied.oom_kills
    if killed <= 0:
        return None
    return (f"memory limit {applied.limits.max_memory_mb} MB exceeded: the kernel killed {killed} process(es) "
            "of the run at its cgroup's memory limit")


def cpu_verdict(applied: Applied | None, cpu_budget: Any) -> str | None:
    """``CPU time limit N s exceeded (...)`` when the watchdog found the run's processes together over
    ``max_cpu_s`` (it marks ``cpu_budget[1]`` with -1 when it sends SIGXCPU), else None. Resets the
    budget: no limit until the next run sets one."""
    if cpu_budget is None:
        return None
    fired, cpu_budget[1] = cpu_budget[1] < 0, math.inf
    if not fired or applied is None:
        return None
    return (f"CPU time limit {applied.limits.max_cpu_s} s exceeded by the run's processes together (its cgroup's "
            "CPU time): SIGXCPU sent to them")


def _on_xcpu(max_cpu_s: float) -> Any:
    def handler(_signum: int, _frame: object) -> None:
        raise CpuLimitExceeded(f"CPU time limit {max_cpu_s:g} s exceeded")
    return handler


def _data_bytes() -> int:
    """This process's data segment now (``VmData``), in bytes; 0 where /proc does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
