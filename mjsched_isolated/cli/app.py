"""``python -m mjsched_isolated`` / ``mjsched``: serve, and manage jobs, runs and plugins.

Exit codes: 0 ok; 1 a run failed or was refused; 2 bad input (one line naming the field; nothing
written). Every listing has ``--json``, with the store's column names and ISO-8601 UTC timestamps.
Handlers for logging are configured here and nowhere else.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa

from mjsched_isolated import cron
from mjsched_isolated import jobspec
from mjsched_isolated import logs
from mjsched_isolated.supervisor import metrics as metrics_mod
from mjsched_isolated.config import Settings, load_settings, redact_url
from mjsched_isolated.errors import InputError, MjschedError, NotFoundError
from mjsched_isolated.errors import first_line as _short
from mjsched_isolated.supervisor.inspection import inspect_plugins
from mjsched_isolated.store.migrate import SchemaError
from mjsched_isolated.supervisor.pool import Pool
from mjsched_isolated.store import migrate
from mjsched_isolated.store import schema
from mjsched_isolated.store.schema import RUN_STATUSES
from mjsched_isolated.store.core import Store
from mjsched_isolated.supervisor.core import Supervisor, utcnow

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def _raise_interrupt(signum, frame):  # noqa: ANN001
    raise KeyboardInterrupt


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML settings file (default: $MJSCHED_CONFIG)")
    common.add_argument("--db", help="database URL (default: $MJSCHED_DATABASE_URL or sqlite:///mjsched.db)")
    common.add_argument("--plugins", help="plugins folder (default: $MJSCHED_PLUGINS_DIR or ./plugins)")
    common.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default: $MJSCHED_LOG_LEVEL or INFO")
    common.add_argument("--log-format", choices=list(logs.FORMATS),
                        help="text (default) or json: one JSON object per line on stderr")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")

    parser = _Parser(prog="mjsched", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", parents=[common], help="run the scheduler")
    serve.add_argument("--jobs", help="TOML jobs file synced at start (default: <plugins>/jobs.toml if present)")
    serve.add_argument("--max-concurrent-jobs", type=int, help="the cap: worker children, so runs at once (5)")
    serve.add_argument("--lease-timeout-s", type=float, help="default run deadline (600)")
    serve.add_argument("--shutdown-timeout-s", type=float, help="drain bound on SIGTERM/SIGINT (30)")
    serve.add_argument("--lease-ttl-s", type=float,
                       help="liveness lease of this supervisor; a dead one is recovered within TTL + rescan (30)")
    serve.add_argument("--lease-renew-interval-s", type=float, help="(10)")
    serve.add_argument("--rescan-interval-s", type=float,
                       help="longest sleep before looking for job changes and dead supervisors (1)")
    serve.add_argument("--heartbeat-interval-s", type=float, help="at most one deadline extension per interval (300)")
    serve.add_argument("--heartbeat-lease-s", type=float, help="a heartbeat extends the deadline to now + this (360)")
    serve.add_argument("--clock-skew-s", type=float, help=argparse.SUPPRESS)  # tests only
    serve.add_argument("--max-catchup-runs", type=int, help="RunAll jobs catch up at most this many missed occurrences (100)")
    serve.add_argument("--run-for", type=float, metavar="S", help="stop (gracefully) after S seconds")
    serve.add_argument("--auto-upgrade", action="store_true", default=None,
                       help="apply pending schema migrations at start instead of refusing to start")
    serve.add_argument("--metrics-port", type=int,
                       help="serve Prometheus /metrics and /healthz on this port (0: a free one); off if unset")
    serve.add_argument("--metrics-host", help="address for --metrics-port (default 127.0.0.1)")

    jobs = sub.add_parser("jobs", help="manage jobs").add_subparsers(dest="action", required=True, parser_class=_Parser)
    add = jobs.add_parser("add", parents=[common], help="create a job (Active)")
    add.add_argument("name")
    add.add_argument("--type", dest="job_type", required=True)
    add.add_argument("--cron", dest="cron_expression", required=True)
    add.add_argument("--tz", dest="timezone", default="UTC")
    add.add_argument("--configuration", dest="configuration", metavar="JSON", help="the plugin's configuration as a JSON object")
    add.add_argument("--description")
    add.add_argument("--status", default="Active")
    add.add_argument("--concurrency-mode", default="Skip")
    add.add_argument("--missed-run-policy", default="RunOnce", help="Skip, RunOnce (default) or RunAll")
    add.add_argument("--max-jitter-s", type=float, help="random delay, stable per occurrence, up to S seconds")
    add.add_argument("--max-runtime-minutes", type=int)
    add.add_argument("--run-immediately-if-never-run", action="store_true")
    add.add_argument("--start-at", help="ISO-8601; without an offset it is read in --tz")
    add.add_argument("--end-at", help="ISO-8601; without an offset it is read in --tz")
    add.add_argument("--notify-on-success", action="store_true")
    add.add_argument("--no-notify-on-failure", dest="notify_on_failure", action="store_false")
    add.add_argument("--notify-on-missed", action="store_true",
                     help="notify when an occurrence is skipped (concurrency) or missed (missed-run policy)")
    add.add_argument("--notify-recipients", metavar="A,B", help="email addresses for this job's notices "
                     "(default: notifications.email.recipients)")
    jobs.add_parser("list", parents=[common, as_json], help="list jobs")
    for verb, text in (("show", "show one job"), ("pause", "stop scheduling a job"),
                       ("resume", "schedule a job again from now"), ("remove", "delete a job and its runs"),
                       ("run", "run a job now, in a worker; exit 1 if it fails")):
        p = jobs.add_parser(verb, parents=[common] + ([as_json] if verb in ("show", "run") else []), help=text)
        p.add_argument("name")
    sync = jobs.add_parser("sync", parents=[common], help="create or update jobs from a TOML file")
    sync.add_argument("file")

    runs = sub.add_parser("runs", help="inspect runs").add_subparsers(dest="action", required=True, parser_class=_Parser)
    rl = runs.add_parser("list", parents=[common, as_json], help="list runs, newest first")
    rl.add_argument("--job")
    rl.add_argument("--status", choices=RUN_STATUSES)
    rl.add_argument("--limit", type=int, default=20)
    rs = runs.add_parser("show", parents=[common, as_json], help="show one run")
    rs.add_argument("id", type=int)
    rp = runs.add_parser("prune", parents=[common, as_json],
                         help="delete old finished runs (retention.keep_days, retention.keep_min_per_job)")
    rp.add_argument("--keep-days", type=float, help="keep finished runs this many days (0: keep all; "
                                                    "default: retention.keep_days)")
    rp.add_argument("--keep-min-per-job", type=int, help="always keep each job's newest M finished runs "
                                                         "(default: retention.keep_min_per_job)")
    rp.add_argument("--dry-run", action="store_true", help="only count what would be deleted")
    sub.add_parser("status", parents=[common, as_json],
                   help="supervisors, in-flight runs, next due jobs, recent failures")

    cron_cmd = sub.add_parser("cron", help="see what a schedule will do").add_subparsers(
        dest="action", required=True, parser_class=_Parser)
    nxt = cron_cmd.add_parser("next", parents=[as_json], help="the next occurrences, local and UTC, DST notes")
    nxt.add_argument("expression", help="5 fields, or 6 with seconds first")
    nxt.add_argument("--tz", default="UTC", help="IANA time zone (default UTC)")
    nxt.add_argument("--after", help="ISO-8601 start (default now); without an offset it is read in --tz")
    nxt.add_argument("--count", type=int, default=10)

    plugins = sub.add_parser("plugins", help="inspect plugins").add_subparsers(dest="action", required=True,
                                                                              parser_class=_Parser)
    plugins.add_parser("list", parents=[common, as_json], help="job types found, and modules that failed")
    check = sub.add_parser("check", parents=[common, as_json],
                           help="validate the settings, import every plugin, check every job; exit 0 when all is well")
    check.add_argument("--jobs", help="also validate this TOML jobs file (default: the configured one)")


    db = sub.add_parser("db", help="database schema").add_subparsers(dest="action", required=True, parser_class=_Parser)
    db.add_parser("current", parents=[common], help="the schema revision; exit 0 if up to date, 1 if not")
    db.add_parser("upgrade", parents=[common], help="apply pending schema migrations")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "db"):  # a command that reads settings (cron next does not)
        try:
            args.settings = load_settings(config_path=args.config, flags=settings_flags(args))
        except InputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        logs.configure(args.settings.log_level, args.settings.log_format, args.settings.instance)
    else:
        logs.configure("INFO", "text")
    handler = {
        ("serve", None): cmd_serve, ("jobs", "add"): cmd_jobs_add, ("jobs", "list"): cmd_jobs_list,
        ("jobs", "show"): cmd_jobs_show, ("jobs", "pause"): cmd_jobs_pause, ("jobs", "resume"): cmd_jobs_resume,
        ("jobs", "remove"): cmd_jobs_remove, ("jobs", "run"): cmd_jobs_run, ("jobs", "sync"): cmd_jobs_sync,
        ("runs", "list"): cmd_runs_list, ("runs", "show"): cmd_runs_show, ("plugins", "list"): cmd_plugins_list,
        ("cron", "next"): cmd_cron_next, ("check", None): cmd_check, ("runs", "prune"): cmd_runs_prune,
        ("status", None): cmd_status, ("db", "current"): cmd_db_current, ("db", "upgrade"): cmd_db_upgrade,
    }[(args.command, getattr(args, "action", None))]
    try:
        return handler(args)
    except BrokenPipeError:  # `mjsched status | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (InputError, NotFoundError, SchemaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (MjschedError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except sa.exc.SQLAlchemyError as exc:  # e.g. the database went away mid-command
        print(f"error: database: {(str(getattr(exc, 'orig', exc)).strip().splitlines() or ['?'])[0]}", file=sys.stderr)
        return EXIT_FAILED


# -- helpers -----------------------------------------------------------------------------------------
# command-line flag (argparse dest) -> settings key; a flag left out (None) does not override anything
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "db": ("database_url",), "plugins": ("plugins_dir",), "log_level": ("log_level",), "jobs": ("jobs_file",),
    "log_format": ("log_format",), "metrics_port": ("metrics", "port"), "metrics_host": ("metrics", "host"),
    **{name: (name,) for name in ("max_concurrent_jobs", "lease_timeout_s", "shutdown_timeout_s", "lease_ttl_s",
                                  "lease_renew_interval_s", "rescan_interval_s", "heartbeat_interval_s",
                                  "heartbeat_lease_s", "clock_skew_s", "max_catchup_runs", "auto_upgrade")},
}


def settings_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The nested settings table spelled by the flags given on the command line (highest precedence)."""
    table: dict[str, Any] = {}
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = table
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return table


