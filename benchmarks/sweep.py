"""The experiments behind REPORT.md, each writing ``<results>/<name>.json`` and ``<name>.csv``.

    python benchmarks/sweep.py caps|leases|ttl|memory|compare|fleet [--results DIR] [--duration-s S] [--repeats N]

* ``compare``: the same workload (``mixed.toml``, cap 5, lease timeout 5 s) on this engine and on APScheduler
  one after the other, the raw database limit (rawdb.py, through our store and with the bare driver) on SQLite
  and PostgreSQL, and the simulator on the
  engine run's workload and window (``agreement``).
* ``caps``: cap 1, 2, 5, 10, 20 x lease timeout 1 s and 5 s, hung share 10 % (``sweep.toml``).
* ``leases``: lease timeout 1, 2, 5 s x hung share 0, 10 %, 30 % at cap 5.
* ``ttl``: ``ttl.toml`` (10 jobs every second, 800 ms runs), 2 supervisors on PostgreSQL, one SIGKILLed 8 s
  in, lease TTL 3, 6, 12 s (renewal every TTL/3): when its runs were lost and its jobs ran again.
* ``memory``: ~10,000 runs including ~100 kills (``memory.toml``, cap 10, lease timeout 1 s): supervisor
  RSS against runs completed.
* ``fleet``: the simulator on ``fleet.toml``: 100 supervisors x cap 10, a million jobs, 3 h 15 min, a
  supervisor lost every hour (1 min after each :00 burst), the database 3x slower from 1:00 to 1:20;
  with max_jitter_s 0 and 600.
* ``saturation``: ``saturate.toml`` (1000 jobs every second, 1 ms runs), cap 10, 20 s: the engine's ceiling in
  runs/s, compared with the raw database limit.
Every point is repeated ``--repeats`` times (default 2); each row carries ``rep`` and ``loadavg_1m``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
import time
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import apsched
import metrics
import rawdb
import runner
import simulator
import workload as wl

WL = HERE / "workloads"


def save(results: Path, name: str, data) -> None:
    """``data`` to ``<name>.json``, and its flat fields to ``<name>.csv`` (one row per measurement)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    if isinstance(data, dict):  # one measurement, or compare's {"engine", "aps", "raw", ...}: its flat rows
        data = [data["engine"], data["aps"], *data["raw"]] if "aps" in data else [data]
    if data:
        keys = list(dict.fromkeys(k for row in data for k in row if not isinstance(row[k], (list, dict))))
        with open(results / f"{name}.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore", restval="")
            writer.writeheader()
            writer.writerows(data)


def _with(w: wl.Workload, **faults) -> wl.Workload:
    return msgspec.structs.replace(w, faults=msgspec.structs.replace(w.faults, **faults))


def _log(row: dict) -> None:
    keys = ("engine", "cap", "lease_timeout_s", "lease_ttl_s", "hang", "rep", "runs_per_s", "late_p99_ms",
            "starve_total_s", "kills", "recovery_s", "loadavg_1m")
    print("  " + " ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}"
                          for k in keys if k in row), flush=True)


def caps(results: Path, duration_s: float = 14, repeats: int = 2, caps=(1, 2, 5, 10, 20), leases=(1.0, 5.0)) -> list:
    w = _with(wl.load(WL / "sweep.toml"), hang=0.1)
    rows = []
    for rep in range(repeats):
        for lease in leases:
            for cap in caps:
                rows.append({**runner.run_engine(w, cap=cap, duration_s=duration_s, lease_timeout_s=lease), "rep": rep})
                _log(rows[-1])
    save(results, "caps", rows)
    return rows


def leases(results: Path, duration_s: float = 14, repeats: int = 2, leases=(1.0, 2.0, 5.0), hangs=(0.0, 0.1, 0.3),
           cap: int = 5) -> list:
    base = wl.load(WL / "sweep.toml")
    rows = []
    for rep in range(repeats):
        for hang in hangs:
            for lease in leases:
                rows.append({**runner.run_engine(_with(base, hang=hang), cap=cap, duration_s=duration_s,
                                                 lease_timeout_s=lease), "rep": rep})
                _log(rows[-1])
    save(results, "leases", rows)
    return rows


