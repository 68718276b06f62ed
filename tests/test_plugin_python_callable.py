"""Tests of mjsched_isolated/plugins/python_callable.py with real importable callables and a real SQLite database."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from plugin_helpers import load_plugin, make_context, run_job

from mjsched_isolated.errors import ConfigurationError

PythonCallableJob = load_plugin("python_callable")
TESTS_DIR = str(Path(__file__).resolve().parent)


@pytest.fixture(autouse=True)
def _targets_importable(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)  # makes `callable_targets` importable, as PYTHONPATH would


@pytest.fixture
def db_url(tmp_path):
    path = tmp_path / "data.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE settings (name TEXT PRIMARY KEY, value TEXT, n INTEGER)")
        conn.executemany("INSERT INTO settings VALUES (?, ?, ?)", [("region", "eu-west", 7), ("tier", "gold", 3)])
    conn.close()
    return f"sqlite:///{path}"


def test_static_arguments_and_json_return_value():
    result = run_job(PythonCallableJob, {"callable": "callable_targets:add", "arguments": {"a": 2, "b": 40}})
    assert result.success, result.error_message
    assert result.details["return_value"] == 42
    assert result.details["callable"] == "callable_targets:add" and result.details["return_type"] == "int"


def test_dict_return_value_and_dotted_attribute():
    result = run_job(PythonCallableJob, {"callable": "callable_targets:Reports.count", "arguments": {"n": 5}})
    assert result.success and result.details["return_value"] == {"count": 5}


def test_scheduled_job_result_is_used_as_is():
    result = run_job(PythonCallableJob, {"callable": "callable_targets:returns_result", "arguments": {"flag": False}})
    assert not result.success
    assert result.error_message == "flag was false" and result.details == {"flag": False}


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("returns_none", None),
        ("returns_datetime", "datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)"),
        ("returns_nan", "nan"),
    ],
)
def test_non_json_return_values_become_repr(target, expected):
    result = run_job(PythonCallableJob, {"callable": f"callable_targets:{target}"})
    assert result.success
    assert result.details["return_value"] == expected


def test_sql_arguments_take_first_column_of_first_row(db_url):
    result = run_job(
        PythonCallableJob,
        {
            "callable": "callable_targets:summary",
            "arguments": {"static": [1, 2]},
            "sql_arguments": {
                "region": "SELECT value FROM settings WHERE name = 'region'",
                "total": "SELECT sum(n), 'ignored' FROM settings",
                "absent": "SELECT value FROM settings WHERE name = 'nope'",
            },
            "database_url": db_url,
        },
    )
    assert result.success, result.error_message
    assert result.details["return_value"] == {"static": [1, 2], "region": "eu-west", "total": 10, "absent": None}
    assert result.details["sql_values"] == {"region": "'eu-west'", "total": "10", "absent": "None"}


def test_bad_sql_names_the_argument(db_url):
    result = run_job(
        PythonCallableJob,
        {"callable": "callable_targets:summary", "sql_arguments": {"x": "SELECT nope FROM missing_table"},
         "database_url": db_url},
    )
    assert not result.success
    assert result.error_message.startswith("sql_arguments.x: OperationalError")
    assert "missing_table" in result.details["traceback"]


def test_exception_in_callable_is_a_failure_with_traceback():
    result = run_job(PythonCallableJob, {"callable": "callable_targets:fails", "arguments": {"message": "boom"}})
    assert not result.success
    assert result.error_message == "ValueError: boom"
    assert "callable_targets.py" in result.details["traceback"] and "ValueError: boom" in result.details["traceback"]


def test_wrong_arguments_are_a_failure():
    result = run_job(PythonCallableJob, {"callable": "callable_targets:add", "arguments": {"a": 1}})
    assert not result.success and result.error_message.startswith("TypeError: ")


@pytest.mark.parametrize(("code", "success"), [(0, True), (None, True), (3, False)])
def test_system_exit(code, success):
    result = run_job(PythonCallableJob, {"callable": "callable_targets:exits", "arguments": {"code": code}})
    assert result.success is success
    if not success:
        assert result.error_message == "SystemExit: 3"


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("no_such_module_mjsched:run", "ModuleNotFoundError"),
        ("callable_targets:missing_function", "AttributeError"),
        ("callable_targets:NOT_CALLABLE", "TypeError"),
    ],
)
def test_import_problems_name_the_callable(target, fragment):
    result = run_job(PythonCallableJob, {"callable": target})
    assert not result.success
    assert result.error_message.startswith(f"cannot load {target}: {fragment}")


def test_pass_context():
    beats = []
    result = run_job(
        PythonCallableJob,
        {"callable": "callable_targets:uses_context", "arguments": {"label": "x"}, "pass_context": True},
        heartbeat=lambda: beats.append(1),
    )
    assert result.success, result.error_message
    assert result.details["return_value"] == {"job_name": "test-python_callable", "run_id": 1, "label": "x"}
    assert beats == [1]


@pytest.mark.parametrize(
    ("config", "prefix"),
    [
        ({"callable": "callable_targets.add"}, "configuration.callable"),
        ({"callable": "pkg:"}, "configuration.callable"),
        ({"callable": "1pkg:f"}, "configuration.callable"),
        ({"callable": "m:f", "arguments": {"not valid": 1}}, "configuration.arguments"),
        ({"callable": "m:f", "arguments": []}, "configuration.arguments"),
        ({"callable": "m:f", "sql_arguments": {"x": "SELECT 1"}}, "configuration.database_url"),
        ({"callable": "m:f", "sql_arguments": {"x": " "}, "database_url": "sqlite://"}, "configuration.sql_arguments"),
        ({"callable": "m:f", "sql_arguments": {"x": "SELECT 1"}, "arguments": {"x": 1}, "database_url": "sqlite://"},
         "configuration.sql_arguments.x"),
        ({"callable": "m:f", "database_url": "not a url"}, "configuration.database_url"),
        ({"callable": "m:f", "pass_context": True, "arguments": {"context": 1}}, "configuration.arguments.context"),
        ({"callable": "m:f", "pass_context": "yes"}, "configuration.pass_context"),
    ],
)
def test_bad_configuration_names_the_field(config, prefix):
    with pytest.raises(ConfigurationError) as info:
        make_context(PythonCallableJob, config)
    assert str(info.value).startswith(prefix), str(info.value)
