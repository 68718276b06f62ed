"""One command for the benchmarks.

    python benchmarks/run.py --quick            # < 2 min: headline table only (results in a temp dir)
    python benchmarks/run.py --full             # every experiment of sweep.py (~20 min), then report.py
    python benchmarks/run.py --full --only caps,leases   # some experiments, then the report

``--results DIR`` (default ``benchmarks/results`` for --full) is where JSON/CSV/PNG/REPORT.md go.
The headline table: engine vs APScheduler (same workload, same run), a small cap sweep, and the simulator
against the real run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sweep

FULL = ("compare", "saturation", "caps", "leases", "ttl", "memory", "fleet")


def _f(x, fmt=".0f") -> str:
    return "-" if x is None else format(x, fmt)


def headline(results: Path) -> str:
    """The headline table as text, from ``compare.json`` and ``caps.json`` in ``results``."""
    comp = json.loads((results / "compare.json").read_text())
    e, a, ag = comp["engine"], comp["aps"], comp["agreement"]
    lines = [f"load average now: {os.getloadavg()}",
             "", "engine vs APScheduler (workload mixed.toml, cap 5, SQLite, same run):",
             f"{'':24}{'mjsched':>12}{'APScheduler':>14}{'ratio':>8}"]
    for key, label in (("runs_per_s", "runs/s"), ("exec_late_p50_ms", "exec lateness p50 ms"),
                       ("exec_late_p99_ms", "exec lateness p99 ms"), ("missed_healthy", "healthy missed"),
                       ("kills", "hung runs killed"), ("sup_cpu_ms_per_run", "CPU ms / run"),
                       ("sup_peak_rss_mb", "peak RSS MB")):
        ratio = e[key] / a[key] if e.get(key) and a.get(key) else None
        lines.append(f"{label:24}{_f(e[key], '.1f'):>12}{_f(a[key], '.1f'):>14}{_f(ratio, '.2f'):>8}")
    lines.append(f"APScheduler 'maximum number of running instances reached' skips: {a['aps_max_instances_skips']}")
    raw = {f"{r['backend']} {r.get('path', 'store')}": r["runs_per_s"] for r in comp["raw"]}
    lines.append("raw database limit (claim+finish statements only, through our store / the bare driver): "
                 f"{', '.join(f'{k} {v:.0f} runs/s' for k, v in raw.items())}")
    caps_path = results / "caps.json"
    if caps_path.exists():
        rows = json.loads(caps_path.read_text())
        lines += ["", "cap sweep (sweep.toml, hung 10 %):",
                  f"{'cap':>5}{'lease s':>9}{'runs/s':>9}{'late p99 ms':>13}{'starved s':>11}"]
        for r in rows:
            lines.append(f"{r['cap']:>5}{r['lease_timeout_s']:>9.0f}{r['runs_per_s']:>9.1f}{_f(r['late_p99_ms']):>13}"
                         f"{r['starve_total_s']:>11.1f}")
    lines += ["", "simulator vs real run (same workload and window):", f"{'':16}{'real':>10}{'sim':>10}"]
    for key in ("runs", "skipped", "missed", "kills", "late_p50_ms", "late_p99_ms"):
        lines.append(f"{key:16}{_f(ag['real'][key]):>10}{_f(ag['sim'][key]):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--full", action="store_true")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(FULL)} (with --full)")
    ap.add_argument("--results")
    args = ap.parse_args(argv)
    began = time.time()
    if args.quick:
        results = Path(args.results or tempfile.mkdtemp(prefix="mjsched-quick-"))
        print(f"quick run; results in {results}", flush=True)
        sweep.compare(results, duration_s=15, raw_runs=500)
        sweep.caps(results, duration_s=12, repeats=1, caps=(1, 5, 10), leases=(2.0,))
    else:
        results = Path(args.results or HERE / "results")
        for name in (args.only.split(",") if args.only else FULL):
            print(f"== {name} ({time.time() - began:.0f} s)", flush=True)
            getattr(sweep, name)(results)
        import report
        report.write(results)
    print(headline(results))
    print(f"\ntotal {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
