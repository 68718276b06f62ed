"""From "job is due" to "run handed to a worker": the first half of the supervisor's path.

Every ``rescan_interval_s`` :meth:`Dispatcher.rescan` sweeps: it fails runs of dead supervisors, repairs
unreadable ``next_run_at`` values, gives unscheduled Active jobs a ``next_run_at`` and logs the advice.
At every step :meth:`Dispatcher.dispatch_due` reads the due jobs (earliest first, at most one per idle
worker) and decides each one (:meth:`Dispatcher.decide_one`, rules in :mod:`mjsched_isolated.planner`):
expired, not yet started, missed (the missed-run policy), unknown job type, or *run*. A run is claimed
(``Store.claim``: lease + occurrence + Running run row, one transaction) and its ``RunRequest`` sent to
the worker (:meth:`Dispatcher.claim`). A job whose row cannot be scheduled is set aside as *bad* until
its row changes; the poll goes on for the others.
"""

from __future__ import annotations

import datetime as dt
import logging
import operator
import random
from collections.abc import Callable
from typing import Any

from mjsched_isolated import jobspec, notices, planner, protocol
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import CronError
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.isotime import iso
from mjsched_isolated.store import Store
from mjsched_isolated.store.jobs import Share
from mjsched_isolated.store.leases import ClaimRequest, Outcome, poolable
from mjsched_isolated.store.records import Claim, JobRow
from mjsched_isolated.supervisor.advice import Advice
from mjsched_isolated.supervisor.clock import Clock
from mjsched_isolated.supervisor.inflight import InFlight, log_ctx
from mjsched_isolated.supervisor.limits import run_limits, watch_cpu
from mjsched_isolated.supervisor.metrics import Metrics

log = logging.getLogger("mjsched.supervisor")
SCHEDULE_ERRORS = (CronError, OverflowError, ValueError)  # a schedule no date arithmetic can follow
UNREADABLE_SWEEP_ROWS = 500  # job ids checked for an unreadable next_run_at per rescan (SQLite only)
MANY_JOBS = 5000  # above this many Active jobs the high-frequency advice is recomputed once a minute
ADVICE_INTERVAL_S = 60.0
LIVE_SKIP_ROWS = 100  # due Skip jobs with a live run skipped per poll when no worker is idle
# after a claim met a row another supervisor held, the due read passes over such rows (SKIP LOCKED) this long
CONTENDED_FOR = dt.timedelta(seconds=30)
# meanwhile it reads this many times its free slots and takes them in a random order within each instant: a
# claim holds its rows for one statement only (PostgreSQL), too briefly for a peer's read to pass over them
CONTENDED_READ = 3
# a run claimed ahead: its cancel requests and its job's status and next run time are read once more this long
# before its instant (RunGuard.cancel_before_start), so a `runs cancel`, a `jobs pause` (disable, remove, or an
# edit of its schedule) while it waits stops it before its plugin starts: the bound of docs/concepts/concurrency
CANCEL_CHECK_BEFORE = dt.timedelta(milliseconds=50)
# a fleet (PostgreSQL, MariaDB) divides the jobs among its live supervisors (store.jobs.Share): another's job is
# taken only when its occurrence is this much older than this supervisor's own oldest due one (or than now):
# its owner is dead (taken over at once, not after its TTL), or behind
SHARE_STEAL_AFTER = dt.timedelta(milliseconds=10)
# ... and while its own share is this far behind (saturated), another's job is taken only when it is this much
# further behind: peers balance their backlogs without reaching for the rows their owners are taking (measured
# at 200 ms: 3-5 % of the claims met a row a peer held; at 1 s none)
SHARE_STEAL_BEHIND = dt.timedelta(seconds=1)
NUMBERS_SEEN_MAX = 10_000  # sets of number columns remembered as fine (Dispatcher._numbers_ok)
NUMBER_COLUMNS = operator.itemgetter(*jobspec.STORED_NUMBER_COLUMNS)  # what _numbers_fine remembers of a row


def how_many(count: int) -> str:
    """``count`` of occurrences for a log line: "1000 or more" at the counting bound."""
    return f"{count} or more" if count >= planner.MAX_COUNTED_OCCURRENCES else str(count)


def job_types(worker: Any) -> set[str]:
    """The job types ``worker`` loaded (empty until it is ready)."""
    return set() if worker.ready is None else {p.job_type for p in worker.ready.plugins}


