"""The worker pool: N pre-started spawn children, one run at a time each, owned by the supervisor.

The pool knows processes and pipes, not the database. :meth:`Pool.wait` blocks on every child's pipe and
process sentinel at once (plus any extra wake-up handles) and returns :class:`ChildEvent` s. A child that
dies or must be killed costs only its own run: :meth:`Pool.kill` takes down its whole process tree and the
slot is refilled. A child that dies (or hangs past ``ready_timeout_s``) while importing a plugin module
names that module (children announce each import): the module is left out of every later child and
reported as a load failure, so only its own job types are lost; a SIGKILL, which may come from outside,
only the second time. A slot whose child keeps dying before it is ready for any other reason backs off
(1 s doubling to 60 s), so it cannot spin the supervisor.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import math
import multiprocessing
import os
import select
import shutil
import signal
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

from mjsched_isolated import cgroups, proctree, protocol
from mjsched_isolated.errors import ProtocolError
from mjsched_isolated.keptcopies import keep_copy
from mjsched_isolated.proctree import kill_tree, kill_trees
from mjsched_isolated.supervisor.recycling import recycle_reason
from mjsched_isolated.worker import main as child

if TYPE_CHECKING:
    from mjsched_isolated.config import Settings

log = logging.getLogger("mjsched.pool")

_ctx = multiprocessing.get_context("spawn")
MAX_RESPAWN_BACKOFF_S = 60.0
_swept = False  # remove_stale_keep_dirs ran in this process
RECYCLE_STOP_TIMEOUT_S = 10.0  # a recycled child that has not exited after Stop by then is killed
KEEP_DIR_PREFIX = "mjsched-plugins-good-"
PROBE_DIR_PREFIX = "mjsched-plugins-probe-"  # the reload probe's copies: never borrowed nor fallen back to
KEEP_LOCK = ".lock"  # held (flock) by the pool that owns the folder, see lock_keep_dir
STALE_DIR_MARGIN_S = 2.0  # psutil's process start time may be off by up to a second (boot time in seconds)


def wait_ready(handles: Sequence[Any], timeout_s: float | None) -> list[Any]:
    """``multiprocessing.connection.wait`` on POSIX (the same handles - objects with ``fileno()`` or file
    descriptors -, the same millisecond rounding up, any event counting as ready), without building a
    selector and its keys at every call: one ``select.poll`` (issue 11, the supervisor's loop runs this for
    every batch of results). Returns the ready handles."""
    poller = select.poll()
    by_fd: dict[int, list[Any]] = {}
    for handle in handles:
        fd = handle if isinstance(handle, int) else handle.fileno()
        if fd not in by_fd:
            poller.register(fd, select.POLLIN)
            by_fd[fd] = []
        by_fd[fd].append(handle)
    timeout_ms = None if timeout_s is None else math.ceil(max(0.0, timeout_s) * 1000)
    return [handle for fd, _ in poller.poll(timeout_ms) for handle in by_fd[fd]]


# a child whose pipe ended while it was not yet reapable gets this long to finish exiting (its own exit code,
# os._exit or a crash, is the truth) before it is killed as one that closed its pipe and runs on
EXITING_GRACE_S = 0.1


class Worker:
    """One slot's current child. ``run`` is the request it is executing (None when idle)."""

    def __init__(self, slot: int, process: BaseProcess, conn: protocol.Channel, started_mono: float) -> None:
        self.slot = slot
        self.process = process
        self.conn = conn
        self.started_mono = started_mono
        self.ready: protocol.Ready | None = None
        self.importing: str | None = None  # the plugin module being imported (before Ready)
        self.run: protocol.RunRequest | None = None
        self.runs_done = 0
        self.retiring: str | None = None  # the child said it exits after its last run, and why
        self.generation = 0  # the pool's plugin generation when it was spawned (see Pool.replace_all)
        self.pending = select.poll()  # its pipe alone: "is another message waiting?" in one call (_drain)
        self.pending.register(conn.fileno(), select.POLLIN)
        self.cgroup: cgroups.WorkerCgroup | None = None  # its own cgroup, if cgroups are used
        self.terminating: Any = None  # shared byte: set before SIGTERM at a deadline (worker/main.py _on_sigterm)
        self.oom_kills: int | None = None  # its cgroup's out-of-memory kills when its run (with a memory limit) began
        self.pipe_trouble: str | None = None  # why its pipe was given up (closed, garbage): it is killed if alive

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    @property
    def idle(self) -> bool:
        return self.ready is not None and self.run is None


class ChildEvent(msgspec.Struct):
    """Something a child did: sent ``message``, or died (``exitcode`` set; ``run`` was in flight;
    ``culprit``: the plugin module whose import it died in, now left out of later children; ``oom_killed``:
    the kernel killed a process in its cgroup at the run's memory limit during the run)."""

    worker: Any
    message: Any = None
    died: bool = False
    exitcode: int | None = None
    run: protocol.RunRequest | None = None
    culprit: str | None = None
    oom_killed: bool = False
    oom_evidence: bool | None = None
    # this pool killed the child, still alive when reaped, because of its pipe: why (else None)
    killed_for: str | None = None


