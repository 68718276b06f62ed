"""api: configuration parsing, default notifications, JobContext.heartbeat."""

from __future__ import annotations

import datetime as dt
import logging
from typing import TypeVar

import msgspec
import pytest

from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
    _field_message,
)
from mjsched_isolated.errors import ConfigurationError, MjschedError


class Inner(msgspec.Struct, forbid_unknown_fields=True):
    port: int = 80


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    timeout_s: float = 5.0
    name: str = "default"
    inner: Inner = msgspec.field(default_factory=Inner)
    items: list[int] = []


class Typed(BaseScheduledJob):
    job_type = "typed"
    configuration_type = Config


class Lenient(msgspec.Struct):
    value: int = 1


class LenientJob(BaseScheduledJob):
    job_type = "lenient"
    configuration_type = Lenient


class Raw(BaseScheduledJob):
    job_type = "raw"


def _context(**kw) -> JobContext:
    values = {"run_id": 17, "job_id": 3, "job_name": "nightly", "job_type": "typed", "configuration": None}
    values.update(kw)
    return JobContext(**values)


# -- parse_configuration -------------------------------------------------------------------------------


def test_valid_json_decodes_into_struct():
    cfg = Typed.parse_configuration('{"timeout_s": 2.5, "name": "n", "inner": {"port": 8080}, "items": [1, 2]}')
    assert isinstance(cfg, Config)
    assert cfg == Config(timeout_s=2.5, name="n", inner=Inner(port=8080), items=[1, 2])


def test_int_is_accepted_for_float_field():
    assert Typed.parse_configuration('{"timeout_s": 3}').timeout_s == 3.0


@pytest.mark.parametrize(("text", "prefix"), [
    ('{"timeout_s": "soon"}', "configuration.timeout_s: "),
    ('{"name": 5}', "configuration.name: "),
    ('{"inner": {"port": "http"}}', "configuration.inner.port: "),
    ('{"items": [1, "two"]}', "configuration.items[1]: "),
])
def test_wrong_type_names_the_field(text, prefix):
    with pytest.raises(ConfigurationError) as info:
        Typed.parse_configuration(text)
    message = str(info.value)
    assert message.startswith(prefix), message
    assert "Expected" in message
    assert " - at `" not in message  # msgspec's path suffix was turned into the prefix


def test_wrong_type_message_names_expected_and_actual_type():
    with pytest.raises(ConfigurationError, match=r"^configuration\.timeout_s: Expected `float`, got `str`$"):
        Typed.parse_configuration('{"timeout_s": "soon"}')


@pytest.mark.parametrize(("text", "field"), [('{"bogus": 1}', "bogus"), ('{"inner": {"zzz": 1}}', "zzz")])
def test_unknown_field_rejected(text, field):
    with pytest.raises(ConfigurationError) as info:
        Typed.parse_configuration(text)
    assert str(info.value).startswith("configuration")
    assert field in str(info.value)


def test_unknown_field_allowed_when_struct_permits_it():
    assert LenientJob.parse_configuration('{"value": 4, "extra": true}') == Lenient(value=4)


@pytest.mark.parametrize("text", [None, "", "null"])
def test_none_or_empty_gives_defaults(text):
    assert Typed.parse_configuration(text) == Config()


def test_top_level_not_an_object():
    with pytest.raises(ConfigurationError) as info:
        Typed.parse_configuration("[1, 2]")
    assert str(info.value).startswith("configuration: ")


@pytest.mark.parametrize("text", ["{bad", '{"timeout_s": ', "not json", "{'single': 1}"])
def test_invalid_json_raises_configuration_error(text):
    with pytest.raises(ConfigurationError) as info:
        Typed.parse_configuration(text)
    assert str(info.value).startswith("configuration: invalid JSON")
    with pytest.raises(ConfigurationError) as raw_info:
        Raw.parse_configuration(text)
    assert str(raw_info.value).startswith("configuration: invalid JSON")


def test_configuration_error_is_a_value_error_and_project_error():
    with pytest.raises(ValueError):
        Typed.parse_configuration("{bad")
    with pytest.raises(MjschedError):
        Typed.parse_configuration("{bad")


@pytest.mark.parametrize(("text", "expected"), [
    (None, None),
    ("", None),
    ("null", None),
    ('{"a": 1, "b": [true, null, "x"]}', {"a": 1, "b": [True, None, "x"]}),
    ("[1, 2.5]", [1, 2.5]),
    ('"just a string"', "just a string"),
    ("42", 42),
])
def test_no_configuration_type_passes_raw_values(text, expected):
    assert Raw.parse_configuration(text) == expected


def test_field_message_without_path():
    assert _field_message(msgspec.ValidationError("Expected `object`, got `int`")) == \
        "configuration: Expected `object`, got `int`"
    assert _field_message(msgspec.ValidationError("Expected `int`, got `str` - at `$.a.b`")) == \
        "configuration.a.b: Expected `int`, got `str`"


