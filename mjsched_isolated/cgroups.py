"""Per-worker cgroups (Linux): each worker process and everything it starts, whatever its session, lives in
a cgroup of its own, so kills and the leftover cleanup after a run catch every process of the tree (systemd's
``KillMode=control-group``), also after the worker itself was killed from outside.

Layout: ``<base>/mjsched/<pidns>.<pid>.<start ticks>.<n>/w<slot>-<seq>``, where ``<base>`` is the
supervisor's own cgroup in that hierarchy (so limits set on it, by systemd or a container, still apply),
``<pidns>.<pid>.<start ticks>`` names the owning supervisor process (its pid namespace's inode, its pid,
its start time in clock ticks after boot, ``/proc/PID/stat`` field 22, so a reused pid is not mistaken for
it) and ``<n>`` its pool. A :class:`Parent` (one per pool) creates the worker cgroups and removes them; at
start it removes those of supervisors of its own pid namespace that are gone (killed with SIGKILL),
killing what still runs in them, and those of other pid namespaces (a container's) once nothing has run
in them for a minute.

Mechanisms, first usable one wins (``[isolation] cgroups``: ``auto``, or ``v2``/``v1`` to insist, ``off``):

- **cgroup v2** (a ``cgroup2`` mount: pure, or ``/sys/fs/cgroup/unified`` of a hybrid setup): kill with
  ``cgroup.kill`` (Linux >= 5.14; else every pid in ``cgroup.procs``, repeated until it is empty); CPU time
  of the whole tree from ``cpu.stat``. The ``memory`` controller, where it can be enabled for the subtree,
  gives ``memory.max`` and the out-of-memory count (``memory.peak`` is not used: it can be reset only for
  reads through the same open file, from Linux 6.12).
- **cgroup v1** (``freezer`` hierarchy): kill by freezing the cgroup, SIGKILL to every pid in
  ``cgroup.procs``, thawing (a frozen process cannot fork while it is being killed).
- Where the v2 mount has no ``memory`` controller (hybrid), the v1 ``memory`` hierarchy, if mounted and
  writable, gives ``memory.limit_in_bytes`` and ``memory.max_usage_in_bytes``.

Standard library only: the worker imports this module to join its cgroup and read its figures.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

MODES = ("auto", "v2", "v1", "off")
ROOT_NAME = "mjsched"
STALE_EMPTY_AFTER_S = 60.0  # a pool cgroup of another pid namespace, empty this long, is stale
KILL_ROUNDS = 50  # pid-by-pid kills (no cgroup.kill): rounds until no process is left (a forking tree)
_pool_numbers = itertools.count()


@dataclass(frozen=True)
class WorkerCgroup:
    """One worker's cgroup: ``kill_dir`` (v2, or v1 ``freezer``) and ``memory_dir`` (the same directory
    when v2 has the memory controller, a v1 ``memory`` cgroup, or None). Plain paths: it is pickled into
    the spawned worker, which joins it with :meth:`join`."""

    kill_dir: str
    version: int  # 2 or 1: of kill_dir
    memory_dir: str | None = None
    memory_version: int = 0
    pids_dir: str | None = None  # v2 pids controller (kill_dir) or a v1 pids cgroup: pids.max

    @property
    def dirs(self) -> tuple[str, ...]:
        """Its directory in every hierarchy it uses."""
        return tuple(dict.fromkeys(p for p in (self.kill_dir, self.memory_dir, self.pids_dir) if p))

    def join(self, pid: int = 0) -> None:
        """Move ``pid`` (0: this process) into the cgroup, in every hierarchy. Raises ``OSError``."""
        for path in self.dirs:
            _write(path, "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        """Pids of the processes in the cgroup now (empty if it is gone)."""
        try:
            return {int(p) for p in _read(self.kill_dir, "cgroup.procs").split()}
        except OSError:
            return set()

    def holds_only(self, pids: tuple[int, ...]) -> bool:
        """True when ``pids[0]`` is in the cgroup and no process but ``pids`` is (``cgroup.procs``, read
        through a kept descriptor: the worker asks after every run whether its run left anything); False
        also when the file cannot be read. Exited processes not yet reaped (zombies) are not listed."""
        try:
            members = read_kernel_file(f"{self.kill_dir}/cgroup.procs").split()
        except OSError:
            return False
        return str(pids[0]).encode() in members and all(int(pid) in pids for pid in members)

    def signal(self, sig: int, *, exclude: set[int] | frozenset[int] = frozenset()) -> None:
        """Send ``sig`` to every process in the cgroup but ``exclude`` (one pass: for SIGTERM)."""
        for pid in self.pids() - exclude:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self, *, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """SIGKILL every process in the cgroup but ``exclude``, including those forked meanwhile. Without
        ``exclude``: v2 ``cgroup.kill`` (one write), v1 freeze-kill-thaw. Returns the number of processes
        signalled (0 with ``cgroup.kill``, which does not say). Does not wait for them to end."""
        if not exclude and self.version == 2 and os.path.exists(os.path.join(self.kill_dir, "cgroup.kill")):
            with contextlib.suppress(OSError):
                _write(self.kill_dir, "cgroup.kill", "1")
                return 0
        frozen = not exclude and self._freeze(True)
        killed = 0
        try:
            for _ in range(KILL_ROUNDS):
                left = self.pids() - exclude
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
                if frozen:
                    break  # a frozen process cannot fork: one round caught them all
        finally:
            if frozen:
                self._freeze(False)  # SIGKILL is delivered once thawed
        if frozen:  # freezing is asynchronous: one more pass for a process that forked as it began
            for pid in self.pids() - exclude:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        return killed

    def _freeze(self, on: bool) -> bool:
        try:
            if self.version == 1:
                _write(self.kill_dir, "freezer.state", "FROZEN" if on else "THAWED")
            else:
                _write(self.kill_dir, "cgroup.freeze", "1" if on else "0")
        except OSError:
            return False
        return True

    def remove(self) -> bool:
        """Remove the (empty) cgroup from every hierarchy; True when none of it is left. A cgroup whose
        processes have not ended yet stays (``EBUSY``): try again later."""
        done = True
        for path in self.dirs:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) used so far by every process that was ever in the cgroup (v2
        ``cpu.stat`` ``usage_usec``); None for v1 (no ``cpuacct`` cgroup is made) or if unreadable."""
        if self.version != 2:
            return None
        try:
            data = read_kernel_file(f"{self.kill_dir}/cpu.stat")  # twice a run: no path join, no line split
            if data.startswith(b"usage_usec "):  # the first line, in every kernel so far
                return int(data[11:data.index(b"\n")]) / 1e6
            for line in data.splitlines():
                key, _, value = line.partition(b" ")
                if key == b"usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            return None
        return None

    def set_memory_limit(self, limit_bytes: int | None) -> bool:
        """Memory limit of the whole cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None lifts
        it. False without a memory cgroup or if the kernel refused (a limit below the current usage)."""
        if self.memory_dir is None:
            return False
        name, value = (("memory.max", "max") if self.memory_version == 2 else ("memory.limit_in_bytes", "-1"))
        try:
            _write(self.memory_dir, name, value if limit_bytes is None else str(limit_bytes))
        except OSError:
            return False
        return True

    def set_pids_limit(self, limit: int | None) -> bool:
        """Most tasks (processes and threads) the cgroup may hold (``pids.max``, v1 and v2); None lifts it.
        False without a pids cgroup or if the kernel refused."""
        if self.pids_dir is None:
            return False
        try:
            _write(self.pids_dir, "pids.max", "max" if limit is None else str(limit))
        except OSError:
            return False
        return True

    def pids_now(self) -> int | None:
        """Tasks (processes and threads) in the cgroup now (``pids.current``)."""
        if self.pids_dir is None:
            return None
        try:
            return int(_read(self.pids_dir, "pids.current"))
        except (OSError, ValueError):
            return None

    def memory_now(self) -> int | None:
        """Bytes charged to the cgroup now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``)."""
        return self._read_int("memory.current" if self.memory_version == 2 else "memory.usage_in_bytes")

    def reset_memory_peak(self) -> bool:
        """Reset the peak to the current usage (v1 ``memory.max_usage_in_bytes``). False where it cannot be:
        v2's ``memory.peak`` resets only for reads through the same open file (Linux >= 6.12), not used."""
        if self.memory_dir is None or self.memory_version != 1:
            return False
        try:
            write_kernel_file(f"{self.memory_dir}/memory.max_usage_in_bytes", b"0")  # every run
        except OSError:
            return False
        return True

    def memory_peak(self) -> int | None:
        """Peak bytes charged to the cgroup since the last reset (the whole tree together)."""
        return self._read_int("memory.peak" if self.memory_version == 2 else "memory.max_usage_in_bytes")

    def oom_kills(self) -> int | None:
        """Processes the kernel killed for the cgroup's memory limit so far (v2 ``memory.events``
        ``oom_kill``; v1 ``memory.oom_control`` ``oom_kill``, Linux >= 4.13)."""
        if self.memory_dir is None:
            return None
        name = "memory.events" if self.memory_version == 2 else "memory.oom_control"
        try:
            for line in _read(self.memory_dir, name).splitlines():
                key, _, value = line.partition(b" ")
                if key == b"oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def _read_int(self, name: str) -> int | None:
        if self.memory_dir is None:
            return None
        try:
            return int(read_kernel_file(f"{self.memory_dir}/{name}"))
        except (OSError, ValueError):
            return None