def keep_dir_prefix(plugins_dir: str | None, *, probe: bool = False) -> str:
    """How the folders of last good plugin copies (:class:`Pool`'s ``keep_dir``) of ``plugins_dir`` (None:
    ``./plugins`` if it exists) start, for this user: each pool adds its process id, so that another pool
    of the same plugins folder on this machine finds them (:func:`borrow_good_copies`). ``probe``: the
    reload probe's folder, another prefix (nobody borrows copies not accepted yet)."""
    folder = plugins_dir if plugins_dir is not None else ("plugins" if os.path.isdir("plugins") else None)
    key = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()[:16] if folder is not None else "none"
    return f"{PROBE_DIR_PREFIX if probe else KEEP_DIR_PREFIX}{os.getuid()}-{key}-"


def lock_keep_dir(folder: str) -> int:
    """Lock ``folder`` (a pool's copies) for the life of this process: an ``flock`` on ``<folder>/.lock``,
    released by the kernel however the process ends, whatever its PID namespace (a ``serve`` that is PID 1
    of a container sharing ``/tmp``). The file gets its name once locked, so a sweep never finds it
    unlocked while its owner lives. Returns the descriptor to keep open (closed by :meth:`Pool.close`)."""
    temporary = os.path.join(folder, f"{KEEP_LOCK}.{os.getpid()}")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, os.path.join(folder, KEEP_LOCK))
    except OSError:
        os.close(fd)
        raise
    return fd


def _keep_dirs() -> list[tuple[os.DirEntry[str], int]]:
    """The folders of plugin copies (:func:`keep_dir_prefix`) in the temporary folder that this user owns and
    nobody else may write to, each with the process id in its name. One listing; [] if it fails."""
    uid = os.getuid()
    found = []
    try:
        with os.scandir(tempfile.gettempdir()) as entries:
            for entry in entries:
                base = next((p for p in (KEEP_DIR_PREFIX, PROBE_DIR_PREFIX) if entry.name.startswith(p)), None)
                if base is None:
                    continue
                fields = entry.name[len(base):].split("-")  # uid, plugins folder key, pid, mkdtemp's part
                if len(fields) < 4 or fields[0] != str(uid) or not fields[2].isdigit():
                    continue
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False) and info.st_uid == uid and not info.st_mode & 0o022:
                        found.append((entry, int(fields[2])))
    except OSError:
        pass
    return found


