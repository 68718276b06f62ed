"""The project's exception root and its subclasses. Each message names the field at fault."""

from __future__ import annotations


class MjschedError(Exception):
    """Root of every error this package raises on purpose."""


class InputError(MjschedError, ValueError):
    """Bad user input (CLI flag, jobs file, job row). ``field`` is the offending field's name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


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


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line (or its type's name), for one-line log messages."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]
