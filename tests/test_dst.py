"""cron daylight-saving rules, checked against a brute-force reference that walks every UTC minute/second.

Rules (see mjsched_isolated/cron.py):
1. a nonexistent local time (spring-forward gap) runs once, at the first valid instant after the gap;
2. in a repeated hour (fall back) an expression with a fixed hour field runs in the first copy only, one
   with a wildcard/step hour field runs in both copies;
3. next_run_time is strictly increasing in UTC.
Those are the default policies (dst_gap_policy Shift, dst_fold_policy OnceIfFixedHour); the others
(gap Skip: no run; fold Once: first copy only, Both: both copies, whatever the hour field) are checked
against the same reference.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import zoneinfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mjsched_isolated import cron, cronshow
from mjsched_isolated.errors import CronError

UTC = dt.UTC
MINUTE = dt.timedelta(minutes=1)
SECOND = dt.timedelta(seconds=1)


def utc(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


# --- a tiny, independent cron matcher (numbers, lists, ranges, *, */n, a-b/n) -----------------------------

def _field_values(text: str, lo: int, hi: int) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/")
            step = int(step_text)
        if part == "*":
            a, b = lo, hi
        elif "-" in part:
            a, b = (int(x) for x in part.split("-"))
        else:
            a = b = int(part)
        values.update(range(a, b + 1, step))
    return values


@functools.cache
def _matcher(expr: str):
    fields = expr.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    sec, minute, hour, dom, month, dow = fields
    assert dom == month == dow == "*", "reference matcher supports time-of-day fields only"
    secs, mins, hours = _field_values(sec, 0, 59), _field_values(minute, 0, 59), _field_values(hour, 0, 23)
    fixed_hour = not any(c in hour for c in "*/")
    return (lambda w: w.second in secs and w.minute in mins and w.hour in hours), fixed_hour


def reference(expr: str, zone_name: str, start: dt.datetime, end: dt.datetime, gap: str = "Shift",
              fold: str = "OnceIfFixedHour") -> list[dt.datetime]:
    """Occurrences in (start, end), by walking every UTC minute (second for 6 fields) and applying the rules."""
    tz = zoneinfo.ZoneInfo(zone_name)
    matches, fixed_hour = _matcher(expr)
    step = SECOND if len(expr.split()) == 6 else MINUTE
    out = []
    u = start + step
    prev_off = (u - step).astimezone(tz).utcoffset()
    while u < end:
        local = u.astimezone(tz)
        off = local.utcoffset()
        wall = local.replace(tzinfo=None)
        run = False
        if off > prev_off and gap == "Shift":  # u is the first instant after a gap: did a nonexistent wall time match?
            w = u.replace(tzinfo=None) + prev_off  # first nonexistent wall time
            while w < wall and not run:
                run = matches(w)
                w += step
        if matches(wall):
            ambiguous = (wall.replace(tzinfo=tz, fold=0).utcoffset()
                         != wall.replace(tzinfo=tz, fold=1).utcoffset())  # exists (from u), so a fold
            both = fold == "Both" or (fold == "OnceIfFixedHour" and not fixed_hour)
            if not ambiguous or both or local.fold == 0:
                run = True
        if run:
            out.append(u)
        prev_off = off
        u += step
    return out


def iterate(expr: str, zone_name: str, start: dt.datetime, end: dt.datetime, *policies: str) -> list[dt.datetime]:
    out = []
    t = cron.next_run_time(expr, zone_name, start, *policies)
    while t < end:
        out.append(t)
        nxt = cron.next_run_time(expr, zone_name, t, *policies)
        assert nxt > t
        t = nxt
    return out


ZONES = ["Europe/Berlin", "America/New_York", "America/Los_Angeles", "Europe/Helsinki",
         "Australia/Lord_Howe", "America/Santiago"]


def transitions(zone_name: str, year: int) -> list[dt.datetime]:
    """UTC instants (to the minute) where the zone's offset changes during ``year`` (independent of cron.py)."""
    tz = zoneinfo.ZoneInfo(zone_name)
    found = []
    t = utc(year, 1, 1)
    off = t.astimezone(tz).utcoffset()
    while t.year == year:
        nxt = t + dt.timedelta(hours=1)
        if nxt.astimezone(tz).utcoffset() != off:
            m = t
            while m.astimezone(tz).utcoffset() == off:
                m += MINUTE
            found.append(m)
            off = m.astimezone(tz).utcoffset()
        t = nxt
    return found