def _plugins_dir(args: argparse.Namespace) -> str:
    return args.settings.plugins_dir


def _store(args: argparse.Namespace) -> Store:
    return open_store(args.settings.database_url)


def open_store(url: str, *, auto_upgrade: bool = False) -> Store:
    """Store.open with connection problems reported as bad input on ``--db``."""
    try:
        return Store.open(url, auto_upgrade=auto_upgrade)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as exc:  # ValueError: e.g. a bad port
        raise InputError("--db", f"not a usable database URL {redact_url(url)!r} ({_short(exc)})") from None
    except sa.exc.OperationalError as exc:
        reason = str(exc.orig).lower()
        if getattr(exc, "connection_invalidated", False) or "connect" in reason or "unable to open" in reason:
            raise InputError("--db", f"cannot connect to {redact_url(url)!r}: "
                                     f"{str(exc.orig).strip().splitlines()[0]}") from None
        raise


def _validate_configs(settings: Settings, specs: list[jobspec.JobSpec], prefix=lambda i: "") -> None:
    """Ask a worker child whether each spec's job_type exists and its configuration is valid."""
    checks = [(s.job_type, jobspec.row_values(s)["configuration"]) for s in specs]
    report = inspect_plugins(settings, checks)
    for i, error in enumerate(report.errors):
        if error is not None:
            field, _, message = error.partition(": ")
            if field == "job_type" and report.failures:  # the type may live in a module that did not load
                message += "; plugin modules that failed to load: " + ", ".join(
                    f.module for f in report.failures) + " (see `plugins list`)"
            raise InputError(f"{prefix(i)}{field}", message)


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value, enc_hook=str).decode() + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, float):
        return f"{value:.1f}"
    return "-" if value is None else str(value)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # terminal escapes and the like (not tab or newline)


