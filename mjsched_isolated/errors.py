"""The project's exception root and its subclasses. Each message names the field at fault.

Errors carry their parts (``field``, ``message``) so nobody parses error text back apart: to re-label an
error for another audience (a CLI flag instead of a settings key), use :meth:`InputError.renamed`.
"""

from __future__ import annotations

import msgspec


class MjschedError(Exception):
    """Root of every error this package raises on purpose."""


class InputError(MjschedError, ValueError):
    """Bad user input (CLI flag, jobs file, job row, API argument).

    ``field``: the offending field's name (``cron_expression``, ``--db``, ``jobs[2].timezone``);
    ``message``: what is wrong with it, without the field. ``str(exc)`` is ``"<field>: <message>"``.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def renamed(self, field: str) -> InputError:
        """The same error (same class, same message) about ``field`` instead."""
        clone = type(self).__new__(type(self))
        InputError.__init__(clone, field, self.message)
        return clone


class CronError(InputError):
    """An invalid cron expression or time zone."""


class ConfigurationError(MjschedError, ValueError):
    """A job's configuration was rejected by its plugin; the message starts with the field path."""


class NotFoundError(InputError, LookupError):
    """A named job or run does not exist (``field`` is ``name`` or ``id``)."""


class WorkerError(MjschedError):
    """A worker child died where it must not (e.g. while a CLI command was waiting for its answer)."""


class ProtocolError(MjschedError):
    """A message between supervisor and worker could not be decoded."""


def not_utf8(field: str, value: str) -> InputError | None:
    """An :class:`InputError` naming ``field`` when ``value`` cannot be written as UTF-8: it holds a lone
    surrogate, Python's stand-in for a byte that was not UTF-8 (an argument from a terminal in Latin-1, a
    file name), which the database driver would refuse with a traceback. None when it is fine."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        what = (f"the byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF
                else f"a lone surrogate U+{ord(bad):04X}")
        return InputError(field, f"is not UTF-8 text: {what} at character {exc.start + 1} (a terminal or file "
                                 f"in another encoding?), got {value[:40]!r}")
    return None


def require_utf8(field: str, value: object) -> None:
    """Raise :func:`not_utf8`'s error for a text ``value`` that cannot be written as UTF-8 (other values pass)."""
    if isinstance(value, str) and (error := not_utf8(field, value)) is not None:
        raise error


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line (or its type's name), for one-line log messages."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]


def msgspec_field_error(exc: msgspec.ValidationError, root: str) -> tuple[str, str]:
    """The one translation of a msgspec validation error into ``(field path, message)``.

    ``root`` names the document (``"configuration"``; ``""`` for a top-level settings table). msgspec's
    ``"Expected `int`, got `str` - at `$.a.b`"`` becomes ``("<root>.a.b", "Expected `int`, got `str`")``;
    ``"Object missing required field `x`"`` names the missing field itself (``"<root>.x"``, ``"missing
    required field"``), and so does an unknown one (``"unknown field"``). An :class:`InputError` raised by
    a ``__post_init__`` inside the document keeps its own field and message.
    """
    text, sep, where = str(exc).rpartition(" - at `$")
    if not sep:
        text, where = str(exc), ""
    path = where.rstrip("`")
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, InputError):
        return cause.field, cause.message
    field = f"{root}{path}" if root else path.lstrip(".")
    for prefix, what in (("Object missing required field `", "missing required field"),
                         ("Object contains unknown field `", "unknown field")):
        if text.startswith(prefix):
            name = text[len(prefix):].split("`")[0]
            return (f"{field}.{name}" if field else name), what
    return field or root or "value", text
