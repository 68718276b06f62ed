"""Fast stand-ins for the two things a supervisor decision test does not need for real.

- :class:`FakePool`: exactly the interface the supervisor uses of
  :class:`~mjsched_isolated.supervisor.pool.Pool`, with the plugin run *in this process* by the worker's own
  execution code (``mjsched_isolated.worker.main.run``, plugins loaded by ``worker.loader.load_plugins``),
  rq's ``SimpleWorker`` idea. A run can be *held* (not finished until the test says): the test then
  finishes it, beats its heartbeat or crashes its "worker" (an exit code or a signal, as a real pool
  reports a dead child). What a real child is needed for (killing a process tree, os._exit, a segfault,
  a plugin hanging at import, recycling, the watchdog's fence) stays in the end-to-end tests.
- :func:`memory_store`: a :class:`~mjsched_isolated.store.Store` on an in-memory SQLite database (one
  shared connection), copied from a template made once by the normal migration path (``migrate.prepare``):
  about 2 ms a store against 100-250 ms for migrating, 50-100 ms for ``create_all`` + ``stamp``.
"""

from __future__ import annotations

import functools
import itertools
import sqlite3
import threading
from collections.abc import Callable
from multiprocessing.connection import wait as wait_handles
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from mjsched_isolated import protocol
from mjsched_isolated.store import Store, migrate
from mjsched_isolated.supervisor.pool import ChildEvent
from mjsched_isolated.worker.execute import run as execute_run
from mjsched_isolated.worker.loader import Registry, load_plugins

FAKE_PID_BASE = 10_000_000  # above Linux's pid_max (2**22): a fake pid can never name a real process
_pids = itertools.count(FAKE_PID_BASE)


# -- the in-memory store ----------------------------------------------------------------------------------
def _memory_engine(creator: Callable[[], sqlite3.Connection] | None = None) -> sa.Engine:
    kwargs: dict[str, Any] = {"creator": creator} if creator is not None else {}
    engine = sa.create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False},
                              **kwargs)

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:
        dbapi_conn.execute("PRAGMA foreign_keys=ON")

    return engine


@functools.cache
def _template() -> sqlite3.Connection:
    """An in-memory database brought to head by the migrations, once per test session."""
    engine = _memory_engine()
    migrate.prepare(engine)
    conn = engine.raw_connection().driver_connection  # StaticPool: the one connection, kept open
    assert isinstance(conn, sqlite3.Connection)
    return conn


def memory_store() -> Store:
    """A fresh, migrated store on its own in-memory SQLite database (close it with ``Store.close``)."""
    template = _template()

    def copy() -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        template.backup(conn)
        return conn

    return Store(_memory_engine(copy))


# -- the in-process pool ----------------------------------------------------------------------------------
@functools.cache
def _registry(plugins_dir: str) -> Registry:
    """Plugins are imported into the test process once per folder (a real worker imports them each time)."""
    return load_plugins(plugins_dir)


class FakeWorker:
    """A pool slot's "child": ``pid`` is fake (never a real process), ``run`` the request it executes."""

    def __init__(self, slot: int, ready: protocol.Ready | None) -> None:
        self.slot = slot
        self.pid = next(_pids)
        self.ready: protocol.Ready | None = ready
        self.run: protocol.RunRequest | None = None
        self.runs_done = 0

    @property
    def idle(self) -> bool:
        return self.ready is not None and self.run is None


class _Value:
    def __init__(self, value: float) -> None:
        self.value = value


