"""Page speed of the web dashboard on real data: fill a database with 10,000 jobs and 1,000,000 runs (a
month of history: ~33,000 runs in the last day), start a real ``mjsched dashboard`` on it, and time every
page and API call over HTTP (median and worst of ``--repeats`` after a warm-up). Prints a table; the
target is 300 ms per page.

    python benchmarks/dashboard_pages.py                     # SQLite in a temp dir
    python benchmarks/dashboard_pages.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test --schema
    python benchmarks/dashboard_pages.py --jobs 1000 --runs 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import jobs, supervisors

TOKEN = "bench-token-" + uuid.uuid4().hex
CRONS = [("*/5 * * * *", "UTC"), ("0 * * * *", "Europe/Berlin"), ("30 2 * * *", "America/New_York"),
         ("*/15 * * * 1-5", "UTC"), ("0 0 * * *", "Asia/Tokyo")]
TYPES = ["shell", "http_check", "sqlite_backup", "file_retention"]
MODES = ["Skip", "Queue", "Concurrent"]


def fill(url: str, n_jobs: int, n_runs: int, now: dt.datetime) -> None:
    """Jobs by executemany; runs by one INSERT ... SELECT over a generated series (in the database)."""
    store = Store.open(url)
    engine = store.engine
    rows = []
    for i in range(n_jobs):
        cron, zone = CRONS[i % len(CRONS)]
        rows.append({"name": f"job-{i:05d}", "job_type": TYPES[i % len(TYPES)], "cron_expression": cron,
                     "timezone": zone, "status": "Paused" if i % 25 == 0 else "Active",
                     "description": f"benchmark job {i} of team {i % 40}",
                     "configuration": '{"command": ["true"]}', "concurrency_mode": MODES[i % 3],
                     "next_run_at": None if i % 25 == 0 else now + dt.timedelta(seconds=i * 7),
                     "run_count": n_runs // n_jobs, "success_count": n_runs // n_jobs - 3, "failure_count": 3,
                     "skipped_count": i % 4, "created_at": now, "updated_at": now})
    with engine.begin() as conn:
        for start in range(0, len(rows), 2000):
            conn.execute(jobs.insert(), rows[start:start + 2000])
        conn.execute(supervisors.insert(), [
            {"instance": f"sup-{k}", "hostname": "bench", "pid": 100 + k, "started_at": now, "heartbeat_at": now,
             "lease_expires_at": now + dt.timedelta(seconds=30), "stopped_at": None} for k in range(3)])
    span_s = 30 * 86400
    step = span_s / n_runs
    t0 = int(now.timestamp()) - span_s
    status = ("CASE WHEN i % 20 = 0 THEN 'Failed' WHEN i % 50 = 1 THEN 'Timeout' "
              f"WHEN i > {n_runs} - 5 THEN 'Running' ELSE 'Completed' END")
    error = "CASE WHEN i % 20 = 0 THEN 'exit code 1: disk full' WHEN i % 50 = 1 THEN 'deadline passed' END"
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            ts = f"strftime('%Y-%m-%d %H:%M:%S', {t0} + CAST(i * {step} AS INTEGER), 'unixepoch') || '.000000'"
            conn.exec_driver_sql(
                f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n_runs}) "
                "INSERT INTO runs (job_id, scheduled_at, started_at, completed_at, status, success, error_message, "
                "details, executed_by_instance, duration_ms, deadline_at) "
                f"SELECT (i % {n_jobs}) + 1, {ts}, {ts}, {ts}, {status}, {status} = 'Completed', {error}, "
                "'{\"rows\": 12}', 'sup-' || (i % 3), 50 + i % 400, "
                f"{ts} FROM n")
            # no ANALYZE: mjsched never runs it, so a real SQLite database has no planner statistics
        elif engine.dialect.name == "postgresql":
            ts = f"(to_timestamp({t0} + floor(i * {step})) AT TIME ZONE 'UTC')"
            conn.exec_driver_sql((  # psycopg reads % as a placeholder: doubled
                "INSERT INTO runs (job_id, scheduled_at, started_at, completed_at, status, success, error_message, "
                "details, executed_by_instance, duration_ms, deadline_at) "
                f"SELECT (i % {n_jobs}) + 1, {ts}, {ts}, {ts}, {status}, ({status}) = 'Completed', {error}, "
                "'{\"rows\": 12}', 'sup-' || (i % 3), 50 + i % 400, "
                f"{ts} FROM generate_series(1, {n_runs}) AS i").replace("%", "%%"))
        else:
            raise SystemExit(f"--db: {engine.dialect.name} is not supported by this script (sqlite, postgresql)")
    if engine.dialect.name == "postgresql":
        # what autovacuum does to a table that grew over a month: statistics, and the visibility map that
        # lets index-only scans (the charts' range counts) skip the table
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE runs")
            conn.exec_driver_sql("VACUUM ANALYZE jobs")
    store.close()


def pages(now: dt.datetime, n_jobs: int, n_runs: int) -> list[str]:
    day = (now - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    week = (now - dt.timedelta(days=7)).strftime("%Y-%m-%dT%H:%M:%SZ")
    out, job = [], f"job-{n_jobs // 3:05d}"
    for prefix in ("", "/api"):
        out += [f"{prefix}/" if prefix == "" else "/api/overview", f"{prefix}/jobs", f"{prefix}/jobs?q=team%2033",
                f"{prefix}/jobs?status=Paused", f"{prefix}/jobs?type=http_check&mode=Queue",
                f"{prefix}/jobs?failing=1", f"{prefix}/jobs?after=job-09000", f"{prefix}/jobs/{job}",
                f"{prefix}/jobs/{job}?before={n_runs // 2}", f"{prefix}/runs", f"{prefix}/runs?status=Failed",
                f"{prefix}/runs?status=Timeout&before={n_runs // 10}", f"{prefix}/runs?job=job-00042",
                f"{prefix}/runs?supervisor=sup-1", f"{prefix}/runs?since={week}&until={day}",
                f"{prefix}/runs?before={n_runs // 3}", f"{prefix}/runs/{n_runs // 2}", f"{prefix}/audit"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: a SQLite file in a temp dir)")
    parser.add_argument("--schema", action="store_true", help="PostgreSQL: use a fresh schema, dropped after")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="mjsched-dash-bench-")
    url, admin, schema = args.db or f"sqlite:///{tmp}/bench.db", None, None
    if args.db and args.schema:
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(args.db)
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        url = sa.engine.make_url(args.db).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    now = dt.datetime.now(dt.UTC)
    started = time.perf_counter()
    fill(url, args.jobs, args.runs, now)
    print(f"filled {args.jobs} jobs and {args.runs} runs in {time.perf_counter() - started:.1f} s")
    env = {**os.environ, "MJSCHED_DASHBOARD_OPERATOR_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "mjsched_isolated", "dashboard", "--db", url, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            if m := re.search(r"dashboard on http://127\.0\.0\.1:(\d+)/", line):
                port = m.group(1)
                break
        if port is None:
            raise SystemExit("the dashboard did not start")
        results = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=60) as client:
            for path in pages(now, args.jobs, args.runs):
                first = client.get(path)
                if first.status_code != 200:
                    raise SystemExit(f"{path}: HTTP {first.status_code}: {first.text[:200]}")
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    client.get(path).raise_for_status()
                    times.append((time.perf_counter() - t) * 1000)
                results.append((path, statistics.median(times), max(times)))
        load = os.getloadavg()
        print(f"\n{'page':60} {'median ms':>10} {'max ms':>8}")
        for path, med, worst in results:
            print(f"{path:60} {med:10.1f} {worst:8.1f}{'  SLOW' if worst > 300 else ''}")
        print(f"\nworst median {max(r[1] for r in results):.1f} ms, worst single {max(r[2] for r in results):.1f} ms; "
              f"{sum(r[2] > 300 for r in results)} page(s) over 300 ms; load average {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f} ({os.cpu_count()} cores); backend {sa.engine.make_url(url).get_backend_name()}")
    finally:
        proc.terminate()
        proc.wait(10)
        if admin is not None:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
            admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
