"""Cron expressions: the only module that imports croniter.

Expressions have 5 fields (minute hour day-of-month month day-of-week) or 6 fields with **seconds
first**, as in the reference engine (cron-parser): ``0 30 9 * * MON-FRI`` is 09:30:00 on weekdays
(reference-engine-spec.md §6). Every expression is read in an IANA time zone; results are aware UTC.

Supported forms (:data:`SUPPORTED_FORMS`, shown in the CLI's help): ``*``, values, lists (``1,15``),
ascending ranges (``1-5``; a descending one such as ``5-1`` is refused: croniter would silently wrap it
around), steps (``*/15``, ``0-30/10``), month and weekday names (``JAN``, ``MON-FRI``), ``L``, ``W`` and
``#`` (``L`` last day of month, ``15W`` nearest weekday, ``FRI#2`` second Friday), and the aliases
``@yearly``/``@annually``, ``@monthly``, ``@weekly``, ``@daily``/``@midnight``, ``@hourly`` (as Vixie
cron and Kubernetes CronJob; ``@reboot`` has no meaning for a scheduler and is refused).
"""

from __future__ import annotations

import bisect
import copy
import datetime as dt
import functools
import itertools
import re
import zoneinfo

from croniter import croniter

from mjsched_isolated.enums import DstFoldPolicy, DstGapPolicy, values
from mjsched_isolated.errors import CronError

UTC = dt.UTC

SUPPORTED_FORMS = ("5 fields (min hour dom month dow) or 6 with seconds first; lists 1,15; ascending "
                   "ranges 1-5; steps */15; names JAN, MON-FRI; L, W, #; aliases @hourly @daily @midnight "
                   "@weekly @monthly @yearly @annually")
ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
           "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}
