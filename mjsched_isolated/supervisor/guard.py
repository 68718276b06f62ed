"""What happens to runs while they are in flight: deadline kills, heartbeat extensions, fences,
cancellations, worker deaths, and moving them with a time jump. Each ending goes to the
:class:`~mjsched_isolated.supervisor.recording.Recorder`; each kill takes the worker's whole process tree
(``Pool.kill``) and the pool refills the slot.
"""

from __future__ import annotations

import datetime as dt
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from mjsched_isolated import planner
from mjsched_isolated.config import Settings
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.isotime import iso
from mjsched_isolated.store import Store
from mjsched_isolated.store.leases import HeldBeforeStart, Outcome
from mjsched_isolated.supervisor.inflight import InFlight, log_ctx
from mjsched_isolated.supervisor.limits import CPU_KILL_MARGIN_S, next_cpu_check_s
from mjsched_isolated.supervisor.metrics import Metrics
from mjsched_isolated.supervisor.pool import ChildEvent, describe_exit
from mjsched_isolated.supervisor.recording import Recorder

log = logging.getLogger("mjsched.supervisor")
WITHDRAW_MARGIN_S = 0.05  # a shutdown withdraws a run claimed ahead only this long before its instant or more


class RunGuard:
    """Acts on ``inflight`` (run id -> :class:`InFlight`, the supervisor's own dict): removes a run from it
    before recording its end, so a run is recorded at most once by this supervisor."""

    def __init__(self, settings: Settings, store: Store, pool: Any, metrics: Metrics, recorder: Recorder,
                 inflight: dict[int, InFlight], lease_lapsed: Callable[[InFlight], bool] = lambda _flight: False,
                 ) -> None:
        self.lease_lapsed = lease_lapsed  # did the liveness lease lapse while this run was in flight?
        self.settings = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.recorder = recorder
        self.inflight = inflight
        self._replace_declined: set[int] = set()  # runs whose replace request was declined (job not Active)

    def enforce_deadlines(self, now: dt.datetime) -> None:
        """Runs past their deadline get SIGTERM (their whole process tree; a plugin's SIGTERM handler and
        its commands may clean up), then SIGKILL ``kill_grace_s`` later if still running, recorded Timeout
        saying which signal ended them (Kubernetes' ``terminationGracePeriodSeconds``, systemd's
        ``TimeoutStopSec``). Never waits: the loop wakes at the end of the grace (``InFlight.wake_at``).
        Runs falling due together are signalled together, then reaped, refilled and recorded."""
        grace_s = min(self.settings.kill_grace_s, self.settings.lease_ttl_s / 2)  # the job lease outlasts it
        overdue = [f for f in self.inflight.values() if f.kill_at is None and now >= f.deadline]
        if overdue and grace_s > 0:
            self.pool.terminate([f.worker for f in overdue])
            for flight in overdue:
                flight.kill_at = now + dt.timedelta(seconds=grace_s)
                log.warning("run %d of job %s exceeded its deadline of %g s: SIGTERM sent to its process tree, "
                            "SIGKILL in %g s", flight.run_id, flight.job_name, flight.timeout_s, grace_s,
                            extra=log_ctx(flight))
            overdue = []
        hard = overdue + [f for f in self.inflight.values() if f.kill_at is not None and now >= f.kill_at]
        if not hard:
            return
        for flight in hard:
            del self.inflight[flight.run_id]
        self.pool.kill_all([f.worker for f in hard])
        for flight in hard:
            self.metrics.run_killed("deadline")
            how = ("killed with SIGKILL" if grace_s <= 0 else
                   f"sent SIGTERM, still running {grace_s:g} s later (kill_grace_s): killed with SIGKILL")
            self.recorder.record(flight, now, status="Timeout", success=False,
                                 error_message=f"{self._exceeded(flight)}; worker {flight.worker.pid} and its "
                                               f"process tree {how}")

    def enforce_cpu_limits(self, now: dt.datetime) -> None:
        """Runs whose process tree used ``max_cpu_s`` + :data:`CPU_KILL_MARGIN_S` CPU seconds since they
        were handed over (read from the worker's cgroup, else by psutil over the tree: ``Pool.tree_cpu_s``)
        are killed and recorded Failed. The worker stops a run at SIGXCPU (its ``RLIMIT_CPU``, its watchdog
        for the tree); this catches what does not stop there: a long call in C (a big regex, ``sum`` over a
        huge range: Python's handler runs only when it returns) or a command that ignores SIGXCPU. Each run's
        tree is read only when its check is due (``InFlight.cpu_check_at``: the soonest it could reach the
        kill point on this machine's CPUs, 0.1 to 5 s apart)."""
        over: list[tuple[InFlight, float]] = []
        for flight in self.inflight.values():
            if flight.cpu_check_at is None or flight.kill_at is not None or now < flight.cpu_check_at:
                continue
            total = self.pool.tree_cpu_s(flight.worker)
            if total is None or flight.cpu_limit_s is None:  # the worker is gone: its death is recorded
                flight.cpu_check_at = None
                continue
            used = total - flight.cpu_base_s
            left = flight.cpu_limit_s + CPU_KILL_MARGIN_S - used
            if left > 0:
                flight.cpu_check_at = now + dt.timedelta(seconds=next_cpu_check_s(left))
            else:
                over.append((flight, used))
        if not over:
            return
        for flight, _ in over:
            del self.inflight[flight.run_id]
        self.pool.kill_all([f.worker for f, _ in over])
        for flight, used in over:
            self.metrics.run_killed("cpu")
            error = (f"CPU time limit {flight.cpu_limit_s:g} s exceeded: its process tree used {used:.1f} s of CPU "
                     f"and did not stop at SIGXCPU (a long call in C, or a process ignoring the signal); worker "
                     f"{flight.worker.pid} and its process tree killed with SIGKILL at max_cpu_s + "
                     f"{CPU_KILL_MARGIN_S:g} s")
            log.warning("run %d of job %s: %s", flight.run_id, flight.job_name, error, extra=log_ctx(flight))
            self.recorder.record(flight, now, status="Failed", success=False, error_message=error)

    def ended_after_sigterm(self, flight: InFlight, now: dt.datetime, how: str) -> None:
        """A run sent SIGTERM at its deadline ended within its grace (``how``: its plugin returned, or the
        worker exited): recorded Timeout, saying SIGTERM ended it."""
        del self.inflight[flight.run_id]
        self.metrics.run_killed("deadline")
        self.recorder.record(flight, now, status="Timeout", success=False,
                             error_message=f"{self._exceeded(flight)}; worker {flight.worker.pid} and its process "
                                           f"tree sent SIGTERM: it ended within the grace ({how})")

    @staticmethod
    def _exceeded(flight: InFlight) -> str:
        """Which limit the run broke: its (heartbeat-extended) deadline, or the hard ``max_total_runtime_s``."""
        hard = flight.hard_deadline
        if hard is not None and flight.deadline >= hard:
            limit = (f"max_total_runtime_s of {(hard - flight.started_at).total_seconds():g} s "
                     "(a hard cap no heartbeat extends)")
        else:
            limit = f"deadline of {flight.timeout_s:g} s"
        return f"run exceeded its {limit} (started {iso(flight.started_at)})"

    def heartbeat(self, flight: InFlight, now: dt.datetime) -> None:
        """A plugin heartbeat: at most one effective extension per ``heartbeat_interval_s`` (the first one
        at once, unlike the reference, whose first beat can only count after 5 min), to
        ``max(deadline, now + heartbeat_lease_s)``, token-checked (reference §2.3 / §7.1), never past the
        job's ``max_total_runtime_s`` cap (``flight.hard_deadline``). The new deadline is sent back to the
        worker, so the plugin's ``context.deadline_at`` shows it."""
        if flight.kill_at is not None:  # past its deadline, being terminated: too late to extend
            return
        if flight.last_extended and (now - flight.last_extended).total_seconds() < self.settings.heartbeat_interval_s:
            return
        deadline = max(flight.deadline, now + dt.timedelta(seconds=self.settings.heartbeat_lease_s))
        if flight.hard_deadline is not None and deadline > flight.hard_deadline:
            if flight.deadline >= flight.hard_deadline:
                return  # already at the cap: nothing to extend
            deadline = flight.hard_deadline
        lease_s = (deadline - now).total_seconds() + self.settings.lease_ttl_s
        try:
            extended = self.store.extend(flight.job_id, flight.token, lease_s, flight.run_id, deadline)
        except Exception as exc:  # noqa: BLE001 - the plugin keeps its current deadline
            log.warning("run %d: heartbeat not applied (%s)", flight.run_id, _short(exc), extra=log_ctx(flight))
            return
        if extended:
            flight.deadline = deadline
            flight.last_extended = now
            self.pool.tell_deadline(flight.worker, flight.run_id, deadline.timestamp())  # context.deadline_at
            log.debug("run %d: deadline extended to %s by heartbeat", flight.run_id, iso(deadline),
                      extra=log_ctx(flight))
        else:
            log.warning("run %d of job %s: heartbeat could not extend the lease (token no longer holds it)",
                        flight.run_id, flight.job_name, extra=log_ctx(flight))

    def fence(self, flight: InFlight, now: dt.datetime, why: str) -> None:
        """Kill a run this supervisor may no longer hold, before anyone else may legally take the job.
        Its outcome is recorded only if the run row is still Running (never over another's verdict)."""
        del self.inflight[flight.run_id]
        self.pool.kill(flight.worker)
        self.metrics.run_killed("fence")
        if flight.unstarted(now, self._reaped_at()):  # claimed ahead, killed before its instant: run again
            self.recorder.record_unstarted(flight, now, f"fenced: {why}", again=True)
            return
        log.error("run %d of job %s fenced: %s", flight.run_id, flight.job_name, why, extra=log_ctx(flight))
        self.recorder.record(flight, now, status="Failed", success=False,
                             error_message=f"fenced: run killed because {why}", fenced=True)

    def fence_unheld(self, now: dt.datetime) -> None:
        """After a renewal: fence runs whose job lease or run row this supervisor no longer holds (matched by
        run id, lease token and instance), and cancel the held runs someone asked to cancel (`runs cancel`):
        one query per renewal serves both."""
        if not self.inflight:
            return
        try:
            held = self.store.held_runs({run_id: f.token for run_id, f in self.inflight.items()},
                                        self.settings.instance)
        except Exception:  # noqa: BLE001 - checked again at the next renewal
            return
        for run_id in set(self.inflight) - set(held):
            self.fence(self.inflight[run_id], now,
                       "its lease was taken over, the run was abandoned, or its job was removed")
        self._act_on_cancels(held, now)

    def _act_on_cancels(self, held: dict[int, str | None], now: dt.datetime) -> None:
        """Cancel the runs of ``held`` (:meth:`Store.held_runs`) someone asked to cancel."""
        for run_id, requested_by in held.items():
            if requested_by is not None and run_id in self.inflight:
                if planner.is_replacement(requested_by):  # another supervisor saw its Replace occurrence due
                    if self._replacement_stands(self.inflight[run_id], requested_by):
                        self.cancel(self.inflight[run_id], now, requested_by, retry=False)
                else:
                    self.cancel(self.inflight[run_id], now, f"cancelled by {requested_by} (runs cancel)")

    def _replacement_stands(self, flight: InFlight, requested_by: str) -> bool:
        """A replace request from another supervisor is acted on only while the job is still Active: a job
        paused (or removed) since then starts no new run, so its live run is not killed for one (it goes on;
        said once per run)."""
        try:
            job = self.store.get_job_by_id(flight.job_id)
        except Exception:  # noqa: BLE001 - judged again at the next renewal
            return False
        if job is not None and job["status"] == "Active":
            return True
        if flight.run_id not in self._replace_declined:
            self._replace_declined.add(flight.run_id)
            log.warning("run %d of job %s: not replaced (%s): the job is no longer Active, so no new run would "
                        "start; the run goes on", flight.run_id, flight.job_name, requested_by, extra=log_ctx(flight))
        return False

    def cancel_before_start(self, now: dt.datetime) -> None:
        """Runs claimed ahead whose ``cancel_check_at`` (just before their instant) has come: one read of their
        cancel requests and their jobs' status and next run time (:meth:`Store.held_before_start`). Before
        their workers start the plugins (recorded never started, not run again): those asked to be cancelled
        are cancelled; those whose job was paused, disabled or otherwise made not Active, or re-planned by
        an edit of its schedule so that this instant is no longer its next occurrence, are withdrawn; those
        no longer held (the job removed, the lease taken over) are fenced. Something that comes later is
        acted on at the next renewal, as for any live run (a pause then lets the run go on)."""
        due = [f for f in self.inflight.values() if f.cancel_check_at is not None and now >= f.cancel_check_at]
        if not due:
            return
        for flight in due:
            flight.cancel_check_at = None
        try:
            held = self.store.held_before_start({f.run_id: f.token for f in due}, self.settings.instance)
        except Exception:  # noqa: BLE001 - the renewal's check still comes
            return
        for flight in due:
            if flight.run_id not in self.inflight:
                continue
            state = held.get(flight.run_id)
            if state is None:
                if flight.unstarted(now):  # a started run is fenced at the renewal, as before
                    self.fence(flight, now, "its lease was taken over, the run was abandoned, or its job was "
                                            "removed")
            elif state.cancel_requested_by is not None:
                self._act_on_cancels({flight.run_id: state.cancel_requested_by}, now)
            elif flight.unstarted(now) and (why := _withdrawn_because(flight, state)) is not None:
                log.info("run %d of job %s withdrawn before its instant %s: %s", flight.run_id, flight.job_name,
                         iso(flight.recorded_start), why, extra=log_ctx(flight))
                self.cancel(flight, now, why, retry=False, kill_reason="cancel")

    def cancel(self, flight: InFlight, now: dt.datetime, reason: str, *, retry: bool = True,
               kill_reason: str | None = None) -> None:
        """Kill one run's process tree at someone's request and record it Cancelled (lease released, not
        counted as a run or a failure). ``retry`` False: never retried (a run replaced by a newer occurrence,
        concurrency_mode Replace), else retried only if the job's ``retry_on`` lists Cancelled. ``kill_reason``:
        the kill's metrics label (default ``cancel``, ``replace`` when not retried)."""
        del self.inflight[flight.run_id]
        self.pool.kill(flight.worker)
        self.metrics.run_killed(kill_reason or ("cancel" if retry else "replace"))
        if flight.unstarted(now, self._reaped_at()):  # claimed ahead, cancelled before its instant: never started
            self.recorder.record_unstarted(flight, now, reason, again=False)
            return
        log.warning("run %d of job %s: %s; its process tree was killed", flight.run_id, flight.job_name, reason,
                    extra=log_ctx(flight))
        self.recorder.record(flight, now, status="Cancelled", success=False, error_message=reason, count=False,
                             retryable=retry)

    def kill_replaced(self, flight: InFlight, outcome: Outcome) -> None:
        """Kill the process tree of a run replaced by a newer occurrence (concurrency_mode Replace) whose
        Cancelled ``outcome`` was recorded with the claim of its replacement (``Store.claim_replacement``):
        its log line and metrics as if recorded here."""
        del self.inflight[flight.run_id]
        self.pool.kill(flight.worker)
        self.metrics.run_killed("replace")
        log.warning("run %d of job %s: %s; its process tree was killed", flight.run_id, flight.job_name,
                    outcome.error_message, extra=log_ctx(flight))
        self.recorder.recorded(flight, outcome)

    def fence_all(self, now: dt.datetime) -> None:
        """The liveness lease cannot be trusted locally any more: fence every run."""
        for flight in list(self.inflight.values()):
            self.fence(flight, now, f"this supervisor could not renew its lease for "
                                    f"{self.settings.lease_ttl_s * 0.8:g} s (database unreachable?)")

    def cancel_all(self, now: dt.datetime, reason: str) -> None:
        """Kill every in-flight run's process tree and record it Cancelled (lease released, not counted)."""
        for flight in list(self.inflight.values()):
            del self.inflight[flight.run_id]
            self.pool.kill(flight.worker)
            self.metrics.run_killed("shutdown")
            if flight.unstarted(now, self._reaped_at()):  # claimed ahead, stopped before its instant: run again
                self.recorder.record_unstarted(flight, now, reason, again=True)
            else:
                self.recorder.record(flight, now, status="Cancelled", success=False, error_message=reason,
                                     count=False)

    def _reaped_at(self) -> float | None:
        """When the pool's last kill had reaped its workers (before it spawned their replacements), None:
        unknown (then "now" judges whether a run claimed ahead had started)."""
        at = getattr(self.pool, "reaped_at", None)
        return at if isinstance(at, float) else None

    def withdraw_unstarted(self, now: dt.datetime, why: str) -> None:
        """Kill the workers of the runs claimed ahead whose instant is more than :data:`WITHDRAW_MARGIN_S`
        away (a shutdown starts no new run) and record them never started, their occurrences run again (by
        whichever supervisor runs then). A run nearer its instant is left to start and drain: a kill that
        came after its start would interrupt it."""
        margin = time.time() + WITHDRAW_MARGIN_S
        later = now + dt.timedelta(seconds=WITHDRAW_MARGIN_S)
        unstarted = [f for f in self.inflight.values()
                     if f.start_at is not None and f.start_at > margin and later < f.recorded_start]
        if not unstarted:
            return
        for flight in unstarted:
            del self.inflight[flight.run_id]
        self.pool.kill_all([f.worker for f in unstarted])
        reaped_at = self._reaped_at()
        for flight in unstarted:
            self.metrics.run_killed("shutdown")
            if flight.unstarted(now, reaped_at):
                self.recorder.record_unstarted(flight, now, why, again=True)
            else:
                self.recorder.record(flight, now, status="Cancelled", success=False, count=False,
                                     error_message=f"interrupted: {why}")

    def on_death(self, event: ChildEvent, now: dt.datetime) -> None:
        """A worker died: its run (if any) is Failed with the exit code or signal."""
        how = describe_exit(event.exitcode)
        flight = self.inflight.pop(event.run.run_id, None) if event.run is not None else None
        if flight is None:
            if event.culprit is None:  # the pool has already named a plugin module that killed it at import
                log.warning("worker %d exited while idle (%s); slot refilled", event.worker.pid, how)
            return
        if flight.kill_at is not None:  # sent SIGTERM at its deadline: the worker ended within the grace
            self.inflight[flight.run_id] = flight
            self.ended_after_sigterm(flight, now, f"the worker exited: {how}")
            return
        if flight.unstarted(now):  # claimed ahead, its worker dead before the instant: its occurrence runs again
            self.recorder.record_unstarted(flight, now, f"worker process {event.worker.pid} died ({how}) while the "
                                                        "run waited for its instant", again=True)
            return
        if event.exitcode == -signal.SIGKILL and not event.oom_killed and self.lease_lapsed(flight):
            self.metrics.run_killed("fence")
            why = (f"its worker's watchdog killed it: this supervisor's liveness lease was not renewed for "
                   f"{self.settings.lease_ttl_s * 0.8:g} s (0.8 x lease_ttl_s; the supervisor was frozen or cut "
                   "off), so another supervisor might take the job over")
            log.error("run %d of job %s fenced: %s", flight.run_id, flight.job_name, why, extra=log_ctx(flight))
            self.recorder.record(flight, now, status="Failed", success=False, error_message=f"fenced: {why}",
                                 fenced=True)
            return
        limit_mb = event.run.limits.max_memory_mb if event.run is not None and event.run.limits is not None else None
        if event.killed_for is not None:  # still alive when its pipe failed: this supervisor killed it
            error = (f"worker process {event.worker.pid} killed by this supervisor during the run: {event.killed_for} "
                     "(did the plugin close or write to file descriptors it does not own, e.g. os.closerange?)")
        elif event.oom_killed:  # the kernel counted it in the worker's cgroup: no guess
            error = (f"memory limit {limit_mb} MB exceeded: the kernel's out-of-memory killer ended worker process "
                     f"{event.worker.pid} at its cgroup's memory limit ({how})")
        else:
            error = (f"worker process {event.worker.pid} died during the run ({how})"
                     f"{death_hint(event.exitcode, flight.job.get('max_memory_mb') or limit_mb, event.oom_evidence)}")
        self.recorder.record(flight, now, status="Failed", success=False, error_message=error)

    def shift(self, by: dt.timedelta, now: dt.datetime, jump_s: float) -> None:
        """A time jump of ``by``: each run keeps the time it had left, in memory and in its run row and job
        lease (token-checked), so a forward jump never kills a run for time it did not use and a backward
        one never stretches a deadline."""
        for flight in self.inflight.values():
            flight.shift(by)
            self.pool.tell_deadline(flight.worker, flight.run_id, flight.deadline.timestamp())
            lease_s = max(0.0, (flight.deadline - now).total_seconds()) + self.settings.lease_ttl_s
            try:
                self.store.extend(flight.job_id, flight.token, lease_s, flight.run_id, flight.deadline)
            except Exception as exc:  # noqa: BLE001 - the run keeps its local deadline; renewal checks the lease
                log.warning("run %d: deadline not moved in the database (%s)", flight.run_id, _short(exc))
        if self.inflight:
            log.warning("time jumped %+.1f s against the monotonic clock; %d in-flight run(s) keep the time "
                        "they had left", jump_s, len(self.inflight))


