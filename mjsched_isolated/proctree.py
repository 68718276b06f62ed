"""Process trees: the one place that finds and signals a process together with its group and descendants.

Used by the supervisor's pool (killing a worker child's tree), the worker's leftover cleanup
(:mod:`mjsched_isolated.worker.hygiene`) and watchdog (:mod:`mjsched_isolated.worker.watchdog`), and the
``shell`` plugin. psutil for the descendants (it sees processes that moved to another group), ``os.killpg``
for the group (it reaches processes psutil's snapshot missed, e.g. a grandchild forked a moment later).
Processes already gone are ignored everywhere. Standard library and psutil only: the worker imports it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

from mjsched_isolated.cgroups import KernelFile

PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux >= 3.4


def descendants(pid: int) -> list[psutil.Process]:
    """``pid``'s descendants now (children, grandchildren, ...); empty if ``pid`` is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants, plus the children each
    of them has waited for; None if ``pid`` is gone. A descendant that ended and was not reaped yet is
    missing until its parent waits for it: the figure can dip, never overstate. On Linux a few small reads
    (``/proc/PID/stat`` and the kernel's children lists, about 0.1 ms for a worker and its watchdog; a
    worker is a child subreaper, so its orphans stay below it), else psutil over the process table."""
    listed, found = _proc_tree_cpu_s(pid)
    if listed:
        return found
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            if proc is root:
                return None
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_tree_cpu_s(pid: int) -> tuple[bool, float | None]:
    """:func:`tree_cpu_s` from ``/proc``: ``(False, None)`` where the kernel does not list children (no
    ``CONFIG_PROC_CHILDREN``, no /proc), else ``(True, seconds or None if pid is gone)``."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return (True, None) if os.path.exists("/proc/self/task") and os.path.exists(
            f"/proc/self/task/{os.getpid()}/children") else (False, None)
    ticks = 0
    stack, seen = [pid], {pid}
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
            tasks = os.listdir(f"/proc/{current}/task")
        except (OSError, IndexError, ValueError):
            if current == pid:
                return True, None
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children", "rb") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    return True, ticks / _TICKS


def foreign_proc() -> str | None:
    """None when ``/proc`` shows this process's own PID namespace (or there is no ``/proc``); else what is
    wrong with ``/proc``, on one line naming the cause and the fix. A PID namespace started without its
    own ``/proc`` (``unshare -pf`` without ``--mount-proc``) still shows its parent's: every pid read there
    (a worker's parent, a run's descendants) is another process's, so the worker's watchdog judged a
    stranger."""
    try:
        seen = os.readlink("/proc/self")
    except OSError:
        return None
    if seen == str(os.getpid()):
        return None
    return (f"mounted for another PID namespace (/proc/self is pid {seen}, this process is pid {os.getpid()}): "
            "workers would judge and signal other processes by their pids; give this PID namespace its own /proc "
            "(unshare --mount-proc, or a container's own /proc)")


