"""cron: 5- and 6-field expressions (seconds first), time zones, strictly-after, errors, minimum interval."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mjsched_isolated import cron
from mjsched_isolated.cron import next_run_time
from mjsched_isolated.errors import CronError, InputError

UTC = dt.UTC


def utc(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


def test_five_field_every_minute():
    assert cron.next_run_time("* * * * *", "UTC", utc(2024, 1, 1, 10, 0, 30)) == utc(2024, 1, 1, 10, 1)


def test_five_field_hour_and_minute():
    assert cron.next_run_time("15 3 * * *", "UTC", utc(2024, 1, 1, 10, 0)) == utc(2024, 1, 2, 3, 15)


def test_six_field_is_seconds_first():
    # "5 * * * * *" is second 5 of every minute, not minute 5
    assert cron.next_run_time("5 * * * * *", "UTC", utc(2024, 1, 1, 10, 0, 0)) == utc(2024, 1, 1, 10, 0, 5)
    assert cron.next_run_time("*/10 * * * * *", "UTC", utc(2024, 1, 1, 10, 0, 7)) == utc(2024, 1, 1, 10, 0, 10)


def test_six_field_weekdays_at_0930():
    expr = "0 30 9 * * MON-FRI"
    # Wednesday 2024-01-03 08:00 -> same day 09:30:00
    assert cron.next_run_time(expr, "UTC", utc(2024, 1, 3, 8, 0)) == utc(2024, 1, 3, 9, 30, 0)
    # Friday 2024-01-05 after 09:30 -> skips Saturday 6th and Sunday 7th -> Monday 8th
    assert cron.next_run_time(expr, "UTC", utc(2024, 1, 5, 9, 30, 1)) == utc(2024, 1, 8, 9, 30, 0)
    # Saturday -> Monday
    assert cron.next_run_time(expr, "UTC", utc(2024, 1, 6, 0, 0)) == utc(2024, 1, 8, 9, 30, 0)
    t = utc(2024, 1, 1)
    seen = []
    for _ in range(10):
        t = cron.next_run_time(expr, "UTC", t)
        seen.append(t)
        assert (t.hour, t.minute, t.second) == (9, 30, 0)
        assert t.weekday() < 5
    assert len({s.date() for s in seen}) == 10


def test_expression_is_read_in_its_zone():
    # Chicago is UTC-6 in January (CST): noon local is 18:00Z
    got = cron.next_run_time("0 12 * * *", "America/Chicago", utc(2024, 1, 15, 0, 0))
    assert got == utc(2024, 1, 15, 18, 0)
    # ... and UTC-5 in July (CDT)
    assert cron.next_run_time("0 12 * * *", "America/Chicago", utc(2024, 7, 15, 0, 0)) == utc(2024, 7, 15, 17, 0)
    assert cron.next_run_time("0 12 * * *", "Asia/Kolkata", utc(2024, 1, 15, 0, 0)) == utc(2024, 1, 15, 6, 30)


def test_after_in_another_zone_is_the_same_instant():
    plus2 = dt.timezone(dt.timedelta(hours=2))
    after = dt.datetime(2024, 1, 1, 12, 0, 30, tzinfo=plus2)  # 10:00:30Z
    assert cron.next_run_time("* * * * *", "UTC", after) == utc(2024, 1, 1, 10, 1)


def test_strictly_after_an_occurrence():
    assert cron.next_run_time("0 * * * *", "UTC", utc(2024, 1, 1, 10, 0)) == utc(2024, 1, 1, 11, 0)
    assert cron.next_run_time("* * * * * *", "UTC", utc(2024, 1, 1, 10, 0, 0)) == utc(2024, 1, 1, 10, 0, 1)
    # a microsecond before the occurrence still finds it
    assert cron.next_run_time("0 * * * *", "UTC", utc(2024, 1, 1, 10, 59, 59, 999999)) == utc(2024, 1, 1, 11, 0)


def test_result_is_aware_utc():
    got = cron.next_run_time("0 12 * * *", "Europe/Berlin", utc(2024, 5, 1))
    assert got.tzinfo is not None
    assert got.utcoffset() == dt.timedelta(0)
    assert got.tzinfo == UTC
    assert got == utc(2024, 5, 1, 10, 0)


@pytest.mark.parametrize("expr", ["60 * * * *", "bogus * * * *", "* * *", "* * * * * * *", "", "   ",
                                  "0 0 30 2 *"])
def test_invalid_expression_raises_cron_error_naming_field(expr):
    with pytest.raises(CronError) as info:
        cron.next_run_time(expr, "UTC", utc(2024, 1, 1))
    assert info.value.field == "cron_expression"
    assert isinstance(info.value, InputError)
    assert str(info.value).startswith("cron_expression: ")


@pytest.mark.parametrize("expr", ["60 * * * *", "bogus * * * *", "* * *", "", "61 * * * * *"])
def test_validate_rejects_invalid_expression(expr):
    with pytest.raises(CronError) as info:
        cron.validate(expr, "UTC")
    assert info.value.field == "cron_expression"


@pytest.mark.parametrize("expr", ["* * * * *", "*/5 * * * *", "0 30 9 * * MON-FRI", "0 0 1 JAN *"])
def test_validate_accepts_valid_expression(expr):
    cron.validate(expr, "Europe/Berlin")


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "UTC+99", "../etc/passwd", "localtime", "Local", "LocalTime"])
def test_invalid_zone_raises_cron_error_naming_timezone(zone):
    with pytest.raises(CronError) as info:
        cron.next_run_time("* * * * *", zone, utc(2024, 1, 1))
    assert info.value.field == "timezone"
    with pytest.raises(CronError) as info2:
        cron.validate("* * * * *", zone)
    assert info2.value.field == "timezone"


def test_naive_after_raises_value_error():
    with pytest.raises(ValueError):
        cron.next_run_time("* * * * *", "UTC", dt.datetime(2024, 1, 1))


@pytest.mark.parametrize(("expr", "expected"), [
    ("* * * * *", 60.0),
    ("*/5 * * * *", 300.0),
    ("*/30 * * * * *", 30.0),
    ("0 * * * *", 3600.0),
    ("0,10 * * * *", 600.0),
])
def test_min_interval_s(expr, expected):
    assert cron.min_interval_s(expr, "UTC", utc(2024, 1, 1, 0, 0, 10)) == expected


@pytest.mark.parametrize("expr", ["bogus", "60 * * * *", "0 0 30 2 *"])
def test_min_interval_s_is_inf_for_invalid(expr):
    assert math.isinf(cron.min_interval_s(expr, "UTC", utc(2024, 1, 1)))


def test_min_interval_s_inf_for_invalid_zone():
    assert math.isinf(cron.min_interval_s("* * * * *", "Nowhere/Land", utc(2024, 1, 1)))


def test_zone_lookup():
    assert str(cron.zone("Europe/Berlin")) == "Europe/Berlin"
    with pytest.raises(CronError) as info:
        cron.zone(None)  # type: ignore[arg-type]
    assert info.value.field == "timezone"


def test_dst_spring_forward_gap_does_not_go_backwards():
    # Europe/Berlin skips 02:00-03:00 local on 2024-03-31
    before = utc(2024, 3, 30, 12, 0)
    got = cron.next_run_time("30 2 * * *", "Europe/Berlin", before)
    assert got > before
    assert got <= utc(2024, 4, 1, 0, 30)  # at latest the next day's 02:30 CEST


EXPRESSIONS = ["*/15 * * * *", "30 2 * * *", "0 * * * *", "0 30 9 * * MON-FRI", "*/20 * * * * *", "0 0 1 * *"]
ZONES = ["UTC", "Europe/Berlin", "America/New_York"]


@settings(max_examples=100, deadline=None)
@given(
    expr=st.sampled_from(EXPRESSIONS),
    zone=st.sampled_from(ZONES),
    start=st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2040, 12, 31), timezones=st.just(UTC)),
)
def test_next_run_time_strictly_increases(expr, zone, start):
    t = start
    for _ in range(5):
        nxt = cron.next_run_time(expr, zone, t)
        assert nxt > t
        assert nxt.utcoffset() == dt.timedelta(0)
        # never more than ~a month and a bit between occurrences of these expressions
        assert nxt - t <= dt.timedelta(days=32)
        t = nxt


TRANSITIONS = [  # (zone, a DST transition instant)
    ("Europe/Berlin", utc(2024, 3, 31, 1, 0)),
    ("Europe/Berlin", utc(2024, 10, 27, 1, 0)),
    ("America/New_York", utc(2024, 3, 10, 7, 0)),
    ("America/New_York", utc(2024, 11, 3, 6, 0)),
]


@settings(max_examples=100, deadline=None)
@given(
    where=st.sampled_from(TRANSITIONS),
    expr=st.sampled_from([*EXPRESSIONS, "0 2 * * *", "30 1 * * *"]),
    offset_s=st.integers(min_value=-3 * 3600, max_value=3 * 3600),
)
def test_next_run_time_strictly_increases_across_dst_transitions(where, expr, offset_s):
    zone, instant = where
    t = instant + dt.timedelta(seconds=offset_s)
    for _ in range(5):
        nxt = cron.next_run_time(expr, zone, t)
        assert nxt > t
        t = nxt


@pytest.mark.parametrize(("zone", "instant"), TRANSITIONS)
@pytest.mark.parametrize(("expr", "gap_s"), [("*/15 * * * *", 900), ("0 * * * *", 3600), ("*/20 * * * * *", 20)])
def test_fixed_utc_gaps_across_dst_transitions(zone, instant, expr, gap_s):
    """Sub-hourly expressions in whole-hour-offset zones fire at constant UTC spacing through DST changes:
    none skipped in the spring gap, none doubled or lost in the autumn fold."""
    t = cron.next_run_time(expr, zone, instant - dt.timedelta(hours=2))
    while t < instant + dt.timedelta(hours=2):
        nxt = cron.next_run_time(expr, zone, t)
        assert (nxt - t).total_seconds() == gap_s, (t, nxt)
        t = nxt


# -- the supported forms (cron.SUPPORTED_FORMS) ---------------------------------------------------------
@pytest.mark.parametrize("alias, same_as", [
    ("@hourly", "0 * * * *"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"), ("@weekly", "0 0 * * 0"),
    ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *"), ("@DAILY", "0 0 * * *")])
def test_aliases_run_like_their_expansion(alias, same_as):
    cron.validate(alias, "Europe/Berlin")
    start = utc(2024, 3, 30, 12, 0)
    assert cron.next_run_time(alias, "Europe/Berlin", start) == cron.next_run_time(same_as, "Europe/Berlin", start)


@pytest.mark.parametrize("expr", ["@reboot", "@every_minute", "@"])
def test_unknown_aliases_are_refused(expr):
    with pytest.raises(CronError) as info:
        cron.validate(expr, "UTC")
    assert info.value.field == "cron_expression"


@pytest.mark.parametrize("expr", ["0 5-1 * * *", "50-10 * * * *", "0 0 * DEC-JAN *", "0 0 * * FRI-MON",
                                  "0 0 0 20-3 * *", "0 1,22-2 * * *", "0 22-2/2 * * *"])
def test_descending_ranges_are_refused_rather_than_wrapped(expr):
    with pytest.raises(CronError) as info:
        cron.validate(expr, "UTC")
    assert info.value.field == "cron_expression" and "descending range" in info.value.message
    with pytest.raises(CronError):
        cron.next_run_time(expr, "UTC", utc(2024, 1, 1))


@pytest.mark.parametrize("expr, after, expected", [
    ("0 0 L * *", utc(2024, 2, 1), utc(2024, 2, 29)),  # last day of the month
    ("0 0 15W * *", utc(2024, 6, 1), utc(2024, 6, 14)),  # the 15th is a Saturday: the Friday before
    ("0 0 * * FRI#2", utc(2024, 1, 1), utc(2024, 1, 12)),  # second Friday
    ("0 9 * * MON-FRI", utc(2024, 1, 6), utc(2024, 1, 8, 9)),  # an ascending name range
])
def test_l_w_hash_and_name_ranges_are_supported(expr, after, expected):
    cron.validate(expr, "UTC")
    assert cron.next_run_time(expr, "UTC", after) == expected


def test_the_supported_forms_are_stated():
    for form in ("5 fields", "6 with seconds first", "1,15", "1-5", "*/15", "MON-FRI", "L, W, #", "@hourly",
                 "@annually", "@midnight"):
        assert form in cron.SUPPORTED_FORMS


@pytest.mark.parametrize(("expression", "first", "second"), [
    ("0 3-3 * * *", "2026-12-01T03:00", "2026-12-02T03:00"),   # croniter alone ran this every hour
    ("1-1 * * * *", "2026-12-01T00:01", "2026-12-01T01:01"),
    ("0 0 5-5 * *", "2026-12-05T00:00", "2027-01-05T00:00"),
    ("0 0 * * SUN-SUN", "2026-12-06T00:00", "2026-12-13T00:00"),
    ("0 0 * * 7-7", "2026-12-06T00:00", "2026-12-13T00:00"),
    ("0 3-3/2 * * *", "2026-12-01T03:00", "2026-12-02T03:00"),
])
def test_a_range_with_equal_ends_is_its_single_value(expression, first, second):
    after = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    a = next_run_time(expression, "UTC", after)
    b = next_run_time(expression, "UTC", a)
    assert (a.strftime("%Y-%m-%dT%H:%M"), b.strftime("%Y-%m-%dT%H:%M")) == (first, second)
