"""Metrics from a runs list, pure (no I/O): what runner.py and apsched.py report.

A run is a dict with epoch-second floats (None when absent): ``job`` (name), ``kind`` (ok/hang/crash/leak),
``scheduled_at``, ``started_at`` (claim / submission), ``exec_at`` (plugin's ``execute`` began; None if
unknown), ``completed_at``, ``status`` (Completed/Failed/Timeout/Cancelled/Running), ``crashed`` (bool),
``instance`` (which supervisor ran it).
"""

from __future__ import annotations

import datetime as dt
import math

from mjsched_isolated.cron import next_run_time

UTC = dt.UTC


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, nearest rank) or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def occurrences(cron_expression: str, t0: float, t1: float) -> int:
    """How many occurrences of ``cron_expression`` (UTC) fall in ``[t0, t1)``, by the engine's cron module."""
    count, when = 0, next_run_time(cron_expression, "UTC",
                                   dt.datetime.fromtimestamp(t0, UTC) - dt.timedelta(microseconds=1))
    end = dt.datetime.fromtimestamp(t1, UTC)
    while when < end:
        count += 1
        when = next_run_time(cron_expression, "UTC", when)
    return count


def busy_stretches(intervals: list[tuple[float, float]], threshold: int, t0: float, t1: float) -> list[float]:
    """Lengths (s) of the stretches within ``[t0, t1)`` where at least ``threshold`` of ``intervals`` overlap."""
    events = sorted([(max(a, t0), 1) for a, b in intervals if b > t0 and a < t1] +
                    [(min(b, t1), -1) for a, b in intervals if b > t0 and a < t1], key=lambda e: (e[0], e[1]))
    stretches, level, since = [], 0, None
    for when, delta in events:
        level += delta
        if level >= threshold and since is None:
            since = when
        elif level < threshold and since is not None:
            stretches.append(when - since)
            since = None
    if since is not None:
        stretches.append(t1 - since)
    return [s for s in stretches if s > 0]


def summarize(runs: list[dict], specs: list[dict], t0: float, t1: float, cap: int, end: float) -> dict:
    """Metrics over the window ``[t0, t1)`` (occurrences scheduled in it). ``specs``: workload.job_specs;
    ``cap``: slots per instance; ``end``: when the process stopped (open runs end there).

    Keys: runs, runs_per_s, late_p50_ms / late_p99_ms / late_max_ms (started_at - scheduled_at, all runs),
    healthy_late_p99_ms, exec_late_p50_ms / exec_late_p99_ms (exec_at - scheduled_at), expected, missed,
    missed_healthy, kills, crashes, starve_total_s, starve_max_s (all slots of one instance held by hung
    runs), healthy_gap_max_s (longest stretch without a healthy run starting), kill_after_deadline_p50_ms /
    _max_ms (Timeout runs: completed_at - deadline_at, i.e. from the deadline to the kill being recorded,
    where runs carry ``deadline_at``)."""
    kinds = {s["name"]: s["kind"] for s in specs}
    win = [r for r in runs if r["scheduled_at"] is not None and t0 <= r["scheduled_at"] < t1]
    late = [(r["started_at"] - r["scheduled_at"]) * 1000 for r in win if r["started_at"] is not None]
    healthy = [r for r in win if kinds.get(r["job"]) == "ok"]
    healthy_late = [(r["started_at"] - r["scheduled_at"]) * 1000 for r in healthy if r["started_at"] is not None]
    exec_late = [(r["exec_at"] - r["scheduled_at"]) * 1000 for r in win if r.get("exec_at")]
    expected = {s["name"]: occurrences(s["cron_expression"], t0, t1) for s in specs}
    done = {}
    for r in win:
        done[r["job"]] = done.get(r["job"], 0) + 1
    missed = {name: max(0, n - done.get(name, 0)) for name, n in expected.items()}
    hung: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        if kinds.get(r["job"]) == "hang" and r["started_at"] is not None:
            hung.setdefault(r["instance"], []).append((r["started_at"], r["completed_at"] or end))
    stretches = [s for ivs in hung.values() for s in busy_stretches(ivs, cap, t0, t1)]
    starts = sorted(r["started_at"] for r in runs if kinds.get(r["job"]) == "ok" and r["started_at"] is not None
                    and t0 <= r["started_at"] < t1)
    gaps = [b - a for a, b in zip([t0, *starts], [*starts, t1])]
    started_in = [r for r in runs if r["started_at"] is not None and t0 <= r["started_at"] < t1]
    overrun = [(r["completed_at"] - r["deadline_at"]) * 1000 for r in started_in
               if r["status"] == "Timeout" and r.get("deadline_at") and r["completed_at"]]
    return {
        "runs": len(started_in), "runs_per_s": len(started_in) / (t1 - t0),
        "late_p50_ms": pct(late, 50), "late_p99_ms": pct(late, 99), "late_max_ms": max(late, default=None),
        "healthy_late_p99_ms": pct(healthy_late, 99),
        "exec_late_p50_ms": pct(exec_late, 50), "exec_late_p99_ms": pct(exec_late, 99),
        "expected": sum(expected.values()), "missed": sum(missed.values()),
        "missed_healthy": sum(n for name, n in missed.items() if kinds.get(name) == "ok"),
        "kills": sum(r["status"] == "Timeout" for r in started_in),
        "crashes": sum(bool(r.get("crashed")) for r in started_in),
        "starve_total_s": sum(stretches), "starve_max_s": max(stretches, default=0.0),
        "healthy_gap_max_s": max(gaps, default=t1 - t0),
        "kill_after_deadline_p50_ms": pct(overrun, 50), "kill_after_deadline_max_ms": max(overrun, default=None),
    }
