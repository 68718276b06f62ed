"""``steps`` job type, and :class:`StepsJob`, a base class for work in stages: the analogue of the
reference engine's Agent driver (multi-step agent work that heartbeats per step).

A run executes its steps in order; each is a shell command (:class:`CommandStep`), a Python callable
(:class:`CallStep`, like ``python_callable``) or an HTTP call (:class:`HttpStep`). After each step the
driver heartbeats (``context.heartbeat()``: a long multi-step run extends its deadline as it makes
progress) and records the step in the run's details. The first step that fails (non-zero exit, an
exception, a non-2xx status, its ``timeout_s`` passed) ends the run as Failed; the steps after it do not
run.

Per-step timeouts: a command's whole process group is killed (SIGTERM, then SIGKILL after 2 s); an HTTP
call's socket operations time out; a callable is interrupted by an exception raised in it from a
``SIGALRM`` timer (Python code stops at once; a blocking call into C finishes first).

Details (a JSON object): ``steps``: one entry per step reached, ``{"name", "kind", "status" ("ok",
"failed", "timeout" or "resumed"), "duration_ms", "output"?, "error"?}``; ``failed_step``: the name of the
failed step (None when all passed); ``resume``: ``{"completed": {name: output}}``, what a later run needs
to resume (below).

**Resuming.** A run given a previous run's details (:meth:`StepsJob.resume_details`) does not run again
the steps that run completed: each is recorded ``"resumed"`` and its recorded output is handed back in
its place, so the run starts with the first step that failed. With ``resume = true`` in the ``steps``
job's configuration a retry (``max_retries``, ``runs retry``: ``context.attempt`` > 1) resumes from the
failed attempt's details (``context.previous_details``); ``resume`` may also be a run's details given by
hand (``mjsched runs show ID --json``, ``Client.get_run(ID).details``), used by every run. Steps match by
name, so a plan whose steps depend on earlier outputs (a generator, below) replays the same way. Outputs
larger than :data:`MAX_OUTPUT_CHARS` once encoded are not kept, and such a step runs again. A resumed
run's ``resume.completed`` holds the resumed steps too, so a second retry resumes from the third attempt's
failure, not from scratch.

**A plan in Python.** Subclass :class:`StepsJob` and write ``plan(context)`` as a generator: ``output =
yield HttpStep(...)`` hands each step to the driver and receives its output (a command's exit code, a
callable's return value, an HTTP response's decoded JSON or text), so a step may depend on the earlier ones
and the number of steps may depend on what they return (an LLM-style loop: call the model, run the tool it
asks for, call it again, until it says it is done). See the manual's built-in plugins page for an example.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from mjsched_isolated.api import BaseScheduledJob, JobContext, ScheduledJobResult
from mjsched_isolated.errors import ConfigurationError

MAX_OUTPUT_CHARS = 4000  # a step's output kept in details (encoded JSON); larger ones are not kept
_ERROR_CHARS = 1000
_KILL_GRACE_S = 2.0


# -- the steps, for plans written in Python --------------------------------------------------------------
@dataclass
class CommandStep:
    """Run ``argv`` (no shell; use ``["sh", "-c", "..."]`` for one) in a process group of its own; its
    stdout and stderr go to the run's output. Output: the exit code (success: 0)."""

    name: str
    argv: list[str]
    timeout_s: float | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None  # added to the worker's environment


@dataclass
class CallStep:
    """Call ``func(**kwargs)``. Output: its return value (success: it returned)."""

    name: str
    func: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None


@dataclass
class HttpStep:
    """Request ``url``; ``json`` (any JSON value) is sent as the body with ``Content-Type:
    application/json``, else ``body`` (text). Output: the response body decoded as JSON if it is JSON,
    else as text (success: a 2xx status)."""

    name: str
    url: str
    method: str = "GET"
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    body: str | None = None
    timeout_s: float | None = 30.0


Step = CommandStep | CallStep | HttpStep
Plan = Generator[Step, Any, Any] | Iterator[Step]


class StepError(Exception):
    """A step did not succeed; ``status`` is ``failed`` or ``timeout``."""

    def __init__(self, message: str, status: str = "failed") -> None:
        super().__init__(message)
        self.status = status


class _Timeout(BaseException):
    """Raised in a callable by the step's timer (BaseException: a plugin's ``except Exception`` must not
    swallow it)."""


