"""Shared fixtures: a fresh SQLite store per test, the fixture plugins, and a bounded supervisor driver.
The suite runs in parallel (pytest-xdist): the ``serial`` group and the ``alone`` marker are in parallel.py."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fakes import FakePool, memory_store
from parallel import pytest_collection_modifyitems, pytest_configure, pytest_runtest_protocol, serial  # noqa: F401
from waiting import wait_gone  # noqa: F401 - re-exported for the tests that import it from here

from mjsched_isolated.config import Settings
from mjsched_isolated.store import Store, schema
from mjsched_isolated.supervisor import Supervisor, utcnow
from mjsched_isolated.supervisor.pool import Pool

FIXTURE_PLUGINS = str(Path(__file__).parent / "fixture_plugins")
UTC = dt.UTC


POSTGRES_URL = os.environ.get("MJSCHED_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("MJSCHED_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
# .ci/run sets this: there, a database server that cannot be reached fails the test instead of skipping it
REQUIRE_SERVERS = os.environ.get("MJSCHED_REQUIRE_SERVERS") == "1"
BACKENDS = ["sqlite", "postgresql", "mysql"]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mjsched.db'}"


def _server_or_skip(url: str) -> sa.engine.Engine:
    engine = sa.create_engine(url, pool_pre_ping=True)  # survives a server restart (tests/test_outage.py)
    try:
        with engine.connect():
            pass
    except Exception as exc:
        engine.dispose()
        message = f"database server {url} unreachable: {str(exc).splitlines()[0]}"
        if REQUIRE_SERVERS:
            pytest.fail(message)
        pytest.skip(message)
    return engine


@contextlib.contextmanager
def isolated_database(backend: str, tmp_path: Path):
    """A URL for an empty namespace of its own on ``backend``: a SQLite file, a fresh PostgreSQL schema
    (via search_path) or a fresh MySQL/MariaDB database; dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'mjsched.db'}"
        return
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = _server_or_skip(POSTGRES_URL if backend == "postgresql" else MYSQL_URL)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {name}" if backend == "postgresql" else f"CREATE DATABASE {name}")
    base = sa.engine.make_url(POSTGRES_URL if backend == "postgresql" else MYSQL_URL)
    url = (base.update_query_dict({"options": f"-csearch_path={name}"}) if backend == "postgresql"
           else base.set(database=name))
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {name} CASCADE" if backend == "postgresql" else f"DROP DATABASE {name}")
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def backend_url(request, tmp_path: Path):
    """Each test using this runs on SQLite, PostgreSQL and MySQL/MariaDB, each in a namespace of its own."""
    with isolated_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(params=["postgresql", "mysql"])
def server_store(request, tmp_path: Path):
    """An opened :class:`Store` on each database server (PostgreSQL, MySQL/MariaDB), in a namespace of its own."""
    with isolated_database(request.param, tmp_path) as url:
        store = Store.open(url)
        yield store
        store.close()


class _SharedNamespaces:
    """The migrated namespaces (one per backend) shared by this test process's ``shared_backend_url`` tests,
    each made on first use with an engine kept to empty it, and dropped at the end of the session."""

    def __init__(self, folder: pytest.TempPathFactory, stack: contextlib.ExitStack) -> None:
        self.folder, self.stack = folder, stack
        self.made: dict[str, tuple[str, sa.Engine]] = {}

    def emptied(self, backend: str) -> str:
        """The URL of ``backend``'s namespace, every table of the schema emptied (alembic's row stays)."""
        if backend not in self.made:
            url = self.stack.enter_context(isolated_database(backend, self.folder.mktemp(f"shared-{backend}")))
            engine = schema.create_engine(url)  # the migration, once
            self.stack.callback(engine.dispose)
            self.made[backend] = url, engine
        url, engine = self.made[backend]
        with engine.begin() as conn:
            for table in reversed(schema.metadata.sorted_tables):  # children before their parents
                conn.execute(table.delete())
        return url


@pytest.fixture(scope="session")
def _shared_namespaces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_SharedNamespaces]:
    with contextlib.ExitStack() as stack:
        yield _SharedNamespaces(tmp_path_factory, stack)


@pytest.fixture(params=BACKENDS)
def shared_backend_url(request, _shared_namespaces: _SharedNamespaces) -> str:
    """Like ``backend_url`` (each test on SQLite, PostgreSQL and MySQL/MariaDB), but a migrated namespace
    shared with this process's other such tests and emptied of rows before the test: a test that needs the
    schema, not an empty database, skips the migration (0.1-0.4 s a test idle, seconds on a loaded
    MariaDB). Ids are not reset: a test must not expect an id's value. Anything else a test adds to the
    namespace (a function, a table) it must remove itself."""
    return _shared_namespaces.emptied(request.param)


