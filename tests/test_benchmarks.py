"""benchmarks/: workload parsing, metrics, the simulator, compare.py's counting, rawdb.py's replay, and that
APScheduler's side leaves no process behind. No timing is asserted here."""

import os
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare
import metrics
import simulator
import workload as wl
from waiting import wait_until

from mjsched_isolated import planner


@pytest.mark.parametrize("text, field", [
    ('jobs = "ten"', "jobs:"),
    ("jobs = 0", "jobs:"),
    ('[runtime]\nmean_ms = "x"', "runtime.mean_ms:"),
    ('[runtime]\ndistribution = "normal"', "runtime.distribution:"),
    ("[runtime]\nspeed = 1", "runtime.speed:"),
    ("[faults]\nhang = 1.5", "faults.hang:"),
    ("[faults]\nhang = 0.6\ncrash = 0.6", "faults:"),
    ("[cron_mix]\nevery_second = 0.0", "cron_mix:"),
    ('concurrency_mode = "Sometimes"', "concurrency_mode:"),
])
def test_workload_errors_name_the_field(text, field):
    with pytest.raises(wl.WorkloadError) as info:
        wl.parse(tomllib.loads(text))
    assert str(info.value).startswith(field)


def test_shipped_workloads_load_and_apportion():
    for path in (Path(__file__).resolve().parent.parent / "benchmarks" / "workloads").glob("*.toml"):
        wl.load(path)
    w = wl.load(Path(__file__).resolve().parent.parent / "benchmarks" / "workloads" / "mixed.toml")
    specs = wl.job_specs(w)
    assert len(specs) == 20 and [s["kind"] for s in specs].count("hang") == 2
    assert [s["cron_kind"] for s in specs].count("every_second") == 18
    assert specs == wl.job_specs(w)  # seeded


def test_metrics_on_hand_made_runs():
    specs = [{"name": "a", "kind": "ok", "cron_expression": "* * * * * *"},
             {"name": "h", "kind": "hang", "cron_expression": "* * * * * *"}]
    t0 = 1_800_000_000.0
    runs = [{"job": "a", "scheduled_at": t0 + i, "started_at": t0 + i + 0.01 * (i + 1), "exec_at": None,
             "completed_at": t0 + i + 0.5, "status": "Completed", "crashed": False, "instance": "s"} for i in range(4)]
    runs.append({"job": "h", "scheduled_at": t0, "started_at": t0, "exec_at": None, "completed_at": t0 + 3,
                 "status": "Timeout", "crashed": False, "instance": "s"})
    m = metrics.summarize(runs, specs, t0, t0 + 4, cap=1, end=t0 + 5)
    assert m["runs"] == 5 and m["expected"] == 8
    assert m["missed"] == 3 and m["missed_healthy"] == 0  # the hung job ran once out of 4
    assert m["late_max_ms"] == pytest.approx(40, abs=1e-3) and m["kills"] == 1
    assert m["starve_total_s"] == pytest.approx(3.0)  # cap 1, held by the hung run for 3 s
    assert metrics.pct([1, 2, 3, 4], 50) == 2 and metrics.pct([], 99) is None
    assert metrics.busy_stretches([(0, 2), (1, 3)], 2, 0, 10) == [1]


def _small(**over):
    w = wl.parse({"name": "t", "jobs": 12, "cron_mix": {"every_second": 0.8, "every_minute": 0.2},
                  "runtime": {"distribution": "uniform", "min_ms": 10, "max_ms": 400},
                  "faults": {"hang": 0.17, "crash": 0.09}})
    return msgspec.structs.replace(w, **over)


@pytest.mark.parametrize("mode, policy", [("Skip", "RunOnce"), ("Queue", "RunOnce"), ("Concurrent", "Skip")])
def test_simulator_is_deterministic_and_fast_path_matches_planner_decide(mode, policy):
    w = _small(concurrency_mode=mode, missed_run_policy=policy)
    cfg = dict(cap=2, lease_timeout_s=2.0, horizon_s=40.0, supervisors=2, lose_every_s=20.0, lease_ttl_s=3.0,
               renew_s=1.0)
    runs = []
    for exact in (False, False, True):
        sim = simulator.Simulator(w, simulator.SimConfig(exact=exact, **cfg))
        sim.run()
        runs.append([(r["job"], r["scheduled_at"], r["started_at"], r["status"]) for r in sim.runs])
    assert runs[0] and runs[0] == runs[1] == runs[2]