TRANSITIONS = [(z, t) for z in ZONES for t in transitions(z, 2024)]


def test_every_zone_has_a_gap_and_a_fold_in_2024():
    assert len(TRANSITIONS) == 2 * len(ZONES)


# (expression, half-width of the window around each transition)
CASES = [
    ("0 2 * * *", dt.timedelta(hours=30)),
    ("30 2 * * *", dt.timedelta(hours=30)),
    ("0 * * * *", dt.timedelta(hours=30)),
    ("*/15 * * * *", dt.timedelta(hours=30)),
    ("* * * * *", dt.timedelta(hours=6)),
    ("30 1 * * *", dt.timedelta(hours=30)),
    ("0 0 * * *", dt.timedelta(hours=30)),
    ("45 1 * * *", dt.timedelta(hours=30)),
    ("15 2 * * *", dt.timedelta(hours=30)),
    ("* 2 * * *", dt.timedelta(hours=30)),
    ("0 1-3 * * *", dt.timedelta(hours=30)),
    ("0 */2 * * *", dt.timedelta(hours=30)),
    ("0 30 2 * * *", dt.timedelta(hours=4)),
    ("*/20 * * * * *", dt.timedelta(hours=2)),
]


@pytest.mark.parametrize(("zone_name", "instant"), TRANSITIONS, ids=[f"{z}-{t:%m%d}" for z, t in TRANSITIONS])
@pytest.mark.parametrize(("expr", "half"), CASES, ids=[c[0] for c in CASES])
def test_matches_brute_force_reference(expr, half, zone_name, instant):
    start, end = instant - half, instant + half
    expected = reference(expr, zone_name, start, end)
    assert expected, "window should contain occurrences"
    assert iterate(expr, zone_name, start, end) == expected


POLICY_CASES = [c for c in CASES if c[0] in ("30 2 * * *", "0 * * * *", "30 1 * * *", "* 2 * * *", "0 1-3 * * *",
                                             "0 30 2 * * *")]
POLICIES = [("Skip", "OnceIfFixedHour"), ("Shift", "Once"), ("Shift", "Both"), ("Skip", "Once"), ("Skip", "Both")]


