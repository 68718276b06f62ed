"""``shell`` job type: run one command (argv, no shell) and record its exit code and output tails.

The command runs in its own session / process group (``start_new_session=True``); the group is signalled
and its members found through :mod:`mjsched_isolated.proctree`, the one process-tree module. On timeout the whole
group is sent SIGTERM, then SIGKILL after ``kill_grace_s`` seconds, so grandchildren die too. After a normal
exit, processes the command left behind in its group are killed unless ``kill_leftover_processes`` is
false. The leader is not reaped until the group has been signalled, so its PID (= the group id) cannot be
reused in between.

What the command writes is also passed on, as it comes, to this process's own fd 1 (stdout) and fd 2
(stderr): in a worker those are the run's output capture (:mod:`mjsched_isolated.worker.output`), so the
command's output appears in ``runs logs`` like a plugin's prints, bounded by ``max_run_output_bytes``.

Details (all durations in milliseconds): ``command``, ``exit_code`` (int, negative = killed by that
signal, None if it never started), ``duration_ms``, ``timed_out``, ``stdout_tail`` / ``stderr_tail``
(last ``output_tail_chars`` characters, UTF-8 with replacement), ``stdout_bytes`` / ``stderr_bytes``
(totals), ``leftover_pids`` (processes still in the group after the command exited, killed or not).
"""

import os
import selectors
import signal
import subprocess
import time
from typing import Annotated

import msgspec

from mjsched_isolated import proctree
from mjsched_isolated.api import (
    BaseScheduledJob,
    JobContext,
    NotificationContent,
    ScheduledJobResult,
)
from mjsched_isolated.errors import ConfigurationError

_READ_SIZE = 65536
_DRAIN_AFTER_EXIT_S = 1.0  # how long to keep reading pipes held open by leftovers after the command exits


