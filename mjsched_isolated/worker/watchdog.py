"""The worker's watchdog: a forked *process* that ends the worker's whole tree when its supervisor is gone
or can no longer be trusted.

It is forked before any plugin code runs (no thread, no lock held), so a plugin holding the GIL cannot
stall it. Every ``PARENT_CHECK_INTERVAL_S`` it checks that the worker's parent is still the supervisor (the
kernel re-parents the worker the moment the supervisor dies, even by SIGKILL) and, while a run executes,
that the supervisor's lease is still trusted (``fence_at``, renewed by the supervisor; a supervisor frozen
by SIGSTOP or a suspended VM cannot fence its own runs, so its workers do; see
:mod:`mjsched_isolated.supervisor.liveness`). Otherwise it kills the worker's tree
(:func:`mjsched_isolated.proctree.kill_tree`; the group signal ends the watchdog too). It exits by itself
when the worker exits.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any

import psutil

from mjsched_isolated import cgroups, proctree

PARENT_CHECK_INTERVAL_S = 0.1


def start(supervisor_pid: int, busy: Any, fence_at: Any, cgroup: cgroups.WorkerCgroup | None = None,
          cpu_budget: Any = None) -> int:
    """Fork the watchdog of this (worker) process and return its pid. ``busy``: a shared byte, 1 while a
    run executes; ``fence_at``: a shared double, the monotonic time after which busy runs are killed (None:
    no fence); ``cgroup``: the worker's cgroup, killed whole (every process in it, whatever its session)
    before the tree is; ``cpu_budget``: two shared doubles, the cgroup's CPU seconds when the run started
    and the run's ``max_cpu_s`` (``inf``: none; see :mod:`mjsched_isolated.worker.limits`): at that much
    CPU of the whole tree, the run's processes other than the worker get SIGXCPU and the budget is marked
    -1 (the worker's own CPU is bounded by its ``RLIMIT_CPU``: with no other process, nothing is sent)."""
    worker_pid = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    with contextlib.suppress(BaseException):  # the watchdog never returns into the worker's code
        os.closerange(3, 1 << 16)  # hold no pipe of the worker's: its death must stay visible at once
        # /proc of another PID namespace (serve refuses to start there, an embedding may not): its pids are
        # strangers', so the worker's parent is not read there (the supervisor's pid is probed by a signal 0)
        # and the kill spares the tree walk (the cgroup and the worker's group are reached without /proc)
        own_proc = proctree.foreign_proc() is None
        worker = psutil.Process(worker_pid) if own_proc else None
        while True:
            time.sleep(PARENT_CHECK_INTERVAL_S)  # an outer loop polling the kernel, not a test sync
            if os.getppid() != worker_pid:
                os._exit(0)  # the worker is gone (exited or killed): nothing left to guard
            if worker is not None and worker.ppid() != supervisor_pid:
                break
            if worker is None and not proctree.exists(supervisor_pid):
                break
            if busy.value and fence_at is not None and time.monotonic() > fence_at.value:
                break
            if busy.value and cgroup is not None and cpu_budget is not None and 0 <= cpu_budget[1] < math.inf:
                used = cgroup.cpu_s()
                if (used is not None and used - cpu_budget[0] >= cpu_budget[1]
                        and cgroup.pids() - {worker_pid, os.getpid()}):
                    cpu_budget[1] = -1.0
                    cgroup.signal(signal.SIGXCPU, exclude={worker_pid, os.getpid()})
        if cgroup is not None:
            cgroup.kill(exclude={os.getpid()})
        if own_proc:
            proctree.kill_tree(worker_pid)
        else:
            os.kill(worker_pid, signal.SIGKILL)
            proctree.signal_group(worker_pid)
    os._exit(0)

