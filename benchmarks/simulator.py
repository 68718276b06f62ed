"""Discrete-event simulator of a fleet of supervisors, driven by the engine's own decision functions.

    python benchmarks/simulator.py benchmarks/workloads/fleet.toml --supervisors 100 --cap 10 --horizon-s 7200 \\
        --lose-every-s 3600 --db-slow 3600:4800:3

No processes and no database: a clock (heapq of events) and the rules the engine applies, called from the
engine itself: :func:`mjsched_isolated.planner.decide_missed_run` (the missed-run policy: run now, run the
missed occurrence, or skip), :func:`planner.run_timeout_s` (deadline), :func:`planner.jitter_s`, and
:func:`mjsched_isolated.cron.next_run_time`, which precomputes every occurrence of each distinct cron
expression over the horizon (``exact=True`` calls :func:`planner.decide` itself per claim instead; the
tests check both give the same runs). Rules modelled as in store.py / supervisor.py:

* due selection: jobs with ``next_run_at <= now``, earliest first, only while a supervisor has an idle slot
  (``due_jobs(limit=idle)``); the supervisor whose loop is free first takes it;
* cap: ``cap`` slots per supervisor; a killed or crashed worker's slot is back after ``respawn_s``;
* leases: Skip/Queue runs hold the job lease until they end, or until their supervisor's liveness lease
  (last renewal + ``lease_ttl_s``) expires; a Skip occurrence that finds the lease live is skipped, a Queue
  (or RunAll) job waits for it; Concurrent takes no lease;
* deadline: a run longer than ``run_timeout_s`` is killed at its deadline (status Timeout);
* sweep: a dead supervisor's runs are Failed ("abandoned") when its lease expires; its jobs are free again
  at that moment; it is replaced after ``restart_s``;
* cost: each claim costs its supervisor ``claim_ms`` of CPU plus ``claim_stmts`` statements (default 2, the
  per-row path), each finish ``finish_ms`` plus ``finish_stmts`` (default 3), each skip 1 statement, at
  ``stmt_ms`` each (times the slowdown factor while the database is slow); a supervisor does these one at a
  time. Batched paths send fewer round trips per run: pass the measured counts (``compare.py --fleet`` does).

Not modelled: RunAll's ``max_catchup_runs`` bound in the fast path, start_at/end_at, manual runs, heartbeats.

:class:`Fleet` is the other model here, for a fleet's throughput only: supervisors, workers and the database
server's backends as processes on shared or dedicated cores, the WAL flush as group commit, with costs per
run measured on a real fleet (``compare.py --fleet`` calibrates it and checks it against the runs).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import heapq
import json
import math
import random
import sys
import time
from array import array
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import metrics
import workload as wl

from mjsched_isolated import cron, planner

UTC = dt.UTC
INF = float("inf")
FINISH, SLOT_BACK, DIE, RESTART, RELEASE = range(5)


class SimConfig(msgspec.Struct, kw_only=True):
    """Durations in seconds unless ``_ms``. ``start``: epoch seconds of the simulated start.
    ``db_slow``: (from_s, to_s, factor) relative to start. ``lose_every_s``: one supervisor is SIGKILLed
    every so often (the first ``lose_first_s`` in, default half of that), replaced after ``restart_s``."""

    supervisors: int = 1
    cap: int = 5
    lease_timeout_s: float = 600.0
    lease_ttl_s: float = 30.0
    renew_s: float = 10.0
    rescan_s: float = 1.0
    horizon_s: float = 60.0
    start: float = 1_798_761_600.0  # 2027-01-01T00:00:00Z
    claim_ms: float = 3.0
    finish_ms: float = 3.0
    stmt_ms: float = 0.4
    claim_stmts: float = 2.0  # database round trips per claim (a fraction: batched claims share theirs)
    finish_stmts: float = 3.0  # per finish
    respawn_s: float = 0.1  # measured: ~60 ms from a kill to the next claim on that slot
    restart_s: float = 60.0
    lose_every_s: float | None = None
    lose_first_s: float | None = None
    db_slow: tuple[float, float, float] | None = None
    exact: bool = False
    keep_runs: bool = True


class Simulator:
    """One simulation of workload ``w`` under ``cfg``. :meth:`run` returns a summary dict; with
    ``cfg.keep_runs`` the runs are in ``self.runs`` as :mod:`metrics` dicts."""

    def __init__(self, w: wl.Workload, cfg: SimConfig) -> None:
        self.w, self.cfg = w, cfg
        cols = wl.job_columns(w)
        self.n = w.jobs
        exprs = sorted({wl.CRONS[k] for k in cols["cron_kind"]})
        index = {wl.CRONS[k]: exprs.index(wl.CRONS[k]) for k in wl.CRONS if wl.CRONS[k] in exprs}
        self.exprs = exprs
        self.job_cron = array("b", (index[wl.CRONS[k]] for k in cols["cron_kind"]))
        self.kind = cols["kind"]
        self.runtime_s = [ms / 1000.0 for ms in cols["runtime_ms"]]
        self.occ = [self._occurrences(e) for e in exprs]
        self.policy, self.mode = w.missed_run_policy, w.concurrency_mode
        self.row = {"max_runtime_minutes": None, "max_jitter_s": w.max_jitter_s}  # what run_timeout_s reads
        self.timeout_s = planner.run_timeout_s(self.row, cfg.lease_timeout_s)
        self.stats = {"runs": 0, "skipped": 0, "kills": 0, "crashes": 0, "abandoned": 0, "completed": 0,
                      "decide_calls": 0}
        self.late_ms = array("d")
        self.runs: list[dict] = []
        self._held: dict[int, float] = {}  # Queue/RunAll job -> its occurrence, waiting for the lease
        self.hourly: dict[int, dict] = {}

    def _occurrences(self, expr: str) -> list[float]:
        """Every occurrence from start - 1 h to the end of the horizon + 1 h (epoch s), by cron.next_run_time."""
        start, end = self.cfg.start - 3600, self.cfg.start + self.cfg.horizon_s + 3600
        out, when = [], cron.next_run_time(expr, "UTC", dt.datetime.fromtimestamp(start, UTC))
        while when.timestamp() <= end:
            out.append(when.timestamp())
            when = cron.next_run_time(expr, "UTC", when)
        return out

    def _after(self, j: int, t: float) -> float:
        """The job's first occurrence strictly after ``t``."""
        occ = self.occ[self.job_cron[j]]
        i = bisect.bisect_right(occ, t)
        return occ[i] if i < len(occ) else INF

    def _jitter(self, j: int, when: float) -> float:
        if not self.w.max_jitter_s or when == INF or self.exprs[self.job_cron[j]] != wl.CRONS["hourly"]:
            return 0.0
        return planner.jitter_s({"name": wl.job_name(self.w, j), "max_jitter_s": self.w.max_jitter_s},
                                dt.datetime.fromtimestamp(when, UTC))

    def decide(self, j: int, scheduled: float, now: float) -> tuple[bool, float]:
        """(run?, next next_run_at) for job ``j``'s due occurrence ``scheduled`` at ``now``."""
        self.stats["decide_calls"] += 1
        if self.cfg.exact:
            row = {"cron_expression": self.exprs[self.job_cron[j]], "timezone": "UTC", "name": wl.job_name(self.w, j),
                   "next_run_at": dt.datetime.fromtimestamp(scheduled, UTC), "missed_run_policy": self.policy,
                   "max_jitter_s": self.w.max_jitter_s if self.exprs[self.job_cron[j]] == wl.CRONS["hourly"] else 0.0}
            d = planner.decide(row, dt.datetime.fromtimestamp(now, UTC))
            return d.run, d.next_run_at.timestamp() if d.next_run_at else INF
        base = scheduled - self._unjitter(j, scheduled)
        following = self._after(j, base)
        action, advance = planner.decide_missed_run(self.policy, base, following, now)
        if action == "SkipAndAdvance":
            nxt = self._after(j, now)
            return False, nxt + self._jitter(j, nxt)
        nxt = self._after(j, max(now, scheduled)) if advance == "Now" else following
        return True, nxt + self._jitter(j, nxt)

    def _unjitter(self, j: int, scheduled: float) -> float:
        """The jitter already in ``scheduled`` (the occurrence it belongs to is the latest one <= it)."""
        if not self.w.max_jitter_s or self.exprs[self.job_cron[j]] != wl.CRONS["hourly"]:
            return 0.0
        occ = self.occ[self.job_cron[j]]
        base = occ[max(0, bisect.bisect_right(occ, scheduled) - 1)]
        return scheduled - base

    # -- the event loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, n = self.cfg, self.n
        t_end = cfg.start + cfg.horizon_s
        nxt = [self._after(j, cfg.start) for j in range(n)]
        nxt = [t + self._jitter(j, t) for j, t in enumerate(nxt)]
        self.next_run = nxt
        ready = sorted((t, j) for j, t in enumerate(nxt) if t < INF)  # the (status, next_run_at) index
        holder = array("i", [-1]) * n           # supervisor holding the job lease, -1 free
        lease_exp = array("d", [0.0]) * n       # expected_completion_at
        waiting: set[int] = set()               # Queue/RunAll jobs waiting for a live lease
        n_sup = cfg.supervisors
        alive = [True] * n_sup
        born = [cfg.start] * n_sup
        idle = [cfg.cap] * n_sup
        cpu = [cfg.start] * n_sup               # when each supervisor's loop is free
        gen = [0] * n_sup
        sup_lease_end = [INF] * n_sup
        inflight: list[dict[int, tuple]] = [{} for _ in range(n_sup)]
        events: list[tuple] = []
        seq = 0
        idle_heap = [(cfg.start, s) for s in range(n_sup)]
        heapq.heapify(idle_heap)
        if cfg.lose_every_s:
            first = cfg.lose_first_s if cfg.lose_first_s is not None else cfg.lose_every_s / 2
            k, t = 0, cfg.start + first
            while t < t_end:
                events.append((t, seq, DIE, k % n_sup, 0))
                seq += 1
                k, t = k + 1, t + cfg.lose_every_s
            heapq.heapify(events)

        def slow(t: float) -> float:
            d = cfg.db_slow
            return d[2] if d and cfg.start + d[0] <= t < cfg.start + d[1] else 1.0

        def lease_live(j: int, t: float) -> bool:
            h = holder[j]
            return h >= 0 and lease_exp[j] >= t and sup_lease_end[h] > t

        def push_ready(j: int) -> None:
            if nxt[j] < INF:
                heapq.heappush(ready, (nxt[j], j))

        keep = cfg.keep_runs
        timeout_s, mode, kind, runtime_s = self.timeout_s, self.mode, self.kind, self.runtime_s
        stats, late = self.stats, self.late_ms
        while True:
            while ready and ready[0][0] != nxt[ready[0][1]]:
                heapq.heappop(ready)                   # stale index entry
            while idle_heap and (not alive[idle_heap[0][1]] or idle[idle_heap[0][1]] <= 0
                                 or idle_heap[0][0] != cpu[idle_heap[0][1]]):
                heapq.heappop(idle_heap)
            te = events[0][0] if events else INF
            if ready and idle_heap:
                now = max(ready[0][0], idle_heap[0][0])
                if now <= te:
                    if now >= t_end:
                        break
                    _, j = heapq.heappop(ready)
                    s = idle_heap[0][1]
                    scheduled = nxt[j]
                    if mode != "Concurrent" and (self.policy == "RunAll" or mode == "Queue") and lease_live(j, now):
                        waiting.add(j)
                        self._held[j] = scheduled      # the occurrence waits, out of the index
                        nxt[j] = -1.0
                        continue
                    run, after = self.decide(j, scheduled, now)
                    nxt[j] = after
                    if not run or (mode == "Skip" and lease_live(j, now)):
                        stats["skipped"] += 1
                        cpu[s] = now + cfg.stmt_ms * slow(now) / 1000
                        heapq.heappush(idle_heap, (cpu[s], s))
                        push_ready(j)
                        continue
                    start = now + (cfg.claim_ms + cfg.claim_stmts * cfg.stmt_ms * slow(now)) / 1000
                    cpu[s] = start
                    idle[s] -= 1
                    if idle[s] > 0:
                        heapq.heappush(idle_heap, (cpu[s], s))
                    k = kind[j]
                    length = INF if k == "hang" else runtime_s[j]
                    status = "Timeout" if length > timeout_s else "Failed" if k == "crash" else "Completed"
                    end = start + min(length, timeout_s)
                    if mode != "Concurrent":
                        holder[j], lease_exp[j] = s, start + timeout_s + cfg.lease_ttl_s
                    rec = {"job": wl.job_name(self.w, j), "kind": k, "scheduled_at": scheduled, "started_at": start,
                           "exec_at": None, "completed_at": None, "status": "Running", "crashed": False,
                           "instance": f"sim-{s}"} if keep else None
                    run_id = stats["runs"]
                    stats["runs"] += 1
                    lat = (start - scheduled) * 1000
                    late.append(lat)
                    h = self.hourly.setdefault(int((start - cfg.start) // 3600), {"runs": 0, "late": array("d")})
                    h["runs"] += 1
                    h["late"].append(lat)
                    inflight[s][run_id] = (j, status, rec)
                    heapq.heappush(events, (end, seq, FINISH, s, (gen[s], run_id)))
                    seq += 1
                    if keep:
                        self.runs.append(rec)
                    push_ready(j)
                    continue
            if not events or te >= t_end:
                break
            t, _, what, s, payload = heapq.heappop(events)
            if what == FINISH:
                g, run_id = payload
                if g != gen[s] or run_id not in inflight[s]:
                    continue                          # its supervisor died: abandoned already
                j, status, rec = inflight[s].pop(run_id)
                stats[{"Timeout": "kills", "Failed": "crashes"}.get(status, "completed")] += 1
                if rec is not None:
                    rec.update(completed_at=t, status=status, crashed=status == "Failed")
                cpu[s] = max(cpu[s], t) + (cfg.finish_ms + cfg.finish_stmts * cfg.stmt_ms * slow(t)) / 1000
                if holder[j] == s:
                    holder[j] = -1
                    if j in waiting:
                        waiting.discard(j)
                        nxt[j] = self._held.pop(j)
                        push_ready(j)
                if status == "Completed":
                    idle[s] += 1
                else:                                 # the worker was killed or died: respawn
                    heapq.heappush(events, (t + cfg.respawn_s, seq, SLOT_BACK, s, gen[s]))
                    seq += 1
                heapq.heappush(idle_heap, (cpu[s], s))
            elif what == SLOT_BACK:
                if payload == gen[s] and alive[s]:
                    idle[s] += 1
                    heapq.heappush(idle_heap, (cpu[s], s))
            elif what == DIE:
                if not alive[s]:
                    continue
                alive[s] = False
                renewed = born[s] + math.floor((t - born[s]) / cfg.renew_s) * cfg.renew_s
                sup_lease_end[s] = lease_end = renewed + cfg.lease_ttl_s
                for j, _status, rec in inflight[s].values():
                    stats["abandoned"] += 1
                    if rec is not None:
                        rec.update(completed_at=lease_end, status="Failed")
                    if j in waiting:
                        heapq.heappush(events, (lease_end, seq, RELEASE, s, j))
                        seq += 1
                inflight[s] = {}
                gen[s] += 1
                heapq.heappush(events, (t + cfg.restart_s, seq, RESTART, s, 0))
                seq += 1
            elif what == RELEASE:
                j = payload
                if j in waiting:
                    waiting.discard(j)
                    nxt[j] = self._held.pop(j)
                    push_ready(j)
            elif what == RESTART:
                alive[s], born[s], idle[s], sup_lease_end[s] = True, t, cfg.cap, INF
                cpu[s] = t + cfg.respawn_s
                heapq.heappush(idle_heap, (cpu[s], s))
        return self.summary()

    def summary(self) -> dict:
        late = self.late_ms
        out = {**self.stats, "late_p50_ms": metrics.pct(list(late), 50), "late_p99_ms": metrics.pct(list(late), 99),
               "late_max_ms": max(late, default=None)}
        out["per_hour"] = {h: {"runs": v["runs"], "late_p50_ms": metrics.pct(list(v["late"]), 50),
                               "late_p99_ms": metrics.pct(list(v["late"]), 99), "late_max_ms": max(v["late"])}
                           for h, v in sorted(self.hourly.items())}
        return out


# -- the fleet's throughput: supervisors, workers and the database server as resources ------------------------

class FleetCosts(msgspec.Struct, kw_only=True):
    """What one run costs, measured on a real fleet (``compare.py --fleet``), in ms: ``sup_ms`` the supervisor's
    CPU, ``db_ms`` its database backend's CPU, ``wrk_ms`` the worker's CPU, ``run_ms`` the plugin's own time (a
    sleep: no CPU); ``flush_ms`` one WAL flush of the database server (its fsync: every transaction that wrote
    waits for the flush that covers its commit record; no CPU)."""

    sup_ms: float
    db_ms: float
    wrk_ms: float
    run_ms: float = 1.0
    flush_ms: float = 0.0


class FleetSpec(msgspec.Struct, kw_only=True):
    """``cores``: every process shares this many cores, as on the measured machine (each supervisor and each
    worker a session of its own, the database server's backends one session; ``others`` runnable tasks of
    other load, each a session, and ``db_others`` runnable backends serving other clients); None: dedicated
    cores - each supervisor on a core of its own, each worker on one of its own, the database server's
    backends sharing ``db_cores``. ``demand``: due runs per second (None: more than any fleet starts). Runs
    started in ``[warmup_s, horizon_s)`` are counted."""

    supervisors: int
    cap: int = 10
    cores: float | None = None
    others: float = 0.0
    db_others: float = 0.0
    db_cores: float = 2.0
    demand: float | None = None
    horizon_s: float = 3.0
    warmup_s: float = 0.5
    seed: int = 1


def fair_shares(cores: float, groups: list[tuple[float, float]]) -> list[float]:
    """Max-min fair split of ``cores`` among ``groups`` of (runnable tasks, how many such groups): each group
    gets an equal share but at most a core per runnable task, and what a group cannot use goes to the others -
    Linux's CFS between autogroups (one per session). Returns each group's cores (per group, not per entry)."""
    order = sorted(range(len(groups)), key=lambda i: groups[i][0])
    out = [0.0] * len(groups)
    left, weight = cores, sum(w for _, w in groups)
    for i in order:
        tasks, w = groups[i]
        if weight <= 0:
            break
        share = left / weight
        out[i] = min(tasks, share)
        left -= out[i] * w
        weight -= w
    return out


class _Shared:
    """Cores shared as the kernel shares them: every burst is a runnable task of a group (a session: the kernel's
    autogroup); the groups with a runnable task split ``cores`` max-min fairly (:func:`fair_shares`), a
    group's tasks split its share equally, a task using a core at most. ``others``: runnable tasks of other
    load, each a group of its own; ``extra``: group -> runnable tasks of other load inside that group (the
    database server's backends serving other clients)."""

    def __init__(self, fleet: Fleet, cores: float, others: float = 0.0, extra: dict | None = None) -> None:
        self.fleet, self.cores, self.others, self.extra = fleet, cores, others, extra or {}
        self.left: dict[object, float] = {}
        self.group: dict[object, object] = {}
        self.rate: dict[object, float] = {}
        self.last, self.version = 0.0, 0

    def _advance(self, t: float) -> None:
        dt_ = t - self.last
        if dt_ > 0:
            for key in self.left:
                self.left[key] -= dt_ * self.rate[key]
        self.last = t

    def _rates(self) -> None:
        tasks: dict[object, int] = {}
        for g in self.group.values():
            tasks[g] = tasks.get(g, 0) + 1
        keys = list(tasks)
        entries = [(tasks[g] + self.extra.get(g, 0.0), 1.0) for g in keys]
        if self.others > 0:
            entries.append((1.0, self.others))
        shares = fair_shares(self.cores, entries)
        per_task = {g: shares[i] / (tasks[g] + self.extra.get(g, 0.0)) for i, g in enumerate(keys)}
        self.rate = {p: per_task[g] for p, g in self.group.items()}

    def _plan(self, t: float) -> None:
        self.version += 1
        self._rates()
        if self.left:
            self.fleet.at(t + max(0.0, min(left / self.rate[p] for p, left in self.left.items())), self._due,
                          self.version)

    def add(self, t: float, proc: object, work_s: float, group: object) -> None:
        self._advance(t)
        self.left[proc], self.group[proc] = work_s, group
        self._plan(t)

    def _due(self, t: float, version: int) -> None:
        if version != self.version:
            return
        self._advance(t)
        for proc in [p for p, left in self.left.items() if left <= 1e-12]:
            del self.left[proc], self.group[proc]
            self.fleet.resume(t, proc)
        self._plan(t)


class _WalFlush:
    """Group commit: a transaction waits for the flush that covers its commit record - the one under way if it
    began after the commit, else the next, which begins when the current one ends and covers every transaction
    that committed meanwhile. One flush at a time (``flush_s`` each): the database's serial part."""

    def __init__(self, fleet: Fleet, flush_s: float) -> None:
        self.fleet, self.flush_s = fleet, flush_s
        self.busy = False
        self.next: list = []
        self.flushes = 0
        self.since: dict[object, float] = {}
        self.waited_s = 0.0

    def commit(self, t: float, proc: object) -> None:
        self.next.append(proc)
        self.since[proc] = t
        if not self.busy:
            self._start(t)

    def _start(self, t: float) -> None:
        self.busy, batch, self.next = True, self.next, []
        self.flushes += 1
        self.fleet.at(t + self.flush_s, self._done, batch)

    def _done(self, t: float, batch: list) -> None:
        self.busy = False
        for proc in batch:
            self.waited_s += t - self.since.pop(proc)
            self.fleet.resume(t, proc)
        if self.next:
            self._start(t)


class Fleet:
    """A discrete-event model of a saturated fleet's throughput: ``spec.supervisors`` supervisors of
    ``spec.cap`` workers on one database, each supervisor a single thread that alternates between recording
    every result its workers sent (one transaction) and claiming a due run for every idle worker (one
    transaction), as the engine's loop does; a transaction of k runs costs k x half of the supervisor's CPU per
    run, then k x half of the backend's, then the wait for its WAL flush (:class:`_WalFlush`), during which
    the supervisor waits. A worker spends ``wrk_ms`` of CPU and ``run_ms`` of sleep on each run. CPU is a
    processor-sharing pool (:class:`_Shared`): the machine's ``cores`` for everyone, or with dedicated cores
    one per supervisor and per worker and ``db_cores`` for the server. Not modelled: the due read's cost per
    poll apart from per run (it is in the per-run figures), lock waits between supervisors (measured ~0 with
    SKIP LOCKED), network latency, the rescan and lease renewals. :meth:`run` returns runs_per_s and what
    limited it (busy shares of each resource)."""

    def __init__(self, costs: FleetCosts, spec: FleetSpec) -> None:
        self.costs, self.spec = costs, spec
        self.events: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        shared = spec.cores is not None
        machine = _Shared(self, spec.cores, spec.others, {"db": spec.db_others}) if shared else None
        self.sup_cpu = machine                      # None: a core of its own (a plain delay)
        self.wrk_cpu = machine
        self.db_cpu = machine if shared else _Shared(self, spec.db_cores)
        self.wal = _WalFlush(self, costs.flush_ms / 1000)
        n = spec.supervisors
        self.free = [spec.cap] * n
        self.results: list[int] = [0] * n            # results waiting to be recorded, per supervisor
        self.sleeping: set[int] = set()
        self.claimed = 0                             # due runs taken so far (against spec.demand)
        self.started: list[float] = []
        self.commits = 0
        self.procs: dict[object, object] = {}
        self.rng = random.Random(spec.seed)

    # -- the event machinery: processes are generators yielding ("cpu", pool, s), ("sleep", s), ("commit",),
    # ("idle",)
    def at(self, t: float, fn, arg) -> None:
        heapq.heappush(self.events, (t, self.seq, fn, arg))
        self.seq += 1

    def resume(self, t: float, proc) -> None:
        try:
            req = next(proc)
        except StopIteration:
            return
        kind = req[0]
        if kind == "cpu":
            if req[1] is None:
                self.at(t + req[2], self.resume, proc)
            else:
                req[1].add(t, proc, req[2], req[3])
        elif kind == "sleep":
            self.at(t + req[1], self.resume, proc)
        elif kind == "commit":
            self.commits += 1
            if self.wal.flush_s > 0:
                self.wal.commit(t, proc)
            else:
                self.at(t, self.resume, proc)
        # "idle": resumed by wake()

    def wake(self, t: float, s: int) -> None:
        if s in self.sleeping:
            self.sleeping.discard(s)
            self.resume(t, self.procs[s])

    def _due(self, t: float) -> int:
        if self.spec.demand is None:
            return 1 << 30
        return max(0, math.floor(self.spec.demand * t + 1e-9) - self.claimed)  # woken at (claimed + 1) / demand

    def _cpu(self, mean_s: float) -> float:
        """A burst's CPU seconds: uniform within +-50 % of its mean (equal bursts under processor sharing would
        all end at one instant and move in lock-step, which real ones do not)."""
        return mean_s * self.rng.uniform(0.5, 1.5)

    def _transaction(self, s: int, k: int):
        c = self.costs
        yield ("cpu", self.sup_cpu, self._cpu(k * c.sup_ms / 2000), ("sup", s))
        yield ("cpu", self.db_cpu, self._cpu(k * c.db_ms / 2000), "db")
        yield ("commit",)

    def _supervisor(self, s: int):
        while True:
            if self.results[s]:
                k, self.results[s] = self.results[s], 0
                yield from self._transaction(s, k)
                self.free[s] += k
            k = min(self.free[s], self._due(self.now))
            if k:
                self.claimed += k
                self.free[s] -= k
                yield from self._transaction(s, k)
                self.started.extend([self.now] * k)
                for _ in range(k):
                    w = self._worker(s)
                    self.at(self.now, self.resume, w)
            elif not self.results[s]:
                self.sleeping.add(s)
                if self.spec.demand is not None:   # the next due run wakes it
                    self.at((self.claimed + 1) / self.spec.demand, self.wake, s)
                yield ("idle",)

    def _worker(self, s: int):
        yield ("cpu", self.wrk_cpu, self._cpu(self.costs.wrk_ms / 1000), object())   # a session of its own
        yield ("sleep", self.costs.run_ms / 1000)
        self.results[s] += 1
        self.wake(self.now, s)

    def run(self) -> dict:
        """Simulate ``spec.horizon_s``; returns runs_per_s (started in the window), commits_per_run,
        commit_wait_ms_per_run (waiting for the WAL flush) and flushes_per_s."""
        spec = self.spec
        for s in range(spec.supervisors):
            self.procs[s] = self._supervisor(s)
            self.at(0.0, self.resume, self.procs[s])
        while self.events and self.events[0][0] < spec.horizon_s:
            self.now, _, fn, arg = heapq.heappop(self.events)
            fn(self.now, arg)
        window = spec.horizon_s - spec.warmup_s
        n = sum(spec.warmup_s <= t < spec.horizon_s for t in self.started)
        runs = max(1, len(self.started))
        return {"runs_per_s": n / window, "commits_per_run": self.commits / runs,
                "commit_wait_ms_per_run": 1000 * self.wal.waited_s / runs,
                "flushes_per_s": self.wal.flushes / spec.horizon_s}


def fleet_runs_per_s(costs: FleetCosts, spec: FleetSpec) -> dict:
    """:class:`Fleet` ``costs`` under ``spec``: its summary."""
    return Fleet(costs, spec).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--jobs", type=int, help="override the workload's job count")
    ap.add_argument("--supervisors", type=int, default=1)
    ap.add_argument("--cap", type=int, default=5)
    ap.add_argument("--horizon-s", type=float, default=60.0)
    ap.add_argument("--lease-timeout-s", type=float, default=600.0)
    ap.add_argument("--lease-ttl-s", type=float, default=30.0)
    ap.add_argument("--lose-every-s", type=float)
    ap.add_argument("--lose-first-s", type=float)
    ap.add_argument("--max-jitter-s", type=float, help="override the workload's max_jitter_s")
    ap.add_argument("--db-slow", help="FROM_S:TO_S:FACTOR, e.g. 3600:4800:3")
    ap.add_argument("--exact", action="store_true", help="call planner.decide per claim (slow, for checking)")
    args = ap.parse_args(argv)
    for flag in ("supervisors", "cap"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: must be at least 1, got {getattr(args, flag)}")
    if not args.horizon_s > 0:
        ap.error(f"--horizon-s: must be positive, got {args.horizon_s}")
    w = wl.load_or_exit(args.workload)
    try:
        if args.jobs is not None:
            w = wl.check(msgspec.structs.replace(w, jobs=args.jobs))
        if args.max_jitter_s is not None:
            if args.max_jitter_s < 0:
                raise wl.WorkloadError(f"must be >= 0, got {args.max_jitter_s}")
            w = wl.check(msgspec.structs.replace(w, max_jitter_s=args.max_jitter_s))
    except wl.WorkloadError as exc:
        ap.error(f"--jobs/--max-jitter-s: {exc}")
    cfg = SimConfig(supervisors=args.supervisors, cap=args.cap, horizon_s=args.horizon_s,
                    lease_timeout_s=args.lease_timeout_s, lease_ttl_s=args.lease_ttl_s, renew_s=args.lease_ttl_s / 3,
                    lose_every_s=args.lose_every_s, lose_first_s=args.lose_first_s, exact=args.exact, keep_runs=False,
                    db_slow=tuple(float(x) for x in args.db_slow.split(":")) if args.db_slow else None)
    began = time.perf_counter()
    summary = Simulator(w, cfg).run()
    summary["wall_s"] = time.perf_counter() - began
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