def ttl(results: Path, duration_s: float = 30, repeats: int = 2, ttls=(3.0, 6.0, 12.0)) -> list:
    w = wl.load(WL / "ttl.toml")
    rows = []
    for rep in range(repeats):
        for t in ttls:
            rows.append({**runner.run_engine(w, cap=5, duration_s=duration_s, lease_timeout_s=5.0, lease_ttl_s=t,
                                             backend="postgresql", supervisors=2, kill_one_at_s=8.0),
                         "rep": rep})
            _log(rows[-1])
    save(results, "ttl", rows)
    return rows


def memory(results: Path, duration_s: float = 110) -> dict:
    w = wl.load(WL / "memory.toml")
    res = runner.run_engine(w, cap=10, duration_s=duration_s, lease_timeout_s=1.0, keep_runs=True)
    runs, series = res.pop("_runs"), res.pop("_series")
    done = sorted(r["completed_at"] for r in runs if r["completed_at"])
    import bisect
    res["rss_series"] = [(t - series[0][0], bisect.bisect_right(done, t), rss) for t, _, rss, _ in series]
    res["total_kills"] = sum(r["status"] == "Timeout" for r in runs)
    _log(res)
    save(results, "memory", res)
    return res


def saturation(results: Path, duration_s: float = 20, cap: int = 10) -> dict:
    """The engine's ceiling: ``saturate.toml`` demands 1000 runs/s, more than one supervisor can claim; the raw
    SQLite limit is measured right before it (``raw``), under the same load."""
    raw, bare = rawdb.raw_limit(2000, "sqlite"), rawdb.bare_limit(2000, "sqlite")
    res = runner.run_engine(wl.load(WL / "saturate.toml"), cap=cap, duration_s=duration_s, lease_timeout_s=5.0)
    res["raw"], res["raw_bare"] = raw, bare
    _log(res)
    save(results, "saturation", res)
    return res


def agreement(real: dict, w: wl.Workload, cap: int, lease_timeout_s: float) -> dict:
    """Simulate the real run's workload from its first run to its stop, calibrated with its measured supervisor
    CPU per run and slot respawn time (:func:`respawn_s`), and compute the same metrics over the same window.
    Returns {"real": ..., "sim": ...}."""
    runs = real["_runs"]
    first = min(r["started_at"] for r in runs if r["started_at"])
    t0, t1 = first + 3.0, first + 3.0 + real["window_s"]
    half_ms = max(0.1, real["sup_cpu_ms_per_run"] / 2 - 1.0)
    cfg = simulator.SimConfig(cap=cap, lease_timeout_s=lease_timeout_s, start=first, horizon_s=t1 + 2 - first,
                              claim_ms=half_ms, finish_ms=half_ms, stmt_ms=0.4, respawn_s=respawn_s(runs))
    sim = simulator.Simulator(w, cfg)
    sim.run()
    sim_m = metrics.summarize(sim.runs, wl.job_specs(w), t0, t1, cap, t1 + 2)
    sim_m.update(skipped=sim.stats["skipped"], sup_cpu_ms_per_run=real["sup_cpu_ms_per_run"],
                 decide_calls=sim.stats["decide_calls"])
    return {"real": {k: v for k, v in real.items() if not k.startswith("_")}, "sim": sim_m,
            "calibration_claim_ms": half_ms, "calibration_respawn_s": cfg.respawn_s}


def respawn_s(runs: list[dict], default: float = 0.1) -> float:
    """How long a killed run's slot stays empty, measured: the median gap between a hung job's Timeout and
    its next start (a hung job is always overdue, so it is claimed as soon as a worker is back)."""
    gaps = []
    by_job: dict[str, list[dict]] = {}
    for r in runs:
        if r["kind"] == "hang" and r["started_at"] is not None:
            by_job.setdefault(r["job"], []).append(r)
    for job_runs in by_job.values():
        job_runs.sort(key=lambda r: r["started_at"])
        gaps += [b["started_at"] - a["completed_at"] for a, b in itertools.pairwise(job_runs)
                 if a["status"] == "Timeout" and a["completed_at"]]
    return metrics.pct(gaps, 50) if gaps else default


