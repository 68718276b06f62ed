"""Where a saturated PostgreSQL supervisor's database time goes, statement kind by statement kind (issue 11).

The hot path's real :class:`Store` calls, in the order a saturated poll makes them, ``--cycles`` times on a
fresh schema with ``--jobs`` jobs all due (none ever catches up: each claim moves its job one second on):

* ``due``: ``Store.due_jobs(now, limit=batch)`` (the poll's read);
* ``claim``: ``Store.claim_many`` of those ``batch`` jobs with ``busy`` given, as ``_claim_batch`` calls it;
* ``skip``: ``Store.due_live_skip_jobs(now, 100)`` (read when the poll was full);
* ``finish``: ``Store.finish_runs`` of the ``batch`` runs (a plain batch: Completed, success, a duration).

Per phase, per run: wall ms, this process's CPU ms, the CPU ms of the PostgreSQL backends serving the
store's connections (``/proc/<pid>/schedstat``, nanoseconds; the backends are told from other clients by
the schema's ``application_name``), statements sent (SQLAlchemy cursor events) and round trips (frontend
``Sync``/``Query`` messages in a libpq trace of every connection), and whether the statements were
prepared on the server (``parses``: unnamed ``Parse`` messages, a statement parsed and planned for one
execution; ``named_binds``: executions of a statement prepared on the server, which psycopg does from a
query's 6th execution on a connection). After the loop: the tables' inserted, updated and HOT-updated rows
(``pg_stat_user_tables``) and the server's prepared statements of each connection. The trace costs client CPU
of its own: read that column from a run with ``--no-trace``.

    python benchmarks/pg_statements.py [--jobs 3000] [--batch 10] [--cycles 600] [--warmup 50] [--json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner
import sqlalchemy as sa

from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import ClaimRequest, Outcome
from mjsched_isolated.store.schema import jobs

INSTANCE = "pgstmt-1"
PHASES = ("due", "claim", "skip", "finish")
LIVE_SKIP_ROWS = 100


def _backend_ns(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


class Trace:
    """A libpq trace of every connection the engine opens, into one file; :meth:`take` returns the frontend
    messages written since the last call."""

    def __init__(self, engine: sa.engine.Engine, path: Path) -> None:
        self.path = path
        self.file = open(path, "w")  # noqa: SIM115 - kept open for the traces' lifetime
        self.pos = 0
        sa.event.listen(engine, "connect", self._connect)

    def _connect(self, dbapi_conn, _record) -> None:
        dbapi_conn.pgconn.trace(self.file.fileno())
        dbapi_conn.pgconn.set_trace_flags(1 | 2)  # suppress timestamps, regress mode

    def take(self) -> list[str]:
        with open(self.path) as f:
            f.seek(self.pos)
            text = f.read()
            self.pos = f.tell()
        return [line for line in text.splitlines() if line.startswith("F")]


def run(jobs_n: int, batch: int, cycles: int, warmup: int, setup_sql: list[str] | None = None,
        trace_on: bool = True) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pgstmt-"))
    ns = runner.Namespace("postgresql", tmp)
    try:
        store = Store.open(ns.url)
        store.engine.dispose()
        trace = Trace(store.engine, tmp / "trace.txt") if trace_on else None
        statements = {"n": 0}
        sa.event.listen(store.engine, "after_cursor_execute",
                        lambda *a: statements.__setitem__("n", statements["n"] + 1))
        now = start = store.db_now()
        store.register_supervisor(INSTANCE, "pgstmt", os.getpid(), 3600.0)
        base = (now - dt.timedelta(days=1)).replace(microsecond=0)
        with store.engine.begin() as conn:  # the jobs in one INSERT (add_job one by one is slow for thousands)
            conn.execute(jobs.insert(), [{
                "name": f"pg-{i}", "job_type": "bench", "cron_expression": "* * * * * *", "status": "Active",
                "timezone": "UTC", "next_run_at": base, "created_at": now, "updated_at": now}
                for i in range(jobs_n)])
            for sql in setup_sql or ():  # e.g. an index to try
                conn.exec_driver_sql(sql)
        deadline = now + dt.timedelta(days=2)
        rows: dict[str, dict[str, float]] = {p: {"wall_ms": 0.0, "client_cpu_ms": 0.0, "backend_cpu_ms": 0.0,
                                                 "statements": 0, "round_trips": 0, "parses": 0,
                                                 "named_binds": 0} for p in PHASES}
        pids: list[int] = []
        stats_before: dict = {}
        runs_done = 0

        def phase(name: str, fn, measured: bool):
            if not measured:
                return fn()
            s0, c0, b0, w0 = statements["n"], time.process_time(), _backend_ns(pids), time.perf_counter()
            out = fn()
            w1, b1, c1 = time.perf_counter(), _backend_ns(pids), time.process_time()
            msgs = trace.take() if trace is not None else []
            r = rows[name]
            r["wall_ms"] += (w1 - w0) * 1000
            r["client_cpu_ms"] += (c1 - c0) * 1000
            r["backend_cpu_ms"] += (b1 - b0) / 1e6
            r["statements"] += statements["n"] - s0
            r["round_trips"] += sum(1 for m in msgs if re.search(r"\t(Sync|Query)\b", m))
            r["parses"] += sum(1 for m in msgs if re.search(r'\tParse\t ""', m))  # parsed for this execution
            r["named_binds"] += sum(1 for m in msgs if re.search(r'\tBind\t "" "[^"]+"', m))  # a prepared one
            return out

        started = time.monotonic()
        for cycle in range(warmup + cycles):
            measured = cycle >= warmup
            now = start + dt.timedelta(seconds=time.monotonic() - started)  # the poll's instant, as in service
            if cycle == warmup:
                with runner.sa.create_engine(runner.POSTGRES_URL).connect() as admin:
                    pids = list(admin.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = "
                                                      ":n"), {"n": ns.name}).scalars())
                    stats_before = _table_stats(admin, ns.name)
                if trace is not None:
                    trace.take()
            due = phase("due", lambda now=now: store.due_jobs(now, limit=batch), measured)
            if len(due) != batch:
                raise RuntimeError(f"cycle {cycle}: {len(due)} due jobs, not {batch}")
            busy: set[int] = set()
            claims = phase("claim", lambda due=due, busy=busy, now=now: store.claim_many([ClaimRequest(
                job=j, next_run_at=j["next_run_at"] + dt.timedelta(seconds=1), lease_s=600.0, deadline_at=deadline,
                scheduled_at=j["next_run_at"]) for j in due], now=now, instance=INSTANCE, not_before=now, busy=busy),
                measured)
            if any(c is None for c in claims) or busy:
                raise RuntimeError(f"cycle {cycle}: a claim lost")
            phase("skip", lambda now=now: store.due_live_skip_jobs(now, LIVE_SKIP_ROWS), measured)
            done = phase("finish", lambda due=due, claims=claims: store.finish_runs([Outcome(
                run_id=c.run_id, job_id=j["id"], token=c.lock_token, status="Completed", success=True,
                details={"plugin_started_at": 0.0}, duration_ms=1.0,
                completed_at=dt.datetime.now(dt.UTC))
                for c, j in zip(claims, due, strict=True) if c is not None]), measured)
            if not all(done):
                raise RuntimeError(f"cycle {cycle}: a result was refused")
            runs_done += batch if measured else 0
        time.sleep(1.5)  # the backends' table statistics are flushed once a second at most
        with runner.sa.create_engine(runner.POSTGRES_URL).connect() as admin:
            now_pids = set(admin.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :n"),
                                         {"n": ns.name}).scalars())
            stats_after = _table_stats(admin, ns.name)
        with store.leases.reader.connect() as conn:
            prepared = [dict(r) for r in conn.execute(sa.text(
                "SELECT name, left(statement, 70) AS statement, generic_plans, custom_plans "
                "FROM pg_prepared_statements")).mappings()]
        per_run = {p: {k: v / runs_done for k, v in r.items()} for p, r in rows.items()}
        per_run["total"] = {k: sum(per_run[p][k] for p in PHASES) for k in rows["due"]}
        tables = {t: {k: stats_after[t][k] - stats_before.get(t, {}).get(k, 0) for k in stats_after[t]}
                  for t in stats_after}
        store.close()
        return {"jobs": jobs_n, "batch": batch, "runs": runs_done, "backends": len(pids),
                "backends_changed": set(pids) != now_pids, "per_run": per_run, "tables": tables,
                "prepared": prepared, "loadavg": os.getloadavg()}
    finally:
        ns.drop()
        shutil.rmtree(tmp, ignore_errors=True)


def _table_stats(conn: sa.Connection, schema_name: str) -> dict[str, dict[str, int]]:
    return {r["relname"]: {"ins": r["n_tup_ins"], "upd": r["n_tup_upd"], "hot_upd": r["n_tup_hot_upd"]}
            for r in conn.execute(sa.text(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE schemaname = :s AND relname IN ('jobs', 'runs')"), {"s": schema_name}).mappings()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--setup-sql", action="append", help="SQL run on the fresh schema before the loop (repeatable)")
    ap.add_argument("--no-trace", action="store_true", help="no libpq trace (its cost is in the client CPU column); "
                    "round trips and prepared statements then read 0")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = run(a.jobs, a.batch, a.cycles, a.warmup, a.setup_sql, not a.no_trace)
    if a.json:
        print(json.dumps(out, default=str))
        return
    print(f"{out['runs']} runs, {a.jobs} jobs, batch {a.batch}, {out['backends']} backend(s), "
          f"load {' '.join(f'{x:.2f}' for x in out['loadavg'])}")
    cols = ("wall_ms", "client_cpu_ms", "backend_cpu_ms", "statements", "round_trips", "parses", "named_binds")
    print(f"{'per run':8}" + "".join(f"{c:>15}" for c in cols))
    for p, r in out["per_run"].items():
        print(f"{p:8}" + "".join(f"{r[c]:15.3f}" for c in cols))
    for t, s in out["tables"].items():
        print(f"{t}: inserted {s['ins']}, updated {s['upd']} (HOT {s['hot_upd']})")
    for p in out["prepared"]:
        print(f"prepared {p['name']}: generic {p['generic_plans']} custom {p['custom_plans']}: {p['statement']}")


if __name__ == "__main__":
    main()