def _cell(value: Any) -> str:
    """A table cell: one line (a multi-line error shows its lines joined by " | "), tabs as spaces, and no
    control characters (a plugin's ANSI colour codes must not repaint the terminal)."""
    text = _CONTROL.sub("?", _fmt(value).replace("\t", " "))
    return " | ".join(line.strip() for line in text.splitlines() if line.strip()) if "\n" in text else text


def _table(rows: list[dict], columns: list[str]) -> None:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


# -- serve -------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    if args.run_for is not None and not 0 <= args.run_for <= 10 * 365 * 86400:
        raise InputError("--run-for", f"must be a finite number of seconds >= 0, got {args.run_for}")
    jobs_file = settings.jobs_file
    if jobs_file is None and Path(settings.plugins_dir, "jobs.toml").is_file():
        jobs_file = str(Path(settings.plugins_dir, "jobs.toml"))
    metrics = metrics_mod.for_settings(settings)
    metrics.start_server()  # a port that cannot be bound is bad input: found before anything is written
    try:
        store = open_store(settings.database_url, auto_upgrade=settings.auto_upgrade)
    except BaseException:
        metrics.stop_server()
        raise
    try:
        if jobs_file:
            sync_jobs(store, settings, jobs_file)
        pool = Pool.from_settings(settings)
        return Supervisor(settings, store, pool, metrics=metrics).serve(run_for_s=args.run_for)
    finally:
        metrics.stop_server()  # also when the jobs file or the pool failed before serve() began
        store.close()