def compare(results: Path, duration_s: float = 60, cap: int = 5, lease_timeout_s: float = 5.0,
            raw_runs: int = 2000) -> dict:
    path = WL / "mixed.toml"
    w = wl.load(path)
    out = {"raw": [rawdb.raw_limit(raw_runs, "sqlite"), rawdb.bare_limit(raw_runs, "sqlite")]}
    try:
        out["raw"] += [rawdb.raw_limit(raw_runs, "postgresql"), rawdb.bare_limit(raw_runs, "postgresql")]
    except Exception as exc:  # noqa: BLE001 - no PostgreSQL server here: report SQLite only
        print(f"  PostgreSQL raw limit skipped: {str(exc).splitlines()[0]}", flush=True)
    print(f"  raw limit: {[round(r['runs_per_s']) for r in out['raw']]} runs/s", flush=True)
    engine = runner.run_engine(w, cap=cap, duration_s=duration_s, lease_timeout_s=lease_timeout_s, keep_runs=True)
    engine.pop("_series")
    _log(engine)
    out["aps"] = apsched.run_aps(str(path), cap=cap, duration_s=duration_s)
    _log(out["aps"])
    out["agreement"] = agreement(engine, w, cap, lease_timeout_s)
    out["engine"] = out["agreement"]["real"]
    save(results, "compare", out)
    return out


def fleet(results: Path, horizon_s: float = 11700, jobs: int | None = None, supervisors: int = 100,
          jitters=(0.0, 600.0)) -> list:
    base = wl.load(WL / "fleet.toml")
    rows = []
    for jitter in jitters:
        w = msgspec.structs.replace(base, max_jitter_s=jitter, jobs=jobs or base.jobs)
        cfg = simulator.SimConfig(supervisors=supervisors, cap=10, lease_timeout_s=60.0, lease_ttl_s=30.0, renew_s=10.0,
                                  horizon_s=horizon_s, lose_every_s=3600.0, lose_first_s=3660.0,
                                  db_slow=(3600.0, 4800.0, 3.0), keep_runs=False)
        began = time.perf_counter()
        summary = simulator.Simulator(w, cfg).run()
        rows.append({"jobs": w.jobs, "supervisors": supervisors, "cap": 10, "max_jitter_s": jitter,
                     "horizon_s": horizon_s, **summary, "wall_s": time.perf_counter() - began,
                     "loadavg_1m": os.getloadavg()[0]})
        print(f"  fleet jitter={jitter}: {summary['runs']} runs, p99 {summary['late_p99_ms']:.0f} ms, "
              f"{rows[-1]['wall_s']:.1f} s", flush=True)
    save(results, "fleet", rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=("caps", "leases", "ttl", "memory", "compare", "fleet", "saturation"))
    ap.add_argument("--results", default="bench-results",
                    help="where JSON/CSV go (default ./bench-results; `run.py --full` writes benchmarks/results)")
    ap.add_argument("--duration-s", type=float, help="seconds per point (not for fleet, a simulation)")
    ap.add_argument("--repeats", type=int, help="repetitions per point (caps, leases, ttl only; default 2)")
    args = ap.parse_args(argv)
    if args.experiment == "fleet" and args.duration_s is not None:
        ap.error("--duration-s: fleet is a simulation of fixed length; it takes no duration")
    if args.repeats is not None and args.experiment not in ("caps", "leases", "ttl"):
        ap.error(f"--repeats: only caps, leases and ttl repeat their points, not {args.experiment}")
    if args.duration_s is not None and args.duration_s < runner.MIN_DURATION_S:
        ap.error(f"--duration-s: must be at least {runner.MIN_DURATION_S:g} s")
    kw = {} if args.duration_s is None else {"duration_s": args.duration_s}
    if args.repeats is not None:
        kw["repeats"] = args.repeats
    fn = globals()[args.experiment]
    fn(Path(args.results), **kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
