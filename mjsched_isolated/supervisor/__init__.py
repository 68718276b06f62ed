"""The supervisor side of the process boundary: the loop, dispatch, recording, the pool of worker
children, the liveness lease, notifications, metrics and retention. It never imports plugin code.

The path from "job is due" to "run recorded", one :meth:`Supervisor.cycle` (``loop.py``) at a time::

    database (jobs, runs, leases)                 supervisor process                         worker child
    ============================      ==============================================        ============

                                       cycle(): read_clock()  (clock.py: the only clock reader;
                                                 |             wall/database jumps noticed here)
                                                 v
                                      step(now, mono) ------------------------------------.
                                        keep_lease          liveness.py  renew, fence ----+--> kill
                                        retry_pending       recording.py (results held    |
                                                                          while DB down)  |
                                        enforce_deadlines   guard.py     Timeout  --------+--> kill
    due_jobs, claim  <----------------  rescan, dispatch_due dispatch.py decide each due  |
    (lease + occurrence +                                                 job; claim it;  |
     Running run row, one txn)                                            RunRequest -----+--> run(plugin)
                                        pruner.step         retention.py                  |
                                                 | returns the wake-up time               |
                                                 v                                        |
                                      pool.wait(until wake) pool.py   pipes + sentinels <-+--- RunFinished,
                                                 |                    + signal pipe            Heartbeat,
                                                 v                                             death
                                      on_events(events, now)
                                        RunFinished -> Completed/Failed --.
                                        death      -> Failed (exit code)  +-> recording.py
                                        Heartbeat  -> guard.py: token-checked deadline extension
    finish_run  <-----------------------------------------------------------'
    (run row, job stats, lease release,
     outbox notices: one txn)                        notifier.py (thread) delivers the outbox

Parts (one owner each): ``loop.py`` Supervisor (serve, cycle, signals, shutdown and drain);
``manual.py`` manual runs (``jobs run``) on the same cycle;
``clock.py`` clocks and jumps; ``dispatch.py`` the sweep, the per-job decision, claim + submit, bad
jobs; ``advice.py`` what is logged about the job set and plugins; ``guard.py`` runs in flight
(deadlines, heartbeats, fences, cancellation, deaths); ``recording.py`` outcomes, pending and refused
results; ``inflight.py`` the :class:`InFlight` record. Beside the loop: ``pool.py`` (children,
recycling), ``liveness.py`` (the supervisor's lease), ``notifier.py``, ``metrics.py``, ``retention.py``.
"""

from mjsched_isolated.supervisor.clock import utcnow
from mjsched_isolated.supervisor.loop import Supervisor

__all__ = ["Supervisor", "utcnow"]