# -- jobs --------------------------------------------------------------------------------------------
def cmd_jobs_add(args: argparse.Namespace) -> int:
    try:
        configuration = json.loads(args.configuration) if args.configuration else None
    except json.JSONDecodeError as exc:
        raise InputError("--configuration", f"invalid JSON ({exc.msg} at position {exc.pos})") from None
    if configuration is not None and not isinstance(configuration, dict):
        raise InputError("--configuration", "must be a JSON object")
    try:
        spec = jobspec.JobSpec(
            name=args.name, job_type=args.job_type, cron_expression=args.cron_expression, timezone=args.timezone,
            description=args.description, status=args.status, configuration=configuration,
            start_at=_iso_arg("--start-at", args.start_at), end_at=_iso_arg("--end-at", args.end_at),
            concurrency_mode=args.concurrency_mode, missed_run_policy=args.missed_run_policy,
            max_jitter_s=args.max_jitter_s,
            run_immediately_if_never_run=args.run_immediately_if_never_run,
            max_runtime_minutes=args.max_runtime_minutes, notify_on_success=args.notify_on_success,
            notify_on_failure=args.notify_on_failure, notify_on_missed=args.notify_on_missed,
            notify_recipients=[a.strip() for a in args.notify_recipients.split(",") if a.strip()]
            if args.notify_recipients else None)
    except TypeError as exc:
        raise InputError("job", str(exc)) from None
    spec = jobspec.check(spec)
    _validate_configs(args.settings, [spec])
    store = _store(args)
    now = utcnow()
    values = jobspec.with_next_run_at(jobspec.row_values(spec), now)
    store.add_job(values, now)
    print(f"job {spec.name!r} added ({values['status']}); next run {_fmt(values['next_run_at'])}")
    return EXIT_OK


def cmd_jobs_list(args: argparse.Namespace) -> int:
    rows = _store(args).list_jobs()
    if args.json:
        _print_json(rows)
    else:
        _table(rows, ["name", "job_type", "status", "cron_expression", "timezone", "next_run_at", "last_run_at",
                      "run_count", "success_count", "failure_count"])
    return EXIT_OK


def cmd_jobs_show(args: argparse.Namespace) -> int:
    row = _store(args).get_job(args.name)
    if args.json:
        _print_json(row)
    else:
        for key, value in row.items():
            print(f"{key:30} {_fmt(value)}")
    return EXIT_OK


def cmd_jobs_pause(args: argparse.Namespace) -> int:
    _store(args).update_job(args.name, {"status": "Paused", "next_run_at": None}, utcnow())
    print(f"job {args.name!r} paused (a run in progress is not interrupted)")
    return EXIT_OK


def cmd_jobs_resume(args: argparse.Namespace) -> int:
    store = _store(args)
    now = utcnow()
    job = store.get_job(args.name)
    values = jobspec.with_next_run_at({**job, "status": "Active"}, now)
    store.update_job(args.name, {"status": values["status"], "next_run_at": values["next_run_at"]}, now)
    if values["status"] == "Expired":
        print(f"job {args.name!r} expired: its end_at {_fmt(job['end_at'])} has passed")
    else:
        print(f"job {args.name!r} active; next run {_fmt(values['next_run_at'])}")
    return EXIT_OK