class Dispatcher:
    """Decides due jobs and starts runs into ``inflight`` (the supervisor's dict, run id -> InFlight)."""

    def __init__(self, settings: Settings, store: Store, pool: Any, metrics: Metrics, clock: Clock,
                 inflight: dict[int, InFlight], wake_sender: Callable[[], None]) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self.inflight = inflight
        self.wake_sender = wake_sender
        self.advice = Advice(store)
        self.bad_jobs: dict[int, tuple[dt.datetime, str]] = {}  # job id -> (updated_at seen, reason)
        self._numbers_fine: set[tuple[Any, ...]] = set()  # number columns found fine (most rows share a few)
        # job id -> job_type this supervisor has no plugin for: left to others until the next rescan
        self.unrunnable: dict[int, str] = {}
        self._reported_unrunnable: set[tuple[int, str]] = set()  # logged once per (job, type)
        self.next_rescan_at: dt.datetime | None = None
        # how many results wait to be recorded (database unreachable): their slots still count as taken
        self.unrecorded: Callable[[], int] = lambda: 0
        self.waiting_for_worker: set[int] = set()  # due jobs whose type only busy workers have (this poll)
        self._next_advice_at: dt.datetime | None = None
        self._unreadable_after = 0  # the unreadable next_run_at sweep continues after this job id
        # job id -> its next_run_at, for the Skip jobs whose run this supervisor holds: when to skip
        self.skip_due_at: dict[int, dt.datetime | None] = {}
        # until when the due read passes over rows a peer's claim holds: set when a claim met such a row
        self.contended_until: dt.datetime | None = None
        self._shuffle = random.Random()  # the order of equally due rows while contended (not a secret)
        # job id -> its next_run_at, for the Replace jobs whose run this supervisor holds: when to replace it
        self.replace_due_at: dict[int, dt.datetime | None] = {}
        # job id -> the occurrence that replaced its run here: the newest due occurrence runs once it is freed
        self.replacing: dict[int, dt.datetime] = {}
        # kills a run of ours and records it Cancelled, never retried (the supervisor's RunGuard.cancel)
        self.cancel_flight: Callable[[InFlight, dt.datetime, str], None] = lambda flight, now, reason: None
        # a run replaced (Replace) once its replacement is claimed: its Cancelled outcome (the supervisor's
        # Recorder.outcome), then the kill of its process tree, its outcome recorded with the claim already
        self.replaced_outcome: Callable[[InFlight, dt.datetime, str], Outcome] = lambda flight, now, by: Outcome(
            flight.run_id, flight.job_id, flight.token, "Cancelled", False, by, count=False)
        self.kill_replaced: Callable[[InFlight, Outcome], None] = lambda flight, outcome: None
        # pending backfill entries are read while there may be some that can start: after each rescan (new
        # requests), while the last read found some, and when a backfill run of ours ended (its lease freed)
        self.backfills_maybe = True
        self._backfill_runs: set[int] = set()  # run ids of the backfill runs this supervisor started
        # serve sets it before its first sweep: runs under its name are then a previous life's (never for a
        # manual run's supervisor: two `jobs run` may share a name, each with a live run)
        self.sweep_previous_life = False
        # claim_ahead_s: database time -> epoch seconds of this machine's clock (a worker's start_at), and
        # whether the liveness lease is still trusted claim_ahead_s from now (both set by the supervisor)
        self.local_epoch: Callable[[dt.datetime], float] = lambda at: at.timestamp()
        self.lease_valid_ahead: Callable[[], bool] = lambda: True
        self.ahead = dt.timedelta(seconds=settings.claim_ahead_s)
        # a fleet's division of the jobs (PostgreSQL, MariaDB): (index, count) among the live supervisors, read
        # at each rescan; None alone or on SQLite. _own_front: the oldest due occurrence of the share, last read
        self.share_of: tuple[int, int] | None = None
        self._own_front: dt.datetime | None = None
        self._stealing = False  # the last due read found late jobs of others' shares

    # -- the sweep ------------------------------------------------------------------------------------
    def rescan(self, now: dt.datetime) -> None:
        """Fail runs of dead supervisors, and give unscheduled Active jobs a next_run_at (e.g. a job activated
        while supervisors run). Both are indexed queries; this runs every ``rescan_interval_s``."""
        self.next_rescan_at = now + dt.timedelta(seconds=self.settings.rescan_interval_s)
        self.backfills_maybe = True
        self._forget_fixed_bad_jobs()
        if len(self._numbers_fine) > NUMBERS_SEEN_MAX:  # bounded: checked afresh after
            self._numbers_fine.clear()
        self.unrunnable.clear()  # looked at again at each rescan: the plugin may be here now
        if self._next_advice_at is None or now >= self._next_advice_at:
            active = self.advice.warn_high_frequency(now)
            # its signature reads every Active job: with many, once a minute, not at every rescan
            self._next_advice_at = now + dt.timedelta(seconds=ADVICE_INTERVAL_S) if active > MANY_JOBS else None
        self.abandon_orphans(now)
        self._read_share()
        self.replace_others(now)
        # edited by hand into a SQLite file: a few thousand job ids per rescan, not every job every second
        window = self.store.unreadable_time_window(self._unreadable_after, UNREADABLE_SWEEP_ROWS)
        for job_id, (field, raw) in window.items():  # read as unset, it would run outside its window
            row = self.store.get_job_by_id(job_id)
            if row is not None:
                self._mark_bad(row, f"{field}: {raw[:40]!r} in the database is not a timestamp (edited by hand?); "
                                    "set it with `jobs update`")
        found, self._unreadable_after = self.store.unreadable_next_run_at_chunk(self._unreadable_after,
                                                                               UNREADABLE_SWEEP_ROWS)
        for job in found:
            if job["id"] not in self.bad_jobs:
                self._repair_unreadable(job, now)
        for job in self.store.unscheduled_active_jobs():
            if job["id"] in self.bad_jobs and self.bad_jobs[job["id"]][0] == job["updated_at"]:
                continue
            try:
                next_run_at = planner.initial_next_run_at(job, now)
            except SCHEDULE_ERRORS as exc:
                self._mark_bad(job, str(exc))
                continue
            status = "Expired" if next_run_at is None else None
            if self.store.set_next_run_at(job["id"], None, next_run_at, now, status=status):
                log.info("job %s scheduled: next_run_at %s", job["name"], iso(next_run_at) if next_run_at else
                         "none (end_at passed; status Expired)")

    def _read_share(self) -> None:
        """This supervisor's place among the live ones (the supervisors table), for :meth:`share`."""
        if self.store.dialect == "sqlite":
            return
        live = self.store.live_instances()
        me = self.settings.instance
        share_of = (live.index(me), len(live)) if me in live and len(live) > 1 else None
        if share_of != self.share_of:  # a supervisor came or went: the rows met held by peers were another division
            self.share_of, self._own_front, self.contended_until, self._stealing = share_of, None, None, False

    def share(self, now: dt.datetime) -> Share | None:
        """The division of the due read (:class:`Share`): another's job is read once its occurrence is
        :data:`SHARE_STEAL_AFTER` older than ``now``, or, while this supervisor's own share is behind (the last
        read found some of it due more than :data:`SHARE_STEAL_BEHIND` ago: saturated), that much older than
        its oldest due occurrence."""
        if self.share_of is None:
            return None
        front = self._own_front
        behind = front is not None and front < now - SHARE_STEAL_BEHIND
        steal_before = front - SHARE_STEAL_BEHIND if front is not None and behind else now - SHARE_STEAL_AFTER
        return Share(self.share_of[0], self.share_of[1], steal_before, SHARE_STEAL_AFTER)

    def _note_front(self, due: list[JobRow], now: dt.datetime) -> None:
        """Remember the oldest due occurrence of this supervisor's share among ``due`` (the next read's bound
        for taking others' jobs), None if the read found none."""
        if self.share_of is None:
            return
        index, count = self.share_of
        mine = [j["next_run_at"] for j in due if j["id"] % count == index and j["next_run_at"] is not None
                and j["next_run_at"] <= now]
        self._own_front = min(mine, default=None)
        self._stealing = any(j["id"] % count != index for j in due)

    # -- due jobs -------------------------------------------------------------------------------------
    def abandon_orphans(self, now: dt.datetime) -> None:
        """Fail the runs of dead supervisors (unless takeovers are held after a time jump), with notices. The
        first sweep of ``serve`` (:attr:`sweep_previous_life`), before its first claim, also fails the Running
        runs under its own name: a dead process's that had the name before (a crashed ``serve --instance
        NAME`` restarted, or a container's PID 1), which this supervisor's live row would otherwise keep alive
        forever."""
        abandoned = [] if self.clock.holding_takeovers(now) else self.store.abandon_orphaned_runs(
            exclude_run_ids=set(self.inflight), notices_for=lambda run: notices.outbox_rows(
                notices.for_abandoned(run), self.settings.notifications.channels()),
            previous_life_of=self.settings.instance if self.sweep_previous_life else None)
        self.sweep_previous_life = False  # once, and only once it went through
        if abandoned:
            self.wake_sender()
        for run in abandoned:
            log.error("run %d of job %s marked Failed: %s", run["id"], run["job_name"], run["error_message"],
                      extra={"job": run["job_name"], "run_id": run["id"]})

    def dispatch_due(self, now: dt.datetime) -> None:
        """Claim due jobs, oldest occurrence first, for idle workers, and hand them over. A run goes to an idle
        worker that has its job type (workers of two plugin generations may differ); a job whose type only
        busy workers have waits for one. Every job decided *run* in this poll is claimed in ONE transaction
        (``Store.claim_many``; each claim is still judged alone), then handed to its worker. Does not wait
        for runs."""
        self.waiting_for_worker.clear()
        self.replace_live(now)
        idle = self.pool.idle_workers()
        # a result not yet recorded still holds its job's lease and its place under the cap: a worker
        # freed by it is not used until it is written (else an outage would let runs pile up past the cap)
        free = self.pool.size - len(self.inflight) - self.unrecorded()
        del idle[max(0, free):]
        if self.pool.last_ready is None:
            return
        # the job types of every ready worker: workers of two plugin generations may differ (a plugin added
        # while serving, a reload in progress); a run goes to a worker that has its type
        known = {p.job_type for w in self.pool.workers.values() if w is not None and w.ready is not None
                 for p in w.ready.plugins}
        if not idle:  # every slot taken: still skip, on time, the occurrences of Skip jobs whose run is live
            self.skip_live(now, known)
            self._forget_passed_skip_times(now)
            return
        types = {id(w): job_types(w) for w in idle}
        to_run: list[tuple[JobRow, dt.datetime | None, Any]] = []
        limit = len(idle)
        # divided (a fleet's share): peers do not reach for its own rows, so no wider read and no pooled claim,
        # unless the last read took others' late rows, for which their owner (and other peers) may be reaching
        contended = (self._stealing if self.share_of is not None
                     else self.contended_until is not None and now < self.contended_until)
        read = limit * CONTENDED_READ if contended else limit
        # contended on PostgreSQL, workers alike: the claim passes over the rows peers hold, not the read
        pooled = (contended and self.store.dialect == "postgresql"
                  and all(types[id(w)] == types[id(idle[0])] for w in idle))
        horizon = now + self.ahead if self.ahead and not pooled else now
        due = self.store.due_jobs(horizon, limit=read, exclude=self._excluded(), skip_locked=contended and not pooled,
                                  share=self.share(now))
        self._note_front(due, now)
        ahead = [j for j in due if j["next_run_at"] is not None and j["next_run_at"] > now]
        if ahead:  # not due yet: claimed ahead below, on the workers the due ones leave idle
            due = [j for j in due if j["next_run_at"] is None or j["next_run_at"] <= now]
        if contended:  # peers read the same first rows: each takes them in an order of its own, instant by instant
            due.sort(key=lambda j: (j["next_run_at"], self._shuffle.random()))
        if pooled:
            self._dispatch_pooled(due, idle, types[id(idle[0])], known, now)
            due_loop: list[JobRow] = []
        else:
            due_loop = due
        for job in due_loop:
            if not idle:
                break
            worker = next((w for w in reversed(idle) if job["job_type"] in types[id(w)]), None)
            if worker is None and job["job_type"] in known:  # only a busy worker has it: wait for one
                self.waiting_for_worker.add(job["id"])
                continue
            decided, next_run_at, job = self._decide(job, known, now)
            if decided:
                worker = worker or idle[-1]
                idle.remove(worker)
                to_run.append((job, next_run_at, worker))
        self._claim_batch(to_run, now)
        if len(due) == read:  # more may be due than this poll could look at: the live Skip ones too
            self.skip_live(now, known)
        elif idle:  # the regular schedule first; workers it left idle run pending backfills and retries
            self.dispatch_backfills(now, idle, types, known)
            if ahead and idle:
                self.claim_ahead(ahead, idle, types, known, now)
        self._forget_passed_skip_times(now)

    def claim_ahead(self, ahead: list[JobRow], idle: list[Any], types: dict[int, set[str]], known: set[str],
                    now: dt.datetime) -> None:
        """Claim occurrences due within ``claim_ahead_s`` of ``now`` (``ahead``, by the due read's order) on the
        ``idle`` workers, each as its claim at its instant would be - decided, claimed and handed over with
        that instant as ``now`` (its ``started_at``, deadline and lease counted from it) - and hand them to
        their workers, which start them at the instant by their own clock, never before
        (``RunRequest.start_at``): the claim, the hand-over and the worker's wake-up are out of the way when
        it comes (issue 11: 20 runs due at once took ~20 ms to claim and hand over one after another).
        Only plain occurrences: the job's lease free as read (or a Concurrent job), no pending retry, not its
        last occurrence, and the liveness lease still trusted ``claim_ahead_s`` from now. The others (a live
        run, whose end may come first; a retry; the last occurrence) are left due and decided at their instant
        as usual (:meth:`next_due_at` wakes the loop then); a claim that lost is not judged ahead (no skip):
        the occurrence is looked at again at its instant. Used up workers are removed from ``idle``."""
        if not self.lease_valid_ahead():
            return
        by_instant: dict[dt.datetime, list[tuple[JobRow, dt.datetime | None, Any, dt.datetime | None]]] = {}
        for job in ahead:
            if not idle:
                break
            instant = job["next_run_at"]
            if (instant is None or planner.pending_retry(job)
                    or (job["lock_token"] is not None and job["concurrency_mode"] != "Concurrent")):
                continue
            worker = next((w for w in reversed(idle) if job["job_type"] in types[id(w)]), None)
            if worker is None:  # only a busy worker (or none) has its type: decided at its instant
                continue
            decided, next_run_at, job = self._decide(job, known, instant)
            if not decided or next_run_at is None or job["next_run_at"] != instant:
                continue
            idle.remove(worker)
            by_instant.setdefault(instant, []).append((job, next_run_at, worker, instant))
        for instant, items in sorted(by_instant.items()):
            busy: set[int] = set()
            self._claim_many(items, instant, busy, start_at=self.local_epoch(instant))
            if busy:
                self.contended_until = now + CONTENDED_FOR

    def dispatch_backfills(self, now: dt.datetime, idle: list[Any], types: dict[int, set[str]],
                           known: set[str]) -> None:
        """Start pending backfill occurrences and ``runs retry`` requests (:mod:`mjsched_isolated.store.backfills`)
        on the ``idle`` workers the regular schedule left (regular occurrences go first), oldest request
        first, each claimed like any run: under the cap and the job's lease, so a non-Concurrent job runs one
        at a time and its backfill waits while a run of it is live (Temporal's backfill with the schedule's
        overlap policy, but never skipped: a pending occurrence waits). The job's ``next_run_at`` is not
        touched. Held back while takeovers are held after a time jump. Not read at every poll: only while
        there may be entries that can start (:attr:`backfills_maybe`), so an empty table costs nothing
        between rescans; a new request starts within ``rescan_interval_s``."""
        if self.clock.holding_takeovers(now):
            return
        if self._backfill_runs - set(self.inflight):  # one ended: the entries it held back may start now
            self._backfill_runs &= set(self.inflight)
            self.backfills_maybe = True
        if not self.backfills_maybe:
            return
        found = self.store.backfills.due(len(idle), exclude=self._excluded())
        self.backfills_maybe = bool(found)
        taken: set[int] = set()
        for entry, job in found:
            concurrent = job["concurrency_mode"] == "Concurrent"
            if not idle:
                break
            if job["id"] in taken and not concurrent:
                continue  # its lease is ours now: the job's next entry waits for this run
            worker = next((w for w in reversed(idle) if job["job_type"] in types[id(w)]), None)
            if worker is None:
                if job["job_type"] not in known and not self.coming(job["job_type"]):
                    self.unrunnable[job["id"]] = job["job_type"]
                continue
            if not self._numbers_ok(job):
                continue
            timeout_s = planner.run_timeout_s(job, self.settings.lease_timeout_s)
            deadline = now + dt.timedelta(seconds=timeout_s)
            claim = self.store.backfills.claim(entry, take_lease=not concurrent, instance=self.settings.instance,
                                               lease_s=timeout_s + self.settings.lease_ttl_s, deadline_at=deadline,
                                               not_before=now)
            if claim is None:
                continue
            taken.add(job["id"])
            self._backfill_runs.add(claim.run_id)
            idle.remove(worker)
            log.info("job %s: %s of occurrence %s (attempt %d) requested by %s at %s starts as run %d", job["name"],
                     entry["kind"].lower(), iso(entry["scheduled_at"], missing="none (a manual run)"),
                     entry["attempt"], entry["requested_by"], iso(entry["requested_at"]), claim.run_id,
                     extra=log_ctx(job))
            self._hand_over(job, worker, entry["scheduled_at"], deadline, timeout_s, claim, now, 0, entry["attempt"],
                            backfill=True)
            if job["concurrency_mode"] == "Skip" and job["missed_run_policy"] != "RunAll":
                self.skip_due_at[job["id"]] = job["next_run_at"]  # a regular occurrence meanwhile is skipped

    def _forget_passed_skip_times(self, now: dt.datetime) -> None:
        """A time in :attr:`skip_due_at` still passed after the poll was not skipped here (another supervisor
        moved the job, it expired, a catch-up was deferred): unknown now, not a wake-up time to spin on."""
        for job_id, at in self.skip_due_at.items():
            if at is not None and at <= now:
                self.skip_due_at[job_id] = None

    def skip_live(self, now: dt.datetime, known: set[str]) -> None:
        """Skip the due occurrences of Skip jobs whose run is live (one indexed query, at most
        :data:`LIVE_SKIP_ROWS` jobs), as a lost claim does in :meth:`_claim_batch`: counted in
        ``skipped_count``, logged, the ``concurrency`` metric and a notice. Without it an occurrence that
        came due while every worker was busy would run late, after the live run, as a catch-up (issue 12).
        The missed-run policy is applied first (:meth:`_decide`), as for any due job."""
        for job in self.store.due_live_skip_jobs(now, LIVE_SKIP_ROWS, exclude=self._excluded()):
            decided, next_run_at, job = self._decide(job, known, now)
            if decided and job["next_run_at"] is not None:
                self._skip_live_one(job, job["next_run_at"], next_run_at, now)

    def replace_live(self, now: dt.datetime) -> None:
        """Replace (issue 12 point 7; Kubernetes' ``concurrencyPolicy: Replace``, Temporal's TerminateOther):
        when the next occurrence of a Replace job whose run this supervisor holds comes due, even with every
        worker busy, kill that run's process tree and record it Cancelled ("replaced by occurrence X", never
        retried); the lease is released with the record, and the newest due occurrence starts on the freed
        slot. One read of the job row per occurrence, only for jobs whose known next occurrence has passed."""
        for job_id, at in list(self.replace_due_at.items()):
            if at is None or at > now:
                continue
            flight = next((f for f in self.inflight.values() if f.job_id == job_id and f.token is not None), None)
            job = None if flight is None else self.store.get_job_by_id(job_id)
            if (flight is None or job is None or job["lock_token"] != flight.token or job["status"] != "Active"
                    or job["concurrency_mode"] != "Replace"):
                del self.replace_due_at[job_id]  # not our run any more, or not to be replaced
            elif job["next_run_at"] is None or job["next_run_at"] > now:
                self.replace_due_at[job_id] = job["next_run_at"]  # moved meanwhile (an edit): wait for it
            else:
                self._replace(job, now, flight)

    def replace_others(self, now: dt.datetime) -> None:
        """At each rescan: due Replace jobs whose run is live but not known to this supervisor as one to
        replace (held by another supervisor, a manual run, a job switched to Replace while its run was live):
        ask the holder to cancel the run (its ``cancel_requested_by`` says which occurrence replaces it); the
        holder kills it at its next lease renewal. One indexed query, at most :data:`LIVE_SKIP_ROWS` jobs."""
        for job in self.store.due_live_skip_jobs(now, LIVE_SKIP_ROWS, exclude=self._excluded(), mode="Replace"):
            mine = next((f for f in self.inflight.values() if f.job_id == job["id"] and f.token is not None
                         and f.token == job["lock_token"]), None)
            if mine is not None:
                self.replace_due_at[job["id"]] = job["next_run_at"]  # replaced by replace_live at the next poll
            elif job["lock_token"] is not None and job["next_run_at"] is not None:
                self._replace(job, now, None)

    def _replace(self, job: JobRow, now: dt.datetime, flight: InFlight | None) -> None:
        """Supersede the job's older due occurrences (counted skipped), then cancel its live run: ``flight``
        (ours) at once, else by a request on the run row for its holder."""
        occurrence = self._supersede(job, now)
        if occurrence is None:  # another supervisor moved the job first: look again at the next rescan
            self.replace_due_at[job["id"]] = None
            return
        by = planner.replaced_by(occurrence)
        if flight is None:
            if job["lock_token"] is not None and self.store.request_replace(job["id"], job["lock_token"], by):
                log.warning("job %s: occurrence %s came due while its run was live (concurrency_mode Replace): "
                            "its holder %s was asked to cancel that run", job["name"], iso(occurrence),
                            job["locked_by_instance"], extra=log_ctx(job))
            return
        worker = next((w for w in reversed(self.pool.idle_workers()) if job["job_type"] in job_types(w)), None)
        if worker is not None or self._refilled_at_once(flight.worker):
            self._replace_claimed_first(job, occurrence, now, flight, worker)
            return
        # no worker can take the replacement at once (the freed slot waits out a backoff): kill the run now,
        # on time; the freed slot runs the newest due occurrence when it is ready (_overlap)
        self.store.request_cancel(flight.run_id, by)  # on the run row too: who asked, as for `runs cancel`
        self.replacing[job["id"]] = occurrence
        self.replace_due_at.pop(job["id"], None)
        self.cancel_flight(flight, now, by)

    def _refilled_at_once(self, worker: Any) -> bool:
        """Whether the pool refills ``worker``'s slot as soon as it is killed (not after a crash backoff)."""
        refills = getattr(self.pool, "refills_at_once", None)
        return bool(refills(worker)) if refills is not None else False

    def _replace_claimed_first(self, job: JobRow, occurrence: dt.datetime, now: dt.datetime, flight: InFlight,
                               worker: Any) -> None:
        """Replace our live run ``flight`` by ``occurrence``: the replacement is claimed first, taking the job
        lease over from the run (``Store.claim_replacement``: the job still Active, its ``next_run_at`` still
        the one read), and only then is the run killed and recorded Cancelled, and the new run handed to
        ``worker`` (an idle one with the job type) or to the worker refilled in the killed one's slot (it
        reads the request once its plugins are loaded). A job paused, edited or moved by then is not
        replaced: its live run goes on (pausing stops new runs, not a live one)."""
        by = planner.replaced_by(occurrence)
        seen = job.copy()
        seen["next_run_at"] = occurrence
        next_run_at = planner.next_after_claim(seen, occurrence)
        timeout_s = planner.run_timeout_s(job, self.settings.lease_timeout_s)
        request = ClaimRequest(seen, next_run_at, lease_s=timeout_s + self.settings.lease_ttl_s,
                               deadline_at=now + dt.timedelta(seconds=timeout_s), scheduled_at=occurrence,
                               status="Expired" if next_run_at is None else None)
        replaced = self.replaced_outcome(flight, now, by)
        claim = self.store.claim_replacement(request, replaced, now=now, instance=self.settings.instance)
        if claim is None:
            self.replace_due_at[job["id"]] = None  # looked at again at the next rescan, if still due
            log.warning("job %s: occurrence %s did not replace run %d: the job was paused, edited or moved "
                        "meanwhile; the run goes on", job["name"], iso(occurrence), flight.run_id, extra=log_ctx(job))
            return
        self.replace_due_at.pop(job["id"], None)
        self.kill_replaced(flight, replaced)  # its end is recorded already, with the claim
        if worker is None:
            worker = self.pool.workers.get(flight.worker.slot)
        if worker is None:  # not refilled after all: the claim cannot run here
            self.store.finish_run(claim.run_id, job["id"], claim.lock_token, status="Cancelled", success=False,
                                  error_message="never started: no worker to run it (its slot was not refilled)",
                                  details=None, duration_ms=None, count=False)
            return
        self._hand_over(seen, worker, occurrence, request.deadline_at, timeout_s, claim, now)
        self.replace_due_at[job["id"]] = next_run_at  # its next occurrence replaces this run

    def _supersede(self, job: JobRow, now: dt.datetime) -> dt.datetime | None:
        """A Replace job runs its newest due occurrence: the older due ones (from ``next_run_at``) are skipped
        (counted, logged, by concurrency). Returns the occurrence to run, None if another supervisor moved
        the job first (or its schedule cannot be read: it is set aside)."""
        seen = job["next_run_at"]
        if seen is None:
            return None
        try:
            newest = planner.newest_due(job, now)
        except SCHEDULE_ERRORS as exc:
            self._mark_bad(job, str(exc))
            return None
        if newest is None:
            return seen
        why = f"superseded by occurrence {iso(newest)} (concurrency_mode Replace: the newest occurrence runs)"
        return newest if self._skip(job, seen, newest, now, "concurrency", "Skipped", why) else None

    def next_due_at(self, now: dt.datetime | None = None) -> dt.datetime | None:
        """When the loop must look again for due jobs. With no idle worker, the next occurrence of a Skip job
        whose run this supervisor holds (to skip it on time), else None (a result wakes the loop); and in any
        case the next occurrence of a Replace job whose run it holds (to replace that run on time). Jobs
        waiting for a worker that has their type are left out: a result or a new worker wakes the loop.
        With an idle worker, ``claim_ahead_s`` before the next due occurrence (:meth:`claim_ahead`), or at
        the occurrence itself when that moment has passed at ``now`` (it was not claimed ahead)."""
        live = {f.job_id for f in self.inflight.values()}
        for job_id in [j for j in self.replace_due_at if j not in live]:
            del self.replace_due_at[job_id]
        replace_at = min((at for at in self.replace_due_at.values() if at is not None), default=None)
        if not self.pool.idle_workers():  # the next occurrence of a Skip job of ours whose run is live
            for job_id in [j for j in self.skip_due_at if j not in live]:
                del self.skip_due_at[job_id]
            due = min((at for at in self.skip_due_at.values() if at is not None), default=None)
        else:
            due = self.store.next_due_at(self._excluded() | self.waiting_for_worker,
                                         share=None if now is None else self.share(now))
            if due is not None and self.ahead and (now is None or due - self.ahead > now):
                due -= self.ahead
        return min((at for at in (due, replace_at) if at is not None), default=None)

    def _excluded(self) -> set[int]:
        """Jobs this supervisor does not look at: bad rows, and job types it has no plugin for."""
        return set(self.bad_jobs) | set(self.unrunnable)

    def decide_one(self, job: JobRow, known: set[str], now: dt.datetime, worker: Any) -> bool:
        """Run, skip or set aside one due job. True if it took ``worker``."""
        decided, next_run_at, job = self._decide(job, known, now)
        return decided and self._claim_batch([(job, next_run_at, worker)], now) == 1

    def _decide(self, job: JobRow, known: set[str], now: dt.datetime) -> tuple[bool, dt.datetime | None, JobRow]:
        """Skip or set aside one due job, or decide to run it: returns (run?, the ``next_run_at`` after it, the
        job as it is to be claimed: a RunAll catch-up cut to its backlog claims its oldest kept occurrence)."""
        if not self._numbers_ok(job):  # a number edited by hand: this job alone is set aside
            return False, None, job
        seen = job["next_run_at"]
        if seen is None:  # due by SQL but unreadable here: a value edited by hand into a SQLite file
            return self._repair_unreadable(job, now), None, job
        if planner.pending_retry(job):  # a retry of an occurrence that already came due: no policy applies
            if not self._runnable(job, known, None):
                return False, None, job
            return True, job["retry_next_run_at"], job
        if planner.expired(job, now):  # its due occurrence (after end_at) is not run: counted missed
            if self.store.set_next_run_at(job["id"], seen, None, now, status="Expired", missed=1):
                self.metrics.occurrences_missed("dropped", 1)
                log.warning("job %s expired: end_at %s has passed; occurrence %s not run",
                            job["name"], iso(job["end_at"]), iso(seen))
            return False, None, job
        try:
            if job["start_at"] is not None and job["start_at"] > now:  # edited outside the CLI: not yet
                return self._reschedule(job, planner.initial_next_run_at(job, now), now), None, job
            overlap = self._overlap(job, now)
            if overlap is not None:
                return self._decide_overlap(job, overlap, known, now)
            decision = planner.decide(job, now, self.settings.max_catchup_runs)
        except SCHEDULE_ERRORS as exc:  # one bad job must not stop the poll
            self._mark_bad(job, str(exc))
            return False, None, job
        next_run_at = decision.next_run_at
        if decision.run and decision.scheduled_at is not None:  # RunAll's backlog cut: drop the older ones
            why = (f"RunAll backlog longer than max_catchup_runs ({self.settings.max_catchup_runs}); catching up "
                   f"from {iso(decision.scheduled_at)}, which runs now")
            if not self._skip(job, seen, decision.scheduled_at, now, "backlog", "Missed", why):
                return False, None, job
            seen = decision.scheduled_at  # ... and run the oldest kept at once (planner.decide)
            job = job.copy()
            job["next_run_at"] = seen
        if decision.deferred:  # a RunOnce catch-up spread by max_jitter_s (planner.decide): not a skip
            # the occurrences before the deferred instant are folded into that catch-up (counted now)
            folded = planner.occurrences_between(job, seen, next_run_at) if next_run_at is not None else 0
            if self.store.set_next_run_at(job["id"], seen, next_run_at, now, missed=folded):
                if folded:
                    self.metrics.occurrences_missed("folded", folded)
                log.info("job %s: catch-up of occurrence %s delayed to %s (max_jitter_s)%s", job["name"], iso(seen),
                         iso(next_run_at), f", folding {how_many(folded)} missed occurrences" if folded else "",
                         extra=log_ctx(job))
            return False, None, job
        if not decision.run:
            why = (f"RunAll backlog longer than max_catchup_runs ({self.settings.max_catchup_runs}) or older "
                   f"than a year; catching up from {iso(next_run_at)}" if decision.skipped_older
                   else "missed and missed_run_policy is Skip")
            self._skip(job, seen, next_run_at, now, "backlog" if decision.skipped_older else "missed", "Missed", why)
            return False, None, job
        return self._runnable(job, known, seen), next_run_at, job

    def _overlap(self, job: JobRow, now: dt.datetime) -> planner.Overlap | None:
        """The QueueAll decision of a job whose occurrence waited for a run (:func:`planner.queue_all_next`),
        or, for a Replace job whose run this supervisor just replaced, its newest due occurrence; None: the
        missed-run policy decides (:func:`planner.decide`). Raises what the planner raises."""
        if job["concurrency_mode"] == "QueueAll":
            return planner.queue_all_next(job, now)
        replaced_for = self.replacing.pop(job["id"], None)
        # only while nobody moved the job since (else the replacement is over: another supervisor claimed it)
        if job["concurrency_mode"] == "Replace" and replaced_for is not None and replaced_for == job["next_run_at"]:
            newest = planner.newest_due(job, now) or replaced_for
            return planner.Overlap(scheduled_at=newest, next_run_at=planner.next_after_claim(job, newest))
        return None

    def _decide_overlap(self, job: JobRow, overlap: planner.Overlap, known: set[str], now: dt.datetime
                        ) -> tuple[bool, dt.datetime | None, JobRow]:
        """Run ``overlap.scheduled_at``, skipping the older due occurrences first (QueueAll: beyond
        ``max_queued``; Replace: superseded by the newest)."""
        seen = job["next_run_at"]
        assert seen is not None  # a due job (checked by _decide)
        if overlap.scheduled_at != seen:
            why = (f"more than max_queued ({job['max_queued']}) occurrences waited for the live run "
                   f"(concurrency_mode QueueAll): the oldest are dropped, {iso(overlap.scheduled_at)} runs next"
                   if job["concurrency_mode"] == "QueueAll" else
                   f"superseded by occurrence {iso(overlap.scheduled_at)} (concurrency_mode Replace: the newest "
                   "occurrence runs)")
            if not self._skip(job, seen, overlap.scheduled_at, now, "concurrency", "Skipped", why):
                return False, None, job
            job = job.copy()
            job["next_run_at"] = seen = overlap.scheduled_at
        return self._runnable(job, known, seen), overlap.next_run_at, job

    def _dispatch_pooled(self, due: list[JobRow], idle: list[Any], types: set[str], known: set[str],
                         now: dt.datetime) -> None:
        """A contended poll on PostgreSQL whose idle workers all have the same job types (``types``): the due
        rows are taken in order as :meth:`dispatch_due` takes them, but a plain one (Skip or Queue, no lease
        held as read, no retry pending, a first attempt with the lease taken if free: ``leases.poolable``) is a
        candidate, not a claim bound to a worker, and the due rows past the free slots are candidates too.
        Any other run is claimed first as usual; then ONE statement (``Store.claim_pool``) claims, for the
        workers still idle, the first candidates no peer holds - a row a peer just took makes way for the
        next candidate instead of leaving a worker idle. A candidate not taken stays due (never skipped).
        Used up workers are removed from ``idle``."""
        exact: list[tuple[JobRow, dt.datetime | None, Any]] = []
        candidates: list[tuple[JobRow, dt.datetime | None, Any, dt.datetime | None]] = []
        for job in due:
            slots = len(idle)  # the workers not given to an exact claim yet
            if not slots:
                break
            plain = (job["concurrency_mode"] in ("Skip", "Queue") and job["lock_token"] is None
                     and not planner.pending_retry(job))
            if not plain and len(candidates) >= slots:
                continue  # past the free slots: only plain rows are candidates
            if job["job_type"] not in types and job["job_type"] in known:  # only a busy worker has it: wait
                self.waiting_for_worker.add(job["id"])
                continue
            decided, next_run_at, job = self._decide(job, known, now)
            if not decided:
                continue
            if plain and job["job_type"] in types and next_run_at is not None:  # not the job's last occurrence
                candidates.append((job, next_run_at, None, job["next_run_at"]))
            else:
                exact.append((job, next_run_at, idle.pop()))
        self._claim_batch(exact, now)
        if candidates and idle:
            self._claim_many(candidates, now, pool=idle)

    def _runnable(self, job: JobRow, known: set[str], seen: dt.datetime | None) -> bool:
        """True if this supervisor has the job's plugin (``known``: the job types of its ready workers). A type
        no ready worker has but a starting one will (:meth:`coming`) is not judged: the job waits, due, for
        that worker's Ready (which wakes the loop). Else the job is left for a supervisor that has the plugin
        until the next rescan, said once per (job, type) (``seen``: the occurrence waiting; None for a
        retry, not logged)."""
        if job["job_type"] in known:
            return True
        if self.coming(job["job_type"]):
            self.waiting_for_worker.add(job["id"])
            return False
        self.unrunnable[job["id"]] = job["job_type"]  # left due for a supervisor that has it (a rolling deploy)
        if seen is not None and (job["id"], job["job_type"]) not in self._reported_unrunnable:
            self._reported_unrunnable.add((job["id"], job["job_type"]))
            log.error("job %s: job_type %r is not available on this supervisor (see `plugins list`); its "
                      "occurrences are left to a supervisor that has it (occurrence %s is waiting)",
                      job["name"], job["job_type"], iso(seen), extra=log_ctx(job))
        return False

    def coming(self, job_type: str) -> bool:
        """True if ``job_type`` is one the newest Ready reported (``pool.last_ready``: what the plugins folder
        offers) while a slot of the pool has no ready worker (at start-up, a refill after a death, a kill or a
        recycle, a reload's replacement): that worker will bring it, even when no ready worker has it now (all
        slots starting again). A type the newest Ready lacks (a rolling deploy, a module left out) is not
        waited for, so a slot that keeps failing to start cannot hold such a job due at every poll."""
        last = self.pool.last_ready
        return (last is not None and any(p.job_type == job_type for p in last.plugins)
                and any(w is None or w.ready is None for w in self.pool.workers.values()))

    def _claim_batch(self, to_run: list[tuple[JobRow, dt.datetime | None, Any]], now: dt.datetime) -> int:
        """Claim the scheduled occurrences of ``to_run`` ((job, next_run_at, worker) each) together and hand
        the won ones over; a lost claim of a Skip job skips its occurrence (a run is still live), of a Queue
        job (or a RunAll catch-up) leaves it waiting for the live run to end. A job row another transaction
        held (``busy``: another supervisor claiming it, its result being written) is left due for the next
        poll, not skipped. Returns how many were won."""
        busy: set[int] = set()  # rows another transaction held (PostgreSQL, MariaDB): neither won nor lost
        flights = self._claim_many([(job, next_run_at, worker, job["retry_scheduled_at"] if planner.pending_retry(job)
                                     else job["next_run_at"]) for job, next_run_at, worker in to_run], now, busy)
        if busy:  # a peer is claiming the same jobs: for a while, its rows are passed over by the due read
            self.contended_until = now + CONTENDED_FOR
        for i, ((job, next_run_at, _), flight) in enumerate(zip(to_run, flights, strict=True)):
            seen = job["next_run_at"]
            if (flight is None and i not in busy and seen is not None and job["concurrency_mode"] == "Skip"
                    and not planner.pending_retry(job)  # a retry waits for the live run, never skipped
                    and job["missed_run_policy"] != "RunAll"):
                self._skip_live_one(job, seen, next_run_at, now)
        return sum(f is not None for f in flights)

    def _skip_live_one(self, job: JobRow, seen: dt.datetime, next_run_at: dt.datetime | None,
                       now: dt.datetime) -> None:
        """Skip occurrence ``seen`` of a Skip job because its lease is held (a run is live)."""
        if (self._skip(job, seen, next_run_at, now, "concurrency", "Skipped", self._live_reason(job))
                and job["id"] in self.skip_due_at):
            self.skip_due_at[job["id"]] = next_run_at

    def _live_reason(self, job: JobRow) -> str:
        """Why a Skip job's occurrence is skipped, for its log line and notice: this supervisor's own live run
        (with its id when it is in flight here), or the lease of another supervisor, which may have died."""
        holder = job.get("locked_by_instance")  # as read by the poll
        if holder is None:
            return "a run is still live (concurrency_mode Skip)"
        if holder == self.settings.instance:
            run_id = next((f.run_id for f in self.inflight.values() if f.job_id == job["id"]), None)
            run = "its run" if run_id is None else f"its run {run_id}"
            return f"{run} on this supervisor ({holder}) is still live (concurrency_mode Skip)"
        return (f"the job's lease is held by supervisor {holder} (concurrency_mode Skip): its run is live, or that "
                "supervisor died and its liveness lease has not lapsed yet")

    def _skip(self, job: JobRow, seen: dt.datetime, next_run_at: dt.datetime | None, now: dt.datetime,
              metric: str, event: str, why: str) -> bool:
        """Advance past occurrence ``seen`` without running it, with its notices (one transaction). False
        when another supervisor moved the job first."""
        rows = notices.outbox_rows(notices.for_skip(job, seen, event=event, reason=why),
                                   self.settings.notifications.channels())
        try:  # the occurrences between seen and next_run_at are passed over with it (issue 12's accounting)
            extra = planner.occurrences_between(job, seen, next_run_at)
        except SCHEDULE_ERRORS:
            extra = 0
        by_concurrency = metric == "concurrency"  # else by the missed-run policy: the others are "missed"
        if self.store.set_next_run_at(job["id"], seen, next_run_at, now, skipped=1 + extra if by_concurrency else 1,
                                      missed=0 if by_concurrency else extra, notices=rows):
            self.wake_sender()
            self.metrics.occurrence_skipped(metric, 1 + extra if by_concurrency else 1)
            if extra and not by_concurrency:
                self.metrics.occurrences_missed("dropped", extra)
            more = (f" (with the {how_many(extra)} later occurrence{'s' * (extra != 1)} before {iso(next_run_at)}, "
                    f"counted as {'skipped' if by_concurrency else 'missed'})" if extra and next_run_at is not None
                    else "")
            log.warning("job %s: occurrence %s skipped%s: %s", job["name"], iso(seen), more, why, extra=log_ctx(job))
            return True
        return False

    # -- claim and hand over --------------------------------------------------------------------------
    def claim(self, job: JobRow, now: dt.datetime, next_run_at: dt.datetime | None, worker: Any,
              scheduled_at: dt.datetime | None) -> InFlight | None:
        """Claim the occurrence ``scheduled_at`` (None: a manual run) and hand it to ``worker``; the job's
        ``next_run_at`` becomes ``next_run_at``. Returns the new :class:`InFlight`, None if the claim lost
        (the lease is held, or another supervisor took the occurrence)."""
        return self._claim_many([(job, next_run_at, worker, scheduled_at)], now)[0]

    def _claim_many(self, items: list[tuple[JobRow, dt.datetime | None, Any, dt.datetime | None]],
                    now: dt.datetime, busy: set[int] | None = None, pool: list[Any] | None = None,
                    start_at: float | None = None) -> list[InFlight | None]:
        """Claim (job, next_run_at, worker, scheduled_at) items in one transaction, then hand each won run
        to its worker. One :class:`InFlight` (or None: lost) per item, in order. ``busy``: see
        ``Store.claim_many`` (job rows locked by another supervisor are skipped, their indexes added).
        ``pool`` (:meth:`_dispatch_pooled`; the items' workers None): idle workers, as many claims as there are
        of them among the items (``Store.claim_pool``), each won run handed to one taken from the list; the
        others are not taken (not lost). ``start_at``: claimed ahead (:meth:`claim_ahead`, ``now`` its instant),
        the workers start the runs at this instant of their clock (epoch seconds)."""
        if not items:
            return []
        holding = self.clock.holding_takeovers(now)
        requests, timeouts = [], []
        for job, next_run_at, _, scheduled_at in items:
            retry = scheduled_at is not None and planner.pending_retry(job)
            timeout_s = planner.run_timeout_s(job, self.settings.lease_timeout_s)
            queued_at = None if retry else planner.queued_at(job, scheduled_at)
            # a retry's occurrence was accounted for by its first attempt
            passed = planner.occurrences_between(job, scheduled_at, next_run_at) if scheduled_at and not retry else 0
            # a Queue run that waited passes over what came due while the live run went on (Queue keeps one
            # occurrence waiting): skipped by concurrency; otherwise folded by the missed-run policy
            timeouts.append(timeout_s)
            requests.append(ClaimRequest(
                # the job lease outlives the deadline by one TTL: time for this supervisor to kill and record
                job, next_run_at, lease_s=timeout_s + self.settings.lease_ttl_s,
                deadline_at=now + dt.timedelta(seconds=timeout_s),
                take_lease=job["concurrency_mode"] != "Concurrent", scheduled_at=scheduled_at,
                queued_at=queued_at, only_free_lease=holding,
                status="Expired" if next_run_at is None and scheduled_at is not None else None,
                missed=0 if queued_at else passed, skipped=passed if queued_at else 0,
                attempt=(job["retry_attempt"] or 1) if retry else 1, retry=retry))
        if pool is None:
            claims = self.store.claim_many(requests, now=now, instance=self.settings.instance, not_before=now,
                                           busy=busy)
        elif poolable(requests):
            claims = self.store.claim_pool(requests, len(pool), instance=self.settings.instance, not_before=now)
            if [c is not None for c in claims] != [i < len(pool) for i in range(len(claims))]:
                self.contended_until = now + CONTENDED_FOR  # a peer took some first candidates: still contended
        else:  # not plain after all (a takeover hold): the first ones, claimed as usual
            taken = min(len(pool), len(requests))
            claims = self.store.claim_many(requests[:taken], now=now, instance=self.settings.instance,
                                           not_before=now, busy=busy) + [None] * (len(requests) - taken)
        flights: list[InFlight | None] = []
        for (job, next_run_at, worker, scheduled_at), request, timeout_s, claim in zip(items, requests, timeouts,
                                                                                       claims, strict=True):
            if claim is not None and pool is not None:
                worker = pool.pop()
            flight = None if claim is None else self._hand_over(job, worker, scheduled_at, request.deadline_at,
                                                                timeout_s, claim, now, request.missed,
                                                                request.attempt, start_at=start_at)
            if flight is not None and start_at is not None:
                flight.planned_next = next_run_at  # an edit of the schedule before the instant is seen
            flights.append(flight)
            if claim is not None and request.skipped:
                self.metrics.occurrence_skipped("concurrency", request.skipped)
                log.warning("job %s: %s occurrence%s after %s skipped: they came due while its run was live "
                            "(concurrency_mode Queue keeps one waiting)", job["name"], how_many(request.skipped),
                            "s" * (request.skipped != 1), iso(scheduled_at), extra=log_ctx(job))
            if claim is not None and job["concurrency_mode"] == "Skip" and job["missed_run_policy"] != "RunAll":
                self.skip_due_at[job["id"]] = next_run_at  # its next occurrence is skipped if the run is live
            if claim is not None and job["concurrency_mode"] == "Replace":
                self.replacing.pop(job["id"], None)
                self.replace_due_at[job["id"]] = next_run_at  # its next occurrence replaces this run
        return flights

    def _previous_details(self, job: JobRow, scheduled_at: dt.datetime | None, attempt: int,
                          flight: InFlight) -> str | None:
        """A retry's previous attempt's details, for ``context.previous_details`` (None for a first run or
        a manual run's retry; a database error is logged and the retry runs without them)."""
        if attempt <= 1 or scheduled_at is None:
            return None
        try:
            return self.store.previous_attempt_details(job["id"], scheduled_at, attempt)
        except Exception as exc:  # noqa: BLE001 - the retry runs anyway, as a fresh attempt
            log.warning("run %d: the previous attempt's details could not be read (%s); the plugin gets none",
                        flight.run_id, _short(exc), extra=log_ctx(flight))
            return None

    def _hand_over(self, job: JobRow, worker: Any, scheduled_at: dt.datetime | None, deadline: dt.datetime,
                   timeout_s: float, claim: Claim, now: dt.datetime, missed: int = 0,
                   attempt: int = 1, backfill: bool = False, start_at: float | None = None) -> InFlight:
        """Record ``claim`` as in flight and send its ``RunRequest`` to ``worker``. ``backfill``: a pending
        backfill or retry, whose start is not counted as lateness of its (past) occurrence. ``start_at``: a
        run claimed ahead, started by its worker at this instant (epoch seconds of this machine's clock)."""
        flight = InFlight(claim.run_id, job, claim.lock_token, worker, now, deadline, timeout_s)
        flight.scheduled_at = scheduled_at
        flight.attempt = attempt
        flight.start_at = start_at
        flight.recorded_start = started_at = claim.started_at or now
        if start_at is not None:  # a `runs cancel` meanwhile is acted on before the plugin starts
            flight.cancel_check_at = started_at - CANCEL_CHECK_BEFORE
        self.inflight[claim.run_id] = flight
        limits = run_limits(job, self.settings.limits)
        notify = bool(self.settings.notifications.channels())  # else the plugin's notice text is not asked for
        request = protocol.RunRequest(
            run_id=claim.run_id, job_id=job["id"], job_name=job["name"], job_type=job["job_type"],
            configuration=job["configuration"], scheduled_at=scheduled_at.timestamp() if scheduled_at else None,
            deadline_at=deadline.timestamp(), limits=limits, attempt=attempt,
            previous_details=self._previous_details(job, scheduled_at, attempt, flight),
            notice_on_success=notify and bool(job.get("notify_on_success")),  # as notices.for_run judges
            notice_on_failure=notify and bool(job.get("notify_on_failure", True)), start_at=start_at)
        if limits is not None and limits.max_cpu_s is not None:
            watch_cpu(flight, self.pool.tree_cpu_s(worker), limits.max_cpu_s, now)
        try:
            self.pool.submit(worker, request)
        except OSError:
            log.warning("worker %d died before run %d reached it; its death will be recorded", worker.pid,
                        claim.run_id, extra=log_ctx(flight))
        self.metrics.run_started((started_at - scheduled_at).total_seconds() if scheduled_at and not backfill
                                 else None)
        if missed:
            self.metrics.occurrences_missed("folded", missed)
        if log.isEnabledFor(logging.INFO):
            log.info("run %d started: job %s (%s) for %s%s on worker %d, deadline %s%s", claim.run_id, job["name"],
                     job["job_type"], iso(scheduled_at) if scheduled_at else "a manual request",
                     f" (attempt {attempt})" if attempt > 1 else "", worker.pid, iso(deadline),
                     f", catching up {how_many(missed)} missed occurrence{'s' * (missed != 1)}" if missed else "",
                     extra=log_ctx(flight))
        return flight

    # -- rows that cannot be scheduled ----------------------------------------------------------------
    def _mark_bad(self, job: JobRow, reason: str) -> None:
        if self.bad_jobs.get(job["id"], (None,))[0] != job["updated_at"]:
            log.error("job %s skipped until it is fixed: %s", job["name"], reason)
        self.bad_jobs[job["id"]] = (job["updated_at"], reason)

    def _numbers_ok(self, job: JobRow) -> bool:
        """False (the job set aside, logged naming the field) when a number of the row is not a number or
        out of range (:func:`jobspec.stored_problem`). The number columns of rows found fine are remembered
        as a set of tuples (most jobs share the defaults or a few values): a row whose numbers are among them
        costs one tuple read and a set lookup, not the check."""
        try:
            numbers: tuple[Any, ...] | None = NUMBER_COLUMNS(job)
        except KeyError:  # a row without every column (not the poll's): checked in full
            numbers = None
        if numbers is not None and numbers in self._numbers_fine:
            return True
        problem = jobspec.stored_problem(job)
        if problem is not None:
            self._mark_bad(job, str(problem))
            return False
        if numbers is not None:
            self._numbers_fine.add(numbers)
        return True

    def _forget_fixed_bad_jobs(self) -> None:
        """Give a bad job another chance once its row has changed (``updated_at`` moved)."""
        for job_id, (updated_at, _) in list(self.bad_jobs.items()):
            row = self.store.get_job_by_id(job_id)
            if row is None or row["updated_at"] != updated_at:
                del self.bad_jobs[job_id]

    def _repair_unreadable(self, job: JobRow, now: dt.datetime) -> bool:
        """Give a job whose stored ``next_run_at`` cannot be read a fresh one from ``now`` (logged)."""
        try:
            next_run_at = planner.initial_next_run_at(job, now)
        except SCHEDULE_ERRORS as exc:
            self._mark_bad(job, str(exc))
            return False
        if self.store.repair_next_run_at(job["id"], next_run_at):
            log.error("job %s: its next_run_at could not be read (not a timestamp in the store's form; edited by "
                      "hand?); rescheduled to %s", job["name"], iso(next_run_at), extra=log_ctx(job))
        return False

    def _reschedule(self, job: JobRow, next_run_at: dt.datetime | None, now: dt.datetime) -> bool:
        if self.store.set_next_run_at(job["id"], job["next_run_at"], next_run_at, now):
            log.info("job %s: not before start_at %s; next_run_at moved to %s", job["name"], iso(job["start_at"]),
                     iso(next_run_at))
        return False
