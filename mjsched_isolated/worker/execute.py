"""Running one request inside a worker child: validation, the plugin's ``execute`` (sync or ``async``),
its notice text, and cleaning what the plugin hands over so the pipe and every database accept it.

:func:`run` and :func:`validate` take the :class:`~mjsched_isolated.worker.loader.Registry` and a request;
they never touch the pipe except through ``sender`` and never raise for plugin misbehaviour. A fake pool
that runs plugins in-process (tests) calls them directly.
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import re
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from mjsched_isolated import protocol
from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
)
from mjsched_isolated.enums import Priority
from mjsched_isolated.errors import ConfigurationError

if TYPE_CHECKING:
    import asyncio

    from mjsched_isolated.worker.loader import Registry

log = logging.getLogger("mjsched.child")

HEARTBEAT_MIN_GAP_S = 0.25  # the child never floods the pipe; the supervisor throttles for real
MAX_DETAILS_BYTES = 64 * 1024  # larger details are replaced by a preview: the run row stays small
MAX_ERROR_CHARS = 4000
MAX_DETAILS_DEPTH = 64  # nesting levels of details; MySQL/MariaDB's JSON type refuses more than 100
TRACEBACK_TAIL_CHARS = 4000
# a run claimed ahead waits at most this long for its start_at (claim_ahead_s is at most 1 s): a longer wait
# means this machine's wall clock stepped back meanwhile, and the supervisor follows such jumps itself
MAX_START_WAIT_S = 2.0


class Sender(Protocol):
    """Where :func:`run` sends ``RunStarted`` and ``Heartbeat``: the worker's pipe (thread-safe), or a
    fake pool's list. Raises ``OSError``/``ValueError`` when the peer is gone."""

    def send(self, message: msgspec.Struct) -> None: ...


