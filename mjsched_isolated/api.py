"""The plugin contract: what a job type implements and what it is given.

A plugin is a module in the plugins folder that defines a subclass of :class:`BaseScheduledJob` with a
class attribute ``job_type``. Plugin modules are imported **only in worker child processes**, never in the
supervisor. The names follow the reference engine (``BaseScheduledJob``, ``ScheduledJobResult``,
``NotificationContent``; reference-engine-spec.md §7) in Python spelling.

Both :class:`BaseScheduledJob` and :class:`JobContext` are generic over the plugin's configuration
Struct, so a type checker sees ``context.configuration`` as that Struct::

    class PingConfig(msgspec.Struct):
        url: str

    class Ping(BaseScheduledJob[PingConfig]):   # configuration_type = PingConfig is inferred
        job_type = "ping"

        def execute(self, context: JobContext[PingConfig]) -> ScheduledJobResult:
            context.configuration.url            # str; a misspelt attribute is a mypy error
"""

from __future__ import annotations

import datetime as dt
import logging
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic, Literal, TypeVar

import msgspec

from mjsched_isolated.errors import ConfigurationError, msgspec_field_error

Priority = Literal["Low", "Normal", "High"]
ConfigT = TypeVar("ConfigT")


class ScheduledJobResult(msgspec.Struct, kw_only=True):
    """What ``execute`` returns.

    ``success``: the run's outcome (False records the run as Failed). ``details``: a JSON-serialisable
    dict stored on the run row. ``error_message``: a human-readable reason, shown for failures.
    """

    success: bool
    details: dict[str, Any] | None = None
    error_message: str | None = None


class NotificationContent(msgspec.Struct, kw_only=True):
    """A notification's text, as in the reference's ``NotificationContent`` (subject, body, priority)."""

    subject: str
    body: str
    priority: Priority = "Normal"
    metadata: dict[str, Any] | None = None


class JobContext(Generic[ConfigT]):
    """What a plugin's ``execute`` receives.

    Attributes: ``run_id`` (int), ``job_id`` (int), ``job_name`` (str), ``job_type`` (str),
    ``configuration`` (the parsed configuration: an instance of the plugin's ``configuration_type``, or
    the raw JSON value when the plugin declares none; typed ``ConfigT``), ``scheduled_at`` (aware UTC datetime of the
    occurrence, or None for a manual run), ``deadline_at`` (aware UTC datetime at which the supervisor
    will kill the run unless heartbeats extend it; after a heartbeat that extended it, the new deadline,
    which the supervisor sends back over the worker's pipe: it shows within milliseconds, at the latest at
    the next ``heartbeat()`` call) and ``log`` (a logger named after the job type).
    ``attempt`` (int): 1 for a first run, 2 for its first retry (the job's ``max_retries``, ``runs retry``),
    and so on; ``previous_details`` (dict or None): on a retry, the ``details`` the previous attempt of the
    same occurrence recorded (a JSON object; None on a first run, for a manual run's retry, or when that
    run recorded none or was pruned), so a plugin can resume where it failed (``steps``' ``resume = true``).
    ``deadline_updates`` (for the worker): returns the newest deadline the supervisor sent, or None.
    """

    def __init__(
        self,
        *,
        run_id: int,
        job_id: int,
        job_name: str,
        job_type: str,
        configuration: ConfigT,
        scheduled_at: dt.datetime | None = None,
        deadline_at: dt.datetime | None = None,
        heartbeat: Callable[[], None] | None = None,
        deadline_updates: Callable[[], dt.datetime | None] | None = None,
        attempt: int = 1,
        previous_details: dict[str, Any] | None = None,
    ) -> None:
        self.run_id = run_id
        self.job_id = job_id
        self.job_name = job_name
        self.job_type = job_type
        self.configuration: ConfigT = configuration
        self.scheduled_at = scheduled_at
        self.attempt = attempt
        self.previous_details = previous_details
        self._deadline_at = deadline_at
        self._deadline_updates = deadline_updates
        self.log = logging.getLogger(f"mjsched.plugin.{job_type}")
        self._heartbeat = heartbeat

    @property
    def deadline_at(self) -> dt.datetime | None:
        """When the supervisor kills the run unless heartbeats extend it (aware UTC), as last extended."""
        self._follow_deadline()
        return self._deadline_at

    @deadline_at.setter
    def deadline_at(self, value: dt.datetime | None) -> None:
        self._deadline_at = value

    def _follow_deadline(self) -> None:
        """Take the newest deadline the supervisor sent (never raises: a plugin's read must not fail)."""
        if self._deadline_updates is None:
            return
        try:
            newer = self._deadline_updates()
        except Exception:
            self.log.debug("deadline update could not be read", exc_info=True)
            return
        if newer is not None:
            self._deadline_at = newer

    def heartbeat(self) -> None:
        """Tell the supervisor this run is making progress, asking it to extend the run's deadline.

        Never raises and never blocks for long: the message is sent over the worker's pipe and the
        supervisor decides (throttled, token-checked) whether to extend. Opt-in, as in the reference
        (`context.heartbeat()`, GH #2749): a plugin that never calls it keeps its fixed deadline.
        """
        if self._heartbeat is None:
            return
        try:
            self._heartbeat()
        except Exception:
            self.log.debug("heartbeat could not be sent", exc_info=True)
        self._follow_deadline()  # an extension earned by an earlier heartbeat, if it has come


