"""Per-run resource accounting in the worker: the CPU time and peak memory of one run, recorded with it.

A :class:`Meter` is created just before the plugin runs and read just after it returns (or raises):

- ``cpu_s``: seconds of CPU (user + system) the worker used during the run (``getrusage(RUSAGE_SELF)``
  delta: every thread of the worker) plus those of the children it waited for during the run
  (``RUSAGE_CHILDREN`` delta: a ``subprocess.run`` command, say). A child the run left behind is not
  waited for before the result is sent (:mod:`~mjsched_isolated.worker.hygiene` kills it afterwards), so
  its CPU is not counted. systemd's ``CPUUsageNSec=``, the ``cpuacct`` figure a cgroup would give.
- ``max_rss_mb``: peak resident memory of the run, in MiB: the worker's peak is reset before the run
  (``/proc/self/clear_refs`` ``5``, Linux >= 4.0) and read after it (``VmHWM`` of ``/proc/self/status``);
  if a child the run waited for peaked higher than any earlier child (``RUSAGE_CHILDREN.ru_maxrss`` grew),
  that child's peak counts instead (the larger one: the figure is the largest single process, not a sum).
  Where the peak cannot be reset (no ``/proc``), it is the worker's lifetime peak only when the run raised
  it (``RUSAGE_SELF.ru_maxrss`` grew), else None: a figure from an earlier run is never reported as this
  one's. systemd's ``MemoryPeak=``, cgroup v2's ``memory.peak``.

Where the worker has a cgroup (:mod:`mjsched_isolated.cgroups`), ``cpu_s`` is the cgroup's CPU time during
the run (v2 ``cpu.stat``: every process of the tree, those the run left running and those that started a
session of their own included), and ``max_rss_mb`` the larger of the figure above and the peak memory
charged to the cgroup during the run (v2 ``memory.peak``, v1 ``memory.max_usage_in_bytes``, reset before
the run: the whole tree together, page cache included) where a memory cgroup is used.

Runs that are killed (deadline, cancel, a crash) send no result, so they have no figures.
"""

from __future__ import annotations

import resource
import sys

from mjsched_isolated import cgroups

_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
_MIB = 1024 * 1024


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def _reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS; False where the platform cannot."""
    try:
        cgroups.write_kernel_file("/proc/self/clear_refs", b"5")  # one descriptor kept for every run
    except OSError:
        return False
    return True


def _status() -> bytes | None:
    """``/proc/self/status`` now; None without ``/proc``."""
    try:
        return cgroups.read_kernel_file("/proc/self/status")  # one descriptor kept: pread, no open per run
    except OSError:
        return None


def _vm_hwm_kib(data: bytes | None) -> int | None:
    """The peak RSS since the last reset (``VmHWM``) in ``/proc/self/status`` text ``data``, KiB; None
    without it."""
    if data is None:
        return None
    try:
        start = data.index(b"\nVmHWM:") + 7
        return int(data[start:data.index(b"kB", start)])
    except ValueError:
        return None


class Meter:
    """Measures one run: created just before the plugin runs (takes the starting figures and resets the
    worker's peak memory), :meth:`stop` just after it."""

    def __init__(self, cgroup: cgroups.WorkerCgroup | None = None) -> None:
        self._cgroup = cgroup
        self._cgroup_cpu = cgroup.cpu_s() if cgroup is not None else None
        self._cgroup_peak = cgroup is not None and cgroup.memory_dir is not None and cgroup.reset_memory_peak()
        self._peak_reset = _reset_peak()
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._children = resource.getrusage(resource.RUSAGE_CHILDREN)

    status: bytes | None = None  # /proc/self/status as stop() read it, for the state check that follows

    def stop(self) -> tuple[float, float | None]:
        """``(cpu_s, max_rss_mb)`` of the run since the meter was created (see the module docstring). The
        ``/proc/self/status`` text it read for the peak is kept in :attr:`status`."""
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = max(0.0, _cpu(own) - _cpu(self._self)) + max(0.0, _cpu(children) - _cpu(self._children))
        peak_bytes: int | None = None
        self.status = _status() if self._peak_reset else None
        hwm = _vm_hwm_kib(self.status)
        if hwm is not None:
            peak_bytes = hwm * 1024
        elif own.ru_maxrss > self._self.ru_maxrss:
            peak_bytes = own.ru_maxrss * _MAXRSS_UNIT
        if children.ru_maxrss > self._children.ru_maxrss:
            peak_bytes = max(peak_bytes or 0, children.ru_maxrss * _MAXRSS_UNIT)
        if self._cgroup is not None:
            if self._cgroup_cpu is not None:
                end = self._cgroup.cpu_s()
                if end is not None:
                    cpu_s = max(cpu_s, end - self._cgroup_cpu)  # the whole tree (never less than rusage says)
            if self._cgroup_peak:
                peak_bytes = max(peak_bytes or 0, self._cgroup.memory_peak() or 0)
        return round(cpu_s, 3), None if peak_bytes is None else round(peak_bytes / _MIB, 1)
