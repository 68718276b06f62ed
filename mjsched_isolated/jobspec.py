"""A job definition as users write it (CLI flags or a TOML jobs file), and its validation.

Field names are the store's column names. Validation happens before anything is written: cron and zone
here, the plugin's configuration rules in a throwaway worker child (:mod:`inspection`), since the
calling process never imports plugins.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from mjsched_isolated import cron, planner
from mjsched_isolated.config import LIMIT_RANGES, is_email_address
from mjsched_isolated.enums import ConcurrencyMode, JobStatus, MissedRunPolicy, values
from mjsched_isolated.errors import InputError, msgspec_field_error, not_utf8, require_utf8
from mjsched_isolated.protocol import MAX_TEXT_BYTES

JOB_STATUSES = values(JobStatus)
CONCURRENCY_MODES = values(ConcurrencyMode)
MISSED_RUN_POLICIES = values(MissedRunPolicy)


MAX_RUNTIME_MINUTES = int(planner.MAX_RUN_TIMEOUT_S // 60)
# The jobs table's column limits in characters (mjsched_isolated/store/schema.py; a test keeps them equal):
# PostgreSQL and MariaDB refuse a longer value, SQLite would keep it, so every backend is held to them.
TEXT_LIMITS = {"name": 200, "job_type": 100, "cron_expression": 120, "timezone": 64}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: newlines, NUL, terminal escapes
_CONTROL_BUT_LAYOUT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # a description may hold tabs, lines
JITTER_REFERENCE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # where a schedule's interval is sampled
# A configuration nests at most this many levels of objects/arrays (the top object is level 1): far above
# any real plugin's needs, far below the depth where Python's json recursion fails (~1000).
MAX_CONFIGURATION_DEPTH = 100


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One job. ``start_at``/``end_at`` without a UTC offset are read in the job's ``timezone``.
    ``status`` left unset means Active for a new job and "unchanged" for an existing one."""

    name: str
    job_type: str
    cron_expression: str
    timezone: str = "UTC"
    description: str | None = None
    status: str | msgspec.UnsetType = msgspec.UNSET
    configuration: dict[str, Any] | None = None
    start_at: dt.datetime | None = None
    end_at: dt.datetime | None = None
    concurrency_mode: str = "Skip"
    max_queued: int = planner.DEFAULT_MAX_QUEUED  # QueueAll: at most this many occurrences wait
    missed_run_policy: str = "RunOnce"
    max_jitter_s: float | None = None
    run_immediately_if_never_run: bool = False
    max_runtime_minutes: int | None = None
    max_memory_mb: int | None = None
    max_cpu_s: int | None = None
    max_open_files: int | None = None
    max_processes: int | None = None
    nice: int | None = None
    notify_on_success: bool = False
    notify_on_failure: bool = True
    notify_on_missed: bool = False
    notify_recipients: list[str] | None = None
    # -- time knobs (issue 12 point 10) --
    dst_gap_policy: str = cron.DEFAULT_DST_GAP
    dst_fold_policy: str = cron.DEFAULT_DST_FOLD
    missed_run_grace_s: float | None = None
    max_total_runtime_s: float | None = None
    # -- retries and pause on repeated failure (issue 12 points 5, 8) --
    max_retries: int = 0
    retry_backoff_s: float = 10.0
    retry_backoff_factor: float = 2.0
    retry_backoff_max_s: float | None = None
    retry_max_jitter_s: float | None = None
    retry_on: list[str] | None = None
    pause_after_failures: int | None = None


MAX_RETRIES = 100


class JobsFile(msgspec.Struct, forbid_unknown_fields=True):
    """A declarative jobs file: ``[[jobs]]`` tables, each a :class:`JobSpec`."""

    jobs: list[JobSpec] = []