class Parent:
    """A pool's parent cgroup(s), owned by this process. :meth:`open` finds a usable mechanism (or says
    why there is none), :meth:`create` makes one worker's cgroup, :meth:`close` removes everything."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.kill_dir: str | None = None
        self.version = 0
        self.memory_dir: str | None = None
        self.memory_version = 0
        self.why_not: str | None = None  # set when no cgroup is used: the reason, for the start line and check
        self.memory_why_not: str | None = None
        self.pids_dir: str | None = None
        self.pids_version = 0
        self._seq = itertools.count()

    @property
    def active(self) -> bool:
        return self.kill_dir is not None

    @classmethod
    def open(cls, mode: str = "auto") -> Parent:
        """Create this pool's parent cgroup in the first usable hierarchy (``mode``: one of :data:`MODES`),
        after removing those of dead supervisors. Never raises: ``why_not`` says what prevented it."""
        parent = cls(mode)
        if mode == "off":
            parent.why_not = 'turned off in the settings ([isolation] cgroups = "off")'
            return parent
        if not sys.platform.startswith("linux"):
            parent.why_not = "not Linux"
            return parent
        mounts = _mounts()
        own = _own_cgroups()
        reasons = []
        for version in ((2, 1) if mode == "auto" else (int(mode[1]),)):
            key = "" if version == 2 else "freezer"
            base = _base(mounts, own, key)
            if base is None:
                reasons.append(f"no cgroup {'v2 (cgroup2)' if version == 2 else 'v1 freezer'} mount")
                continue
            made, why = _make_parent(base)
            if made is None:
                reasons.append(f"cgroup v{version} at {base}: {why}")
                continue
            parent.kill_dir, parent.version = made, version
            break
        if parent.kill_dir is None:
            parent.why_not = "; ".join(reasons)
            return parent
        if parent.version == 2 and _enable_controller(parent.kill_dir, "memory"):
            parent.memory_dir, parent.memory_version = parent.kill_dir, 2
        else:
            base = _base(mounts, own, "memory")
            made, why = _make_parent(base) if base is not None else (None, "no cgroup v1 memory mount")
            if made is None:
                parent.memory_why_not = why
            else:
                parent.memory_dir, parent.memory_version = made, 1
        if parent.version == 2 and _enable_controller(parent.kill_dir, "pids"):
            parent.pids_dir, parent.pids_version = parent.kill_dir, 2
        else:
            base = _base(mounts, own, "pids")
            made, _ = _make_parent(base) if base is not None else (None, "")
            if made is not None:
                parent.pids_dir, parent.pids_version = made, 1
        return parent

    def describe(self) -> str:
        """One line: the mechanism in use, or why none is."""
        if not self.active:
            return f"cgroups are not used ({self.why_not})"
        kill = ("cgroup.kill" if self.version == 2 else "freeze, SIGKILL each process, thaw")
        text = f"cgroup v{self.version} per worker under {self.kill_dir} (kills: {kill})"
        if self.memory_dir is not None:
            peaks = " and peaks" if self.memory_version == 1 else ""
            text += f"; memory limits{peaks} by cgroup v{self.memory_version} memory"
        else:
            text += f"; no memory controller ({self.memory_why_not or 'not enabled'})"
        if self.pids_dir is not None:
            text += f"; process limits by cgroup v{self.pids_version} pids"
        return text

    def create(self, slot: int) -> WorkerCgroup | None:
        """A new, empty cgroup for the worker of ``slot`` (None if cgroups are not used or it cannot be
        made: that worker then runs without)."""
        if self.kill_dir is None:
            return None
        name = f"w{slot}-{next(self._seq)}"
        try:
            os.mkdir(os.path.join(self.kill_dir, name))
        except OSError:
            return None
        kill_dir = os.path.join(self.kill_dir, name)
        memory_dir, pids_dir = (_mkdir_in(parent, name, kill_dir) for parent in (self.memory_dir, self.pids_dir))
        return WorkerCgroup(kill_dir, self.version, memory_dir, self.memory_version if memory_dir else 0, pids_dir)

    def close(self) -> list[str]:
        """Kill what is left in the worker cgroups, remove them and the parent(s). Returns the paths that
        could not be removed (processes that did not end within a second)."""
        left = []
        for path in {p for p in (self.kill_dir, self.memory_dir, self.pids_dir) if p}:
            if not _remove_tree(path, self.version if path == self.kill_dir else 0):
                left.append(path)
            with contextlib.suppress(OSError):  # the shared root, once no supervisor uses it
                os.rmdir(os.path.dirname(path))
        self.kill_dir = self.memory_dir = self.pids_dir = None
        return left


def probe(mode: str = "auto") -> str:
    """What :meth:`Parent.open` would use now (``check``): opens a parent and removes it at once."""
    parent = Parent.open(mode)
    try:
        return parent.describe()
    finally:
        parent.close()


# -- helpers -------------------------------------------------------------------------------------------------
def _mkdir_in(parent: str | None, name: str, kill_dir: str) -> str | None:
    """``parent/name`` made (a v1 hierarchy's worker cgroup), ``kill_dir`` if that is the same, None if
    there is no ``parent`` or it cannot be made."""
    if parent is None:
        return None
    path = os.path.join(parent, name)
    if path == kill_dir:
        return path
    try:
        os.mkdir(path)
    except OSError:
        return None
    return path


def _read(path: str, name: str) -> bytes:
    """The whole of a cgroup file: plain ``os.read`` calls, half the time of ``open()`` (a few read per run)."""
    fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class KernelFile:
    """A small kernel-generated file (a cgroup's ``cpu.stat``, ``/proc/self/status``) read again and again
    through one open descriptor: ``pread`` at offset 0 regenerates it, without the path lookup, open and
    close of every read (issue 11: 1.4 us instead of 12.8 us for ``cpu.stat``, read twice per run). A run's
    plugin may close the descriptor and get its number back for a file of its own: the descriptor is used
    only while it is still the file opened here (same device and inode, same process), else the file is
    opened again (the old number is not closed: it is not ours any more).

    The open file is marked as ours by its owner (``fcntl F_SETOWN``, this process's pid: the process that
    would get ``SIGIO``, sent only for a file opened ``O_ASYNC``, which this one is not); a use checks the
    mark with one ``F_GETOWN``, where an ``fstat`` builds a stat result (issue 11: ~10 % of a worker's
    per-run instructions went to eight of them). A file a run opens has no owner (0) and one a forked
    process inherited has its parent's. Where the mark cannot be set, the device and inode are compared."""

    __slots__ = ("_fd", "_id", "_mode", "_owned", "path")

    def __init__(self, path: str, mode: int = os.O_RDONLY) -> None:
        self.path = path
        self._mode = mode  # os.O_RDONLY for read, os.O_WRONLY for write
        self._fd = -1
        self._id: tuple[int, int, int] | None = None  # (pid, st_dev, st_ino) of the descriptor we opened
        self._owned = False  # the open file is marked with this process's pid as its owner (F_SETOWN)

    def _descriptor(self) -> int:
        fd = self._fd
        if fd >= 0:
            try:
                if self._owned:
                    if _fcntl(fd, _F_GETOWN) == _pid:
                        return fd
                else:
                    st = os.fstat(fd)
                    if (_pid, st.st_dev, st.st_ino) == self._id:
                        return fd
            except OSError:
                pass
            self._fd = -1
        fd = os.open(self.path, self._mode | os.O_CLOEXEC)
        st = os.fstat(fd)
        self._fd, self._id = fd, (_pid, st.st_dev, st.st_ino)
        self._owned = _mark_own(fd)
        return fd

    def read(self) -> bytes:
        """The whole file as it is now. Raises ``OSError`` if it cannot be opened or read."""
        data = os.pread(self._descriptor(), 65536, 0)
        return data if len(data) < 65536 else _read(*os.path.split(self.path))

    def write(self, data: bytes) -> None:
        """Write ``data`` (a control file: ``/proc/self/clear_refs``, a cgroup's reset). Raises ``OSError``."""
        os.write(self._descriptor(), data)

    def close(self) -> None:
        """Close the descriptor if it is still the file opened here (else it is not ours to close; in a
        forked child it is the child's own copy, closed too)."""
        fd, self._fd = self._fd, -1
        if fd >= 0 and self._id is not None:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == self._id[1:]:
                    os.close(fd)


try:
    import fcntl as _fcntl_module
    _fcntl: Any = _fcntl_module.fcntl  # looked up once: a kept descriptor is checked with it per use
    _F_GETOWN, _F_SETOWN = _fcntl_module.F_GETOWN, _fcntl_module.F_SETOWN
except ImportError:  # not POSIX: device and inode compared instead
    _fcntl, _F_GETOWN, _F_SETOWN = None, 0, 0


def _mark_own(fd: int) -> bool:
    """Mark the open file ``fd`` as this process's (its owner, see :class:`KernelFile`); False where the
    platform cannot or the mark does not read back."""
    if _fcntl is None:
        return False
    try:
        _fcntl(fd, _F_SETOWN, _pid)
        return bool(_fcntl(fd, _F_GETOWN) == _pid)
    except OSError:
        return False


_kernel_files: dict[str, KernelFile] = {}
_pid = os.getpid()  # this process's pid, kept current across forks: no getpid call per kernel file read


def own_pid() -> int:
    """This process's pid, without a ``getpid`` call (kept current across ``os.fork``)."""
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def read_kernel_file(path: str) -> bytes:
    """:meth:`KernelFile.read` of ``path``, its descriptor kept for the next read."""
    file = _kernel_files.get(path)
    if file is None:
        file = _kernel_files[path] = KernelFile(path)
    return file.read()


def write_kernel_file(path: str, data: bytes) -> None:
    """:meth:`KernelFile.write` of ``data`` to ``path``, its descriptor kept for the next write."""
    key = "w:" + path
    file = _kernel_files.get(key)
    if file is None:
        file = _kernel_files[key] = KernelFile(path, os.O_WRONLY)
    file.write(data)


def _write(path: str, name: str, value: str) -> None:
    fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> dict[str, tuple[str, str]]:
    """Cgroup mounts from ``/proc/self/mountinfo``: ``""`` -> the cgroup2 mount, a v1 controller name ->
    its mount; each as (mount point, the cgroup path mounted there)."""
    found: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            found.setdefault("", (point, root))
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                found.setdefault(option, (point, root))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy (``/proc/self/cgroup``): ``""`` (v2) or a v1 controller -> path."""
    own: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    own[controller] = path
    except (OSError, ValueError):
        pass
    return own


def _base(mounts: dict[str, tuple[str, str]], own: dict[str, str], key: str) -> str | None:
    """The directory of this process's own cgroup in hierarchy ``key``, or None if it is not mounted."""
    if key not in mounts or key not in own:
        return None
    point, root = mounts[key]
    path = own[key]
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]  # the mount shows a subtree (a container without a cgroup namespace)
    return os.path.join(point, path.lstrip("/"))


def _pid_namespace() -> str:
    """This process's pid namespace, as the inode number of ``/proc/self/ns/pid`` ("0" if unknown)."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _make_parent(base: str) -> tuple[str | None, str]:
    """Create ``<base>/mjsched/<pidns>.<pid>.<start ticks>.<n>``, after removing stale siblings: ``(path, "")``,
    or ``(None, why it could not be made)``."""
    root = os.path.join(base, ROOT_NAME)
    path = os.path.join(root, f"{_pid_namespace()}.{os.getpid()}.{_start_ticks(os.getpid())}.{next(_pool_numbers)}")
    try:
        os.makedirs(root, exist_ok=True)
        _remove_stale(root)
        try:
            os.mkdir(path)
        except FileNotFoundError:  # another supervisor's close() removed the empty root meanwhile
            os.makedirs(path)
    except OSError as exc:
        return None, f"cannot create a cgroup ({exc.strerror or exc}{'; not root?' if os.geteuid() else ''})"
    if not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None, "cgroup.procs is not writable"
    return path, ""


def _remove_stale(root: str) -> None:
    """Remove the pool cgroups of supervisors that are gone, killing what still runs in them: those of this
    pid namespace (named ``<pidns>.<pid>.<start ticks>.<n>``) whose supervisor process is gone, and any
    other with no process in it for :data:`STALE_EMPTY_AFTER_S` (a supervisor of another pid namespace,
    whose pids this one cannot check: a live one always has workers in it)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    namespace = _pid_namespace()
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        version = 1 if os.path.exists(os.path.join(path, "freezer.state")) else 2
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == namespace and parts[1].isdigit():
            if _start_ticks(int(parts[1])) == parts[2]:
                continue  # its supervisor is alive
        elif _populated(path) or _age_s(path) < STALE_EMPTY_AFTER_S:
            continue
        _remove_tree(path, version)


def _populated(path: str) -> bool:
    """Whether any process is in cgroup ``path`` or below it."""
    try:
        with open(os.path.join(path, "cgroup.events"), "rb") as f:  # v2: the whole subtree
            return b"populated 1" in f.read()
    except FileNotFoundError:
        pass
    except OSError:
        return True
    return any(WorkerCgroup(folder, 1).pids() for folder, _, _ in os.walk(path))  # v1: each cgroup's own


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _remove_tree(path: str, version: int) -> bool:
    """Kill everything in the worker cgroups below ``path`` and remove them and ``path`` (bounded: 1 s
    for killed processes to end). True when nothing is left."""
    try:
        children = [e.path for e in os.scandir(path) if e.is_dir()]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    groups = [WorkerCgroup(c, version) for c in children]
    for group in groups:
        group.kill()
    give_up = time.monotonic() + 1.0
    while True:
        groups = [g for g in groups if not g.remove()]
        if not groups or time.monotonic() > give_up:
            break
        time.sleep(0.005)  # SIGKILLed processes end within milliseconds: a bounded poll of the kernel
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _enable_controller(path: str, controller: str) -> bool:
    """Enable the v2 ``controller`` (``memory``, ``pids``) for the worker cgroups below the pool cgroup
    ``path``: in the subtrees of this process's own cgroup, of ``mjsched`` and of ``path`` (cgroups above
    this process's own are not touched: its own must offer the controller, and can enable it only if it
    holds no process other than at the root). False where it is not available."""
    levels = [os.path.dirname(os.path.dirname(path)), os.path.dirname(path), path]
    for level in levels:
        try:
            if controller not in _read(level, "cgroup.controllers").decode().split():
                return False
            if controller in _read(level, "cgroup.subtree_control").decode().split():
                continue
            _write(level, "cgroup.subtree_control", f"+{controller}")
        except OSError:
            return False
    return True