class ShellConfiguration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``command``: argv list, ``command[0]`` looked up on PATH. ``cwd``: working directory (default: the
    worker's). ``env``: variables merged over ``os.environ``. ``timeout_s``: seconds before the group is
    killed (None = no limit of its own; the supervisor's deadline still applies). ``kill_grace_s``: seconds
    between SIGTERM and SIGKILL on timeout. ``output_tail_chars``: characters kept from the end of each of
    stdout/stderr. ``heartbeat_interval_s``: seconds between heartbeats while the command runs."""

    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    kill_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    output_tail_chars: Annotated[int, msgspec.Meta(ge=0)] = 4000
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    kill_leftover_processes: bool = True


class _Tail:
    """Keeps the last ``chars`` characters' worth of bytes from a stream, and the total byte count."""

    def __init__(self, chars: int) -> None:
        self.limit = chars * 4  # a UTF-8 character is at most 4 bytes
        self.buf = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def text(self, chars: int) -> str:
        return self.buf.decode("utf-8", errors="replace")[-chars:] if chars else ""


class ShellJob(BaseScheduledJob[ShellConfiguration]):
    """Run a command; success means exit code 0 within ``timeout_s``."""

    job_type = "shell"
    configuration_type = ShellConfiguration
    description = "Run a command (argv) in its own process group; record exit code and output tails"

    def validate_configuration(self, configuration: ShellConfiguration) -> None:
        if not configuration.command[0]:
            raise ConfigurationError("configuration.command[0]: must be a non-empty program name")
        for i, arg in enumerate(configuration.command):
            if "\0" in arg:
                raise ConfigurationError(f"configuration.command[{i}]: must not contain NUL characters")
        if configuration.cwd is not None and (not configuration.cwd or "\0" in configuration.cwd):
            raise ConfigurationError("configuration.cwd: must be a non-empty path without NUL characters")
        for name, value in (configuration.env or {}).items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise ConfigurationError(
                    f"configuration.env.{name}: names must be non-empty without '=' or NUL; values without NUL"
                )

    def execute(self, context: JobContext[ShellConfiguration]) -> ScheduledJobResult:
        cfg: ShellConfiguration = context.configuration
        details: dict = {"command": list(cfg.command), "exit_code": None, "timed_out": False}
        env = {**os.environ, **cfg.env} if cfg.env is not None else None
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                cfg.command, cwd=cfg.cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )
        except FileNotFoundError as exc:
            details["duration_ms"] = _ms(start)
            missing = exc.filename if exc.filename is not None else cfg.command[0]
            what = "working directory not found" if cfg.cwd is not None and missing == cfg.cwd else "command not found"
            return ScheduledJobResult(success=False, details=details, error_message=f"{what}: {missing}")
        except OSError as exc:
            details["duration_ms"] = _ms(start)
            return ScheduledJobResult(success=False, details=details, error_message=f"cannot start command: {exc}")

        out, err = _Tail(cfg.output_tail_chars), _Tail(cfg.output_tail_chars)
        timed_out = self._supervise(proc, cfg, context, {proc.stdout: out, proc.stderr: err}, details)
        exit_code = proc.wait()  # reaps only now, after any killpg
        details.update(
            exit_code=exit_code, timed_out=timed_out, duration_ms=_ms(start),
            stdout_tail=out.text(cfg.output_tail_chars), stderr_tail=err.text(cfg.output_tail_chars),
            stdout_bytes=out.total, stderr_bytes=err.total,
        )
        if timed_out:
            return ScheduledJobResult(success=False, details=details,
                                      error_message=f"timed out after {cfg.timeout_s:g}s")
        if exit_code < 0:
            return ScheduledJobResult(success=False, details=details, error_message=f"killed by {_signame(-exit_code)}")
        if exit_code != 0:
            return ScheduledJobResult(success=False, details=details, error_message=f"exit code {exit_code}")
        return ScheduledJobResult(success=True, details=details)

    def _supervise(self, proc, cfg, context, tails, details) -> bool:
        """Read output, heartbeat and enforce the timeout until the command has exited (unreaped) and its
        pipes are drained. Returns whether it timed out. Leaves the group signalled as configured."""
        sel = selectors.DefaultSelector()
        for pipe in tails:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ)
        pidfd = _pidfd_open(proc.pid)  # readable when the command exits; else poll every 50 ms
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, data="exit")
        now = time.monotonic()
        deadline = now + cfg.timeout_s if cfg.timeout_s is not None else None
        next_beat = now + cfg.heartbeat_interval_s
        exited_at: float | None = None
        timed_out = False
        try:
            while True:
                now = time.monotonic()
                if exited_at is None and _has_exited(proc):
                    exited_at = now
                    if pidfd is not None:
                        sel.unregister(pidfd)
                if exited_at is not None and (not sel.get_map() or now - exited_at >= _DRAIN_AFTER_EXIT_S):
                    break
                if exited_at is None and not timed_out and deadline is not None and now >= deadline:
                    timed_out = True
                    _kill_group(proc, cfg.kill_grace_s)
                    continue
                if now >= next_beat:
                    context.heartbeat()
                    next_beat = now + cfg.heartbeat_interval_s
                wait = next_beat - now
                if exited_at is not None:
                    wait = min(wait, exited_at + _DRAIN_AFTER_EXIT_S - now)
                else:
                    if deadline is not None and not timed_out:
                        wait = min(wait, deadline - now)
                    if pidfd is None:
                        wait = min(wait, 0.05)
                if not sel.get_map():  # no pidfd and both pipes closed: poll for the exit
                    time.sleep(max(wait, 0))
                    continue
                for key, _ in sel.select(max(wait, 0)):
                    if key.data == "exit":
                        continue  # handled at the top of the loop
                    data = os.read(key.fd, _READ_SIZE)
                    if data:
                        tails[key.fileobj].feed(data)
                        _pass_on(1 if key.fileobj is proc.stdout else 2, data)
                    else:
                        sel.unregister(key.fileobj)
        finally:
            if exited_at is None and not timed_out:  # an unexpected error in the loop: never leave it running
                proctree.signal_group(proc.pid, signal.SIGKILL)
            leftovers = proctree.group_members(proc.pid, exclude=proc.pid)
            details["leftover_pids"] = leftovers
            if leftovers and (timed_out or cfg.kill_leftover_processes):
                proctree.signal_group(proc.pid, signal.SIGKILL)
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            for pipe in tails:
                pipe.close()
        return timed_out

    def format_notification(self, context: JobContext[ShellConfiguration],
            result: ScheduledJobResult) -> NotificationContent:
        details = result.details or {}
        command = " ".join(details.get("command") or [])
        if result.success:
            return NotificationContent(
                subject=f"Scheduled job '{context.job_name}' completed",
                body=f"Run {context.run_id}: `{command}` exited 0 in {details.get('duration_ms', '?')} ms.",
            )
        stderr = (details.get("stderr_tail") or "")[-1000:]
        body = f"Run {context.run_id}: `{command}` failed: {result.error_message}."
        if stderr:
            body += f"\n\nLast stderr:\n{stderr}"
        return NotificationContent(subject=f"Scheduled job '{context.job_name}' failed", body=body, priority="High")


def _pass_on(fd: int, data: bytes) -> None:
    """Write ``data`` to this process's ``fd`` (1 or 2: in a worker, the run's output capture). A closed
    or broken fd loses the copy, never the run (the tails in ``details`` are kept either way)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass


def _has_exited(proc: subprocess.Popen) -> bool:
    """True once the command has exited, without reaping it where ``os.waitid`` exists (the zombie keeps
    the group id reserved until we have signalled the group)."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux >= 5.3), or None where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for the leader to exit, then SIGKILL the group."""
    pgid = proc.pid
    proctree.signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and not _has_exited(proc):
        time.sleep(0.02)
    proctree.signal_group(pgid, signal.SIGKILL)


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