def check(spec: JobSpec, where: str = "") -> JobSpec:
    """Validate everything but the plugin configuration; return the spec with aware UTC times.
    Raises :class:`InputError` naming the field (prefixed by ``where``, e.g. ``jobs[2].``)."""
    def fail(field: str, message: str) -> None:
        raise InputError(f"{where}{field}", message)

    if not spec.name.strip():
        fail("name", "must not be empty")
    if spec.name != spec.name.strip():  # ' lead' would be stored as such, then `jobs show lead` misses it
        fail("name", f"must not begin or end with whitespace, got {spec.name[:40]!r}")
    if not spec.job_type.strip():
        fail("job_type", "must not be empty")
    for field, limit in TEXT_LIMITS.items():
        text = getattr(spec, field)
        if len(text) > limit:
            fail(field, f"must be at most {limit} characters, got {len(text)}")
        if _CONTROL.search(text):  # a newline in a name forges log lines; PostgreSQL refuses NUL outright
            fail(field, f"must not contain control characters (newline, NUL, escape), got {text[:40]!r}")
        if any(unicodedata.category(c) == "Cf" for c in text):  # bidi overrides, zero-width characters
            fail(field, f"must not contain invisible formatting characters (bidi overrides, zero-width "
                        f"spaces), got {text[:40]!r}")
    if spec.configuration is not None and nesting_depth(spec.configuration, MAX_CONFIGURATION_DEPTH) > \
            MAX_CONFIGURATION_DEPTH:
        fail("configuration", f"nested deeper than {MAX_CONFIGURATION_DEPTH} levels")
    for field, text in _texts(spec):  # a byte that was not UTF-8 (a lone surrogate): refused before it is written
        if (error := not_utf8(field, text)) is not None:
            fail(field, error.message)
    if spec.description is not None and _CONTROL_BUT_LAYOUT.search(spec.description):
        fail("description", "must not contain control characters other than tab and newline")
    for field, value in (("description", spec.description),
                         ("configuration", None if spec.configuration is None else json.dumps(spec.configuration))):
        if value is not None and len(value.encode("utf-8")) > MAX_TEXT_BYTES:  # MariaDB's TEXT holds 65,535
            fail(field, f"must be at most {MAX_TEXT_BYTES} bytes (as stored), got {len(value.encode('utf-8'))}")
    try:
        cron.validate(spec.cron_expression, spec.timezone)
    except InputError as exc:
        fail(exc.field, exc.message)
    try:
        cron.check_dst_policies(spec.dst_gap_policy, spec.dst_fold_policy)
    except InputError as exc:
        fail(exc.field, exc.message)
    for field in ("missed_run_grace_s", "max_total_runtime_s"):
        value = getattr(spec, field)
        if value is not None and not 0 < value <= planner.MAX_RUN_TIMEOUT_S:
            fail(field, f"must be more than 0 and at most {planner.MAX_RUN_TIMEOUT_S:g} seconds (ten years), "
                        f"got {value:g}")
    _check_retries(spec, fail)
    if spec.status is not msgspec.UNSET and spec.status not in JOB_STATUSES:
        fail("status", f"must be one of {', '.join(JOB_STATUSES)}, got {spec.status!r}")
    if spec.concurrency_mode not in CONCURRENCY_MODES:
        fail("concurrency_mode", f"must be one of {', '.join(CONCURRENCY_MODES)}, got {spec.concurrency_mode!r}")
    if not 1 <= spec.max_queued <= planner.MAX_QUEUED:
        fail("max_queued", f"must be between 1 and {planner.MAX_QUEUED}, got {spec.max_queued}")
    if spec.missed_run_policy not in MISSED_RUN_POLICIES:
        fail("missed_run_policy", f"must be one of {', '.join(MISSED_RUN_POLICIES)}, got {spec.missed_run_policy!r}")
    if spec.max_jitter_s is not None and not 0 <= spec.max_jitter_s <= 86400:
        fail("max_jitter_s", f"must be between 0 and 86400 seconds, got {spec.max_jitter_s}")
    if spec.max_jitter_s:
        interval_s = cron.min_interval_s(spec.cron_expression, spec.timezone, spec.start_at or JITTER_REFERENCE)
        if spec.max_jitter_s >= interval_s:
            fail("max_jitter_s", f"must be shorter than the schedule's interval ({interval_s:g} s), "
                                 f"or delayed occurrences would swallow the next ones; got {spec.max_jitter_s:g}")
    if spec.max_runtime_minutes is not None and not 0 < spec.max_runtime_minutes <= MAX_RUNTIME_MINUTES:
        fail("max_runtime_minutes", f"must be between 1 and {MAX_RUNTIME_MINUTES} minutes (ten years), "
                                    f"got {spec.max_runtime_minutes}")
    for field, (low, high) in LIMIT_RANGES.items():
        value = getattr(spec, field)
        if value is not None and not low <= value <= high:
            fail(field, f"must be between {low} and {high}, got {value}")
    for i, address in enumerate(spec.notify_recipients or []):
        if not is_email_address(address):
            fail(f"notify_recipients[{i}]", f"not an email address: {address!r}")
    zone = cron.zone(spec.timezone)
    start_at = _aware(spec.start_at, zone)
    end_at = _aware(spec.end_at, zone)
    if start_at and end_at and end_at <= start_at:
        fail("end_at", "must be after start_at")
    return msgspec.structs.replace(spec, start_at=start_at, end_at=end_at,
                                   cron_expression=" ".join(spec.cron_expression.split()))