# Zone names that mean "whatever this host is set to": a fleet would schedule one job differently per host
HOST_ZONES = frozenset({"local", "localtime", "posixrules"})
_NAMES = {3: {m: i for i, m in enumerate(("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                                          "NOV", "DEC"), start=1)},
          4: {d: i for i, d in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))}}
_RANGE = re.compile(r"^([0-9A-Za-z]+)-([0-9A-Za-z]+)$")
DST_GAP_POLICIES = values(DstGapPolicy)  # ("Shift", "Skip"); Shift is the default
DST_FOLD_POLICIES = values(DstFoldPolicy)  # ("OnceIfFixedHour", "Once", "Both"); OnceIfFixedHour is the default
DEFAULT_DST_GAP = DstGapPolicy.SHIFT.value
DEFAULT_DST_FOLD = DstFoldPolicy.ONCE_IF_FIXED_HOUR.value


@functools.lru_cache(maxsize=512)
def zone(timezone: str) -> zoneinfo.ZoneInfo:
    """The ``ZoneInfo`` for an IANA name. Raises :class:`CronError` (field ``timezone``) if unknown."""
    if not timezone or not isinstance(timezone, str):
        raise CronError("timezone", "must be an IANA time zone name such as 'UTC' or 'Europe/Berlin'")
    if timezone.strip().lower() in HOST_ZONES:
        raise CronError("timezone", f"{timezone!r} is the host's own zone, which differs between machines; "
                                    "name an IANA zone such as 'Europe/Berlin'")
    try:
        return zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError("timezone", f"unknown time zone {timezone!r}") from None


def expand(cron_expression: str) -> str:
    """``cron_expression`` with an alias (``@daily``) replaced by its 5 fields; other text unchanged."""
    text = cron_expression.strip()
    if text.startswith("@"):
        try:
            return ALIASES[text.lower()]
        except KeyError:
            raise CronError("cron_expression", f"unknown alias {text!r}; supported: "
                                               f"{', '.join(ALIASES)}") from None
    return cron_expression


def _fields(cron_expression: str) -> list[str]:
    if not isinstance(cron_expression, str) or not cron_expression.strip():
        raise CronError("cron_expression", "is required")
    fields = expand(cron_expression).split()
    if len(fields) not in (5, 6):
        raise CronError(
            "cron_expression",
            f"{cron_expression!r} has {len(fields)} fields; expected 5 (min hour dom month dow) "
            "or 6 (sec min hour dom month dow)",
        )
    return _single_value_ranges(fields)


def _single_value_ranges(fields: list[str]) -> list[str]:
    """``3-3`` (or ``SUN-SUN``, ``3-3/2``) written as the single value ``3``: croniter reads a range whose
    two ends are equal as the whole field (``0 3-3 * * *`` ran every hour)."""
    offset = 1 if len(fields) == 6 else 0
    out = []
    for position, field in enumerate(fields):
        names = _NAMES.get(position - offset, {})
        parts = []
        for part in field.split(","):
            match = _RANGE.match(part.split("/")[0])
            if match:
                low, high = (names.get(v.upper()) if not v.isdigit() else int(v) for v in match.groups())
                if low is not None and low == high:
                    part = match.group(1)
            parts.append(part)
        out.append(",".join(parts))
    return out


def validate(cron_expression: str, timezone: str = "UTC") -> None:
    """Raise :class:`CronError` naming ``cron_expression`` or ``timezone`` if either is invalid."""
    fields = _fields(cron_expression)
    zone(timezone)
    _refuse_descending_ranges(cron_expression, fields)
    if not croniter.is_valid(" ".join(fields), second_at_beginning=len(fields) == 6):
        raise CronError("cron_expression", f"invalid cron expression {cron_expression!r}")


def check_dst_policies(dst_gap_policy: str, dst_fold_policy: str) -> None:
    """Raise :class:`CronError` naming ``dst_gap_policy`` or ``dst_fold_policy`` if either is unknown."""
    if dst_gap_policy not in DST_GAP_POLICIES:
        raise CronError("dst_gap_policy", f"must be one of {', '.join(DST_GAP_POLICIES)}, got {dst_gap_policy!r}")
    if dst_fold_policy not in DST_FOLD_POLICIES:
        raise CronError("dst_fold_policy", f"must be one of {', '.join(DST_FOLD_POLICIES)}, got {dst_fold_policy!r}")


def _refuse_descending_ranges(cron_expression: str, fields: list[str]) -> None:
    """croniter reads ``5-1`` as a wrap-around (5,6,...,0,1); cron(8) and the reference refuse it."""
    offset = 1 if len(fields) == 6 else 0
    for position, field in enumerate(fields):
        names = _NAMES.get(position - offset, {})
        for part in field.split(","):
            match = _RANGE.match(part.split("/")[0])
            if not match:
                continue
            low, high = (names.get(v.upper()) if not v.isdigit() else int(v) for v in match.groups())
            if low is not None and high is not None and low > high:
                raise CronError("cron_expression", f"descending range {part.split('/')[0]!r} in "
                                                   f"{cron_expression!r}; write it as two ranges or a list")


# --- Daylight-saving rules -------------------------------------------------------------------------
#
# Expressions are matched against *local wall times* (naive datetimes, enumerated by croniter, which
# knows nothing about zones here); each matching wall time is then mapped to UTC instants:
#
# 1. Gap (spring forward; the offset increases at instant T from ``ob`` to ``oa``): wall times in
#    ``[T+ob, T+oa)`` do not exist. If any of them matches, the expression runs once at ``T``, the
#    first valid instant after the gap (several nonexistent slots collapse into that one instant):
#    ``dst_gap_policy`` ``Shift``, the default. Under ``Skip`` those slots do not run at all.
#    Matching wall times outside the gap keep their times.
# 2. Fold (fall back; the offset decreases at T): wall times in ``[T+oa, T+ob)`` occur twice. Under
#    ``dst_fold_policy`` ``OnceIfFixedHour`` (the default; Cronos's rule) an expression whose hour field
#    is fixed (no ``*``/``?`` and no step ``/``) runs only in the first copy, one with a wildcard or step
#    in the hour field runs in both. ``Once``: every expression runs only in the first copy (a wall time
#    runs at most once). ``Both``: every expression runs in both copies.
# 3. ``next_run_time`` is the least such instant strictly after ``after``, so iterating it is strictly
#    increasing in UTC.
#
# The UTC timeline is cut into segments of constant offset at the zone's transitions (found by sampling
# ``utcoffset`` hourly and bisecting to the second, cached per zone and year). Within one segment the
# wall-time -> UTC mapping is a plain shift, so the common case (no transition between ``after`` and
# the candidate) costs one croniter step plus a cached bisect.

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
_SAMPLE_STEP = dt.timedelta(hours=1)
_SECOND = dt.timedelta(seconds=1)
# How far back a transition can still constrain the next occurrence (a fold's repeated wall times):
_LOOKBACK = dt.timedelta(days=1)


class _Transition(tuple):
    """``(instant, offset_before, offset_after)``; ``instant`` is the first UTC instant with the new offset."""

    __slots__ = ()

    @property
    def at(self) -> dt.datetime:
        return self[0]

    @property
    def before(self) -> dt.timedelta:
        return self[1]

    @property
    def after(self) -> dt.timedelta:
        return self[2]


def _offset(tz: zoneinfo.ZoneInfo, instant: dt.datetime) -> dt.timedelta:
    return instant.astimezone(tz).utcoffset()  # type: ignore[return-value]


def _bisect_change(tz: zoneinfo.ZoneInfo, lo: dt.datetime, hi: dt.datetime, off_lo: dt.timedelta) -> dt.datetime:
    """The first whole second in ``(lo, hi]`` whose offset differs from ``off_lo`` (which ``hi``'s does)."""
    lo_s, hi_s = 0, int((hi - lo).total_seconds())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if _offset(tz, lo + dt.timedelta(seconds=mid)) == off_lo:
            lo_s = mid
        else:
            hi_s = mid
    return lo + dt.timedelta(seconds=hi_s)


@functools.lru_cache(maxsize=4096)
def _year_transitions(timezone: str, year: int) -> tuple[tuple[dt.datetime, ...], tuple[_Transition, ...]]:
    """The offset changes of ``timezone`` whose instant falls in UTC year ``year``: (instants, transitions)."""
    tz = zone(timezone)
    if year < 2 or year > 9998:
        return (), ()
    start = dt.datetime(year, 1, 1, tzinfo=UTC)
    end = dt.datetime(year + 1, 1, 1, tzinfo=UTC)
    found: list[_Transition] = []
    prev_t = start - _SECOND
    prev_off = _offset(tz, prev_t)
    while prev_t < end - _SECOND:
        t = min(prev_t + _SAMPLE_STEP, end - _SECOND)
        off = _offset(tz, t)
        while off != prev_off:  # one or more changes in (prev_t, t]
            at = _bisect_change(tz, prev_t, t, prev_off)
            new_off = _offset(tz, at)
            found.append(_Transition((at, prev_off, new_off)))
            prev_t, prev_off = at, new_off
        prev_t, prev_off = t, off
    return tuple(tr.at for tr in found), tuple(found)


def _first_transition(timezone: str, lo: dt.datetime, hi: dt.datetime) -> _Transition | None:
    """The earliest transition with ``lo < instant <= hi``."""
    for year in range(lo.year, hi.year + 1):
        instants, transitions = _year_transitions(timezone, year)
        i = bisect.bisect_right(instants, lo)
        if i < len(instants):
            return transitions[i] if instants[i] <= hi else None
    return None


def _last_transition(timezone: str, lo: dt.datetime, hi: dt.datetime) -> _Transition | None:
    """The latest transition with ``lo < instant <= hi``."""
    for year in range(hi.year, lo.year - 1, -1):
        instants, transitions = _year_transitions(timezone, year)
        i = bisect.bisect_right(instants, hi)
        if i > 0:
            return transitions[i - 1] if instants[i - 1] > lo else None
    return None


@functools.lru_cache(maxsize=512)
def _prototype(cron_expression: str) -> tuple[croniter, bool]:
    """A parsed croniter (copied per use: parsing costs ~0.1 ms) and whether the hour field is fixed."""
    fields = _fields(cron_expression)
    six = len(fields) == 6
    _refuse_descending_ranges(cron_expression, fields)
    try:
        proto = croniter(" ".join(fields), dt.datetime(2000, 1, 1), second_at_beginning=six)
    except (ValueError, KeyError, TypeError) as exc:
        raise CronError("cron_expression", f"invalid cron expression {cron_expression!r} ({exc})") from None
    hour = fields[2 if six else 1]
    fixed_hour = not any(c in hour for c in "*?/")
    return proto, fixed_hour


class _Walls:
    """Matching local wall times (naive), via one croniter copy."""

    __slots__ = ("_expr", "_itr")

    def __init__(self, cron_expression: str, proto: croniter) -> None:
        self._itr = copy.copy(proto)
        self._expr = cron_expression

    def after(self, wall: dt.datetime) -> dt.datetime:
        """First matching wall time strictly after ``wall``."""
        try:
            return self._itr.get_next(dt.datetime, start_time=wall)
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise CronError(
                "cron_expression", f"invalid cron expression {self._expr!r} ({exc})"
            ) from None

    def at_or_after(self, wall: dt.datetime) -> dt.datetime:
        """First matching wall time at or after ``wall`` (a whole second)."""
        return self.after(wall - _SECOND)


def _naive_utc(instant: dt.datetime) -> dt.datetime:
    return instant.replace(tzinfo=None)


def next_run_time(cron_expression: str, timezone: str, after: dt.datetime, dst_gap_policy: str = DEFAULT_DST_GAP,
                  dst_fold_policy: str = DEFAULT_DST_FOLD) -> dt.datetime:
    """The first occurrence strictly after ``after``, as an aware UTC datetime.

    ``after`` must be aware (any zone). The expression is evaluated in ``timezone``, with the
    daylight-saving rules described above (by default, gap: run once at the first instant after it;
    fold: first copy only for a fixed hour field, both copies otherwise; see :data:`DST_GAP_POLICIES`,
    :data:`DST_FOLD_POLICIES`). Raises :class:`CronError` for an invalid expression, zone or policy,
    :class:`ValueError` for a naive ``after``.
    """
    if after.tzinfo is None:
        raise ValueError("after must be an aware datetime")
    check_dst_policies(dst_gap_policy, dst_fold_policy)
    return _next_run_time(cron_expression, timezone, after.astimezone(UTC), dst_gap_policy, dst_fold_policy)


@functools.lru_cache(maxsize=4096)
def _next_run_time(cron_expression: str, timezone: str, after: dt.datetime, dst_gap_policy: str,
                   dst_fold_policy: str) -> dt.datetime:
    """:func:`next_run_time` for an aware UTC ``after``, memoised: the jobs of one poll share a cron
    expression, a due instant and ``now`` far more often than not (issue 11: croniter was a quarter of the
    supervisor's CPU per run at saturation). A :class:`CronError` is not cached (it is raised again)."""
    proto, fixed_hour = _prototype(cron_expression)
    once_in_fold = dst_fold_policy == "Once" or (dst_fold_policy == DEFAULT_DST_FOLD and fixed_hour)
    tz = zone(timezone)
    walls = _Walls(cron_expression, proto)
    after = after.astimezone(UTC)

    # The segment containing ``after`` (offset ``off``): first matching wall time after after's own.
    local = after.astimezone(tz)
    off: dt.timedelta = local.utcoffset()  # type: ignore[assignment]
    w = walls.after(local.replace(tzinfo=None, fold=0))
    prev = _last_transition(timezone, after - _LOOKBACK, after)
    if once_in_fold and prev is not None and prev.before > prev.after:
        # shortly past a fold: wall times before prev.at + prev.before already ran in the first copy
        first_unseen = _naive_utc(prev.at + prev.before)
        if w < first_unseen:
            w = walls.at_or_after(first_unseen)
    seg_start = after
    while True:
        candidate = (w - off).replace(tzinfo=UTC)
        nxt = _first_transition(timezone, seg_start, candidate)
        if nxt is None:  # the common case: no offset change between after and the candidate
            return candidate
        # The candidate lies beyond this segment, so no wall time in [segment's, w) matches.
        at, ob, oa = nxt
        if oa > ob:  # gap: wall times [at+ob, at+oa) do not exist; w is the first match >= at+ob
            if w < _naive_utc(at + oa):
                if dst_gap_policy == "Shift":
                    return at
                w = walls.at_or_after(_naive_utc(at + oa))  # Skip: the first match after the gap
        elif not once_in_fold:  # fold, both copies run: look again from the start of the repeated wall times
            w = walls.at_or_after(_naive_utc(at + oa))
        # (fold, once: the repeated wall times ran in the first copy; w, >= at+ob, stands)
        off, seg_start = oa, at


def moved_wall_times(cron_expression: str, timezone: str, instant: dt.datetime, limit: int = 3600) -> list[dt.datetime]:
    """The nonexistent local wall times (naive) of a DST gap that ``instant`` runs for, in order (at most
    ``limit``); empty unless ``instant`` is the first instant after a gap in which the expression matches
    (under ``dst_gap_policy`` ``Shift``; under ``Skip`` they are :func:`skipped_wall_times`)."""
    instant = instant.astimezone(UTC)
    tr = _first_transition(timezone, instant - _SECOND, instant)
    if tr is None or tr.at != instant:
        return []
    return _gap_wall_times(cron_expression, tr, limit)


def skipped_wall_times(cron_expression: str, timezone: str, after: dt.datetime, instant: dt.datetime,
                       limit: int = 3600) -> list[dt.datetime]:
    """Under ``dst_gap_policy`` ``Skip``: the nonexistent local wall times (naive, in order, at most
    ``limit``) of DST gaps between two consecutive occurrences ``after`` and ``instant``, which did not run."""
    out: list[dt.datetime] = []
    lo = after.astimezone(UTC)
    while len(out) < limit:
        tr = _first_transition(timezone, lo, instant.astimezone(UTC))
        if tr is None:
            return out
        out += _gap_wall_times(cron_expression, tr, limit - len(out))
        lo = tr.at
    return out


def _gap_wall_times(cron_expression: str, tr: _Transition, limit: int) -> list[dt.datetime]:
    """The wall times in transition ``tr``'s gap that match (empty for a fold), at most ``limit``."""
    proto, _ = _prototype(cron_expression)
    if tr.after <= tr.before:
        return []
    walls = _Walls(cron_expression, proto)
    end = _naive_utc(tr.at + tr.after)
    out: list[dt.datetime] = []
    w = walls.at_or_after(_naive_utc(tr.at + tr.before))
    while w < end and len(out) < limit:
        out.append(w)
        w = walls.after(w)
    return out


def min_interval_s(cron_expression: str, timezone: str, after: dt.datetime, samples: int = 6,
                   dst_gap_policy: str = DEFAULT_DST_GAP, dst_fold_policy: str = DEFAULT_DST_FOLD) -> float:
    """Smallest gap between the next ``samples`` occurrences, in seconds (reference §6.4
    ``GetMinIntervalMs``). ``inf`` if the expression (or a policy) is invalid."""
    try:
        times = [next_run_time(cron_expression, timezone, after, dst_gap_policy, dst_fold_policy)]
        for _ in range(samples - 1):
            times.append(next_run_time(cron_expression, timezone, times[-1], dst_gap_policy, dst_fold_policy))
    except CronError:
        return float("inf")
    return min((b - a).total_seconds() for a, b in itertools.pairwise(times))