# -- the driver ------------------------------------------------------------------------------------------
def run_plan(context: JobContext[Any], plan: Plan, resume: dict[str, Any] | None = None) -> ScheduledJobResult:
    """Execute ``plan``'s steps in order (see the module docstring); heartbeats after each. ``resume``: a
    previous run's details, whose completed steps are not run again. Never raises for a failing step."""
    completed_before = _completed(resume)
    records: list[dict[str, Any]] = []
    completed: dict[str, Any] = {}
    failed: str | None = None
    error: str | None = None
    names: set[str] = set()
    output: Any = None
    try:
        step = next(plan)
        while True:
            if step.name in names:
                raise ValueError(f"step name {step.name!r} used twice: names identify steps when resuming")
            names.add(step.name)
            kind = _kind(step)
            if step.name in completed_before:
                output = completed_before[step.name]
                completed[step.name] = output
                records.append({"name": step.name, "kind": kind, "status": "resumed", "duration_ms": 0})
                context.log.info("step %s: completed by an earlier run; not run again", step.name)
            else:
                context.log.info("step %s (%s): started", step.name, kind)
                started = time.monotonic()
                try:
                    output = _execute(step)
                except StepError as exc:
                    records.append({"name": step.name, "kind": kind, "status": exc.status,
                                    "duration_ms": _ms(started), "error": str(exc)[:_ERROR_CHARS]})
                    failed, error = step.name, f"step {step.name} {exc.status}: {exc}"[:_ERROR_CHARS]
                    context.log.error("%s", error)
                    context.heartbeat()
                    break
                record: dict[str, Any] = {"name": step.name, "kind": kind, "status": "ok", "duration_ms": _ms(started)}
                kept = _keepable(output)
                if kept is not _NOT_KEPT:
                    record["output"] = kept
                    completed[step.name] = kept
                records.append(record)
                context.log.info("step %s: ok in %d ms", step.name, record["duration_ms"])
                context.heartbeat()
            step = plan.send(output) if isinstance(plan, Generator) else next(plan)
    except StopIteration:
        pass
    finally:
        if isinstance(plan, Generator):
            plan.close()
    details = {"steps": records, "failed_step": failed, "resume": {"completed": completed}}
    return ScheduledJobResult(success=failed is None, details=details, error_message=error)


