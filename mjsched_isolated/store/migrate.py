"""Schema migrations: Alembic, configured in code, scripts shipped in ``mjsched_isolated/store/migrations``.

Revisions are ``0001`` (baseline: jobs, runs, supervisors), ``0002`` (notifications), ... - a linear
history, one file ``versions/NNNN_slug.py`` each (:func:`new_revision`). A database is in one of the
states of :class:`SchemaStatus`:

* ``empty`` (none of our tables): :func:`prepare` brings it to head the first time it is opened.
* ``legacy`` (tables made by ``create_all`` before migrations existed, no ``alembic_version``):
  recognised as the revision its tables match (``0001``, or ``0002`` for a build between the two);
  :func:`upgrade` stamps it so, then migrates it.
* ``outdated`` / ``unknown`` (a revision newer than this code): refused with :class:`SchemaError`
  until ``python -m mjsched_isolated db upgrade`` (or ``serve --auto-upgrade``); nothing is written.
* ``current``.

Race safety (several supervisors starting together on an empty database): every change runs on one
connection holding a lock, and the state is read again under it - PostgreSQL
``pg_advisory_xact_lock`` (per schema, transactional DDL: all or nothing), MySQL/MariaDB ``GET_LOCK``
(per database; its DDL commits as it goes), SQLite ``BEGIN IMMEDIATE`` (the database's write lock).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from mjsched_isolated.errors import MjschedError

log = logging.getLogger("mjsched.migrate")
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
BASELINE = "0001"
BASELINE_TABLES = frozenset({"jobs", "runs", "supervisors"})  # what create_all made before migrations
LOCK_TIMEOUT_S = 60
UPGRADE_HINT = "run `python -m mjsched_isolated db upgrade` (or serve --auto-upgrade)"

State = Literal["empty", "legacy", "outdated", "current", "unknown"]


class SchemaError(MjschedError):
    """The database's schema is not the one this code needs (outdated or newer); the message says what
    to run. The CLI exits 2 on it."""


class SchemaStatus(msgspec.Struct, frozen=True):
    """``current``: the database's revision (``"0001"`` for a legacy database, None when empty);
    ``head``: this code's newest revision; ``state``: see the module docstring."""

    current: str | None
    head: str
    state: State

    @property
    def up_to_date(self) -> bool:
        return self.state == "current"

    def message(self) -> str:
        """One line for an operator: where the schema is and what to do."""
        if self.state == "unknown":
            return (f"database schema is at revision {self.current}, which this version does not know (it "
                    f"needs {self.head}): the database was upgraded by a newer mjsched_isolated; run that version")
        if self.state == "current":
            return f"database schema is at revision {self.current} (head): up to date"
        if self.state == "legacy" and self.current == self.head:
            return (f"database schema has no version stamp (made before migrations; its tables match revision "
                    f"{self.current}, what this version needs): {UPGRADE_HINT} to stamp it")
        return (f"database schema is at revision {self.current or 'none (empty database)'}, this version "
                f"needs {self.head}: {UPGRADE_HINT}")


def config(connection: Connection | None = None) -> Config:
    """An Alembic :class:`Config` built in code (no alembic.ini): the packaged scripts, files named
    ``NNNN_slug.py``; ``connection`` (if given) is what env.py migrates."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head_revision() -> str:
    """This code's newest revision id, e.g. ``"0002"``."""
    head = _scripts().get_current_head()
    if head is None:
        raise RuntimeError("the migrations folder has no revision")  # a broken checkout, not user input
    return head


def _status(conn: Connection) -> SchemaStatus:
    head = head_revision()
    tables = set(sa.inspect(conn).get_table_names())
    if "alembic_version" in tables:
        current = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    elif tables & BASELINE_TABLES:
        return SchemaStatus(_legacy_revision(conn, tables), head, "legacy")
    else:
        current = None
    if current is None:
        return SchemaStatus(None, head, "empty")
    if current == head:
        return SchemaStatus(current, head, "current")
    try:
        _scripts().get_revision(current)
    except Exception:  # noqa: BLE001 - alembic raises several kinds for an id it does not have
        return SchemaStatus(current, head, "unknown")
    return SchemaStatus(current, head, "outdated")


def _legacy_revision(conn: Connection, tables: set[str]) -> str:
    """The revision a database made by ``create_all`` (no ``alembic_version``) matches: 0002 if it already
    has the notification outbox and the jobs columns 0002 adds (made by a build between the two), else 0001."""
    if "notifications" in tables:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
        if {"notify_on_missed", "notify_recipients"} <= columns:
            return "0002"
    return BASELINE


def check(engine: Engine) -> SchemaStatus:
    """The database's schema status; reads only."""
    with engine.connect() as conn:
        return _status(conn)


def current_revision(engine: Engine) -> str | None:
    """The database's revision: ``"0001"`` for a legacy database, None for an empty one."""
    return check(engine).current


