"""Process trees: the one place that signals a process together with its group and descendants.

Used by the supervisor's pool (killing a worker child's tree), the worker's leftover cleanup and its
watchdog, and the ``shell`` plugin. psutil for the descendants (it sees processes that moved to another
group), ``os.killpg`` for the group (it reaches processes psutil's snapshot missed, e.g. a grandchild
forked a moment later). Processes already gone are ignored everywhere.
"""

from __future__ import annotations

import os
import signal

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """``pid``'s descendants now (children, grandchildren, ...); empty if ``pid`` is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


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
    """Send ``sig`` (default SIGKILL) to ``pid``, its process group (``pid`` leads one: worker children
    and ``shell`` commands start their own session) and every descendant, grandchildren included.

    Does not wait: SIGKILL cannot be caught or ignored. The caller reaps its own child (``join``/``wait``)
    so its exit status is kept; orphaned descendants are reaped by init (or a subreaper).
    """
    if pid <= 0:
        return
    procs: list[psutil.Process] = []
    try:
        procs = [psutil.Process(pid), *descendants(pid)]
    except psutil.Error:
        pass
    signal_group(pid, sig)
    signal_all(procs, sig)