def cmd_jobs_remove(args: argparse.Namespace) -> int:
    _store(args).remove_job(args.name)
    print(f"job {args.name!r} removed")
    return EXIT_OK


def cmd_jobs_run(args: argparse.Namespace) -> int:
    store = _store(args)
    job = store.get_job(args.name)
    settings = msgspec.structs.replace(args.settings, max_concurrent_jobs=1)
    pool = Pool.from_settings(settings, size=1)
    supervisor = Supervisor(settings, store, pool)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        run_id = supervisor.run_now(job, ready_timeout_s=settings.worker_ready_timeout_s)
    except LookupError as exc:
        raise InputError("job_type", str(exc).split(": ", 1)[-1]) from None
    except KeyboardInterrupt:
        print(f"error: interrupted; the run of {args.name!r} was cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        pool.close()
    if run_id is None and job["concurrency_mode"] == "Queue":
        store.queue_now(job["id"], utcnow())
        print(f"job {args.name!r} is running; queued: its next run starts as soon as the live one ends")
        return EXIT_OK
    if run_id is None:
        current = store.get_job(args.name)
        holder = (f"its run holds the lease, taken by supervisor {current['locked_by_instance']} at "
                  f"{_fmt(current['locked_at'])}"
                  if current["locked_by_instance"] else "its run ended just now; try again")
        print(f"error: job {args.name!r} is already running ({holder}); concurrency_mode "
              f"{job['concurrency_mode']} refuses a second run", file=sys.stderr)
        return EXIT_FAILED
    run = store.get_run(run_id)
    if args.json:
        _print_json(run)
    else:
        print(f"run {run_id}: {run['status']} in {run['duration_ms'] or 0:.0f} ms"
              + (f": {_cell(run['error_message'])}" if run["error_message"] else ""))
    return EXIT_OK if run["status"] == "Completed" else EXIT_FAILED


def cmd_jobs_sync(args: argparse.Namespace) -> int:
    store = _store(args)
    created, updated = sync_jobs(store, args.settings, args.file)
    print(f"{args.file}: {created} job(s) created, {updated} updated")
    return EXIT_OK


def sync_jobs(store: Store, settings: Settings, path: str) -> tuple[int, int]:
    """Create or update (by name) every job in the TOML file ``path``; jobs not in it are untouched.
    Everything is validated before anything is written. Returns (created, updated)."""
    specs = jobspec.load_file(path)
    _validate_configs(settings, specs, prefix=lambda i: f"{path}: jobs[{i}].")
    now = utcnow()
    existing = {row["name"]: row for row in store.list_jobs()}
    created = updated = 0
    for spec in specs:
        values = jobspec.row_values(spec)
        old = existing.get(spec.name)
        if old is None:
            try:
                store.add_job(jobspec.with_next_run_at({"status": "Active", **values}, now), now)
                created += 1
                continue
            except InputError as exc:
                if exc.field != "name":
                    raise
                old = store.get_job(spec.name)  # created meanwhile by another supervisor's sync: update it
        changed = {k: v for k, v in values.items() if old.get(k) != v}
        if not changed:
            continue
        if jobspec.schedule_fields_changed(old, changed):
            changed["next_run_at"] = jobspec.with_next_run_at({**old, **values}, now)["next_run_at"]
        store.update_job(spec.name, changed, now)
        updated += 1
    logging.getLogger("mjsched.cli").info("jobs file %s synced: %d created, %d updated", path, created, updated)
    return created, updated


# -- runs and plugins --------------------------------------------------------------------------------
def cmd_runs_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise InputError("--limit", "must be a positive integer")
    try:
        rows = _store(args).list_runs(job_name=args.job, status=args.status, limit=args.limit)
    except NotFoundError as exc:
        raise InputError("--job", str(exc).split(": ", 1)[1]) from None
    if args.json:
        _print_json(rows)
    else:
        _table(rows, ["id", "job_name", "status", "scheduled_at", "started_at", "duration_ms", "error_message"])
    return EXIT_OK


def cmd_runs_show(args: argparse.Namespace) -> int:
    if not 0 < args.id < 2**63:
        raise NotFoundError("id", f"no run with id {args.id}")
    row = _store(args).get_run(args.id)
    if args.json:
        _print_json(row)
    else:
        for key, value in row.items():
            print(f"{key:22} {json.dumps(value) if isinstance(value, dict) else _fmt(value)}")
    return EXIT_OK


def cmd_cron_next(args: argparse.Namespace) -> int:
    from mjsched_isolated.cronshow import MAX_COUNT, describe_next  # noqa: PLC0415 - only this command needs it

    if not 1 <= args.count <= MAX_COUNT:
        raise InputError("--count", f"must be between 1 and {MAX_COUNT}, got {args.count}")
    try:
        zone = cron.zone(args.tz)
        after = _iso_arg("--after", args.after) or utcnow()
        if after.tzinfo is None:
            after = after.replace(tzinfo=zone)
        rows = describe_next(args.expression, args.tz, after, args.count)
    except InputError as exc:
        raise InputError({"timezone": "--tz", "cron_expression": "expression"}.get(exc.field, exc.field),
                         str(exc).split(": ", 1)[-1]) from None
    if args.json:
        _print_json(rows)
        return EXIT_OK
    for row in rows:
        local = row["local"].strftime("%Y-%m-%d %H:%M:%S %Z (%z)")
        print(f"{local:36} {row['utc'].strftime('%Y-%m-%dT%H:%M:%SZ')}  {row['note'] or ''}".rstrip())
    return EXIT_OK


def cmd_plugins_list(args: argparse.Namespace) -> int:
    report = inspect_plugins(args.settings)
    if args.json:
        _print_json({"plugins": report.plugins, "failures": report.failures})
        return EXIT_OK
    for info in report.plugins:
        print(f"{info.job_type:20} {info.module:24} {info.description}")
    for failure in report.failures:
        last = failure.error.strip().splitlines()[-1] if failure.error.strip() else "?"
        print(f"FAILED {failure.module}: {last}")
    return EXIT_OK


def _iso_arg(field: str, value: str | None) -> dt.datetime | None:
    if value is None:
        return None
    try:
        return dt.datetime.fromisoformat(value)
    except ValueError:
        raise InputError(field, f"not an ISO-8601 date-time: {value!r}") from None


# -- check -------------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    """Settings (already loaded: a bad one exited 2), plugins imported in a child, the jobs file, and
    every job in the database (cron, zone, type, configuration). Exit 0 when all is well, 1 otherwise."""
    settings: Settings = args.settings
    problems: list[str] = []
    notes = [f"settings: ok (database {redact_url(settings.database_url)}, plugins {settings.plugins_dir}, "
             f"cap {settings.max_concurrent_jobs}, notification channels {', '.join(settings.notifications.channels())})"]
    report = inspect_plugins(settings)
    notes.append(f"plugins: {len(report.plugins)} job type(s): "
                 + (", ".join(sorted(p.job_type for p in report.plugins)) or "none"))
    for failure in report.failures:
        last = failure.error.strip().splitlines()[-1] if failure.error.strip() else "?"
        problems.append(f"plugin module {failure.module}: failed to import: {last}")
    if settings.jobs_file:
        try:
            specs = jobspec.load_file(settings.jobs_file)
            _validate_configs(settings, specs, prefix=lambda i: f"{settings.jobs_file}: jobs[{i}].")
            notes.append(f"jobs file {settings.jobs_file}: {len(specs)} job(s) ok")
        except InputError as exc:
            problems.append(f"jobs file: {exc}")
    try:
        jobs = _store(args).list_jobs()  # an empty database is created at the newest schema revision
        notes.append(f"database schema: up to date ({migrate.head_revision()})")
    except SchemaError as exc:  # outdated, or newer than this code: nothing else to check in it
        problems.append(str(exc))
        jobs = []
    checks = []
    for job in jobs:
        try:
            cron.validate(job["cron_expression"], job["timezone"])
        except InputError as exc:
            problems.append(f"job {job['name']}: {exc}")
        checks.append((job["job_type"], job["configuration"]))
    for job, error in zip(jobs, inspect_plugins(settings, checks).errors if checks else []):
        if error is not None:
            problems.append(f"job {job['name']}: {error}")
    email = settings.notifications.email
    if email is not None and not email.recipients:
        for job in jobs:
            if (job["notify_on_failure"] or job["notify_on_success"] or job["notify_on_missed"]) \
                    and not job["notify_recipients"]:
                problems.append(f"job {job['name']}: notify_recipients: none, and notifications.email.recipients "
                                "is empty: its email notices could not be delivered")
    bad = {job["name"] for job in jobs if any(p.startswith(f"job {job['name']}: ") for p in problems)}
    notes.append(f"jobs: {len(jobs)} in the database, {len(jobs) - len(bad)} ok")
    if args.json:
        _print_json({"ok": not problems, "problems": problems, "notes": notes})
    else:
        for line in notes:
            print(line)
        for line in problems:
            print(f"PROBLEM {line}")
        print("all is well" if not problems else f"{len(problems)} problem(s)")
    return EXIT_OK if not problems else EXIT_FAILED


# -- status and run retention ------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    from mjsched_isolated import status  # noqa: PLC0415 - only this command needs it

    report = status.collect(_store(args))
    if args.json:
        _print_json(report)
        return EXIT_OK
    print(f"database time {_fmt(report['db_time'])}")
    for title, key, columns in (("Supervisors", "supervisors", status.SUPERVISOR_COLUMNS),
                                ("In-flight runs", "in_flight", status.IN_FLIGHT_COLUMNS),
                                ("Next due jobs", "next_due", status.NEXT_DUE_COLUMNS),
                                ("Recent failures", "recent_failures", status.FAILURE_COLUMNS)):
        print(f"\n{title}:")
        if report[key]:
            _table(report[key], columns)
        else:
            print("(none)")
    return EXIT_OK


def cmd_runs_prune(args: argparse.Namespace) -> int:
    """Defaults come from the settings (file, environment); the flags override them for this call."""
    from mjsched_isolated.config import Retention  # noqa: PLC0415

    base = args.settings.retention
    given = {k: v for k, v in (("keep_days", args.keep_days), ("keep_min_per_job", args.keep_min_per_job))
             if v is not None}
    try:
        retention = Retention(**{**msgspec.structs.asdict(base), **given})
    except InputError as exc:
        flag = {"retention.keep_days": "--keep-days", "retention.keep_min_per_job": "--keep-min-per-job"}
        raise InputError(flag.get(exc.field, exc.field) if given else exc.field, str(exc).split(": ", 1)[-1]) from None
    store = _store(args)
    now = store.db_now()  # run timestamps are written by the database clock
    if args.dry_run:
        count = store.count_prunable_runs(now, retention.keep_days, retention.keep_min_per_job)
        notices = store.count_prunable_notifications(now, retention.keep_days)
    else:
        count = store.prune_runs(now, retention.keep_days, retention.keep_min_per_job, retention.prune_batch_size)
        notices = store.prune_notifications(now, retention.keep_days, retention.prune_batch_size)
    if args.json:
        _print_json({"pruned": count, "dry_run": args.dry_run, "keep_days": retention.keep_days,
                     "keep_min_per_job": retention.keep_min_per_job, "notifications_pruned": notices})
    elif retention.keep_days <= 0:
        print("keep_days is 0: every run is kept; nothing pruned")
    else:
        print(f"{'would prune' if args.dry_run else 'pruned'} {count} finished run(s) older than "
              f"{retention.keep_days:g} days (keeping the newest {retention.keep_min_per_job} per job) and "
              f"{notices} delivered or given-up notification(s)")
    return EXIT_OK


# -- db ----------------------------------------------------------------------------------------------
def cmd_db_current(args: argparse.Namespace) -> int:
    engine = schema.connect(args.settings.database_url)
    try:
        status = migrate.check(engine)
    finally:
        engine.dispose()
    print(status.message())
    return EXIT_OK if status.up_to_date else EXIT_FAILED


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    engine = schema.connect(args.settings.database_url)
    try:
        before, after = migrate.upgrade(engine)
    finally:
        engine.dispose()
    if before.state == "legacy" and before.current == after.current:
        print(f"database schema stamped at {after.current} (head): its tables already matched")
    elif before.current == after.current:
        print(f"database schema already at {after.current} (head): nothing to do")
    else:
        print(f"database schema upgraded: {before.current or 'none'} -> {after.current}")
    return EXIT_OK
