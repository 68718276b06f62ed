"""``cgroups.KernelFile``: a kernel file read again through one kept descriptor (issue 11, the worker's
per-run cgroup and /proc reads) is read as it is now, and never through a descriptor that a run closed and
reused for a file of its own, nor one inherited by a forked process."""

from __future__ import annotations

import os
import sys

import pytest

from mjsched_isolated.cgroups import KernelFile

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def _field(data: bytes, name: bytes) -> int:
    start = data.index(b"\n" + name + b":") + len(name) + 2
    return int(data[start:data.index(b"\n", start)].split()[0])


def test_each_read_is_the_file_as_it_is_now():
    status = KernelFile("/proc/self/status")
    before = _field(status.read(), b"VmRSS")
    grown = bytearray(64 * 1024 * 1024)
    grown[::4096] = b"\x01" * len(grown[::4096])  # touch every page: resident
    assert _field(status.read(), b"VmRSS") >= before + 60 * 1024
    del grown


def test_a_descriptor_closed_and_reused_by_a_run_is_left_to_the_run(tmp_path):
    status = KernelFile("/proc/self/status")
    assert _field(status.read(), b"Pid") == os.getpid()
    kept = status._fd
    os.close(kept)  # a plugin closing descriptors it does not own ...
    mine = tmp_path / "mine.txt"
    mine.write_text("the run's own file\n")
    fd = os.open(mine, os.O_RDONLY)  # ... and getting that number back for a file of its own
    try:
        assert fd == kept
        assert _field(status.read(), b"Pid") == os.getpid()  # read from /proc, not from the run's file
        assert status._fd != fd
        assert os.pread(fd, 100, 0) == b"the run's own file\n"  # still open: not closed by the reader
    finally:
        os.close(fd)


def test_a_kept_descriptor_is_checked_without_a_stat(monkeypatch):
    """Each use checks that the descriptor is still the file opened here by its owner mark (one fcntl), not
    by an fstat per use (issue 11: a stat result per read was ~10 % of a worker's per-run instructions)."""
    status = KernelFile("/proc/self/status")
    status.read()
    stats = []
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: stats.append(fd) or real_fstat(fd))
    for _ in range(3):
        assert _field(status.read(), b"Pid") == os.getpid()
    assert stats == []


def test_a_reused_number_whose_file_has_an_owner_is_not_taken_for_ours(tmp_path):
    """A run's own file on the kept number is recognised even when the run set an owner on it (a socket for
    SIGIO, say): only a mark this process set on the file it opened counts."""
    import fcntl

    status = KernelFile("/proc/self/status")
    status.read()
    kept = status._fd
    os.close(kept)
    fd = os.open(tmp_path / "mine.txt", os.O_RDWR | os.O_CREAT)
    try:
        assert fd == kept
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getppid())
        assert _field(status.read(), b"Pid") == os.getpid()
        assert status._fd != fd
    finally:
        os.close(fd)


def test_a_forked_process_reads_its_own_file():
    status = KernelFile("/proc/self/status")
    assert _field(status.read(), b"Pid") == os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the Pid it reads, then leave at once
        try:
            os.write(w, str(_field(status.read(), b"Pid")).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        seen = int(os.read(r, 100))
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert seen == pid


def test_a_control_file_written_again_through_its_kept_descriptor_acts_each_time():
    clear_refs, status = KernelFile("/proc/self/clear_refs", os.O_WRONLY), KernelFile("/proc/self/status")
    for _ in range(2):
        grown = bytearray(64 * 1024 * 1024)
        grown[::4096] = b"\x01" * len(grown[::4096])
        del grown
        high = _field(status.read(), b"VmHWM")
        clear_refs.write(b"5")  # the peak is reset to the current RSS
        assert _field(status.read(), b"VmHWM") < high - 48 * 1024


def test_close_closes_only_a_descriptor_that_is_still_its_own(tmp_path):
    status = KernelFile("/proc/self/status")
    status.read()
    fd = status._fd
    status.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    status.read()
    kept = status._fd
    os.close(kept)  # a run closed it and got the number back for a file of its own
    mine = os.open(tmp_path / "mine.txt", os.O_WRONLY | os.O_CREAT)
    try:
        assert mine == kept
        status.close()
        os.fstat(mine)  # still open: not ours to close
    finally:
        os.close(mine)


def test_own_children_finds_a_thread_s_child_through_kept_descriptors_and_after_the_thread_ended():
    """The worker's after-run check (issue 11): each thread's children file read through a descriptor kept
    open, no open per call; a thread that ended passes its children to another thread of the process and
    its file is closed."""
    import subprocess
    import threading

    from mjsched_isolated import proctree

    started: list[subprocess.Popen] = []
    go, done = threading.Event(), threading.Event()

    def fork_and_wait() -> None:
        started.append(subprocess.Popen(["sleep", "100"]))
        go.set()
        done.wait(30)

    thread = threading.Thread(target=fork_and_wait)
    thread.start()
    try:
        assert go.wait(30)
        child = started[0].pid
        assert child in proctree.own_children()
        assert str(thread.native_id) in proctree._children_files
        # read again through the same descriptors (their objects, not a listing of /proc/self/fd: under
        # xdist another thread of this process may open or close a descriptor meanwhile)
        before = dict(proctree._children_files)
        assert child in proctree.own_children()
        assert all(proctree._children_files.get(tid) is file for tid, file in before.items()
                   if os.path.exists(f"/proc/self/task/{tid}"))
        done.set()
        thread.join(30)
        # join() returns once the Python thread is done; the kernel task may outlive it for a moment
        import time
        gone_by = time.monotonic() + 10
        while os.path.exists(f"/proc/self/task/{thread.native_id}") and time.monotonic() < gone_by:
            time.sleep(0.001)
        assert not os.path.exists(f"/proc/self/task/{thread.native_id}")
        assert child in proctree.own_children()  # now listed under a live thread
        assert str(thread.native_id) not in proctree._children_files
    finally:
        done.set()
        for proc in started:
            proc.kill()
            proc.wait()