@pytest.fixture
def any_store(shared_backend_url: str):
    """A Store on ``shared_backend_url`` (emptied: SQLite, PostgreSQL, MySQL/MariaDB)."""
    s = Store.open(shared_backend_url)
    yield s
    s.close()


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, made once per test process: ``store`` copies it (a copy is ~1 ms, a
    migration 100-250 ms)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "mjsched.db"
    Store.open(f"sqlite:///{path}").close()
    assert not path.with_name(path.name + "-wal").exists()  # closed: everything is in the one file
    return path


@pytest.fixture
def store(db_url: str, tmp_path: Path, _sqlite_template: Path):
    """A Store on ``db_url``: a fresh migrated SQLite file of the test's own (a copy of the template)."""
    shutil.copyfile(_sqlite_template, tmp_path / "mjsched.db")
    s = Store.open(db_url)
    yield s
    s.close()


def add_job(store: Store, name: str, job_type: str, cron: str = "* * * * * *", *, now: dt.datetime | None = None,
            next_run_at: dt.datetime | None = None, **values) -> dict:
    """Insert an Active job due at ``next_run_at`` (default: now) and return its row."""
    now = now or utcnow()
    store.add_job({"name": name, "job_type": job_type, "cron_expression": cron, "status": "Active",
                   "next_run_at": next_run_at or now, **values}, now)
    return store.get_job(name)


class Driver:
    """Runs a Supervisor in this process, cycle by cycle (``Supervisor.cycle``: step, wait, events), like
    ``serve`` but without signals. The pool is a real spawn :class:`Pool` unless ``pool`` is given (the
    in-process :class:`fakes.FakePool`).

    ``until(cond, timeout_s)`` runs cycles until ``cond()`` holds; it fails the test if ``timeout_s`` passes
    first. Every wait is bounded; nothing sleeps.
    """

    def __init__(self, store: Store, db_url: str, *, pool=None, **settings) -> None:
        settings.setdefault("plugins_dir", FIXTURE_PLUGINS)
        settings.setdefault("max_concurrent_jobs", 2)
        self.settings = Settings(database_url=db_url, **settings)
        self.pool = pool if pool is not None else Pool.from_settings(self.settings)
        self.supervisor = Supervisor(self.settings, store, self.pool)

    @property
    def max_inflight(self) -> int:
        return self.supervisor.peak_inflight

    def start(self) -> Driver:
        self.pool.start()
        self.until(lambda: len(self.pool.idle_workers()) == self.pool.size, 30)
        return self

    def until(self, cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
        give_up = time.monotonic() + timeout_s
        while not cond():
            if self.supervisor.done:
                pytest.fail("supervisor stopped before the condition held")
            left = give_up - time.monotonic()
            if left <= 0:
                pytest.fail(f"condition not met within {timeout_s} s")
            self.supervisor.cycle(max_wait_s=left)

    def at(self, now: dt.datetime, mono: float) -> None:
        """One step at the given instant (database time, monotonic seconds), then the events the pool has
        now (a zero wait), handled at that instant: time passed in, for tests that choose it."""
        self.supervisor.step(now, mono)
        events, _ = self.pool.wait(0)
        self.supervisor.on_events(events, now)

    def timeline(self) -> Callable[[float], dt.datetime]:
        """``at(seconds)``: :meth:`at` the instant ``seconds`` after now, on both clocks alike (no jump);
        returns that instant. Never mix it with :meth:`until` (the real clocks) in one test phase."""
        self.supervisor.keep_lease(*self.supervisor.read_clock())  # registered: the database offset is measured
        now0, mono0 = self.supervisor.read_clock()
        # at(0) is just after every job a test added before (the offset estimate is within a millisecond)
        now0, mono0 = now0 + dt.timedelta(milliseconds=10), mono0 + 0.01

        def at(seconds: float) -> dt.datetime:
            now = now0 + dt.timedelta(seconds=seconds)
            self.at(now, mono0 + seconds)
            return now

        return at

    def close(self) -> None:
        self.pool.close()
        self.supervisor.liveness.stop()


@pytest.fixture
def mem_store():
    """A migrated store on an in-memory SQLite database of its own (see :func:`fakes.memory_store`)."""
    s = memory_store()
    yield s
    s.close()


@pytest.fixture
def fake_factory(mem_store: Store):
    """Like ``driver_factory``, on :class:`fakes.FakePool` (plugins run in this process) and ``mem_store``:
    for tests whose point is a supervisor decision. ``make(**settings)`` returns a started Driver."""
    made: list[Driver] = []

    def make(**settings) -> Driver:
        settings.setdefault("plugins_dir", FIXTURE_PLUGINS)
        settings.setdefault("max_concurrent_jobs", 2)
        pool = FakePool(settings["max_concurrent_jobs"], settings["plugins_dir"])
        d = Driver(mem_store, "sqlite://", pool=pool, **settings)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.close()


@pytest.fixture
def driver_factory(store: Store, db_url: str):
    made: list[Driver] = []

    def make(**settings) -> Driver:
        d = Driver(store, db_url, **settings)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.close()
