"""The database's limit for this engine: the statements of one run, issued back to back by one process
with no supervisor, pool, planner or cron around them, measured two ways and labelled (``path``):

* ``store``: through our store (``Store.claim`` then ``Store.finish_run``, SQLAlchemy Core): what the
  engine's database path costs, Python statement building and SQLAlchemy execution included;
* ``bare``: the *same SQL* through the bare driver (``sqlite3`` / ``psycopg``): the statements, parameters
  and transaction ends the store sent, recorded with SQLAlchemy's cursor events on one database and replayed
  on a second one set up identically (each statement's row count is checked against the recording). What
  the database and driver cost; the store's overhead is the difference.

    python benchmarks/rawdb.py [--runs 2000] [--backend sqlite|postgresql] [--jobs 50] [--batch 10]

One run = claim (job UPDATE with the lease and occurrence compare-and-set + run INSERT, one transaction)
then finish (run UPDATE + statistics UPDATE + lease release, one transaction); ``--batch K``: K runs claimed in
one transaction (``Store.claim_many``) and finished in one (``Store.finish_runs``), as the supervisor batches
them. The due-jobs poll is not included. Prints runs/s and per-run latency in ms for both paths.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import runner
import sqlalchemy as sa

from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import ClaimRequest, Outcome

UTC = dt.UTC
INSTANCE = "rawdb-1"


def _setup(store: Store, jobs: int) -> tuple[list[int], dict, dt.datetime]:
    """The same starting state on every database: ``jobs`` Active jobs due in 2020, one supervisor row."""
    now = store.db_now()
    store.register_supervisor(INSTANCE, "rawdb", os.getpid(), 3600.0)
    base = dt.datetime(2020, 1, 1, tzinfo=UTC)
    ids = [store.add_job({"name": f"raw-{i}", "job_type": "bench", "cron_expression": "* * * * * *",
                          "status": "Active", "next_run_at": base}, now) for i in range(jobs)]
    return ids, {i: store.get_job_by_id(i) for i in ids}, now


def _store_runs(store: Store, runs: int, jobs: int, mark=None, batch: int = 1) -> list[float]:
    """Claim + finish ``runs`` times through ``store``, cycling over ``jobs`` jobs; per-run ms. ``batch`` > 1:
    that many runs (of different jobs) claimed in one transaction (``Store.claim_many``) and finished in one
    (``Store.finish_runs``), as the supervisor batches them; each run gets its batch's time / ``batch``.
    ``mark(n)`` is called before run (batch) ``n``: the recorder's boundaries."""
    if not 1 <= batch <= jobs:
        raise ValueError(f"batch: must be between 1 and the number of jobs ({jobs}), got {batch}")
    ids, rows, now = _setup(store, jobs)
    deadline = now + dt.timedelta(seconds=600)
    lat_ms: list[float] = []
    for n in range(runs // batch):
        group = [rows[ids[(n * batch + k) % jobs]] for k in range(batch)]
        if mark:
            mark(n)
        t = time.perf_counter()
        if batch == 1:
            job = group[0]
            claims = [store.claim(job, now=now, next_run_at=job["next_run_at"] + dt.timedelta(seconds=1),
                                  instance=INSTANCE, lease_s=600.0, deadline_at=deadline,
                                  scheduled_at=job["next_run_at"])]
        else:
            claims = store.claim_many([ClaimRequest(job=job, next_run_at=job["next_run_at"] + dt.timedelta(seconds=1),
                                                    lease_s=600.0, deadline_at=deadline,
                                                    scheduled_at=job["next_run_at"]) for job in group],
                                      now=now, instance=INSTANCE)
        if any(c is None for c in claims):
            raise RuntimeError(f"claim {n} refused")
        if batch == 1:
            c = claims[0]
            assert c is not None
            store.finish_run(c.run_id, group[0]["id"], c.lock_token, status="Completed", success=True,
                             error_message=None, details={"plugin_started_at": 0.0}, duration_ms=1.0)
        else:
            store.finish_runs([Outcome(run_id=c.run_id, job_id=job["id"], token=c.lock_token, status="Completed",
                                       success=True, details={"plugin_started_at": 0.0}, duration_ms=1.0)
                               for c, job in zip(claims, group) if c is not None])
        lat_ms += [(time.perf_counter() - t) * 1000 / batch] * batch
        for job in group:
            job["next_run_at"] += dt.timedelta(seconds=1)
    return lat_ms


def _result(backend: str, path: str, lat_ms: list[float], elapsed_s: float) -> dict:
    return {"backend": backend, "path": path, "runs": len(lat_ms), "runs_per_s": len(lat_ms) / elapsed_s,
            "ms_per_run_p50": metrics.pct(lat_ms, 50), "ms_per_run_p99": metrics.pct(lat_ms, 99),
            "loadavg_1m": os.getloadavg()[0]}


def raw_limit(runs: int = 2000, backend: str = "sqlite", jobs: int = 50, batch: int = 1) -> dict:
    """Through our store: claim + finish ``runs`` times, cycling over ``jobs`` jobs. Returns backend, path
    ("store"), runs_per_s, ms_per_run_p50/p99, loadavg_1m."""
    tmp = Path(tempfile.mkdtemp(prefix="rawdb-"))
    ns = runner.Namespace(backend, tmp)
    store = Store.open(ns.url)
    try:
        begin = time.perf_counter()
        lat_ms = _store_runs(store, runs, jobs, batch=batch)
        return {**_result(backend, "store", lat_ms, time.perf_counter() - begin), "batch": batch}
    finally:
        store.close()
        ns.drop()
        shutil.rmtree(tmp, ignore_errors=True)


class Recorder:
    """What a SQLAlchemy engine sends to its driver: ``ops`` is a list of ("run", n) marks, ("sql", statement,
    parameters, executemany, rowcount) and ("commit",) / ("rollback",), in order."""

    def __init__(self, engine: sa.engine.Engine) -> None:
        self.ops: list[tuple] = []
        self.engine = engine
        sa.event.listen(engine, "after_cursor_execute", self._sql)
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "rollback", self._rollback)

    def _sql(self, _conn, cursor, statement, parameters, _context, executemany) -> None:
        self.ops.append(("sql", statement, parameters, executemany, cursor.rowcount))

    def _commit(self, _conn) -> None:
        self.ops.append(("commit",))

    def _rollback(self, _conn) -> None:
        self.ops.append(("rollback",))

    def mark(self, n: int) -> None:
        self.ops.append(("run", n))

    def close(self) -> None:
        sa.event.remove(self.engine, "after_cursor_execute", self._sql)
        sa.event.remove(self.engine, "commit", self._commit)
        sa.event.remove(self.engine, "rollback", self._rollback)