@contextlib.contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """A connection holding the schema lock (see the module docstring), inside a transaction that is
    committed when the block ends normally."""
    with engine.connect() as conn:
        dialect = engine.dialect.name
        if dialect == "postgresql":
            with conn.begin():
                schema, search_path = conn.execute(sa.text("SELECT current_schema(), current_setting('search_path')")
                                                   ).one()
                if schema is None:  # else "no schema has been selected to create in", at the first CREATE
                    raise SchemaError(f"database schema: no schema of PostgreSQL's search_path ({search_path}) "
                                      "exists: create it first (CREATE SCHEMA name), or correct the URL's "
                                      "options=-csearch_path%3Dname")
                conn.execute(sa.text("SELECT pg_advisory_xact_lock("
                                     "hashtext('mjsched_schema:' || coalesce(current_schema(), '')))"))
                yield conn
        elif dialect in ("mysql", "mariadb"):
            name = conn.execute(sa.text("SELECT CONCAT('mjsched_schema:', DATABASE())")).scalar_one()
            if conn.execute(sa.text("SELECT GET_LOCK(:n, :t)"), {"n": name, "t": LOCK_TIMEOUT_S}).scalar() != 1:
                raise SchemaError(f"database schema: lock {name!r} not obtained within {LOCK_TIMEOUT_S} s")
            conn.commit()
            try:
                with conn.begin():
                    yield conn
            finally:
                conn.execute(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": name})
                conn.commit()
        elif dialect == "sqlite":
            # foreign keys off while migrating (it is a no-op inside a transaction, hence first): a
            # batch_alter_table that recreates a table must not cascade the drop of the old copy
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            try:
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # waits up to the busy timeout for other writers
                try:
                    yield conn
                    if violation := conn.exec_driver_sql("PRAGMA foreign_key_check").first():
                        raise SchemaError(f"database schema: migration broke a foreign key: {tuple(violation)}")
                except BaseException:
                    conn.rollback()
                    raise
                conn.commit()
            finally:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()
        else:
            raise NotImplementedError(f"database dialect {dialect!r} is not supported")


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's INFO lines ("Context impl ...", "Running upgrade ...") off while migrating: the one line
    logged here says it all, and a command's one-line error stays one line."""
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        alembic_log.setLevel(level)


def upgrade(engine: Engine, *, only_if_empty: bool = False) -> tuple[SchemaStatus, SchemaStatus]:
    """Apply pending migrations under the schema lock; a legacy database is stamped with the revision
    it matches (:func:`_legacy_revision`) first.
    Returns (before, after), both read under the lock. With ``only_if_empty`` a database found
    non-empty under the lock is left alone. Raises :class:`SchemaError` for a revision newer than this code."""
    with _locked(engine) as conn:
        before = _status(conn)
        if before.state == "unknown":
            raise SchemaError(before.message())
        if before.state != "current" and (before.state == "empty" or not only_if_empty):
            cfg = config(conn)
            with _quiet_alembic():
                if before.state == "legacy" and before.current is not None:
                    command.stamp(cfg, before.current)
                command.upgrade(cfg, "head")
            # creating the schema of a new database is routine (DEBUG); changing an existing one is news
            log.log(logging.DEBUG if before.state == "empty" else logging.INFO,
                    "database schema %s %s", "stamped at" if before.current == before.head else "upgraded from",
                    before.head if before.current == before.head else f"{before.current or 'none'} to {before.head}")
        after = _status(conn)
    return before, after


def prepare(engine: Engine, *, auto_upgrade: bool = False) -> SchemaStatus:
    """Make ``engine`` usable by the Store: an empty database is brought to head (race-safe), an
    outdated one only with ``auto_upgrade``. Raises :class:`SchemaError` (nothing written) otherwise."""
    status = check(engine)
    if status.state == "current":
        return status
    if status.state != "empty" and not auto_upgrade:
        # MySQL/MariaDB DDL is not transactional: another process creating this database may be between
        # 0001 and head right now. Look again once its lock is released before calling the schema outdated.
        with _locked(engine) as conn:
            status = _status(conn)
        if status.state == "current":
            return status
    if status.state == "empty" or (auto_upgrade and status.state in ("legacy", "outdated")):
        _, after = upgrade(engine, only_if_empty=not auto_upgrade)
        if after.state == "current":
            return after
        status = after
    raise SchemaError(status.message())


def new_revision(message: str) -> str:
    """Developers: write ``versions/NNNN_slug.py`` (the next number) from script.py.mako and return its
    path; fill in upgrade() by hand with explicit op.* calls."""
    rev_id = f"{int(head_revision()) + 1:04d}"
    script = command.revision(config(), message, rev_id=rev_id)
    if script is None or isinstance(script, list):
        raise RuntimeError(f"alembic wrote no single revision for {message!r}")
    return script.path