def test_simulator_calls_the_engines_planner(monkeypatch):
    calls = {"decide_missed_run": 0, "run_timeout_s": 0, "decide": 0}
    for name in calls:
        real = getattr(planner, name)

        def counting(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(planner, name, counting)
    sim = simulator.Simulator(_small(), simulator.SimConfig(cap=2, lease_timeout_s=2.0, horizon_s=10.0))
    sim.run()
    assert calls["run_timeout_s"] >= 1 and calls["decide_missed_run"] == sim.stats["decide_calls"] > 0
    simulator.Simulator(_small(), simulator.SimConfig(cap=2, horizon_s=5.0, exact=True)).run()
    assert calls["decide"] > 0


# ---------------------------------------------------------------- compare.py (side by side)

def test_compare_window_counts_starts_after_the_first_run_and_cpu_is_interpolated_at_its_edges():
    t = 1_800_000_000.0
    runs = [{"job": f"j{i % 3}", "scheduled_at": t + i // 3, "exec_at": t + 0.5 + 0.1 * i,
             "completed_at": t + 0.55 + 0.1 * i} for i in range(40)]
    runs.append({"job": "j0", "scheduled_at": t, "exec_at": None, "completed_at": None})  # never began: not counted
    # (time, supervisor CPU, workers CPU, machine busy, machine total): 1 s of supervisor CPU per s, 0.5 for workers
    series = [(t + s, 1.0 * s, 0.5 * s, 1.5 * s, 2.0 * s) for s in range(0, 6)]
    row = compare.measure(runs, series, warmup_s=1.0, window_s=2.0)
    assert (row["t0"], row["t1"]) == (t + 1.5, t + 3.5)  # first start + warm-up, + window
    assert row["runs"] == 20 and row["runs_per_s"] == 10  # exec_at 1.5 .. 3.4 inclusive
    assert row["sup_ms_per_run"] == pytest.approx(100.0) and row["wrk_ms_per_run"] == pytest.approx(50.0)
    assert row["busy_pct"] == pytest.approx(75.0) and row["dup"] == 1  # j0 at t has two rows
    assert compare.at(series, t - 5, 1) == 0.0 and compare.at(series, t + 99, 2) == 2.5
    with pytest.raises(ValueError, match="no run started"):
        compare.window([], 1.0, 2.0)


def test_compare_table_gives_median_min_max_load_per_row_and_the_ratio():
    rows = [{"engine": e, "backend": "sqlite", "cap": 10, "supervisors": 1, "runs_per_s": v, "done_per_s": v,
             "sup_ms_per_run": 1.0, "wrk_ms_per_run": 0.5, "late_p50_ms": 3.0, "busy_pct": 90.0, "dup": 0,
             "left": 0, "loadavg_1m": load}
            for e, v, load in (("mjsched", 100, 1.0), ("mjsched", 300, 1.2), ("mjsched", 200, 1.4),
                               ("apscheduler", 50, 0.9), ("apscheduler", 100, 1.1), ("apscheduler", 150, 1.3))]
    text = compare.table(rows)
    assert "| sqlite | 10 | 1 | mjsched | 3 | 200 (100–300) |" in text and "1.0 / 1.2 / 1.4 |" in text
    assert "sqlite cap 10: engine / APScheduler = 2.00" in text


@pytest.mark.timeout(40)
def test_compare_apscheduler_leaves_no_process_behind_even_a_hung_one(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text('name = "tiny"\njobs = 3\n[runtime]\ndistribution = "fixed"\nmean_ms = 1.0\n'
                    "[faults]\nhang = 0.34\n")
    w = wl.load(path)
    row = compare.run_aps(w, str(path), cap=2, backend="sqlite", warmup_s=0.5, window_s=1.0)
    assert row["runs"] >= 1 and row["left"] >= 1  # the pool, the hung process among it, outlived the scheduler
    # APScheduler 3.11 *spawns* its pool (fresh interpreters, other command lines): found by process group;
    # a killed process not yet reaped by init is a zombie, i.e. gone
    assert wait_until(lambda: not _live_in_group(row["pgid"]), 10, "the scheduler's process group emptied",
                      diagnostic=lambda: repr(_live_in_group(row["pgid"])))


def _live_in_group(pgid: int) -> list[str]:
    import psutil
    live = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, PermissionError):
            pass
    return live


@pytest.mark.timeout(30)
def test_rawdb_bare_driver_replays_the_stores_sql_and_notices_when_it_does_not_do_the_same_work(tmp_path):
    import rawdb
    import runner
    row = rawdb.bare_limit(runs=12, backend="sqlite", jobs=3)
    assert row["path"] == "bare sqlite3" and row["runs"] == 12 and row["runs_per_s"] > 0
    assert rawdb.raw_limit(runs=5, backend="sqlite", jobs=2)["path"] == "store"
    batched = rawdb.bare_limit(runs=12, backend="sqlite", jobs=4, batch=4)  # claim_many / finish_runs, replayed
    assert batched["runs"] == 12 and batched["batch"] == 4
    ns = runner.Namespace("sqlite", tmp_path)  # record 4 runs, replay them twice on one database
    store = rawdb.Store.open(ns.url)
    recorder = rawdb.Recorder(store.engine)
    rawdb._store_runs(store, 4, 2, mark=recorder.mark)
    recorder.close()
    store.close()
    ops = recorder.ops[next(i for i, op in enumerate(recorder.ops) if op[0] == "run"):]
    assert [op[0] for op in ops].count("commit") == 8  # claim and finish: one transaction each
    other = runner.Namespace("sqlite", tmp_path / "b")
    (tmp_path / "b").mkdir()
    store = rawdb.Store.open(other.url)
    rawdb._setup(store, 2)
    store.close()
    conn = rawdb.bare_connect(other.url)
    assert len(rawdb.replay(conn, ops)) == 4
    with pytest.raises(RuntimeError, match="replay differs"):  # the occurrences are claimed already
        rawdb.replay(conn, ops)
    conn.close()


def test_fair_shares_split_the_cores_between_sessions_max_min():
    assert simulator.fair_shares(2.0, [(1, 1), (3, 1)]) == [1.0, 1.0]       # one core each
    assert simulator.fair_shares(2.0, [(1, 1), (1, 2)]) == pytest.approx([2 / 3, 2 / 3])  # 3 sessions, 2 cores
    assert simulator.fair_shares(4.0, [(0.5, 1), (8, 1)]) == [0.5, 3.5]     # what one cannot use goes to the other


def _fleet(n: int, **kw) -> float:
    costs = {k: kw.pop(k) for k in ("sup_ms", "db_ms", "wrk_ms", "run_ms", "flush_ms") if k in kw}
    return simulator.Fleet(simulator.FleetCosts(**{"sup_ms": 0.0, "db_ms": 0.0, "wrk_ms": 0.0, **costs}),
                           simulator.FleetSpec(supervisors=n, **kw)).run()["runs_per_s"]


@pytest.mark.timeout(30)
def test_fleet_model_is_limited_by_the_supervisor_then_by_the_database_server():
    # dedicated cores: a supervisor's run is 1 ms of its CPU + 1 ms of its backend's, one at a time: 500/s each
    assert 480 <= _fleet(1, sup_ms=1.0, db_ms=1.0) <= 510
    assert 1900 <= _fleet(16, sup_ms=1.0, db_ms=1.0, db_cores=2.0) <= 2010   # the server's 2 cores: 2,000/s
    assert 3800 <= _fleet(16, sup_ms=1.0, db_ms=1.0, db_cores=4.0) <= 4010
    assert 95 <= _fleet(4, sup_ms=1.0, db_ms=1.0, demand=100.0) <= 105         # fewer due: the demand


@pytest.mark.timeout(30)
def test_fleet_model_group_commit_shares_flushes_and_cores_are_shared_by_session():
    one = _fleet(1, flush_ms=2.0, run_ms=1.0)   # every transaction waits 2 ms for its flush
    assert _fleet(8, flush_ms=2.0, run_ms=1.0) >= 3.5 * one                    # the flushes are shared
    # 2 cores, one supervisor (its runs 2 ms of CPU in all) against two other busy sessions: 2/3 of a core each
    assert 480 <= _fleet(1, sup_ms=1.0, db_ms=1.0, cores=2.0) <= 510
    assert 315 <= _fleet(1, sup_ms=1.0, db_ms=1.0, cores=2.0, others=2.0) <= 345
    # the server's backends are one session: another client's busy backend halves its share, not the machine's
    assert 480 <= _fleet(1, sup_ms=1.0, db_ms=1.0, cores=2.0, others=1.0) <= 510
    assert 315 <= _fleet(1, sup_ms=1.0, db_ms=1.0, cores=2.0, others=1.0, db_others=1.0) <= 345


def _fleet_row(n: int, runs_per_s: float, sup: float, db: float) -> dict:
    return {"supervisors": n, "runs_per_s": runs_per_s, "sup_ms_per_run": sup, "db_ms_per_run": db,
            "wrk_ms_per_run": 0.5, "db_wait": {"io": 0.4, "lwlock": 0.1}, "wal_flush_ms": 1.0 + n / 10,
            "others_runnable": 0.0, "db_others_runnable": 0.0, "loadavg_1m": 1.0}


@pytest.mark.timeout(60)
def test_compare_fleet_model_calibrates_on_the_rows_and_grows_the_costs_with_the_fleet():
    w = wl.parse({"name": "f", "jobs": 10, "cron_mix": {"every_second": 1.0},
                  "runtime": {"distribution": "fixed", "mean_ms": 1.0}})
    rows = [_fleet_row(1, 400, 0.5, 1.0), _fleet_row(2, 600, 0.6, 1.2), _fleet_row(3, 650, 0.7, 1.4)]
    model = compare.fleet_model(rows, w, cap=10, sizes=[1, 2, 8], db_cores=2.0, horizon_s=1.5)
    assert model["flush_ms"] == pytest.approx(1.2)  # the median of the runs' probes
    assert model["check"][0]["commit_wait_ms"] == pytest.approx(0.5) and model["check"][0]["sim_commit_wait_ms"] > 0
    assert model["costs_1"]["db_ms_per_run"] == pytest.approx(1.0)
    assert model["growth_per_supervisor"]["db_ms_per_run"] == pytest.approx(0.2)
    assert [c["measured"] for c in model["check"]] == [400, 600, 650]
    assert all(c["predicted"] > 0 for c in model["check"])
    ded = {d["supervisors"]: d for d in model["dedicated"]}
    assert ded[8]["grown"] < ded[8]["flat"] <= 2000 * 1.01       # 2 server cores / 1 ms of backend CPU a run
    assert ded[8]["flat_busy"]["database_cpu"] > 0.95              # what limits it
    assert "| 8 |" in compare.fleet_report(model)


def test_compare_counts_database_states_per_sample():
    rows = [(10.0 + i / 10, 1, 0, 0, 1, 0, 1) for i in range(10)]  # one backend on CPU, one waiting for IO
    assert compare.db_in_window(rows, 10.0, 11.0) == {"cpu": 1, "lock": 0, "lwlock": 0, "io": 1, "wait": 0,
                                                       "intx": 1}


@pytest.mark.timeout(30)
def test_compare_db_activity_sees_only_the_benchmarks_backends(monkeypatch):
    import conftest
    import rawdb
    import runner
    pg_url = conftest.POSTGRES_URL
    conftest._server_or_skip(pg_url).dispose()
    monkeypatch.setattr(runner, "POSTGRES_URL", pg_url)
    ns = runner.Namespace("postgresql", Path("."))
    conn, other = rawdb.bare_connect(ns.url), rawdb.bare_connect(pg_url)
    try:
        conn.execute("SELECT 1")  # psycopg opens a transaction: idle in transaction from now on
        other.execute("SELECT 1")
        with compare.DbActivity(ns.name) as activity:
            wait_until(lambda: activity.rows, 10, "a pg_stat_activity sample")
        assert activity.pids == {conn.info.backend_pid}
        assert activity.rows[0][1:] == (0, 0, 0, 0, 0, 1)
        conn.rollback()
        assert compare.wal_flush_ms(ns.url, commits=5) > 0   # its table made and dropped in the schema
        assert conn.execute("SELECT to_regclass('wal_probe')").fetchone() == (None,)
    finally:
        conn.close()
        other.close()
        ns.drop()


def test_idle_burst_lateness_is_that_of_the_last_run_of_each_instant():
    import idle
    t = 1_800_000_000.0
    runs = [{"scheduled_at": t + s, "exec_at": t + s + d, "started_at": t + s + d / 2}
            for s, d in ((0, 0.010), (0, 0.030), (1, 0.005), (1, 0.020), (2, 0.5))]
    runs.append({"scheduled_at": t + 1, "exec_at": None, "started_at": None})  # never began: ignored
    assert idle.last_of_instant_ms(runs, "exec_at", t, t + 2) == pytest.approx([30.0, 20.0])  # instant 2 is out
    assert idle.last_of_instant_ms(runs, "started_at", t + 1, t + 3) == pytest.approx([10.0, 250.0])