def _pool_alive(folder: str, pid: int, changed: float) -> bool:
    """Whether the pool that made ``folder`` (named with process id ``pid``, last changed at ``changed``,
    wall clock) still lives: its lock (:func:`lock_keep_dir`) is held; a folder made before the lock, when
    its process may be the one that made it (:func:`_owner_alive`)."""
    try:
        fd = os.open(os.path.join(folder, KEEP_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _owner_alive(pid, changed)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_stale_keep_dirs() -> int:
    """Remove the folders of plugin copies (:func:`_keep_dirs`) left by pools of this user whose process is
    gone (a ``serve`` killed with SIGKILL never runs :meth:`Pool.close`), as :func:`_pool_alive` judges: a
    folder with a lock file when its lock can be taken; one without (made before the lock) when its process
    id is not in use, or is in use by a process that started after the folder last changed (the id was
    reused). Returns the number removed."""
    removed = 0
    for entry, pid in _keep_dirs():
        with contextlib.suppress(OSError):
            if not _pool_alive(entry.path, pid, entry.stat(follow_symlinks=False).st_mtime):
                shutil.rmtree(entry.path)
                removed += 1
    return removed


def _owner_alive(pid: int, changed: float) -> bool:
    """Whether the process ``pid`` may be the one that made a folder last changed at ``changed`` (wall
    clock): it exists and started before that (a process started later got the id of a dead one)."""
    if not proctree.exists(pid):
        return False
    try:
        return psutil.Process(pid).create_time() <= changed + STALE_DIR_MARGIN_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def borrow_good_copies(prefix: str, into: str) -> int:
    """Copy into ``into`` the last good plugin copies kept by the live pools (:func:`_pool_alive`) whose
    folders (:func:`_keep_dirs`) start with ``prefix`` (:func:`keep_dir_prefix`), those written last
    winning. Returns the number of files copied."""
    found: list[tuple[int, str]] = []
    for entry, pid in _keep_dirs():
        with contextlib.suppress(OSError):
            info = entry.stat(follow_symlinks=False)
            if entry.name.startswith(prefix) and entry.path != into and _pool_alive(entry.path, pid, info.st_mtime):
                found.append((info.st_mtime_ns, entry.path))
    copied = 0
    for _, folder in sorted(found):
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if name.endswith(".py") and not name.startswith("."):  # not a copy being written
                    shutil.copyfile(os.path.join(folder, name), os.path.join(into, name))
                    copied += 1
    return copied


class Pool:
    """``size`` slots of worker children importing plugins from ``plugins_dir``.

    ``ready_timeout_s``: a child that has not said Ready by then (a plugin hanging at import) is killed
    and its slot backs off. ``max_tasks_per_child`` / ``max_memory_per_child_mb`` (None = off): a child
    over either limit after a run is recycled (see :mod:`recycling`): it gets no new run, is sent ``Stop``
    (killed if still alive after ``RECYCLE_STOP_TIMEOUT_S``), and its slot is refilled at once, without
    the crash backoff. ``keep_good_plugins``: keep the last good copy of each local plugin module in a
    temporary folder (made by :meth:`start`, removed by :meth:`close`) for refilled workers to import when
    the file no longer does (see :mod:`~mjsched_isolated.worker.loader`); False for the reload probe.
    ``borrow_good_plugins`` (``jobs run``): start that folder with the copies kept by the live pools of the
    same plugins folder on this machine (a ``serve`` that refused a reload), so a manual run has the job
    types that ``serve``'s refilled workers have (:func:`borrow_good_copies`).
    All methods are called from the supervisor's single thread.
    """

    def __init__(self, size: int, plugins_dir: str | None, *, log_level: int = logging.INFO,
                 ready_timeout_s: float = 30.0, import_timeout_s: float = 10.0, max_tasks_per_child: int | None = None,
                 max_memory_per_child_mb: float | None = None, log_format: str = "text",
                 max_run_output_bytes: int = 4 * 1024 * 1024, cgroups_mode: str = "auto",
                 keep_good_plugins: bool = True, borrow_good_plugins: bool = False, probe: bool = False):
        if size < 1:
            raise ValueError("max_concurrent_jobs must be >= 1")
        self.size = size
        # None: the children load ./plugins if it exists, and the built-ins always (worker/loader.py)
        self.plugins_dir = os.path.abspath(plugins_dir) if plugins_dir is not None else None
        self.log_level = log_level
        self.log_format = log_format  # children log in the supervisor's format (see logs.py)
        self.max_run_output_bytes = max_run_output_bytes  # per run, kept by the child (worker/output.py)
        self.ready_timeout_s = ready_timeout_s
        self.import_timeout_s = import_timeout_s
        self.workers: dict[int, Worker | None] = {slot: None for slot in range(size)}
        self._backoff_s: dict[int, float] = {slot: 0.0 for slot in range(size)}
        self._respawn_at: dict[int, float] = {slot: 0.0 for slot in range(size)}
        self.respawns = 0
        self.on_respawn: Callable[[], None] | None = None  # called after each respawn (metrics)
        self.refill = True  # False while shutting down: dead slots stay empty
        self.reaped_at: float | None = None  # the wall clock (epoch s) when kill_all had reaped its workers
        # monotonic time after which busy children kill themselves (the supervisor's lease is not trusted
        # any more); infinite until a supervisor with a liveness lease sets it
        self.fence_at = _ctx.RawValue("d", math.inf)
        self.last_ready: protocol.Ready | None = None
        self.max_tasks_per_child = max_tasks_per_child
        self.max_memory_per_child_mb = max_memory_per_child_mb
        self.recycled = 0
        self._retiring: list[tuple[Worker, float]] = []  # recycled children told to Stop: (worker, kill after)
        self._warned: set[str] = set()  # plugin-load warnings already logged
        self._fallbacks_logged: set[str] = set()  # since the last reload event (see reload_event)
        self.fatal_modules: dict[str, str] = {}  # plugin file -> why later children do not import it
        # plugin files a child was SIGKILLed while importing, once: left out only if it happens again
        self.killed_importing: set[str] = set()
        # PID 1 (a container without an init) inherits every orphan of the host's processes: the watchdog
        # and grandchildren of a killed worker. It must reap them or zombies pile up (see _reap_orphans).
        self.reap_orphans = os.getpid() == 1
        self.orphans_reaped = 0
        self.generation = 0  # plugin code generation; replace_all() moves it on (supervisor/reload.py)
        self.cgroups_mode = cgroups_mode  # [isolation] cgroups: auto, v2, v1 or off
        self.cgroups: cgroups.Parent | None = None  # opened by start(): the workers' parent cgroup (or why none)
        self._cgroups_to_remove: list[cgroups.WorkerCgroup] = []  # killed, not empty yet: removed when they are
        # the last good copy of each local plugin module, imported by a refilled worker when the file on disk
        # no longer imports (a reload refused, see supervisor/reload.py and worker/loader.py); made by start()
        self.keep_good_plugins = keep_good_plugins
        self.borrow_good_plugins = borrow_good_plugins
        self.probe = probe  # the reload probe: its copies start empty (no fallback), under PROBE_DIR_PREFIX
        self.keep_dir: str | None = None
        self._keep_lock: int | None = None  # the descriptor holding keep_dir's lock (lock_keep_dir)

    @classmethod
    def from_settings(cls, settings: Settings, *, size: int | None = None, ready_timeout_s: float | None = None,
                      log_level: int | None = None, borrow_good_plugins: bool = False) -> Pool:
        """The one way a pool is built from :class:`~mjsched_isolated.config.Settings`: every setting that
        concerns workers (plugins folder, import and ready timeouts, recycling, log format) is applied, so
        ``serve``, ``jobs run`` and the CLI's plugin checks load plugins alike. ``size`` defaults to
        ``max_concurrent_jobs``; ``log_level`` to the root logger's level; ``borrow_good_plugins``: see the
        class."""
        return cls(size if size is not None else settings.max_concurrent_jobs, settings.plugins_dir,
                   log_level=logging.getLogger().level if log_level is None else log_level,
                   ready_timeout_s=settings.worker_ready_timeout_s if ready_timeout_s is None else ready_timeout_s,
                   import_timeout_s=settings.plugin_import_timeout_s,
                   max_tasks_per_child=settings.recycling.max_tasks_per_child,
                   max_memory_per_child_mb=settings.recycling.max_memory_per_child_mb,
                   log_format=settings.log_format, max_run_output_bytes=settings.max_run_output_bytes,
                   cgroups_mode=settings.isolation.cgroups, borrow_good_plugins=borrow_good_plugins)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn a child in every empty slot (a second call spawns none: ``serve`` may start the pool early,
        while it waits for the database)."""
        if self.reap_orphans:
            log.info("running as PID 1 (no init): orphaned processes that reach this process are reaped")
        if self.cgroups is None:
            self.cgroups = cgroups.Parent.open(self.cgroups_mode)
        if self.keep_good_plugins and self.keep_dir is None:
            global _swept
            if not _swept:  # once per process: the folders of killed pools
                _swept = True
                remove_stale_keep_dirs()
            prefix = keep_dir_prefix(self.plugins_dir, probe=self.probe)
            self.keep_dir = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
            with contextlib.suppress(OSError):  # without the lock the folder is judged by its process id
                self._keep_lock = lock_keep_dir(self.keep_dir)
            if self.borrow_good_plugins:
                borrow_good_copies(prefix, self.keep_dir)
        for slot, worker in self.workers.items():
            if worker is None:
                self._spawn(slot)

    def containment(self) -> str:
        """How this pool's workers contain what runs leave behind (the start line of ``serve``)."""
        return proctree.containment(self.cgroups.describe() if self.cgroups is not None else None)

    def _spawn(self, slot: int) -> Worker:
        parent_conn, child_conn = protocol.channel_pair(_ctx)
        group = self.cgroups.create(slot) if self.cgroups is not None else None
        terminating = _ctx.RawValue("b", 0)
        process = _ctx.Process(target=child.main, args=(child_conn, self.plugins_dir, os.getpid(), self.log_level,
                                                           self.import_timeout_s, self.fence_at, self.log_format,
                                                           dict(self.fatal_modules), self.max_run_output_bytes,
                                                           group, terminating, self.keep_dir),
                               name=f"mjsched-worker-{slot}", daemon=False)
        with _worker_main_module():
            process.start()
        child_conn.close()
        if group is not None:
            try:  # at once, while the new interpreter starts: it joins again itself before it forks anything
                group.join(process.pid or 0)
            except OSError as exc:
                log.warning("worker %d could not be moved into its cgroup %s (%s); it runs without",
                            process.pid, group.kill_dir, exc)
                group.remove()
                group = None
        worker = Worker(slot, process, parent_conn, time.monotonic())
        worker.cgroup = group
        worker.terminating = terminating
        worker.generation = self.generation
        self.workers[slot] = worker
        return worker

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask idle children to stop, kill the rest (busy, or not ready yet), and reap them all
        (bounded by ``timeout_s``)."""
        self.refill = False
        live = [w for w in self.workers.values() if w is not None] + [w for w, _ in self._retiring]
        self._retiring = []
        for worker in live:
            if worker.idle:
                try:
                    protocol.send(worker.conn, protocol.Stop())
                except OSError:
                    pass
            else:
                self._kill_tree(worker)
        deadline = time.monotonic() + timeout_s
        for worker in live:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                self._kill_tree(worker)
                worker.process.join(1.0)
            worker.conn.close()
            self._release_cgroup(worker)
        self.workers = {slot: None for slot in self.workers}
        if self.cgroups is not None:
            left = self.cgroups.close()  # every worker cgroup, and the pool's own, removed
            if left:
                log.warning("cgroups %s could not be removed: processes in them did not end", ", ".join(left))
            self.cgroups = None
            self._cgroups_to_remove = []
        if self.keep_dir is not None:
            shutil.rmtree(self.keep_dir, ignore_errors=True)
            self.keep_dir = None
        if self._keep_lock is not None:
            os.close(self._keep_lock)
            self._keep_lock = None

    # -- dispatch --------------------------------------------------------------------------------
    def refills_at_once(self, worker: Worker) -> bool:
        """Whether ``worker``'s slot is refilled as soon as it is killed (a kill sets no backoff; an earlier
        death before Ready may have)."""
        return self.refill and self._backoff_s[worker.slot] == 0

    def idle_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w is not None and w.idle]

    def busy_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w is not None and w.run is not None]

    def submit(self, worker: Worker, request: protocol.RunRequest) -> None:
        """Hand ``request`` to an idle ``worker``. Raises ``OSError`` if its pipe is broken."""
        worker.run = request
        worker.oom_kills = None
        if worker.cgroup is not None and request.limits is not None and request.limits.max_memory_mb is not None:
            worker.oom_kills = worker.cgroup.oom_kills()  # one small read, only for runs with a memory limit
        protocol.send(worker.conn, request)

    @staticmethod
    def tree_cpu_s(worker: Worker) -> float | None:
        """CPU seconds used so far by ``worker``'s whole process tree: its cgroup's (v2 ``cpu.stat``, every
        process that was ever in it, whatever its session) where it has one, else the worker and its
        descendants from /proc, psutil elsewhere (:func:`~mjsched_isolated.proctree.tree_cpu_s`: 10 us for
        a cgroup, about 0.1-0.4 ms for a small tree). None if unreadable (the worker is gone)."""
        if worker.cgroup is not None:
            used = worker.cgroup.cpu_s()
            if used is not None:
                return used
        return proctree.tree_cpu_s(worker.pid)

    def tell_deadline(self, worker: Worker, run_id: int, deadline_at: float) -> None:
        """Tell busy ``worker`` that run ``run_id``'s deadline moved to ``deadline_at`` (epoch seconds): its
        plugin's ``context.deadline_at`` follows. Nothing if the worker no longer runs it; a broken pipe is
        ignored (the child's death is reported by :meth:`wait`)."""
        if worker.run is None or worker.run.run_id != run_id:
            return
        try:
            protocol.send(worker.conn, protocol.DeadlineExtended(run_id=run_id, deadline_at=deadline_at))
        except OSError:
            pass

    # -- events ----------------------------------------------------------------------------------
    def wait(self, timeout_s: float, extra: Sequence[Any] = ()) -> tuple[list[ChildEvent], list[Any]]:
        """Block up to ``timeout_s`` for child messages, child deaths or a ready ``extra`` handle.

        Returns (child events, the ``extra`` handles that are ready). Also refills slots whose backoff
        has passed and kills children that never became ready.
        """
        self._maintain()
        by_handle: dict[Any, Worker] = {}
        for worker in self.workers.values():
            if worker is not None:
                by_handle[worker.conn] = worker
                by_handle[worker.process.sentinel] = worker
        timeout_s = min(max(0.0, timeout_s), self._next_maintenance_in())
        ready = wait_ready([*by_handle, *extra], timeout_s)
        events: list[ChildEvent] = []
        for worker in {by_handle[h].slot: by_handle[h] for h in ready if h in by_handle}.values():
            if self.workers.get(worker.slot) is not worker:
                continue
            runs_before = worker.runs_done
            eof = self._drain(worker, events)  # messages first, so a final RunFinished is never lost
            if worker.retiring is not None and worker.idle:  # it exits by itself: no run, no death to report
                self._retire(worker, f"replaced: {worker.retiring}", stop=False)
            elif eof or worker.process.sentinel in ready:
                events.append(self._reap(worker))
            elif worker.runs_done > runs_before and worker.idle:
                self._recycle_if_due(worker)
        self._retire_stale()
        return events, [h for h in ready if h in extra]

    def _drain(self, worker: Worker, events: list[ChildEvent]) -> bool:
        """Append every pending message of ``worker`` to ``events``; True if its pipe reached EOF."""
        try:
            while worker.pending.poll(0):  # a message, or EOF (recv then raises EOFError)
                message = protocol.decode_to_supervisor(worker.conn.recv_bytes())
                if isinstance(message, protocol.Importing):
                    worker.importing = message.module
                    continue
                if isinstance(message, protocol.Ready):
                    worker.importing = None
                    worker.ready = message
                    for failure in message.failures:  # a hung import thread may still end the worker later
                        if failure.import_timed_out and failure.module not in self.fatal_modules:
                            self.fatal_modules[failure.module] = failure.error + "; left out of later workers"
                    for warning in message.warnings:  # e.g. a local plugin overriding a built-in: said once
                        if warning not in self._warned:
                            self._warned.add(warning)
                            log.warning("%s", warning)
                    for fallback in message.fallbacks:  # a broken module on disk, its last good copy loaded
                        if fallback not in self._fallbacks_logged:
                            self._fallbacks_logged.add(fallback)
                            log.error("worker %d: %s", message.pid, fallback)
                    self.last_ready = message
                    self._backoff_s[worker.slot] = 0.0
                    self.killed_importing -= {p.module for p in message.plugins}  # it imports: not a suspect
                elif isinstance(message, protocol.RunFinished) and worker.run and message.run_id == worker.run.run_id:
                    worker.run = None
                    worker.runs_done += 1
                    worker.retiring = message.retiring
                events.append(ChildEvent(worker=worker, message=message))
        except (EOFError, OSError):
            worker.pipe_trouble = "its pipe to the supervisor was closed or broke"
            return True
        except ProtocolError:
            log.exception("worker slot %d: child %d sent an undecodable message; replacing it", worker.slot, worker.pid)
            worker.pipe_trouble = "it sent an undecodable message on its pipe to the supervisor"
            return True
        return False

    def _reap(self, worker: Worker) -> ChildEvent:
        """Record a dead (or misbehaving) child, clean up its tree, and schedule the slot's refill.
        ``is_alive`` never blocks; a child still alive here (garbage on its pipe, or a plugin writing into
        the sentinel pipe) is killed before it is joined, so ``join`` cannot hang on it."""
        killed_for = None
        # its pipe ended first: an exiting child is a zombie within moments. Polled (is_alive never blocks),
        # not joined: join() waits for the exit once the sentinel reads ready, and a child that closed its own
        # end of the sentinel is still running
        give_up = time.monotonic() + EXITING_GRACE_S
        while worker.process.is_alive() and time.monotonic() < give_up:
            time.sleep(0.005)
        if worker.process.is_alive():  # still running without its pipe (closed it, or garbage on it)
            self._kill_tree(worker)
            # no trouble read on its pipe: its end of the exit sentinel (a pipe too) was closed while it ran
            killed_for = worker.pipe_trouble or "its pipe to the supervisor was closed or broke"
        worker.process.join(2.0)
        kill_tree(worker.pid)  # grandchildren left behind in its process group
        # the cgroup's out-of-memory kills since the run began (since the worker began for a run without a
        # memory limit: its cgroup is new with each worker); None: no memory accounting to tell
        counted = worker.cgroup.oom_kills() if worker.run is not None and worker.cgroup is not None else None
        oom_evidence = None if counted is None else counted > (worker.oom_kills or 0)
        oom_killed = bool(oom_evidence) and worker.oom_kills is not None
        self._release_cgroup(worker)  # and in its cgroup, whatever their session (a worker killed from outside)
        worker.conn.close()
        code = worker.process.exitcode
        culprit = self._blame_import(worker, f"importing it ended the worker process ({describe_exit(code)})", code)
        event = ChildEvent(worker=worker, died=True, exitcode=code, run=worker.run, culprit=culprit,
                           oom_killed=oom_killed, oom_evidence=oom_evidence, killed_for=killed_for)
        self._vacate(worker, died_before_ready=worker.ready is None and culprit is None)
        return event

    def _kill_tree(self, worker: Worker, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``worker``'s cgroup (every process in it, whatever its session or parent), then
        to its process tree (what the cgroup may have missed: a worker that could not join it)."""
        if worker.cgroup is not None:
            if sig == signal.SIGKILL:
                worker.cgroup.kill()
            else:
                worker.cgroup.signal(sig)
                return  # the tree is in the cgroup: signalled once only (a plugin's handler runs once)
        kill_tree(worker.pid, sig)

    def _release_cgroup(self, worker: Worker) -> None:
        """After ``worker`` was reaped: kill what is left in its cgroup (a ``setsid`` grandchild of a worker
        killed from outside) and remove the cgroup, at once or, while the killed processes end, from
        :meth:`_maintain`."""
        group, worker.cgroup = worker.cgroup, None
        if group is None:
            return
        group.kill()
        if not group.remove():
            self._cgroups_to_remove.append(group)

    def _remove_cgroups(self) -> None:
        self._cgroups_to_remove = [g for g in self._cgroups_to_remove if not g.remove()]

    def _blame_import(self, worker: Worker, why: str, exitcode: int | None = None) -> str | None:
        """If ``worker`` died while importing a plugin module, leave that module out of later children and
        return its file name (the slot is then refilled at once: the next child will get further). A SIGKILL
        (``exitcode`` -9) is not blamed on the module the first time: it may come from outside (the
        out-of-memory killer for another process's memory, an operator, a watchdog reading another /proc);
        the next child imports the module again, and a second SIGKILL there leaves it out."""
        module = worker.importing if worker.ready is None else None
        if module is None:
            return None
        if exitcode == -signal.SIGKILL and module not in self.killed_importing:
            self.killed_importing.add(module)
            log.warning("worker slot %d: child %d was killed (SIGKILL) while importing plugin module %s; not "
                        "blamed on the module yet: the next worker imports it again (left out if that is killed "
                        "too)", worker.slot, worker.pid, module)
            return None
        self.fatal_modules[module] = f"{why}; it is left out of later workers of this process"
        log.error("plugin module %s: %s; its job types are unavailable, the others load without it",
                  module, why)
        return module

    def kill(self, worker: Worker) -> protocol.RunRequest | None:
        """Kill ``worker``'s whole process tree now and refill its slot. Returns the run it had."""
        return self.kill_all([worker])[0]

    def kill_all(self, workers: list[Worker]) -> list[protocol.RunRequest | None]:
        """Kill the process trees of ``workers`` together (every SIGKILL is sent before any is waited for:
        kills that fall due together are not serialised behind each other's reaping), then reap them and
        refill their slots. Returns the run each had, in order."""
        runs = [w.run for w in workers]
        for worker in workers:
            if worker.cgroup is not None:
                worker.cgroup.kill()
        kill_trees([w.pid for w in workers if w.cgroup is None])
        for worker in workers:
            worker.process.join(2.0)
            worker.conn.close()
            self._release_cgroup(worker)
            self._vacate(worker, died_before_ready=False, maintain=False)
        self.reaped_at = time.time()  # dead by then (a run claimed ahead, dead before its instant, never started)
        if workers:
            self._maintain()
        return runs

    def terminate(self, workers: list[Worker]) -> None:
        """Send SIGTERM to the process trees of ``workers`` (a plugin's SIGTERM handler and its commands'
        get the chance to clean up; a plugin without a handler of its own is ended at once: the worker
        raises ``Terminated`` in it, see ``worker/main.py``). Does not wait: the caller kills what is still
        running after its grace (:meth:`kill_all`)."""
        for worker in workers:
            if worker.terminating is not None:
                worker.terminating.value = 1
        for worker in workers:
            if worker.cgroup is not None:
                worker.cgroup.signal(signal.SIGTERM)
        kill_trees([w.pid for w in workers if w.cgroup is None], signal.SIGTERM)

    def adopt_good_copies(self, folder: str | None) -> int:
        """Make the plugin copies of ``folder`` (the accepted reload probe's: the bytes it imported) this
        pool's last good copies, before its workers are replaced: a worker refilled from then on falls back
        to the accepted version, whatever is saved next. A copy kept since the probe read its file (a newer
        version) stays. Returns the number of copies taken."""
        if self.keep_dir is None or folder is None:
            return 0
        taken = 0
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(".py") and not entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        source, read_ns = Path(entry.path).read_bytes(), entry.stat().st_mtime_ns
                        taken += keep_copy(Path(self.keep_dir) / entry.name, source, read_ns)
        return taken

    def reload_event(self) -> None:
        """A reload was accepted or refused: the next fallback of a refilled worker to a last good copy is
        logged again (once per text per reload event), even with the text logged at an earlier one."""
        self._fallbacks_logged.clear()

    def replace_all(self) -> None:
        """New plugin code: every worker is replaced by one that imports it, an idle one at once, a busy
        one when its run ends (its result is read first); refilled slots import the code then on disk."""
        self.generation += 1
        self._retire_stale()

    def _retire_stale(self) -> None:
        for worker in list(self.workers.values()):
            if worker is not None and worker.idle and worker.generation != self.generation:
                self._retire(worker, "replaced to load the new plugin code")

    def _recycle_if_due(self, worker: Worker) -> None:
        """Between runs: retire ``worker`` if it is over a recycling limit (it gets no new run: its slot is
        vacated before the caller dispatches again), ask it to stop, and refill the slot at once."""
        reason = recycle_reason(worker.pid, worker.runs_done, self.max_tasks_per_child, self.max_memory_per_child_mb)
        if reason is None:
            return
        self.recycled += 1
        self._retire(worker, f"recycled {reason}")

    def _retire(self, worker: Worker, why: str, *, stop: bool = True) -> None:
        """Vacate ``worker``'s slot (refilled at once), send it ``Stop`` unless it exits by itself, and join
        it later (killed if still alive after ``RECYCLE_STOP_TIMEOUT_S``)."""
        log.info("worker %d %s", worker.pid, why)
        if stop:
            try:
                protocol.send(worker.conn, protocol.Stop())
            except OSError:
                pass
        self._retiring.append((worker, time.monotonic() + RECYCLE_STOP_TIMEOUT_S))
        self._vacate(worker, died_before_ready=False)

    def _reap_retiring(self, now: float) -> None:
        """Join recycled children that exited; kill (whole tree) those still alive past their bound."""
        still = []
        for worker, kill_after in self._retiring:
            if worker.process.is_alive():  # non-blocking; reaps an exited child
                if now < kill_after:
                    still.append((worker, kill_after))
                    continue
                log.warning("recycled worker %d did not stop within %.0f s; killing it", worker.pid,
                            RECYCLE_STOP_TIMEOUT_S)
                self._kill_tree(worker)  # still our unreaped child: its pid cannot have been reused
            worker.process.join(1.0)
            worker.conn.close()
            self._release_cgroup(worker)
        self._retiring = still

    def _vacate(self, worker: Worker, died_before_ready: bool, maintain: bool = True) -> None:
        slot = worker.slot
        self.workers[slot] = None
        if died_before_ready:
            self._backoff_s[slot] = min(MAX_RESPAWN_BACKOFF_S, max(1.0, self._backoff_s[slot] * 2))
            log.error("worker slot %d: child %d exited before it was ready (exit code %s); retrying in %.0f s",
                      slot, worker.pid, worker.process.exitcode, self._backoff_s[slot])
        self._respawn_at[slot] = time.monotonic() + self._backoff_s[slot]
        if maintain:  # refill at once (unless _maintain itself is the caller)
            self._maintain()

    def _reap_orphans(self) -> None:
        """Reap exited children that are not this pool's workers (nor another ``multiprocessing`` child,
        whose exit code its owner reads): orphans re-parented to this process as PID 1 or a subreaper.
        A few reads of ``/proc/self``; only when :attr:`reap_orphans` (never in an application that owns
        other children, whose exit status a blind ``waitpid`` would steal)."""
        children = proctree.own_children()
        if not children:
            return
        known = {w.pid for w in self.workers.values() if w is not None} | {w.pid for w, _ in self._retiring}
        strays = children - known
        if strays:
            strays -= {p.pid for p in multiprocessing.active_children()}
            self.orphans_reaped += len(strays - proctree.reap(strays))

    def _maintain(self) -> None:
        now = time.monotonic()
        if self.reap_orphans:
            self._reap_orphans()
        if self._retiring:
            self._reap_retiring(now)
        if self._cgroups_to_remove:
            self._remove_cgroups()
        vacated = False
        for slot in list(self.workers):
            worker = self.workers[slot]
            if worker is None and self.refill and now >= self._respawn_at[slot]:
                self._spawn(slot)
                self.respawns += 1
                if self.on_respawn is not None:
                    self.on_respawn()
            elif worker is not None and worker.ready is None and now - worker.started_mono > self.ready_timeout_s:
                log.error("worker slot %d: child %d not ready after %.0f s (a plugin hangs at import?); killing it",
                          slot, worker.pid, self.ready_timeout_s)
                self._kill_tree(worker)
                worker.process.join(1.0)
                worker.conn.close()
                self._release_cgroup(worker)
                culprit = self._blame_import(
                    worker, f"its import had not finished after {self.ready_timeout_s:g} s (the worker was killed)")
                self._vacate(worker, died_before_ready=culprit is None, maintain=False)
                vacated = True
        if vacated:
            self._maintain()  # refill what was just vacated (a second pass kills nothing new)

    def _next_maintenance_in(self) -> float:
        now = time.monotonic()
        times = [self._respawn_at[s] - now for s, w in self.workers.items() if w is None and self.refill]
        times += [w.started_mono + self.ready_timeout_s - now for w in self.workers.values()
                  if w is not None and w.ready is None]
        times += [kill_after - now for _, kill_after in self._retiring]
        if self._cgroups_to_remove:  # killed processes end within milliseconds: look again soon
            times.append(0.05)
        return max(0.0, min(times, default=3600.0))


# The module a spawned worker runs as its ``__main__``: the worker's own entry module, not the parent's.
WORKER_MAIN = "mjsched_isolated.worker.main"


@contextlib.contextmanager
def _worker_main_module() -> Iterator[None]:
    """While a worker is spawned, present :data:`WORKER_MAIN` as the parent's ``__main__``.

    The spawn start method re-runs the parent's main module in every child (as ``__mp_main__``) so that
    pickled references into it resolve: for ``serve`` that re-imported the ``mjsched`` console script, and
    for an application using :class:`~mjsched_isolated.Client` it re-ran the application itself (its
    imports, and all its top-level code without an ``if __name__ == "__main__"`` guard, which crashed).
    A worker needs nothing from the parent's main module (its target is ``worker.main.main``), so the
    preparation data names the worker's entry module instead (``multiprocessing.spawn`` reads
    ``sys.modules["__main__"].__spec__.name``, synchronously, inside ``Process.start``).
    """
    real = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = importlib.util.find_spec(WORKER_MAIN)
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def describe_exit(code: int | None) -> str:
    """``-11`` -> ``"killed by signal SIGSEGV"``, ``3`` -> ``"exit code 3"`` (multiprocessing's exitcode)."""
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