class _Collect:
    """The worker's sender, collecting what the run reports instead of writing it to a pipe."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, message: Any) -> None:
        self.messages.append(message)


class FakePool:
    """``size`` slots whose runs execute in this process, at the next :meth:`wait`, unless held.

    ``hold(*job_names)`` (no name: every job) keeps new runs of those jobs busy until :meth:`finish`,
    :meth:`crash` or a kill. ``beat(run_id)`` makes a held run send a heartbeat. ``submitted`` lists every
    request in order; ``killed`` the run ids the supervisor killed (``None`` for an idle worker),
    ``terminated`` those it sent SIGTERM.
    """

    def __init__(self, size: int, plugins_dir: str) -> None:
        self.size = size
        self.plugins_dir = plugins_dir
        self.registry = _registry(plugins_dir)
        self.workers: dict[int, FakeWorker | None] = {slot: None for slot in range(size)}
        self.on_respawn: Callable[[], None] | None = None
        self.refill = True
        self.fence_at = _Value(float("inf"))
        self.last_ready: protocol.Ready | None = None
        self.respawns = 0
        self.recycled = 0
        self.submitted: list[protocol.RunRequest] = []
        self.killed: list[int | None] = []
        self.terminated: list[int | None] = []  # run ids sent SIGTERM (at their deadline)
        self.kill_batches: list[list[int | None]] = []  # run ids of each kill_all call (kills done together)
        self.deadlines: dict[int, float] = {}  # run id -> the newest deadline sent to its worker (epoch s)
        self.cpu_s: float | None = None  # what tree_cpu_s says of every worker (None: not readable)
        self._holding: set[str] | None = set()  # job names held; None: every job
        self._held: dict[int, FakeWorker] = {}  # run id -> its worker
        self._to_run: list[FakeWorker] = []
        self._events: list[ChildEvent] = []
        self._finished: list[tuple[FakeWorker, list[Any]]] = []  # executed; reported at the next wait
        self._wakeup = threading.Event()
        self._starting = False  # True: new workers stay not ready (a real child importing) until ready_all()

    @classmethod
    def from_settings(cls, settings: Any) -> FakePool:
        return cls(settings.max_concurrent_jobs, settings.plugins_dir)

    # -- what the supervisor calls --------------------------------------------------------------------
    def start(self) -> None:
        for slot in self.workers:
            self._spawn(slot)

    def close(self, timeout_s: float = 5.0) -> None:
        self.refill = False
        self.workers = {slot: None for slot in self.workers}

    def containment(self) -> str:
        return "in-process fake workers: no isolation"

    def refills_at_once(self, _worker: FakeWorker) -> bool:
        return self.refill

    def idle_workers(self) -> list[FakeWorker]:
        return [w for w in self.workers.values() if w is not None and w.idle]

    def busy_workers(self) -> list[FakeWorker]:
        return [w for w in self.workers.values() if w is not None and w.run is not None]

    def submit(self, worker: FakeWorker, request: protocol.RunRequest) -> None:
        worker.run = request
        self.submitted.append(request)
        if self._holding is None or request.job_name in self._holding:
            self._held[request.run_id] = worker
        else:
            self._to_run.append(worker)

    def tree_cpu_s(self, _worker: FakeWorker) -> float | None:
        """The CPU seconds a test set in :attr:`cpu_s` (None by default: the supervisor watches nothing)."""
        return self.cpu_s

    def kill(self, worker: FakeWorker) -> protocol.RunRequest | None:
        run = worker.run
        self.killed.append(run.run_id if run is not None else None)
        if run is not None:
            self._held.pop(run.run_id, None)
        if worker in self._to_run:
            self._to_run.remove(worker)
        self._vacate(worker)
        return run

    def kill_all(self, workers: list[FakeWorker]) -> list[protocol.RunRequest | None]:
        self.kill_batches.append([w.run.run_id if w.run is not None else None for w in workers])
        return [self.kill(worker) for worker in workers]

    def terminate(self, workers: list[FakeWorker]) -> None:
        """SIGTERM: a held run keeps running (the test decides whether it ends: ``finish``, ``crash``)."""
        self.terminated.extend(w.run.run_id if w.run is not None else None for w in workers)

    def tell_deadline(self, worker: FakeWorker, run_id: int, deadline_at: float) -> None:
        """As the real pool: the run's plugin sees the new deadline when it executes (``deadlines``)."""
        if worker.run is not None and worker.run.run_id == run_id:
            self.deadlines[run_id] = deadline_at

    def wait(self, timeout_s: float, extra: Any = ()) -> tuple[list[ChildEvent], list[Any]]:
        """Execute the runs not held, then return every pending event at once (a worker is idle again
        once its result is returned, as with a real pool). With no event, block up to ``timeout_s``
        seconds on the ``extra`` handles, or until another thread finishes, beats or crashes a run."""
        while self._to_run:
            self._execute(self._to_run.pop(0))
        for worker, messages in self._finished:  # as a real pool: a worker is idle once its result is read
            if self.workers.get(worker.slot) is worker:
                worker.run = None
                worker.runs_done += 1
                self._events.extend(ChildEvent(worker=worker, message=m) for m in messages)
        self._finished = []
        if not self._events:
            extra = list(extra)
            if extra:
                return [], list(wait_handles(extra, timeout_s))
            self._wakeup.wait(timeout_s)
            self._wakeup.clear()
        events, self._events = self._events, []
        return events, list(wait_handles(list(extra), 0)) if extra else []

    # -- what the test calls --------------------------------------------------------------------------
    def hold(self, *job_names: str) -> None:
        """Keep new runs of ``job_names`` (none given: of every job) busy until the test ends them."""
        if not job_names:
            self._holding = None
        elif self._holding is not None:
            self._holding.update(job_names)

    def release_holds(self) -> None:
        """New runs execute again at once (held runs stay held)."""
        self._holding = set()

    def hold_ready(self) -> None:
        """Workers spawned from now on (a refill) stay *starting*, not ready, as a real child is while it
        imports the plugins, until :meth:`ready_all`."""
        self._starting = True

    def ready_all(self) -> None:
        """Every starting worker says Ready (its event comes at the next wait); new workers are ready again."""
        self._starting = False
        for worker in self.workers.values():
            if worker is not None and worker.ready is None:
                self._say_ready(worker)
        self._wakeup.set()

    @property
    def held(self) -> list[int]:
        """Run ids held now, oldest first."""
        return list(self._held)

    def finish(self, run_id: int) -> None:
        """Execute held run ``run_id`` now (the real execution code); its events come at the next wait."""
        self._execute(self._held.pop(run_id))
        self._wakeup.set()

    def beat(self, run_id: int, at: float = 0.0) -> None:
        """A heartbeat from held run ``run_id``."""
        self._events.append(ChildEvent(worker=self._held[run_id], message=protocol.Heartbeat(run_id=run_id, at=at)))
        self._wakeup.set()

    def crash(self, run_id: int, exitcode: int = -11) -> None:
        """Held run ``run_id``'s worker dies (``exitcode`` as multiprocessing reports it: -11 is SIGSEGV)."""
        worker = self._held.pop(run_id)
        self._events.append(ChildEvent(worker=worker, died=True, exitcode=exitcode, run=worker.run))
        self._vacate(worker)
        self._wakeup.set()

    # -- inside -----------------------------------------------------------------------------------------
    def _spawn(self, slot: int) -> FakeWorker:
        worker = FakeWorker(slot, None)
        self.workers[slot] = worker
        if not self._starting:
            self._say_ready(worker)
        return worker

    def _say_ready(self, worker: FakeWorker) -> None:
        ready = protocol.Ready(pid=0, plugins=self.registry.infos, failures=self.registry.failures)
        worker.ready = ready
        self.last_ready = ready
        self._events.append(ChildEvent(worker=worker, message=ready))

    def _vacate(self, worker: FakeWorker) -> None:
        if self.workers.get(worker.slot) is not worker:
            return
        self.workers[worker.slot] = None
        if self.refill:
            self._spawn(worker.slot)
            self.respawns += 1
            if self.on_respawn is not None:
                self.on_respawn()

    def _execute(self, worker: FakeWorker) -> None:
        request = worker.run
        assert request is not None
        sender = _Collect()
        finished = execute_run(self.registry, request, sender,  # type: ignore[arg-type]  # duck-typed sender
                               deadline_updates=lambda: self.deadlines.pop(request.run_id, None))
        self._finished.append((worker, [*sender.messages, finished]))
