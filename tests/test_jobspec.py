"""jobspec (validation, TOML jobs files) and planner (pure scheduling decisions)."""

from __future__ import annotations

import datetime as dt
import json
import textwrap
from pathlib import Path

import msgspec
import pytest

from mjsched_isolated import jobspec, planner
from mjsched_isolated.errors import CronError, InputError
from mjsched_isolated.jobspec import JobSpec, check

UTC = dt.UTC


def utc(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


def spec(**kw) -> JobSpec:
    values = {"name": "job", "job_type": "ok", "cron_expression": "*/5 * * * *"}
    values.update(kw)
    return JobSpec(**values)


def _deep_list(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def field_of(exc_info) -> str:
    return exc_info.value.field


# -- jobspec.check -------------------------------------------------------------------------------------


def test_check_accepts_a_valid_spec_and_returns_aware_utc():
    checked = jobspec.check(spec(start_at=utc(2030, 1, 1), end_at=utc(2030, 2, 1), timezone="Europe/Berlin",
                                 concurrency_mode="Queue", status="Paused", max_runtime_minutes=10))
    assert checked.start_at == utc(2030, 1, 1) and checked.start_at.tzinfo is not None
    assert checked.end_at == utc(2030, 2, 1)
    assert checked.status == "Paused"


@pytest.mark.parametrize(("kw", "field"), [
    ({"cron_expression": "61 * * * *"}, "cron_expression"),
    ({"cron_expression": "* * *"}, "cron_expression"),
    ({"cron_expression": ""}, "cron_expression"),
    ({"timezone": "Mars/Olympus"}, "timezone"),
    ({"timezone": ""}, "timezone"),
    ({"concurrency_mode": "Sometimes"}, "concurrency_mode"),
    ({"concurrency_mode": "skip"}, "concurrency_mode"),
    ({"status": "Running"}, "status"),
    ({"max_runtime_minutes": 0}, "max_runtime_minutes"),
    ({"max_runtime_minutes": -5}, "max_runtime_minutes"),
    ({"start_at": utc(2030, 1, 2), "end_at": utc(2030, 1, 1)}, "end_at"),
    ({"start_at": utc(2030, 1, 1), "end_at": utc(2030, 1, 1)}, "end_at"),
    ({"name": "  "}, "name"),
    ({"name": " lead"}, "name"),  # stored as such, then `jobs show lead` would not find it
    ({"name": "trail\t"}, "name"),
    ({"job_type": ""}, "job_type"),
    ({"retry_on": ["Failed", "Timeout", "Failed"]}, "retry_on[2]"),
    ({"configuration": {"a": _deep_list(989)}}, "configuration"),  # json.dumps would recurse out
    ({"configuration": {"a": _deep_list(100)}}, "configuration"),  # 101 levels
    ({"notify_recipients": ["ops@example.org", "not-an-address"]}, "notify_recipients[1]"),
    ({"notify_recipients": ["a b@example.org"]}, "notify_recipients[0]"),
])
def test_check_errors_name_the_field(kw, field):
    with pytest.raises(InputError) as info:
        jobspec.check(spec(**kw))
    assert field_of(info) == field
    assert str(info.value).startswith(f"{field}: ")


def test_check_prefixes_the_field_with_where():
    with pytest.raises(InputError) as info:
        jobspec.check(spec(concurrency_mode="Nope"), "jobs.toml: jobs[2].")
    assert field_of(info) == "jobs.toml: jobs[2].concurrency_mode"
    with pytest.raises(InputError) as info:
        jobspec.check(spec(timezone="Nowhere/Zone"), "jobs[0].")
    assert field_of(info) == "jobs[0].timezone"


def test_naive_start_at_is_read_in_the_jobs_timezone():
    checked = jobspec.check(spec(timezone="Europe/Berlin", start_at=dt.datetime(2030, 1, 1, 0, 0),
                                 end_at=dt.datetime(2030, 7, 1, 12, 0)))
    assert checked.start_at == utc(2029, 12, 31, 23, 0)  # CET = UTC+1
    assert checked.end_at == utc(2030, 7, 1, 10, 0)  # CEST = UTC+2
    assert checked.start_at.utcoffset() == dt.timedelta(0)


def test_aware_start_at_keeps_its_instant():
    plus5 = dt.timezone(dt.timedelta(hours=5))
    checked = jobspec.check(spec(timezone="America/Chicago", start_at=dt.datetime(2030, 1, 1, 5, 0, tzinfo=plus5)))
    assert checked.start_at == utc(2030, 1, 1, 0, 0)


def test_end_at_compared_after_zone_conversion():
    # naive 00:30 Berlin is 23:30Z the day before, so an aware end_at of 00:00Z is after it
    checked = jobspec.check(spec(timezone="Europe/Berlin", start_at=dt.datetime(2030, 1, 1, 0, 30),
                                 end_at=utc(2030, 1, 1, 0, 0)))
    assert checked.end_at > checked.start_at
    with pytest.raises(InputError) as info:  # naive 02:00 Berlin = 01:00Z, after the end
        jobspec.check(spec(timezone="Europe/Berlin", start_at=dt.datetime(2030, 1, 1, 2, 0),
                           end_at=utc(2030, 1, 1, 0, 30)))
    assert field_of(info) == "end_at"


def test_row_values_and_with_next_run_at():
    checked = jobspec.check(spec(configuration={"b": 1, "a": [1, 2]}))
    values = jobspec.row_values(checked)
    assert "status" not in values  # unset: "Active for new / unchanged for existing" is the caller's call
    assert values["configuration"] == json.dumps({"a": [1, 2], "b": 1}, sort_keys=True)
    now = utc(2030, 1, 1, 10, 2)
    active = jobspec.with_next_run_at({**values, "status": "Active"}, now)
    assert active["next_run_at"] == utc(2030, 1, 1, 10, 5)
    paused = jobspec.with_next_run_at({**values, "status": "Paused"}, now)
    assert paused["next_run_at"] is None
    assert jobspec.row_values(jobspec.check(spec()))["configuration"] is None


def test_schedule_fields_changed():
    old = {"cron_expression": "* * * * *", "timezone": "UTC", "status": "Active", "description": "a"}
    assert not jobspec.schedule_fields_changed(old, {"description": "b"})
    assert not jobspec.schedule_fields_changed(old, {"cron_expression": "* * * * *"})
    assert jobspec.schedule_fields_changed(old, {"cron_expression": "*/2 * * * *"})
    assert jobspec.schedule_fields_changed(old, {"status": "Paused"})
    assert jobspec.schedule_fields_changed(old, {"start_at": utc(2030, 1, 1)})


# -- jobspec.load_file ---------------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str, name: str = "jobs.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """
    [[jobs]]
    name = "backup"
    job_type = "ok"
    cron_expression = "0 30 9 * * MON-FRI"
    timezone = "Europe/Berlin"
    start_at = 2030-01-01T00:00:00
    end_at = 2030-06-01T00:00:00Z
    concurrency_mode = "Queue"
    max_runtime_minutes = 30
    notify_on_success = true

    [jobs.configuration]
    seconds = 1.5
    marker_dir = "/tmp/x"

    [[jobs]]
    name = "cleanup"
    job_type = "fail"
    cron_expression = "*/5 * * * *"
    """


def test_load_file_parses_a_good_file(tmp_path):
    specs = jobspec.load_file(_toml(tmp_path, GOOD))
    assert [s.name for s in specs] == ["backup", "cleanup"]
    backup, cleanup = specs
    assert backup.job_type == "ok"
    assert backup.timezone == "Europe/Berlin"
    assert backup.start_at == utc(2029, 12, 31, 23, 0)  # naive TOML datetime read in Europe/Berlin
    assert backup.end_at == utc(2030, 6, 1)
    assert backup.concurrency_mode == "Queue"
    assert backup.max_runtime_minutes == 30
    assert backup.notify_on_success is True
    assert backup.configuration == {"seconds": 1.5, "marker_dir": "/tmp/x"}
    assert backup.status is msgspec.UNSET
    assert cleanup.timezone == "UTC" and cleanup.concurrency_mode == "Skip" and cleanup.configuration is None
    assert cleanup.notify_on_failure is True and cleanup.run_immediately_if_never_run is False


def test_load_file_empty_file_is_no_jobs(tmp_path):
    assert jobspec.load_file(_toml(tmp_path, "")) == []


def test_load_file_unknown_key_names_the_path(tmp_path):
    path = _toml(tmp_path, GOOD + 'retries = 3\n')  # lands in jobs[1]
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert "jobs[1]" in field_of(info)
    assert str(path) in field_of(info)
    assert "retries" in str(info.value)


def test_load_file_unknown_top_level_key(tmp_path):
    with pytest.raises(InputError) as info:
        jobspec.load_file(_toml(tmp_path, 'version = 2\n' + GOOD))
    assert "version" in str(info.value)


def test_load_file_wrong_type_names_the_field(tmp_path):
    path = _toml(tmp_path, """
        [[jobs]]
        name = "a"
        job_type = "ok"
        cron_expression = "* * * * *"
        max_runtime_minutes = "ten"
        """)
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert field_of(info).endswith("jobs[0].max_runtime_minutes")


def test_load_file_check_errors_name_the_job_index(tmp_path):
    path = _toml(tmp_path, GOOD + """
        [[jobs]]
        name = "third"
        job_type = "ok"
        cron_expression = "* * * * *"
        timezone = "Nowhere/Special"
        """)
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert field_of(info) == f"{path}: jobs[2].timezone"


def test_load_file_missing_required_field(tmp_path):
    path = _toml(tmp_path, """
        [[jobs]]
        name = "a"
        job_type = "ok"
        """)
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert "cron_expression" in str(info.value)
    assert "jobs[0]" in str(info.value)


def test_load_file_duplicate_names_rejected(tmp_path):
    path = _toml(tmp_path, GOOD + """
        [[jobs]]
        name = "backup"
        job_type = "ok"
        cron_expression = "* * * * *"
        """)
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert field_of(info) == f"{path}: name"
    assert "backup" in str(info.value) and "twice" in str(info.value)


def test_load_file_invalid_toml(tmp_path):
    with pytest.raises(InputError) as info:
        jobspec.load_file(_toml(tmp_path, "jobs = [ {\n"))
    assert "invalid TOML" in str(info.value)


@pytest.mark.parametrize("which", ["missing", "directory"])
def test_load_file_unreadable_file_rejected(tmp_path, which):
    path = tmp_path / "nope.toml" if which == "missing" else tmp_path
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert field_of(info) == "jobs file"
    assert "cannot read" in str(info.value) and str(path) in str(info.value)


# -- planner.initial_next_run_at -----------------------------------------------------------------------


def job(**kw) -> dict:
    values = {"cron_expression": "0 * * * *", "timezone": "UTC", "start_at": None, "end_at": None,
              "last_run_at": None, "run_immediately_if_never_run": False, "next_run_at": None,
              "max_runtime_minutes": None, "concurrency_mode": "Skip"}
    values.update(kw)
    return values


NOW = utc(2030, 3, 1, 10, 20, 5)


def test_initial_is_next_occurrence_after_now():
    assert planner.initial_next_run_at(job(), NOW) == utc(2030, 3, 1, 11, 0)


def test_initial_strictly_after_now_even_on_an_occurrence():
    assert planner.initial_next_run_at(job(), utc(2030, 3, 1, 11, 0)) == utc(2030, 3, 1, 12, 0)


def test_initial_run_immediately_if_never_run_is_now():
    assert planner.initial_next_run_at(job(run_immediately_if_never_run=True), NOW) == NOW


def test_initial_run_immediately_ignored_once_it_has_run():
    j = job(run_immediately_if_never_run=True, last_run_at=NOW - dt.timedelta(days=1))
    assert planner.initial_next_run_at(j, NOW) == utc(2030, 3, 1, 11, 0)


def test_initial_run_immediately_never_before_start_at():
    start = utc(2030, 3, 5, 8, 17)
    assert planner.initial_next_run_at(job(run_immediately_if_never_run=True, start_at=start), NOW) == start


def test_initial_future_start_at_between_occurrences():
    start = utc(2030, 3, 5, 8, 17)
    assert planner.initial_next_run_at(job(start_at=start), NOW) == utc(2030, 3, 5, 9, 0)


def test_initial_future_start_at_on_an_occurrence_is_that_occurrence():
    start = utc(2030, 3, 5, 8, 0)
    assert planner.initial_next_run_at(job(start_at=start), NOW) == start
    six = job(cron_expression="30 * * * * *", start_at=utc(2030, 3, 5, 8, 0, 30))
    assert planner.initial_next_run_at(six, NOW) == utc(2030, 3, 5, 8, 0, 30)


def test_initial_past_start_at_is_ignored():
    assert planner.initial_next_run_at(job(start_at=NOW - dt.timedelta(days=3)), NOW) == utc(2030, 3, 1, 11, 0)


def test_initial_none_past_end_at():
    assert planner.initial_next_run_at(job(end_at=utc(2030, 3, 1, 10, 59)), NOW) is None
    assert planner.initial_next_run_at(job(end_at=utc(2030, 3, 1, 11, 0)), NOW) == utc(2030, 3, 1, 11, 0)
    assert planner.initial_next_run_at(job(end_at=NOW - dt.timedelta(days=1)), NOW) is None
    assert planner.initial_next_run_at(
        job(run_immediately_if_never_run=True, end_at=NOW - dt.timedelta(seconds=1)), NOW) is None


def test_initial_in_a_zone():
    j = job(cron_expression="0 9 * * *", timezone="America/Chicago")
    assert planner.initial_next_run_at(j, NOW) == utc(2030, 3, 1, 15, 0)  # CST, UTC-6


def test_initial_bad_cron_raises():
    with pytest.raises(CronError):
        planner.initial_next_run_at(job(cron_expression="bogus"), NOW)


# -- planner: run_timeout_s, next_after_claim, expired, queued_at --------------------------------------


@pytest.mark.parametrize(("minutes", "expected"), [(None, 300.0), (0, 300.0), (1, 300.0), (5, 300.0),
                                                    (6, 360.0), (120, 7200.0)])
def test_run_timeout_s_only_lengthens(minutes, expected):
    assert planner.run_timeout_s(job(max_runtime_minutes=minutes), 300.0) == expected


def test_next_after_claim_collapses_missed_occurrences():
    j = job(next_run_at=NOW - dt.timedelta(hours=3))  # hourly job, due 3 hours ago
    assert planner.next_after_claim(j, NOW) == utc(2030, 3, 1, 11, 0)


def test_next_after_claim_on_time():
    j = job(next_run_at=utc(2030, 3, 1, 10, 0))
    assert planner.next_after_claim(j, utc(2030, 3, 1, 10, 0, 0, 300)) == utc(2030, 3, 1, 11, 0)


def test_next_after_claim_early_claim_moves_past_the_occurrence():
    # a manual run claimed before the scheduled occurrence: the next one is after that occurrence
    j = job(next_run_at=utc(2030, 3, 1, 11, 0))
    assert planner.next_after_claim(j, NOW) == utc(2030, 3, 1, 12, 0)


def test_next_after_claim_without_next_run_at_and_past_end():
    assert planner.next_after_claim(job(), NOW) == utc(2030, 3, 1, 11, 0)
    assert planner.next_after_claim(job(next_run_at=NOW, end_at=utc(2030, 3, 1, 10, 30)), NOW) is None


def test_expired():
    assert not planner.expired(job(), NOW)
    assert not planner.expired(job(end_at=NOW), NOW)
    assert planner.expired(job(end_at=NOW - dt.timedelta(microseconds=1)), NOW)


def test_queued_at():
    scheduled = utc(2030, 3, 1, 10, 0)
    late = scheduled + dt.timedelta(minutes=3)
    assert planner.queued_at(job(concurrency_mode="Queue", last_run_at=late), scheduled) == scheduled
    assert planner.queued_at(job(concurrency_mode="Queue", last_run_at=scheduled - dt.timedelta(hours=1)),
                             scheduled) is None
    assert planner.queued_at(job(concurrency_mode="Skip", last_run_at=late), scheduled) is None
    assert planner.queued_at(job(concurrency_mode="Queue", last_run_at=late), None) is None
    assert planner.queued_at(job(concurrency_mode="Queue"), scheduled) is None


def test_notify_keys_in_a_jobs_file_reach_the_row(tmp_path: Path):
    path = tmp_path / "jobs.toml"
    path.write_text(textwrap.dedent("""
        [[jobs]]
        name = "n"
        job_type = "ok"
        cron_expression = "0 3 * * *"
        notify_on_missed = true
        notify_recipients = ["ops@example.org", "dev@example.org"]
    """))
    (only,) = jobspec.load_file(path)
    values = jobspec.row_values(only)
    assert values["notify_on_missed"] is True and values["notify_on_failure"] is True
    assert json.loads(values["notify_recipients"]) == ["ops@example.org", "dev@example.org"]
    assert jobspec.row_values(spec())["notify_recipients"] is None and spec().notify_on_missed is False


# -- column limits and control characters ----------------------------------------------------------------
def test_text_limits_are_the_jobs_table_column_lengths():
    from mjsched_isolated.store.schema import jobs

    assert {field: jobs.c[field].type.length for field in jobspec.TEXT_LIMITS} == jobspec.TEXT_LIMITS


@pytest.mark.parametrize("field, limit", sorted(jobspec.TEXT_LIMITS.items()))
def test_text_fields_over_their_column_limit_are_refused(field, limit):
    value = {"name": "n", "job_type": "t", "cron_expression": "* * * * " + "*" * (limit - 8),
             "timezone": "x" * limit}[field]
    if field in ("name", "job_type"):
        value = value * limit
    with pytest.raises(InputError) as info:
        jobspec.check(spec(**{field: value + "x"}))
    assert field_of(info) == field and f"at most {limit} characters" in info.value.message


@pytest.mark.parametrize("name", ["a\nb", "nul\x00", "tab\tname", "esc\x1b[31m", "del\x7f", "csi\x9b"])
def test_names_with_control_characters_are_refused(name):
    with pytest.raises(InputError) as info:
        jobspec.check(spec(name=name))
    assert field_of(info) == "name" and "control characters" in info.value.message


def test_a_description_keeps_tabs_and_lines_but_not_escapes():
    jobspec.check(spec(description="line one\n\tline two"))
    with pytest.raises(InputError) as info:
        jobspec.check(spec(description="red \x1b[31m or NUL \x00"))
    assert field_of(info) == "description"


@pytest.mark.parametrize(("values", "field"), [
    ({"name": "x\u200by"}, "name"),                          # a zero-width space: two names that look alike
    ({"name": "a\u202eevil"}, "name"),                       # a right-to-left override repaints a listing
    ({"description": "d" * 70_000}, "description"),          # over MariaDB's TEXT: a raw error there before
    ({"configuration": {"blob": "c" * 70_000}}, "configuration"),
])
def test_invisible_characters_and_oversized_text_are_refused_naming_the_field(values, field):
    spec = JobSpec(**{"name": "j", "job_type": "shell", "cron_expression": "* * * * *", **values})
    with pytest.raises(InputError) as caught:
        check(spec)
    assert caught.value.field == field


def test_the_cron_expression_is_stored_without_stray_whitespace():
    assert check(JobSpec(name="j", job_type="shell", cron_expression="  */5  * * * *  ")).cron_expression == \
        "*/5 * * * *"


# -- configuration text and depth (fresh-clone review M1, L4) ---------------------------------------------
def _nested(levels: int) -> str:
    """An object holding arrays: ``levels`` levels in all."""
    return '{"a":' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


def test_a_configuration_may_nest_up_to_the_bound_and_no_deeper():
    limit = jobspec.MAX_CONFIGURATION_DEPTH
    assert jobspec.nesting_depth(jobspec.parse_configuration(_nested(limit))) == limit
    jobspec.check(spec(configuration=jobspec.parse_configuration(_nested(limit))))
    for levels in (limit + 1, 990, 1100, 50_000):  # 990: json.dumps recursed out; 1100: json.loads did
        with pytest.raises(InputError) as info:
            jobspec.parse_configuration(_nested(levels), "--configuration")
        assert str(info.value) == f"--configuration: nested deeper than {limit} levels"


def test_nesting_depth_counts_without_recursion_and_stops_on_a_cycle():
    assert [jobspec.nesting_depth(v) for v in (1, {}, {"a": []}, [{"b": {"c": 1}}])] == [0, 1, 2, 3]
    cycle: list = []
    cycle.append(cycle)
    assert jobspec.nesting_depth(cycle, 10) == 11


@pytest.mark.parametrize(("text", "key"), [('{"command": ["true"], "command": ["false"]}', "command"),
                                           ('{"env": {"A": "1", "A": "2"}}', "A")])
def test_a_configuration_repeating_a_key_is_refused_naming_the_key(text, key):
    with pytest.raises(InputError) as info:
        jobspec.parse_configuration(text)
    assert str(info.value) == f"configuration: duplicate key {key!r} in one object"


@pytest.mark.parametrize(("text", "message"), [("[1]", "must be a JSON object"), ("{x", "invalid JSON")])
def test_a_configuration_that_is_not_a_json_object_is_refused(text, message):
    with pytest.raises(InputError, match=message):
        jobspec.parse_configuration(text)


def test_a_jobs_file_nested_too_deeply_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text('[[jobs]]\nname = "j"\njob_type = "ok"\ncron_expression = "@daily"\n'
                    f'configuration = {{ a = {"[" * 2000 + "]" * 2000} }}\n')
    with pytest.raises(InputError) as info:
        jobspec.load_file(path)
    assert info.value.field == str(path)