def death_hint(exitcode: int | None, max_memory_mb: int | None, oom_evidence: bool | None = None) -> str:
    """What a worker's death by a signal this supervisor did not send most likely means: SIGKILL from
    the kernel's out-of-memory killer only when the worker's cgroup counted an out-of-memory kill
    (``oom_evidence`` True), from someone else when it counted none (False), either without accounting
    (None), naming the job's memory limit; SIGXCPU/SIGXFSZ from rlimits."""
    if exitcode == -signal.SIGKILL:
        limit = f"; the job's memory limit is {max_memory_mb} MB" if max_memory_mb else ""
        if oom_evidence is False:
            return (": not sent by this supervisor, nor by the kernel's out-of-memory killer (the worker's cgroup "
                    "counted no out-of-memory kill): another process or a person killed it")
        if oom_evidence:
            return (f": not sent by this supervisor, most likely the kernel's out-of-memory killer (the worker's "
                    f"cgroup counted an out-of-memory kill){limit}")
        return (f": not sent by this supervisor: the kernel's out-of-memory killer (see the kernel log) or another "
                f"process{limit}")
    if exitcode == -signal.SIGXCPU:
        return ": its CPU time limit (max_cpu_s) was exceeded"
    if exitcode == -signal.SIGXFSZ:
        return ": it wrote past the file size limit"
    return ""


def _withdrawn_because(flight: InFlight, state: HeldBeforeStart) -> str | None:
    """Why a run claimed ahead must not start at its instant, judged on its job as read just before it
    (:meth:`Store.held_before_start`), or None: its job is not Active any more (paused, disabled, expired by
    an edit of ``end_at``), or its next run time is no longer the one the claim wrote nor this instant (an
    edit of its schedule re-planned it from before the instant, and this instant was not its next
    occurrence: not one of the new schedule's). A pending retry's time is not a re-plan."""
    if state.job_status != "Active":
        return f"its job became {state.job_status} before its instant"
    nxt = state.next_run_at
    if (flight.planned_next is None or flight.scheduled_at is None or nxt is None or nxt == flight.planned_next
            or nxt <= flight.scheduled_at or nxt == state.retry_at):
        return None
    return f"its job's schedule was changed before its instant (next run {iso(nxt)})"