def bare_connect(url: str):
    """A bare DBAPI connection to ``url`` set up as the store's engine sets up its own (SQLite: WAL,
    ``synchronous=NORMAL``, foreign keys, 30 s busy timeout; PostgreSQL: the URL's options, e.g. search_path)."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3
        conn = sqlite3.connect(u.database, timeout=30)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            conn.execute(f"PRAGMA {pragma}")
        return conn
    import psycopg
    return psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database,
                           **dict(u.query))


def replay(conn, ops: list[tuple]) -> list[float]:
    """Issue ``ops`` (a :class:`Recorder`'s) on the bare ``conn``; per-run ms (from one mark to the next).
    Raises RuntimeError if a statement's row count differs from the recorded one (the replay would not be
    doing the same work)."""
    lat_ms, t, cur = [], None, conn.cursor()
    for op in ops:
        if op[0] == "run":
            now = time.perf_counter()
            if t is not None:
                lat_ms.append((now - t) * 1000)
            t = now
        elif op[0] == "sql":
            _, statement, parameters, many, rowcount = op
            # SQLAlchemy's insertmanyvalues reports its one multi-row INSERT (one mapping) as an executemany
            many = many and not isinstance(parameters, dict)
            (cur.executemany if many else cur.execute)(statement, parameters)
            if cur.description is not None:
                cur.fetchall()
            if rowcount >= 0 and cur.rowcount >= 0 and cur.rowcount != rowcount:
                raise RuntimeError(f"replay differs: {cur.rowcount} rows instead of {rowcount} for {statement!r}")
        elif op[0] == "commit":
            conn.commit()
        else:
            conn.rollback()
    if t is not None:
        lat_ms.append((time.perf_counter() - t) * 1000)
    return lat_ms


def bare_limit(runs: int = 2000, backend: str = "sqlite", jobs: int = 50, batch: int = 1) -> dict:
    """The same SQL as :func:`raw_limit` through the bare driver: recorded from the store on one fresh
    database, replayed on another set up identically. Returns backend, path ("bare sqlite3" / "bare
    psycopg"), runs_per_s, ms_per_run_p50/p99 (the replay's), loadavg_1m."""
    tmps = [Path(tempfile.mkdtemp(prefix="rawdb-")) for _ in range(2)]
    spaces = [runner.Namespace(backend, tmp) for tmp in tmps]
    try:
        store = Store.open(spaces[0].url)
        try:
            recorder = Recorder(store.engine)
            _store_runs(store, runs, jobs, mark=recorder.mark, batch=batch)
            recorder.close()
        finally:
            store.close()
        # the setup is not replayed (the second database gets its own): from the first run on
        ops = recorder.ops[next(i for i, op in enumerate(recorder.ops) if op[0] == "run"):]
        store = Store.open(spaces[1].url)
        try:
            _setup(store, jobs)
        finally:
            store.close()
        conn = bare_connect(spaces[1].url)
        try:
            begin = time.perf_counter()
            lat_ms = [ms / batch for ms in replay(conn, ops) for _ in range(batch)]
            elapsed = time.perf_counter() - begin
            cur = conn.cursor()
            cur.execute("SELECT count(*) FROM runs WHERE status = 'Completed'")
            if (done := cur.fetchone()[0]) != len(lat_ms):
                raise RuntimeError(f"replay recorded {done} completed runs instead of {len(lat_ms)}")
        finally:
            conn.close()
        return {**_result(backend, "bare sqlite3" if backend == "sqlite" else "bare psycopg", lat_ms, elapsed),
                "batch": batch}
    finally:
        for ns, tmp in zip(spaces, tmps):
            ns.drop()
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--batch", type=int, default=1, help="runs claimed (and finished) per transaction (default 1)")
    args = ap.parse_args(argv)
    if not 1 <= args.batch <= args.jobs:
        ap.error(f"--batch: must be between 1 and --jobs ({args.jobs}), got {args.batch}")
    print(json.dumps([raw_limit(args.runs, args.backend, args.jobs, args.batch),
                      bare_limit(args.runs, args.backend, args.jobs, args.batch)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