def _completed(resume: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(resume, dict):
        return {}
    section = resume.get("resume")
    completed = section.get("completed") if isinstance(section, dict) else None
    return dict(completed) if isinstance(completed, dict) else {}


def _kind(step: Step) -> str:
    return {CommandStep: "command", CallStep: "callable", HttpStep: "http"}[type(step)]


def _execute(step: Step) -> Any:
    if isinstance(step, CommandStep):
        return _command(step)
    if isinstance(step, CallStep):
        return _call(step)
    return _http(step)


def _command(step: CommandStep) -> int:
    env = None if step.env is None else {**os.environ, **step.env}
    try:
        proc = subprocess.Popen(step.argv, cwd=step.cwd, env=env, start_new_session=True)
    except OSError as exc:
        raise StepError(f"cannot start {step.argv[0]!r}: {exc}") from None
    try:
        code = proc.wait(step.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise StepError(f"timed out after {step.timeout_s:g} s (process group killed)", "timeout") from None
    except BaseException:
        _kill_group(proc)
        raise
    if code != 0:
        raise StepError(f"exit code {code}" if code > 0 else f"killed by signal {-code}")
    return code


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    for sig, wait_s in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _call(step: CallStep) -> Any:
    def on_alarm(_signum: int, _frame: object) -> None:
        raise _Timeout

    if step.timeout_s is None:
        try:
            return step.func(**step.kwargs)
        except Exception as exc:  # noqa: BLE001 - the callable's failure is the step's failure
            raise StepError(f"{type(exc).__name__}: {exc}") from None
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    earlier_delay, earlier_interval = signal.setitimer(signal.ITIMER_REAL, step.timeout_s)
    try:
        return step.func(**step.kwargs)
    except _Timeout:
        raise StepError(f"timed out after {step.timeout_s:g} s", "timeout") from None
    except Exception as exc:  # noqa: BLE001 - the callable's failure is the step's failure
        raise StepError(f"{type(exc).__name__}: {exc}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier_delay > 0:  # someone else's timer (a test runner's): put back what is left of it
            left = max(0.001, earlier_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, earlier_interval)


def _http(step: HttpStep) -> Any:
    headers = dict(step.headers)
    data = None
    if step.json is not None:
        data = json.dumps(step.json).encode("utf-8")
        headers.setdefault("Content-Type", "application/json")
    elif step.body is not None:
        data = step.body.encode("utf-8")
    request = urllib.request.Request(step.url, data=data, headers=headers, method=step.method)
    try:
        with urllib.request.urlopen(request, timeout=step.timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise StepError(f"HTTP {exc.code} {exc.reason} from {step.url}") from None
    except TimeoutError:
        raise StepError(f"timed out after {step.timeout_s:g} s", "timeout") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise StepError(f"timed out after {step.timeout_s:g} s", "timeout") from None
        raise StepError(f"{step.url}: {reason}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


_NOT_KEPT = object()


def _keepable(output: Any) -> Any:
    """``output`` if it is JSON of at most ``MAX_OUTPUT_CHARS``, else ``_NOT_KEPT``."""
    try:
        encoded = json.dumps(output, allow_nan=False)
    except (TypeError, ValueError):
        return _NOT_KEPT
    return output if len(encoded) <= MAX_OUTPUT_CHARS else _NOT_KEPT


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


# -- the base class --------------------------------------------------------------------------------------
class StepsJob(BaseScheduledJob[Any]):
    """Base class of a job type whose work is a plan of steps: implement :meth:`plan` (a generator of
    steps); :meth:`execute` runs it with :func:`run_plan`, resuming from :meth:`resume_details`."""

    def plan(self, context: JobContext[Any]) -> Plan:
        """The steps, in order; ``output = yield step`` receives each step's output."""
        raise NotImplementedError

    def resume_details(self, context: JobContext[Any]) -> dict[str, Any] | None:
        """A previous run's details to resume from: the configuration's ``resume`` field if it is a run's
        details; if it is ``True``, on a retry (``context.attempt`` > 1) the failed attempt's details
        (``context.previous_details``), else None (a first run starts from the first step)."""
        resume = getattr(context.configuration, "resume", None)
        if resume is True:
            return context.previous_details if context.attempt > 1 else None
        return resume if isinstance(resume, dict) else None

    def execute(self, context: JobContext[Any]) -> ScheduledJobResult:
        return run_plan(context, iter(self.plan(context)), self.resume_details(context))


# -- the built-in ``steps`` job type -----------------------------------------------------------------------
class HttpCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An HTTP step's request: ``url`` (http/https), ``method``, ``headers``, ``json`` (a JSON value sent
    as the body) or ``body`` (text)."""

    url: str
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"] = "GET"
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    json: Any = None
    body: str | None = None


class StepSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One step: ``name`` (unique in the job) and exactly one of ``command`` (argv list), ``callable``
    (``"package.module:function"``, called with ``arguments``; with ``pass_outputs`` also
    ``outputs={name: output}`` of the earlier steps) or ``http``. ``timeout_s``: the step's bound."""

    name: str
    command: list[str] | None = None
    callable: str | None = None
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    pass_outputs: bool = False
    http: HttpCall | None = None
    timeout_s: float | None = None


class StepsConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``steps``: the steps in order. ``resume``: ``true`` (a retry resumes from its failed attempt), or a
    previous run's details (its completed steps are not run again), or null/``false`` (always from the
    first step)."""

    steps: list[StepSpec]
    resume: dict[str, Any] | bool | None = None


class StepsPlugin(StepsJob):
    """Run a list of shell commands, Python callables and HTTP calls in order, heartbeating after each."""

    job_type = "steps"
    configuration_type = StepsConfiguration
    description = "Shell commands, Python callables and HTTP calls in order; heartbeat, record, resume per step"

    def validate_configuration(self, configuration: StepsConfiguration) -> None:
        if not configuration.steps:
            raise ConfigurationError("configuration.steps: at least one step is needed")
        seen: set[str] = set()
        for i, step in enumerate(configuration.steps):
            where = f"configuration.steps[{i}]"
            if not step.name.strip():
                raise ConfigurationError(f"{where}.name: must not be empty")
            if step.name in seen:
                raise ConfigurationError(f"{where}.name: {step.name!r} is used twice")
            seen.add(step.name)
            given = [k for k in ("command", "callable", "http") if getattr(step, k) is not None]
            if len(given) != 1:
                raise ConfigurationError(f"{where}: give exactly one of command, callable, http (got "
                                         f"{', '.join(given) or 'none'})")
            if step.command is not None and not step.command:
                raise ConfigurationError(f"{where}.command: must not be empty")
            if step.callable is not None and ":" not in step.callable:
                raise ConfigurationError(f"{where}.callable: must look like 'package.module:function'")
            if step.http is not None and not step.http.url.startswith(("http://", "https://")):
                raise ConfigurationError(f"{where}.http.url: must start with http:// or https://")
            if step.timeout_s is not None and not step.timeout_s > 0:
                raise ConfigurationError(f"{where}.timeout_s: must be a positive number of seconds")

    def plan(self, context: JobContext[StepsConfiguration]) -> Generator[Step, Any, None]:
        outputs: dict[str, Any] = {}
        for spec in context.configuration.steps:
            step: Step
            if spec.command is not None:
                step = CommandStep(spec.name, spec.command, timeout_s=spec.timeout_s)
            elif spec.http is not None:
                h = spec.http
                step = HttpStep(spec.name, h.url, method=h.method, headers=h.headers, json=h.json, body=h.body,
                                timeout_s=spec.timeout_s if spec.timeout_s is not None else 30.0)
            else:
                kwargs = dict(spec.arguments)
                if spec.pass_outputs:
                    kwargs["outputs"] = dict(outputs)
                step = CallStep(spec.name, _Resolved(str(spec.callable)), kwargs, timeout_s=spec.timeout_s)
            outputs[spec.name] = yield step


class _Resolved:
    """A ``package.module:function`` imported when the step runs (an import error is the step's failure)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self, **kwargs: Any) -> Any:
        module_name, _, attr_path = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
        return obj(**kwargs)