def _texts(spec: JobSpec) -> Iterator[tuple[str, str]]:
    """Every text of ``spec`` with its field: the text fields, list items, and the configuration's keys and
    string values (``configuration.a.b[0]``)."""
    for field in ("name", "job_type", "cron_expression", "timezone", "description", "status", "concurrency_mode",
                  "missed_run_policy", "dst_gap_policy", "dst_fold_policy"):
        value = getattr(spec, field)
        if isinstance(value, str):
            yield field, value
    for field in ("notify_recipients", "retry_on"):
        for i, item in enumerate(getattr(spec, field) or []):
            if isinstance(item, str):
                yield f"{field}[{i}]", item
    if spec.configuration is not None:
        yield from _nested_texts("configuration", spec.configuration)


def _nested_texts(path: str, value: Any) -> Iterator[tuple[str, str]]:
    """The strings in ``value`` (keys too), with their paths; a loop, not recursion: any depth is fine."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str):
                    yield where, key
                    stack.append((f"{where}.{key}", child))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))


def _check_retries(spec: JobSpec, fail: Any) -> None:
    """The retry and pause-on-failure fields (issue 12 points 5 and 8)."""
    if not 0 <= spec.max_retries <= MAX_RETRIES:
        fail("max_retries", f"must be between 0 and {MAX_RETRIES}, got {spec.max_retries}")
    if not 0 <= spec.retry_backoff_s <= planner.MAX_RUN_TIMEOUT_S:
        fail("retry_backoff_s", f"must be between 0 and {planner.MAX_RUN_TIMEOUT_S:g} seconds, "
                                f"got {spec.retry_backoff_s:g}")
    if not 1 <= spec.retry_backoff_factor <= 100:
        fail("retry_backoff_factor", f"must be between 1 (a constant delay) and 100, got {spec.retry_backoff_factor:g}")
    for field in ("retry_backoff_max_s", "retry_max_jitter_s"):
        value = getattr(spec, field)
        if value is not None and not 0 <= value <= planner.MAX_RUN_TIMEOUT_S:
            fail(field, f"must be between 0 and {planner.MAX_RUN_TIMEOUT_S:g} seconds, got {value:g}")
    for i, status in enumerate(spec.retry_on or []):
        if status not in planner.RETRY_ON_CHOICES:
            fail(f"retry_on[{i}]", f"must be one of {', '.join(planner.RETRY_ON_CHOICES)}, got {status!r}")
    retry_on = spec.retry_on or []
    for i, status in enumerate(retry_on):
        if status in retry_on[:i]:
            fail(f"retry_on[{i}]", f"{status!r} is listed twice (first as retry_on[{retry_on.index(status)}])")
    if spec.retry_on is not None and not spec.retry_on:
        fail("retry_on", "must list at least one status (to retry nothing, set max_retries 0)")
    if spec.pause_after_failures is not None and not 1 <= spec.pause_after_failures <= 1_000_000:
        fail("pause_after_failures", f"must be between 1 and 1000000, got {spec.pause_after_failures}")


def nesting_depth(value: Any, limit: int = MAX_CONFIGURATION_DEPTH) -> int:
    """How many levels of dicts/lists/tuples ``value`` nests (a scalar 0, ``{}`` 1, ``{"a": []}`` 2),
    counted without recursion and stopping at ``limit + 1`` (so a cyclic structure ends too)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKeyError(key)
        seen[key] = value
    return seen


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def parse_configuration(text: str, field: str = "configuration") -> dict[str, Any]:
    """A configuration's JSON text as a dict. Raises :class:`InputError` naming ``field`` when the text is not
    JSON, not an object, repeats a key in one object (JSON would keep the last silently) or nests deeper than
    :data:`MAX_CONFIGURATION_DEPTH` levels."""
    too_deep = InputError(field, f"nested deeper than {MAX_CONFIGURATION_DEPTH} levels")
    require_utf8(field, text)  # else JSON would report a malformed surrogate pair, or the driver a traceback
    try:
        value = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise InputError(field, f"invalid JSON ({exc.msg} at position {exc.pos})") from None
    except _DuplicateKeyError as exc:
        raise InputError(field, f"duplicate key {exc.key[:60]!r} in one object") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(value, dict):
        raise InputError(field, "must be a JSON object")
    if nesting_depth(value) > MAX_CONFIGURATION_DEPTH:
        raise too_deep
    return value