def exists(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (signal 0; one we may not signal exists).
    Needs no ``/proc``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to process group ``pgid``. False if the group no longer exists (or is not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_all(procs: list[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``procs``, ignoring those already gone."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` (default SIGKILL) to ``pid``, every descendant (grandchildren included) and then to
    ``pid``'s process group (``pid`` leads one: worker children and ``shell`` commands start their own
    session).

    The calling process is never signalled individually, and the group comes last: a caller inside the
    group (the worker's watchdog) reaches every descendant before the group signal ends it too. Does not
    wait: SIGKILL cannot be caught or ignored. The caller reaps its own child (``join``/``wait``) so its exit
    status is kept; orphaned descendants are reaped by init (or a subreaper).
    """
    if pid <= 0:
        return
    procs: list[psutil.Process] = []
    try:
        procs = [psutil.Process(pid), *descendants(pid)]
    except psutil.Error:
        pass
    me = os.getpid()
    signal_all([p for p in procs if p.pid != me], sig)
    signal_group(pid, sig)


def kill_trees(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """:func:`kill_tree` for several roots at once, for kills that fall due together: the descendants of
    every root are found in one pass over the process table, then every process and every root's process
    group is signalled, before the caller waits for or reaps any of them."""
    roots = [pid for pid in pids if pid > 0]
    if not roots:
        return
    if len(roots) == 1:
        kill_tree(roots[0], sig)
        return
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"] or 0, []).append(proc.pid)
    targets: list[int] = []
    stack = list(roots)
    seen = set(roots)
    while stack:
        pid = stack.pop()
        targets.append(pid)
        for child in children.get(pid, ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    me = os.getpid()
    for pid in targets:
        if pid != me:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for pid in roots:
        signal_group(pid, sig)


def group_members(pgid: int, *, exclude: int | None = None) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, other than ``exclude``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != exclude and os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return members


def session_and_descendants(leader: int) -> set[int]:
    """Pids (other than ``leader``) in the session ``leader`` leads, or below it: a daemonised subprocess
    re-parented to init stays in its session even in a process group of its own. One pass over /proc's
    ``stat`` files (a millisecond or two for a hundred processes), psutil where there is no /proc."""
    parents: dict[int, int] = {}
    found: set[int] = set()
    try:
        entries: list[str] | None = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        entries = None
    if entries is None:
        for proc in psutil.process_iter(["ppid"]):
            parents[proc.pid] = proc.info["ppid"] or 0
            try:
                if os.getsid(proc.pid) == leader:
                    found.add(proc.pid)
            except OSError:
                pass
    else:
        for name in entries:
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid = int(name)
            parents[pid] = int(fields[1])
            if int(fields[3]) == leader:  # state ppid pgrp session ...
                found.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    stack, seen = [leader], {leader}
    while stack:
        for pid in children.get(stack.pop(), ()):
            if pid not in seen:
                seen.add(pid)
                found.add(pid)
                stack.append(pid)
    found.discard(leader)
    return found


def become_subreaper() -> bool:
    """Make this process a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a descendant
    orphaned below it (a daemonising double fork, a ``setsid`` in the background) is re-parented to it
    rather than to init, so it stays among this process's children to be found, killed and reaped. The
    caller must reap the orphans it inherits. False where the platform does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def own_children() -> set[int] | None:
    """Pids of this process's direct children (zombies included) from ``/proc/self/task/*/children``:
    a few small reads, not a scan of every process. None where the kernel does not list children
    (no ``CONFIG_PROC_CHILDREN``, no /proc): callers fall back to a full scan. Each thread's file is read
    through a descriptor kept open (:class:`~mjsched_isolated.cgroups.KernelFile`: a worker calls this
    after every run; issue 11), those of threads that ended are closed."""
    me = str(os.getpid())
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found: set[int] = set()
    for tid in tasks:
        file = _children_files.get(tid)
        if file is None:
            file = _children_files[tid] = KernelFile(f"/proc/self/task/{tid}/children")
        try:
            found.update(map(int, file.read().split()))
        except OSError:
            if tid == me:  # the main thread's: always there, so the kernel does not list children
                return None
            continue  # the thread has ended since listdir
    if len(_children_files) > len(tasks):  # threads have ended (or this is a forked child): their files go
        for tid in set(_children_files).difference(tasks):
            _children_files.pop(tid).close()
    return found


_children_files: dict[str, KernelFile] = {}  # thread id -> its children file (see own_children)


def reap(pids: set[int]) -> set[int]:
    """``waitpid(WNOHANG)`` each of ``pids`` (this process's children); returns those that are still
    running. A pid that is not (or no longer) our child counts as gone."""
    running = set()
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            running.add(pid)
    return running


def containment(cgroups: str | None = None) -> str:
    """One line on how this machine's workers contain what runs leave behind (for ``check`` and the
    start of ``serve``). ``cgroups``: what :meth:`mjsched_isolated.cgroups.Parent.describe` says (the
    mechanism in use, or why cgroups are not used); None: not known (no pool of real workers)."""
    if sys.platform.startswith("linux") and os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        how = ("workers are child subreapers: a process a run leaves behind is killed when the run ends, also "
               "if it started its own session")
    else:
        how = ("no child subreaper on this platform: a process a run leaves behind is killed when the run ends "
               "unless it started its own session and was re-parented to init")
    if cgroups is None or cgroups.startswith("cgroups are not used"):
        return (f"{how}; {cgroups or 'cgroups are not used'}: limits are per-process rlimits, a worker killed "
                "from outside may leave processes that started their own session (see docs/operating/isolation.md)")
    return (f"{how}; {cgroups}: every process a run starts is killed with the run, or with its worker if that "
            "is killed from outside, whatever its session")
