"""Reading clocks, and noticing when they jump. Only the outer loop (``Supervisor.cycle``) reads clocks;
everything else is given ``now`` (database time) and ``mono`` (the monotonic clock, in seconds).

Two comparisons, both against the monotonic clock, which never jumps:

- the local wall clock (:meth:`Clock.notice_wall_jump`): a step, or a machine waking from suspend, makes
  the supervisor re-measure the database clock's offset at once instead of at the next renewal;
- database time as the loop sees it (:meth:`Clock.step_jump_s`): what moved is then shifted by the loop
  (deadlines, the shutdown bound, timers), and after a *forward* jump every lease in the database looks
  older by the jump, so for one renewal interval (plus a poll) this supervisor neither abandons other
  supervisors' runs nor takes a lease that is not free (:meth:`Clock.holding_takeovers`).

A difference up to ``CLOCK_JUMP_S`` (1 s) is scheduling noise, not a jump.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from mjsched_isolated.isotime import iso

log = logging.getLogger("mjsched.supervisor")
UTC = dt.UTC
CLOCK_JUMP_S = 1.0


def utcnow() -> dt.datetime:
    """This machine's wall clock, aware UTC."""
    return dt.datetime.now(UTC)


class Clock:
    """The supervisor's clocks. ``skew_s`` (seconds, only tests set it) is added to the wall clock;
    ``hold_s`` is how long takeovers are held after a forward jump (renewal interval + rescan + 1 s)."""

    def __init__(self, skew_s: float, hold_s: float) -> None:
        self.skew_s = skew_s
        self.hold_s = hold_s
        self.takeover_hold_until: dt.datetime | None = None  # database time
        self._last_wall: tuple[dt.datetime, float] | None = None  # (local wall clock, monotonic)
        self._last_step: tuple[dt.datetime, float] | None = None  # (database time, monotonic)

    def local_now(self) -> dt.datetime:
        """This machine's wall clock plus the skew."""
        return utcnow() + dt.timedelta(seconds=self.skew_s)

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    def notice_wall_jump(self, local: dt.datetime, mono: float) -> bool:
        """True (and logged) if the wall clock moved more than ``CLOCK_JUMP_S`` differently from the
        monotonic clock since the previous reading."""
        previous, self._last_wall = self._last_wall, (local, mono)
        if previous is None:
            return False
        jump_s = (local - previous[0]).total_seconds() - (mono - previous[1])
        if abs(jump_s) <= CLOCK_JUMP_S:
            return False
        log.warning("wall clock jumped %+.1f s; re-reading the database clock now", jump_s)
        return True

    def step_jump_s(self, now: dt.datetime, mono: float) -> float:
        """How far database time ``now`` jumped against the monotonic clock since the previous call, in
        seconds (0.0 for less than ``CLOCK_JUMP_S``). A forward jump starts the takeover hold; a held
        bound moves with any jump."""
        previous, self._last_step = self._last_step, (now, mono)
        if previous is None:
            return 0.0
        jump_s = (now - previous[0]).total_seconds() - (mono - previous[1])
        if abs(jump_s) <= CLOCK_JUMP_S:
            return 0.0
        if self.takeover_hold_until is not None:
            self.takeover_hold_until += dt.timedelta(seconds=jump_s)
        if jump_s > 0:  # every lease now looks older by the jump: let their holders renew before taking any
            self.takeover_hold_until = now + dt.timedelta(seconds=self.hold_s)
            log.warning("time jumped %+.1f s: no lease of another supervisor is taken and no run abandoned "
                        "until %s, so that live supervisors can renew theirs first", jump_s,
                        iso(self.takeover_hold_until))
        return jump_s

    def holding_takeovers(self, now: dt.datetime) -> bool:
        """True for a short while after a forward time jump (see the module docstring)."""
        return self.takeover_hold_until is not None and now < self.takeover_hold_until