_loop: asyncio.AbstractEventLoop | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The worker's one event loop for ``async def execute`` plugins: created on first use, reused by every
    later run in this process (a plugin's loop-bound clients stay usable), never closed before exit.
    asyncio is imported here, not at module level: it costs a worker ~8 MB that sync plugins never need."""
    global _loop
    import asyncio  # noqa: PLC0415 - ~8 MB that sync plugins never need (see above)
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def validate(registry: Registry, job_type: str, configuration: str | None) -> str | None:
    """None if ``configuration`` (JSON text) is valid for ``job_type``, else a one-line error naming the
    field (``job_type: unknown job type ...``, ``configuration.timeout_s: ...``)."""
    return _parse_valid(registry, job_type, configuration)[1]


def _parse_valid(registry: Registry, job_type: str, configuration: str | None) -> tuple[Any, str | None]:
    """``(parsed configuration, None)`` if it is valid for ``job_type``, else ``(None, error)`` (see
    :func:`validate`): a run parses its configuration once, for the check and for its context."""
    cls = registry.classes.get(job_type)
    if cls is None:
        known = ", ".join(sorted(registry.classes)) or "none"
        return None, f"job_type: unknown job type {job_type!r} (available: {known})"
    try:
        parsed = cls.parse_configuration(configuration)
        cls().validate_configuration(parsed)
    except ConfigurationError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a buggy validator is a plugin error, reported as such
        return None, f"configuration: validator of {job_type!r} raised {type(exc).__name__}: {exc}"
    return parsed, None


def wait_for_start(start_at: float | None, max_wait_s: float = MAX_START_WAIT_S) -> None:
    """Sleep until this process's wall clock reads ``start_at`` (epoch seconds; None: return at once), never
    returning before it: a sleep that ends early (a signal, a monotonic clock running ahead of the slewed wall
    clock) sleeps again. Gives up after ``max_wait_s`` of the monotonic clock (a wall clock stepped back)."""
    if start_at is None:
        return
    give_up = time.monotonic() + max_wait_s
    while (left := start_at - time.time()) > 0:
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(min(left, remaining))


def run(registry: Registry, req: protocol.RunRequest, sender: Sender,
        describe_error: Callable[[BaseException], str | None] | None = None,
        deadline_updates: Callable[[], float | None] | None = None,
        before_start: Callable[[float | None], None] | None = None) -> protocol.RunFinished:
    """Execute one run and build its :class:`~mjsched_isolated.protocol.RunFinished`.

    Sends ``RunStarted`` before the plugin's ``execute`` (when logging at DEBUG: issue 11) and (throttled to one per
    ``HEARTBEAT_MIN_GAP_S``) a ``Heartbeat`` per ``context.heartbeat()``. An ``async def execute`` runs to
    completion in :func:`event_loop`; tasks it leaves pending are cancelled. A configuration that is no
    longer valid gives a failure ``not started: ...``; a plugin exception (``SystemExit`` and
    ``KeyboardInterrupt`` included) a failure with the traceback's tail in ``details["traceback"]``;
    ``describe_error`` may name what an exception means (a resource limit hit) for the error message.
    ``deadline_updates()``: the newest deadline (epoch seconds) the supervisor sent since the last call, or
    None (:meth:`~mjsched_isolated.worker.inbox.Inbox.deadline_for`); ``context.deadline_at`` follows it.
    The plugin's notice (``notification``) is formatted only for an outcome the request says is notified
    (``notice_on_success``, ``notice_on_failure``).
    ``before_start(req.start_at)`` is called just before the plugin, everything else about the run ready:
    the worker waits there until a run claimed ahead of its instant may start (:func:`wait_for_start`; a
    fake pool's in-process runs do not wait).
    """
    configuration, error = _parse_valid(registry, req.job_type, req.configuration)
    if error is not None:
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=f"not started: {error}")
    cls = registry.classes[req.job_type]
    last_beat = [0.0]

    def heartbeat() -> None:
        now = time.time()
        if now - last_beat[0] >= HEARTBEAT_MIN_GAP_S:
            last_beat[0] = now
            try:
                sender.send(protocol.Heartbeat(run_id=req.run_id, at=now))
            except (OSError, ValueError):  # the supervisor is gone (its watchdog ends us): never raise in a plugin
                pass

    context: JobContext[Any] = JobContext(
        run_id=req.run_id, job_id=req.job_id, job_name=req.job_name, job_type=req.job_type,
        configuration=configuration,
        scheduled_at=_from_epoch(req.scheduled_at), deadline_at=_from_epoch(req.deadline_at), heartbeat=heartbeat,
        deadline_updates=None if deadline_updates is None else lambda: _from_epoch(deadline_updates()),
        attempt=req.attempt, previous_details=_json_object(req.previous_details),
    )
    plugin = cls()
    if before_start is not None:
        before_start(req.start_at)
    if logging.getLogger().isEnabledFor(logging.DEBUG):  # its only reader is the supervisor's debug line
        sender.send(protocol.RunStarted(run_id=req.run_id, at=time.time()))
    try:
        result = _call(plugin, context)
        if not isinstance(result, ScheduledJobResult):
            raise TypeError(f"execute() returned {type(result).__name__}, expected ScheduledJobResult")
    except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in a plugin are failures too
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tail = traceback.format_exc()[-TRACEBACK_TAIL_CHARS:]
        meaning = describe_error(exc) if describe_error is not None else None
        error = clean_text(meaning or f"plugin raised {text}")[:MAX_ERROR_CHARS]
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=error, details={"traceback": tail},
                                    notification=notice_text(plugin, context, ScheduledJobResult(
                                        success=False, error_message=error)) if req.notice_on_failure else None)
    error = None if result.error_message is None else clean_text(str(result.error_message))[:MAX_ERROR_CHARS]
    try:
        if not isinstance(result.success, bool):  # msgspec Structs do not check types when built in Python
            raise BadDetailsError(f"success must be True or False, got {result.success!r:.60} "
                                  f"({type(result.success).__name__})", field="success")
        if result.error_message is not None and not isinstance(result.error_message, str):
            raise BadDetailsError(f"error_message must be a string or None, got {type(result.error_message).__name__}",
                                  field="error_message")
        details = clean_details(result.details)
    except BadDetailsError as exc:  # recorded on the run: the plugin's mistake, not a crash of the worker
        error = clean_text(f"plugin returned bad {exc.field}: {exc}" + (f"; its error: {error}" if error else ""))
        outcome = ScheduledJobResult(success=False, error_message=error[:MAX_ERROR_CHARS])
        notice = notice_text(plugin, context, outcome) if req.notice_on_failure else None
        return protocol.RunFinished(run_id=req.run_id, success=False, error_message=outcome.error_message,
                                    notification=notice)
    success = result.success is True
    wanted = req.notice_on_success if success else req.notice_on_failure  # else no notice is sent: not formatted
    notification = notice_text(plugin, context, ScheduledJobResult(success=success, details=result.details,
                                                                   error_message=error)) if wanted else None
    return protocol.RunFinished(run_id=req.run_id, success=success, error_message=error, details=details,
                                notification=notification)


def _call(plugin: BaseScheduledJob[Any], context: JobContext[Any]) -> object:
    """``plugin.execute(context)``; an awaitable it returns is run to completion in the worker's loop."""
    result: object = plugin.execute(context)
    if type(result) is not ScheduledJobResult and inspect.isawaitable(result):  # a sync plugin's result: no ABC check
        loop = event_loop()
        try:
            result = loop.run_until_complete(_await(result))
        finally:
            _cancel_pending(loop)
    return result


async def _await(awaitable: Any) -> object:
    return await awaitable


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks a run left on the loop and let them finish cancelling: no run's work leaks into
    the next (as ``asyncio.run`` does, without closing the loop)."""
    import asyncio  # noqa: PLC0415 - lazy: already loaded by event_loop()

    pending = asyncio.all_tasks(loop)
    if not pending:
        return
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def notice_text(plugin: BaseScheduledJob[Any], context: JobContext[Any],
                result: ScheduledJobResult) -> protocol.NoticeText | None:
    """The plugin's ``format_notification(context, result)`` as a :class:`protocol.NoticeText`. One that
    raises or returns something other than a valid ``NotificationContent`` is logged and replaced by the
    default of :class:`BaseScheduledJob`; it never changes the run's result. None if even that fails."""
    for formatter in (type(plugin).format_notification, BaseScheduledJob.format_notification):
        try:
            content = formatter(plugin, context, result)
            if not isinstance(content, NotificationContent):
                raise TypeError(f"returned {type(content).__name__}, expected NotificationContent")
            if content.priority not in _PRIORITIES:
                raise ValueError(f"priority must be Low, Normal or High, got {content.priority!r}")
            metadata = content.metadata if isinstance(content.metadata, dict) else None
            subject = " ".join(clean_text(content.subject).split())  # one header line: no CR/LF, no NUL
            return protocol.NoticeText(subject=subject[:MAX_ERROR_CHARS] or f"Scheduled job '{context.job_name}'",
                                       body=clean_text(content.body)[:MAX_DETAILS_BYTES], priority=content.priority,
                                       metadata=clean_details(metadata))
        except BaseException as exc:  # noqa: BLE001 - a notice must never break the run's record
            log.warning("format_notification of %s raised %s: %s; the default notice is used instead",
                        context.job_type, type(exc).__name__, exc)
    return None


_PRIORITIES = frozenset(Priority)  # a notice's valid priorities (not a set of the enum built per notice)
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(value: object) -> str:
    """A plugin's string as text every database stores and the pipe can encode: NUL (which PostgreSQL
    refuses) and a lone surrogate (Python's stand-in for an undecodable byte of a file name from
    ``os.listdir``, which UTF-8 cannot encode) become U+FFFD."""
    text = str(value).replace("\x00", "\ufffd")
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)  # ASCII (a flag): no surrogate in it