def test_default_validate_configuration_accepts_everything():
    assert Typed().validate_configuration(Config()) is None
    assert Raw().validate_configuration({"anything": [1]}) is None


def test_default_execute_is_not_implemented():
    with pytest.raises(NotImplementedError):
        Raw().execute(_context())


# -- format_notification -------------------------------------------------------------------------------


def test_default_notification_on_failure_is_high_with_error_in_body():
    note = Typed().format_notification(_context(), ScheduledJobResult(success=False, error_message="disk full"))
    assert isinstance(note, NotificationContent)
    assert note.priority == "High"
    assert "nightly" in note.subject and "failed" in note.subject
    assert "disk full" in note.body
    assert "17" in note.body  # the run id
    assert "typed" in note.body


def test_default_notification_on_failure_without_message():
    note = Typed().format_notification(_context(), ScheduledJobResult(success=False))
    assert note.priority == "High"
    assert "no error message" in note.body


def test_default_notification_on_success_is_normal():
    note = Typed().format_notification(_context(), ScheduledJobResult(success=True, details={"n": 1}))
    assert note.priority == "Normal"
    assert "nightly" in note.subject and "completed" in note.subject
    assert "failed" not in note.body


def test_notification_content_defaults():
    note = NotificationContent(subject="s", body="b")
    assert note.priority == "Normal" and note.metadata is None


# -- JobContext ----------------------------------------------------------------------------------------


def test_context_attributes():
    at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    ctx = _context(configuration=Config(), scheduled_at=at, deadline_at=at + dt.timedelta(minutes=5))
    assert (ctx.run_id, ctx.job_id, ctx.job_name, ctx.job_type) == (17, 3, "nightly", "typed")
    assert ctx.configuration == Config()
    assert ctx.scheduled_at == at and ctx.deadline_at == at + dt.timedelta(minutes=5)
    assert isinstance(ctx.log, logging.Logger)
    assert ctx.log.name == "mjsched.plugin.typed"


def test_heartbeat_calls_the_callable():
    calls = []
    ctx = _context(heartbeat=lambda: calls.append(1))
    ctx.heartbeat()
    ctx.heartbeat()
    assert calls == [1, 1]


def test_heartbeat_without_callable_is_a_no_op():
    _context().heartbeat()


@pytest.mark.parametrize("exc", [RuntimeError("boom"), BrokenPipeError("peer gone"), OSError("closed"),
                                 ValueError("x")])
def test_heartbeat_never_raises_even_if_callable_raises(exc):
    calls = []

    def failing() -> None:
        calls.append(1)
        raise exc

    ctx = _context(heartbeat=failing)
    ctx.heartbeat()  # must not raise
    ctx.heartbeat()
    assert calls == [1, 1]


def test_scheduled_job_result_is_keyword_only():
    with pytest.raises(TypeError):
        ScheduledJobResult(True)  # type: ignore[misc]
    result = ScheduledJobResult(success=True)
    assert result.details is None and result.error_message is None


# -- generic over the configuration Struct -------------------------------------------------------------


class Inferred(BaseScheduledJob[Config]):
    job_type = "inferred"


class Explicit(BaseScheduledJob[Config]):
    job_type = "explicit"
    configuration_type = Lenient  # an explicit setting wins over the parameter


class InheritsExplicit(Explicit):
    job_type = "inherits"


class NotAStruct(BaseScheduledJob[dict]):
    job_type = "not_a_struct"


ConfigT = TypeVar("ConfigT")


class Intermediate(BaseScheduledJob[ConfigT]):
    """A generic base of the plugin author's own."""


class ThroughIntermediate(Intermediate[Inner]):
    job_type = "through"


def test_configuration_type_is_inferred_from_the_generic_parameter():
    assert Inferred.configuration_type is Config
    assert Inferred.parse_configuration('{"timeout_s": 1}') == Config(timeout_s=1.0)
    assert ThroughIntermediate.configuration_type is Inner
    assert Intermediate.configuration_type is None  # a type variable is no configuration


def test_an_explicit_configuration_type_wins_and_is_inherited():
    assert Explicit.configuration_type is Lenient
    assert InheritsExplicit.configuration_type is Lenient  # not re-inferred from Explicit's own parameter


def test_a_parameter_that_is_not_a_struct_leaves_the_raw_json():
    assert NotAStruct.configuration_type is None
    assert NotAStruct.parse_configuration('{"a": 1}') == {"a": 1}


def test_unparametrised_plugins_still_work():
    assert Typed.configuration_type is Config and Raw.configuration_type is None
    context: JobContext[Config] = _context(configuration=Config())
    assert context.configuration.timeout_s == 5.0