def row_values(spec: JobSpec) -> dict[str, Any]:
    """Column values for the store (status excluded when unset)."""
    values = msgspec.structs.asdict(spec)
    if values["status"] is msgspec.UNSET:
        del values["status"]
    values["configuration"] = None if spec.configuration is None else json.dumps(spec.configuration, sort_keys=True)
    values["retry_on"] = ",".join(spec.retry_on) if spec.retry_on else None
    values["notify_recipients"] = (json.dumps([a.strip() for a in spec.notify_recipients])
                                   if spec.notify_recipients else None)
    return values


def schedule_fields_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """True when a change of these columns must recompute ``next_run_at``."""
    keys = ("cron_expression", "timezone", "start_at", "end_at", "status", "dst_gap_policy", "dst_fold_policy")
    return any(k in new and old.get(k) != new[k] for k in keys)


def with_next_run_at(values: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """Add ``next_run_at`` for an Active job (None otherwise). An Active job with no occurrence before its
    ``end_at`` becomes ``Expired`` at once, as the supervisor would make it (the reference leaves it Active).
    Raises :class:`InputError` when no occurrence can be computed: naming ``start_at`` when one is set
    (e.g. year 9999), else ``cron_expression`` (e.g. ``0 0 30 2 *``, February 30th)."""
    active = values.get("status") == "Active"
    try:
        values["next_run_at"] = planner.initial_next_run_at(values, now) if active else None
    except (OverflowError, ValueError) as exc:
        detail = exc.message if isinstance(exc, InputError) else str(exc)
        if values.get("start_at") and _fires_from(values, now):  # the dates ran out after start_at
            raise InputError("start_at", f"no occurrence of {values.get('cron_expression')!r} follows it before "
                                         "the last date this scheduler can compute (9999-12-31T23:59:59Z); choose "
                                         "an earlier start_at") from None
        raise InputError("cron_expression", f"never fires: no occurrence can be computed ({detail})") from None
    if active and values["next_run_at"] is None:
        values["status"] = "Expired"
    return values


def _fires_from(values: Mapping[str, Any], now: dt.datetime) -> bool:
    """True when the schedule of ``values`` has an occurrence after ``now`` (its start_at left out)."""
    try:
        return planner.initial_next_run_at({**values, "start_at": None, "end_at": None}, now) is not None
    except (OverflowError, ValueError):
        return False


def load_file(path: str | Path) -> list[JobSpec]:
    """Parse and check a TOML jobs file. Raises :class:`InputError` naming the file and field."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError("jobs file", f"cannot read {path}: {exc.strerror}") from None
    try:
        parsed = msgspec.toml.decode(data, type=JobsFile)
    except msgspec.ValidationError as exc:
        field, message = msgspec_field_error(exc, "")
        raise InputError(f"{path}: {field}" if field != "value" else f"{path}", message) from None
    except msgspec.DecodeError as exc:
        raise InputError(f"{path}", f"invalid TOML: {exc}") from None
    except RecursionError:
        raise InputError(f"{path}", "invalid TOML: arrays or tables nested too deeply") from None
    specs = [check(spec, f"{path}: jobs[{i}].") for i, spec in enumerate(parsed.jobs)]
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise InputError(f"{path}: name", f"job {name!r} is defined twice")
    return specs


def _aware(value: dt.datetime | None, zone: dt.tzinfo) -> dt.datetime | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=zone)
    return value.astimezone(dt.UTC)


# A stored job row's numeric columns, as :func:`check` bounds them: (column, an int column?, low, high, low
# excluded?). A value edited by hand into a SQLite file (which keeps text in a number column) or out of range
# is found by :func:`stored_problem` before the supervisor computes with it.
_STORED_NUMBERS: tuple[tuple[str, bool, float, float, bool], ...] = (
    ("max_runtime_minutes", True, 1, MAX_RUNTIME_MINUTES, False),
    *((field, True, low, high, False) for field, (low, high) in LIMIT_RANGES.items()),
    ("max_queued", True, 1, planner.MAX_QUEUED, False),
    ("max_retries", True, 0, MAX_RETRIES, False),
    ("pause_after_failures", True, 1, 1_000_000, False),
    ("max_jitter_s", False, 0, 86400, False),
    ("missed_run_grace_s", False, 0, planner.MAX_RUN_TIMEOUT_S, True),
    ("max_total_runtime_s", False, 0, planner.MAX_RUN_TIMEOUT_S, True),
    ("retry_backoff_s", False, 0, planner.MAX_RUN_TIMEOUT_S, False),
    ("retry_backoff_factor", False, 1, 100, False),
    ("retry_backoff_max_s", False, 0, planner.MAX_RUN_TIMEOUT_S, False),
    ("retry_max_jitter_s", False, 0, planner.MAX_RUN_TIMEOUT_S, False),
)
_NULLABLE = frozenset({"max_runtime_minutes", *LIMIT_RANGES, "pause_after_failures", "max_jitter_s",
                       "missed_run_grace_s", "max_total_runtime_s", "retry_backoff_max_s", "retry_max_jitter_s"})


STORED_NUMBER_COLUMNS = tuple(field for field, *_ in _STORED_NUMBERS)
"""The columns :func:`stored_problem` judges (a caller may remember their values of a row found fine)."""


def stored_problem(job: Mapping[str, Any]) -> InputError | None:
    """What makes a stored job row's numeric columns unusable, naming the column: a value that is not a
    number (text kept by SQLite in a number column) or out of the range :func:`check` allows (edited by hand
    around the CLI, on any database). None when all are fine. The supervisor sets such a job aside, ``check``
    reports it: one bad row must not stop the others."""
    for field, integer, low, high, open_low in _STORED_NUMBERS:
        value = job.get(field)
        if value is None:
            if field in _NULLABLE:
                continue
            return InputError(field, "is empty (NULL) in the database; set a value with `jobs update`")
        kind = type(value)
        if kind is not int and (integer or kind is not float) and (
                isinstance(value, bool) or not isinstance(value, int if integer else (int, float))):
            return InputError(field, f"{value!r} in the database is not {'an integer' if integer else 'a number'}"
                                     " (edited by hand?); set it with `jobs update`")
        if not (low < value <= high if open_low else low <= value <= high):
            bounds = f"more than {low:g} and at most {high:g}" if open_low else f"from {low:g} to {high:g}"
            return InputError(field, f"{value!r} in the database is out of range ({bounds}; edited by hand?); "
                                     "set it with `jobs update`")
    return None