@pytest.mark.parametrize(("zone_name", "instant"), TRANSITIONS, ids=[f"{z}-{t:%m%d}" for z, t in TRANSITIONS])
@pytest.mark.parametrize(("expr", "half"), POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
@pytest.mark.parametrize(("gap", "fold"), POLICIES[:3], ids=[f"{g}-{f}" for g, f in POLICIES[:3]])
def test_policies_match_brute_force_reference(gap, fold, expr, half, zone_name, instant):
    start, end = instant - half, instant + half
    assert iterate(expr, zone_name, start, end, gap, fold) == reference(expr, zone_name, start, end, gap, fold)


@pytest.mark.parametrize(("zone_name", "instant"), TRANSITIONS, ids=[f"{z}-{t:%m%d}" for z, t in TRANSITIONS])
@pytest.mark.parametrize(("expr", "half"), POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
@pytest.mark.parametrize(("gap", "fold"), [("Shift", "OnceIfFixedHour"), *POLICIES],
                         ids=[f"{g}-{f}" for g, f in [("Shift", "OnceIfFixedHour"), *POLICIES]])
def test_the_occurrence_after_any_instant_before_the_next_one_is_that_one(gap, fold, expr, half, zone_name, instant):
    """What ``planner.decide`` relies on (issue 11: it takes the occurrence after ``now`` to be the one after
    the claimed occurrence while ``now`` is before that one): from any instant in [an occurrence, the next
    one), the next occurrence is that next one, across gaps and folds, under every policy."""
    start, end = instant - half, instant + half
    occurrences = iterate(expr, zone_name, start, end, gap, fold)
    tick = dt.timedelta(microseconds=1)
    for this, following in itertools.pairwise(occurrences):
        for now in (this, this + tick, this + (following - this) / 2, following - tick):
            assert cron.next_run_time(expr, zone_name, now, gap, fold) == following, (this, now)


# --- pinned examples ------------------------------------------------------------------------------------

def test_gap_runs_once_at_first_valid_instant_berlin():
    # 02:30 does not exist in Berlin on 2024-03-31: runs at 03:00 CEST = 01:00Z; the next day keeps 02:30
    assert iterate("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), utc(2024, 4, 2)) == [
        utc(2024, 3, 31, 1, 0), utc(2024, 4, 1, 0, 30)]


def test_gap_several_slots_collapse_into_one_instant():
    # every minute of 02:xx is nonexistent -> one run at 03:00 CEST, then the next day's 02:00
    assert iterate("* 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), utc(2024, 4, 1, 0, 2)) == [
        utc(2024, 3, 31, 1, 0), utc(2024, 4, 1, 0, 0), utc(2024, 4, 1, 0, 1)]
    # every minute through the gap: 01:59 CET, then 03:00, 03:01 CEST, no duplicates
    assert iterate("* * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 58), utc(2024, 3, 31, 1, 2)) == [
        utc(2024, 3, 31, 0, 59), utc(2024, 3, 31, 1, 0), utc(2024, 3, 31, 1, 1)]


def test_gap_only_moves_the_slot_inside_it():
    # */15: 01:45 CET, (02:00..02:45 collapse onto) 03:00 CEST, 03:15 ...
    assert iterate("*/15 * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 30), utc(2024, 3, 31, 1, 31)) == [
        utc(2024, 3, 31, 0, 45), utc(2024, 3, 31, 1, 0), utc(2024, 3, 31, 1, 15), utc(2024, 3, 31, 1, 30)]


def test_fold_fixed_hour_runs_in_first_copy_only_berlin():
    assert iterate("0 2 * * *", "Europe/Berlin", utc(2023, 10, 28, 12), utc(2023, 10, 31)) == [
        utc(2023, 10, 29, 0, 0), utc(2023, 10, 30, 1, 0)]


def test_fold_fixed_hour_new_york_0130_once():
    # croniter alone fires at 01:30 EDT and 01:30 EST
    assert iterate("30 1 * * *", "America/New_York", utc(2024, 11, 2, 12), utc(2024, 11, 4, 12)) == [
        utc(2024, 11, 3, 5, 30), utc(2024, 11, 4, 6, 30)]
    # asked from inside the second copy, the next run is the next day
    assert cron.next_run_time("30 1 * * *", "America/New_York", utc(2024, 11, 3, 6, 10)) == utc(2024, 11, 4, 6, 30)


def test_fold_wildcard_hour_runs_in_both_copies_los_angeles():
    assert iterate("0 * * * *", "America/Los_Angeles", utc(2025, 11, 2, 7, 30), utc(2025, 11, 2, 10, 30)) == [
        utc(2025, 11, 2, 8, 0), utc(2025, 11, 2, 9, 0), utc(2025, 11, 2, 10, 0)]


def test_fold_every_minute_counts_every_real_minute():
    got = iterate("* * * * *", "America/Los_Angeles", utc(2025, 11, 2, 7, 0), utc(2025, 11, 2, 11, 0))
    assert len(got) == 4 * 60 - 1
    assert all((b - a) == MINUTE for a, b in itertools.pairwise(got))


def test_helsinki_second_copy_pin():
    # 01:45Z is 03:45 EET (second copy of 03:xx); the next :30 is 04:30 EET = 02:30Z
    assert cron.next_run_time("30 * * * *", "Europe/Helsinki", utc(2017, 10, 29, 1, 45)) == utc(2017, 10, 29, 2, 30)


def test_lord_howe_half_hour_shift():
    # fall back 2024-04-07 02:00 +11 -> 01:30 +10:30: 01:45 is repeated; fixed hour -> first copy only
    assert iterate("45 1 * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 0), utc(2024, 4, 7, 23)) == [
        utc(2024, 4, 6, 14, 45), utc(2024, 4, 7, 15, 15)]
    # spring forward 2024-10-06 02:00 +10:30 -> 02:30 +11: 02:15 runs at 02:30 +11 = 15:30Z
    assert iterate("15 2 * * *", "Australia/Lord_Howe", utc(2024, 10, 5, 0), utc(2024, 10, 6, 23)) == [
        utc(2024, 10, 5, 15, 30), utc(2024, 10, 6, 15, 15)]


def test_santiago_midnight_gap():
    # 2024-09-08 00:00 does not exist in Santiago (00:00 -04 -> 01:00 -03): the daily run is at 01:00
    assert iterate("0 0 * * *", "America/Santiago", utc(2024, 9, 6, 12), utc(2024, 9, 9, 12)) == [
        utc(2024, 9, 7, 4, 0), utc(2024, 9, 8, 4, 0), utc(2024, 9, 9, 3, 0)]
    got = cron.next_run_time("0 0 * * *", "America/Santiago", utc(2024, 9, 7, 12))
    assert got.astimezone(zoneinfo.ZoneInfo("America/Santiago")).replace(tzinfo=None) == dt.datetime(2024, 9, 8, 1)


def test_six_field_gap_and_fold():
    # 02:30:00 in Berlin: gap day -> 03:00 CEST; fold day -> first copy only
    assert cron.next_run_time("0 30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12)) == utc(2024, 3, 31, 1, 0)
    assert iterate("0 30 2 * * *", "Europe/Berlin", utc(2024, 10, 26, 12), utc(2024, 10, 28, 12)) == [
        utc(2024, 10, 27, 0, 30), utc(2024, 10, 28, 1, 30)]


def test_gap_skip_does_not_run_the_missing_slot():
    # 02:30 does not exist in Berlin on 2024-03-31: under Skip there is no run that day
    assert iterate("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), utc(2024, 4, 2), "Skip", "OnceIfFixedHour") == [
        utc(2024, 4, 1, 0, 30)]
    # slots outside the gap keep their times; 03:00 CEST itself matches and runs
    assert iterate("0 * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 30), utc(2024, 3, 31, 2, 30), "Skip", "Once") == [
        utc(2024, 3, 31, 1, 0), utc(2024, 3, 31, 2, 0)]
    assert iterate("* 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), utc(2024, 4, 1, 0, 2), "Skip", "Once") == [
        utc(2024, 4, 1, 0, 0), utc(2024, 4, 1, 0, 1)]


def test_fold_once_runs_a_wildcard_hour_in_the_first_copy_only():
    # 01:00 PDT (08:00Z) runs, 01:00 PST (09:00Z) is the same wall time again: not under Once
    assert iterate("0 * * * *", "America/Los_Angeles", utc(2025, 11, 2, 7, 30), utc(2025, 11, 2, 10, 30),
                   "Shift", "Once") == [utc(2025, 11, 2, 8, 0), utc(2025, 11, 2, 10, 0)]
    # asked from inside the second copy: the next new wall time
    assert cron.next_run_time("*/15 * * * *", "America/Los_Angeles", utc(2025, 11, 2, 9, 20), "Shift",
                              "Once") == utc(2025, 11, 2, 10, 0)


def test_fold_both_runs_a_fixed_hour_twice():
    assert iterate("30 1 * * *", "America/New_York", utc(2024, 11, 2, 12), utc(2024, 11, 4, 12), "Shift", "Both") == [
        utc(2024, 11, 3, 5, 30), utc(2024, 11, 3, 6, 30), utc(2024, 11, 4, 6, 30)]


@pytest.mark.parametrize(("field", "policies"), [("dst_gap_policy", ("Later", "Once")),
                                                 ("dst_fold_policy", ("Shift", "Twice")),
                                                 ("dst_fold_policy", ("Shift", "once"))])
def test_unknown_policy_is_refused_naming_it(field, policies):
    with pytest.raises(CronError) as err:
        cron.next_run_time("0 2 * * *", "Europe/Berlin", utc(2024, 1, 1), *policies)
    assert err.value.field == field


@settings(max_examples=150, deadline=None)
@given(
    where=st.sampled_from(TRANSITIONS),
    expr=st.sampled_from(["0 2 * * *", "30 1 * * *", "0 * * * *", "*/15 * * * *", "* 2 * * *", "0 1-3 * * *"]),
    policies=st.sampled_from(POLICIES),
    offset_s=st.integers(min_value=-2 * 86400, max_value=2 * 86400),
    micros=st.integers(min_value=0, max_value=999_999),
)
def test_strictly_increasing_under_every_policy(where, expr, policies, offset_s, micros):
    zone_name, instant = where
    t = instant + dt.timedelta(seconds=offset_s, microseconds=micros)
    for _ in range(8):
        nxt = cron.next_run_time(expr, zone_name, t, *policies)
        assert nxt > t
        t = nxt


def test_microsecond_after_inside_fold():
    t = utc(2025, 11, 2, 8, 59, 59, 999999)
    assert cron.next_run_time("0 * * * *", "America/Los_Angeles", t) == utc(2025, 11, 2, 9, 0)
    assert cron.next_run_time("0 1 * * *", "America/Los_Angeles", t) == utc(2025, 11, 3, 9, 0)


# --- property: strictly increasing near transitions ------------------------------------------------------

PROPERTY_EXPRS = [c[0] for c in CASES] + ["*/7 * * * *", "0,30 1,2 * * *", "5 */3 * * *"]


@settings(max_examples=150, deadline=None)
@given(
    where=st.sampled_from(TRANSITIONS),
    expr=st.sampled_from(PROPERTY_EXPRS),
    offset_s=st.integers(min_value=-2 * 86400, max_value=2 * 86400),
    micros=st.integers(min_value=0, max_value=999_999),
)
def test_strictly_increasing_near_transitions(where, expr, offset_s, micros):
    zone_name, instant = where
    t = instant + dt.timedelta(seconds=offset_s, microseconds=micros)
    for _ in range(8):
        nxt = cron.next_run_time(expr, zone_name, t)
        assert nxt > t
        assert nxt.tzinfo == UTC
        t = nxt


# --- cronshow.describe_next ------------------------------------------------------------------------------

def test_describe_next_notes_gap():
    rows = cronshow.describe_next("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), 2)
    assert rows[0]["utc"] == utc(2024, 3, 31, 1, 0)
    assert rows[0]["local"].isoformat() == "2024-03-31T03:00:00+02:00"
    assert rows[0]["note"] == "moved: 2024-03-31 02:30 does not exist (DST gap)"
    assert rows[1]["note"] is None
    assert rows[1]["utc"] == utc(2024, 4, 1, 0, 30)


def test_describe_next_under_skip_and_both():
    rows = cronshow.describe_next("30 2 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), 2, dst_gap_policy="Skip")
    assert [(r["utc"], r["note"]) for r in rows] == [
        (utc(2024, 4, 1, 0, 30), "skipped before this: 2024-03-31 02:30 does not exist (DST gap)"),
        (utc(2024, 4, 2, 0, 30), None)]
    rows = cronshow.describe_next("30 1 * * *", "America/New_York", utc(2024, 11, 2, 12), 2, dst_fold_policy="Both")
    assert [r["note"] for r in rows] == ["repeated hour: first copy", "repeated hour: second copy"]
    with pytest.raises(CronError) as err:
        cronshow.describe_next("30 1 * * *", "UTC", utc(2024, 1, 1), 1, dst_fold_policy="Twice")
    assert err.value.field == "dst_fold_policy"


def test_describe_next_notes_collapsed_gap_slots():
    rows = cronshow.describe_next("*/15 * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 50), 2)
    assert rows[0]["utc"] == utc(2024, 3, 31, 1, 0)
    assert rows[0]["note"].startswith("moved: 2024-03-31 02:00 does not exist (DST gap)")
    assert "4 slots" in rows[0]["note"]


def test_describe_next_notes_fold_copies():
    rows = cronshow.describe_next("0 * * * *", "America/Los_Angeles", utc(2025, 11, 2, 7, 30), 3)
    assert [r["note"] for r in rows] == ["repeated hour: first copy", "repeated hour: second copy", None]
    assert [r["local"].isoformat() for r in rows] == [
        "2025-11-02T01:00:00-07:00", "2025-11-02T01:00:00-08:00", "2025-11-02T02:00:00-08:00"]
    rows = cronshow.describe_next("30 1 * * *", "America/New_York", utc(2024, 11, 2, 12), 2)
    assert [r["note"] for r in rows] == ["repeated hour: first copy", None]


def test_describe_next_plain_and_naive_after_is_local():
    rows = cronshow.describe_next("0 12 * * *", "Europe/Berlin", dt.datetime(2024, 5, 1, 13, 0), 2)
    assert [r["utc"] for r in rows] == [utc(2024, 5, 2, 10), utc(2024, 5, 3, 10)]
    assert all(r["note"] is None for r in rows)
    assert rows[0]["local"].tzinfo == zoneinfo.ZoneInfo("Europe/Berlin")


@pytest.mark.parametrize(("args", "field"), [
    (("bogus * * * *", "UTC", utc(2024, 1, 1), 1), "cron_expression"),
    (("* * * * *", "Mars/Olympus", utc(2024, 1, 1), 1), "timezone"),
    (("* * * * *", "UTC", utc(2024, 1, 1), 0), "count"),
    (("* * * * *", "UTC", utc(2024, 1, 1), "3"), "count"),
    (("* * * * *", "UTC", "yesterday", 1), "after"),
])
def test_describe_next_errors_name_the_field(args, field):
    with pytest.raises(CronError) as info:
        cronshow.describe_next(*args)
    assert info.value.field == field