class BaseScheduledJob(Generic[ConfigT]):
    """Base class of every job type; ``BaseScheduledJob[MyConfig]`` types ``context.configuration``.

    Class attributes:
      ``job_type``: the name jobs refer to (``jobs.job_type``); required, unique across plugins.
      ``configuration_type``: a ``msgspec.Struct`` subclass; the job's JSON configuration is decoded
      into it (unknown fields rejected if the Struct says ``forbid_unknown_fields=True``). When not set,
      it is inferred from the generic parameter (``class Ping(BaseScheduledJob[PingConfig])``) if that
      is a Struct; otherwise ``None``, which passes the raw JSON value (or None) through.
      ``description``: one line shown by ``plugins list``.

    ``execute`` may be ``async def``: the worker runs it to completion in its own event loop (one per
    worker, reused across runs); heartbeats and results work as for a plain ``def``.

    One instance is created per run, in a worker child, as in the reference (§7.3).
    """

    job_type: ClassVar[str] = ""
    configuration_type: ClassVar[type[msgspec.Struct] | None] = None
    description: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Infer ``configuration_type`` from ``BaseScheduledJob[SomeStruct]`` when the class sets none."""
        super().__init_subclass__(**kwargs)
        if "configuration_type" in cls.__dict__:
            return
        for base in cls.__dict__.get("__orig_bases__", ()):  # its own bases only, not inherited ones
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, BaseScheduledJob):
                for argument in typing.get_args(base):
                    if isinstance(argument, type) and issubclass(argument, msgspec.Struct):
                        cls.configuration_type = argument
                        return

    @classmethod
    def parse_configuration(cls, raw_json: str | None) -> Any:
        """Decode the stored configuration JSON (``None`` means no configuration).

        Returns an instance of ``configuration_type`` (or the raw value). Raises
        :class:`ConfigurationError` whose message names the offending field, e.g.
        ``configuration.timeout_s: Expected `float`, got `str```.
        """
        text = raw_json if raw_json not in (None, "") else "null"
        if cls.configuration_type is None:
            try:
                return msgspec.json.decode(text)
            except msgspec.DecodeError as exc:
                raise ConfigurationError(f"configuration: invalid JSON ({exc})") from None
        if text.strip() == "null":
            text = "{}"
        try:
            return msgspec.json.decode(text, type=cls.configuration_type)
        except msgspec.ValidationError as exc:
            raise ConfigurationError(_field_message(exc)) from None
        except msgspec.DecodeError as exc:
            raise ConfigurationError(f"configuration: invalid JSON ({exc})") from None

    def validate_configuration(self, configuration: ConfigT) -> None:
        """Check rules the Struct's types cannot express. Raise :class:`ConfigurationError` naming the
        field (``"configuration.glob: must be relative"``) to reject. Called when a job is created or
        updated, and again before every run. The default accepts everything."""

    def execute(self, context: JobContext[ConfigT]) -> ScheduledJobResult | Awaitable[ScheduledJobResult]:
        """Do the work and return the outcome (``async def execute`` may be used; see the class). Exceptions
        are caught in the child and recorded as a Failed run with the traceback's last line as
        ``error_message``."""
        raise NotImplementedError

    def format_notification(self, context: JobContext[ConfigT], result: ScheduledJobResult) -> NotificationContent:
        """Subject, body and priority of the notice for this run (reference §7.3 ``FormatNotification``).

        Default: :func:`default_notification` — ``"<job> completed"`` at Normal priority, or ``"<job>
        failed"`` at High priority with the error in the body.
        """
        return default_notification(context.job_name, context.run_id, success=result.success,
                                    error_message=result.error_message, job_type=self.job_type)


def default_notification(job_name: str, run_id: int, *, success: bool, error_message: str | None = None,
                         job_type: str | None = None, timed_out: bool = False) -> NotificationContent:
    """The one default notice text, used by :meth:`BaseScheduledJob.format_notification` in the worker and
    by the supervisor for outcomes no plugin formatted (a crash, a deadline kill, an abandoned run).

    ``"Scheduled job '<job>' completed"`` (Normal priority) or ``"... failed"`` / ``"... timed out"``
    (High priority, the error in the body, ``"no error message"`` without one); ``job_type`` is named
    in the body when given."""
    run = f"Run {run_id} of job '{job_name}'" + (f" ({job_type})" if job_type else "")
    if success:
        return NotificationContent(subject=f"Scheduled job '{job_name}' completed", body=f"{run} completed.",
                                   priority="Normal")
    what = "timed out" if timed_out else "failed"
    return NotificationContent(subject=f"Scheduled job '{job_name}' {what}",
                               body=f"{run} {what}: {error_message or 'no error message'}", priority="High")


def _field_message(exc: msgspec.ValidationError) -> str:
    """``"configuration.a.b: Expected ..."`` for a configuration that does not fit its Struct."""
    field, message = msgspec_field_error(exc, "configuration")
    return f"{field}: {message}"