def scrub(value: Any) -> Any:
    """``value`` (plain JSON-like values) with every string, dict keys included, made encodable as UTF-8:
    each lone surrogate becomes U+FFFD, as in the run's output. Other values are returned as they are."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


class BadDetailsError(ValueError):
    """A result a plugin returned that cannot be stored: details not a JSON object, cyclic, or nested too
    deeply; ``success`` not a bool, ``error_message`` not text (``field`` names which)."""

    def __init__(self, message: str, field: str = "details") -> None:
        super().__init__(message)
        self.field = field


def clean_details(details: object) -> dict[str, Any] | None:
    """Details as plain JSON values (anything else becomes its ``repr``), at most ``MAX_DETAILS_BYTES``
    encoded; larger ones are replaced by ``{"truncated": True, "size_bytes": N, "preview": "..."}``.
    Raises :class:`BadDetailsError` for a value that is not a dict (``"details must be a JSON object (a dict),
    got list"``), a cyclic one, or one nested more than ``MAX_DETAILS_DEPTH`` levels."""
    if details is None:
        return None
    if not isinstance(details, dict):
        raise BadDetailsError(f"details must be a JSON object (a dict), got {type(details).__name__}")
    try:
        try:
            encoded = msgspec.json.encode(details, enc_hook=repr)
        except UnicodeEncodeError:  # a lone surrogate in a string: U+FFFD in its place (see clean_text)
            encoded = msgspec.json.encode(scrub(details), enc_hook=repr)
    except RecursionError:
        raise BadDetailsError("details must be a JSON object without reference cycles, nested at most "
                         f"{MAX_DETAILS_DEPTH} levels") from None
    if len(encoded) > MAX_DETAILS_BYTES:
        return {"truncated": True, "size_bytes": len(encoded),
                "preview": encoded[:2000].decode("utf-8", errors="replace")}
    decoded = msgspec.json.decode(encoded)
    if _depth(decoded) > MAX_DETAILS_DEPTH:
        raise BadDetailsError(f"details must be nested at most {MAX_DETAILS_DEPTH} levels")
    cleaned = _wire_safe(decoded)
    return cleaned if isinstance(cleaned, dict) else None


def _depth(value: object) -> int:
    """Nesting depth of decoded JSON (a tree: no cycles), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item if isinstance(v, dict | list))
    return deepest


def _wire_safe(value: object) -> object:
    """JSON values the pipe's msgpack encoding accepts: integers beyond 64 bits become strings."""
    if isinstance(value, dict):
        return {k: _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire_safe(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)
    return value


def _json_object(text: str | None) -> dict[str, Any] | None:
    """``text`` decoded if it is a JSON object, else None (stored details are objects; a hand-edited row
    may hold anything)."""
    if not text:
        return None
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _from_epoch(value: float | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromtimestamp(value, dt.UTC)
