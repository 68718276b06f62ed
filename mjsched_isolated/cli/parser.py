"""The argument parser: every command, option, choice and help text (the CLI reference page is generated
from :func:`build_parser`).

``serve``'s flags are generated from the :class:`~mjsched_isolated.config.Settings` fields, their
descriptions and defaults (:func:`config.field_docs`); their values land in the namespace as
``set:<settings key>`` and :func:`settings_flags` turns them into the settings table. The common options
(``--config``, ``--db``, ``--plugins``, ``--log-level``, ``--log-format``) are accepted before the
subcommand too. Job fields land as ``job:<store column>``. Each subcommand names its function with
``set_defaults(func=...)``.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Literal

from mjsched_isolated import config
from mjsched_isolated.cli.commands import JOB, SETTING, dashboard, jobs, runs, system
from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.cron import (
    DEFAULT_DST_FOLD,
    DEFAULT_DST_GAP,
    DST_FOLD_POLICIES,
    DST_GAP_POLICIES,
    SUPPORTED_FORMS,
)
from mjsched_isolated.enums import (
    ConcurrencyMode,
    JobStatus,
    MissedRunPolicy,
    RunStatus,
    values,
)
from mjsched_isolated.planner import DEFAULT_BACKFILL_MAX, DEFAULT_MAX_QUEUED, RETRY_ON_CHOICES

EPILOG = """\
examples:
  mjsched jobs add backup --type shell --cron '@daily' --tz Europe/Berlin \\
      --configuration '{"command": ["/usr/local/bin/backup"]}'
  mjsched jobs update backup --cron '30 2 * * *'
  mjsched jobs run backup --json
  mjsched --db postgresql+psycopg://sched@db/sched status
  mjsched serve --max-concurrent-jobs 10 --metrics-port 9464

exit codes: 0 ok; 1 a run failed or was refused, or check found problems; 2 bad input (one line naming
the field; nothing written); 130 interrupted (Ctrl-C); 143 `jobs run` stopped by SIGTERM.
settings come from flags, then MJSCHED_* variables, then the --config file, then defaults.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2
        self.exit(Exit.BAD_INPUT, f"{self.prog}: error: {message}\n")


def _help(doc: config.FieldDoc) -> str:
    text = doc.description
    if doc.default is not None and doc.type is not bool:
        text += f" (default: {doc.default})"
    return text.replace("%", "%%")


METAVARS = {"database_url": "URL", "plugins_dir": "DIR", "jobs_file": "FILE", "instance": "NAME",
            "metrics.host": "HOST",
            "metrics.port": "PORT"}


def _add_setting(parser: argparse.ArgumentParser, doc: config.FieldDoc, *flags: str) -> None:
    names = flags or ("--" + doc.key.replace(".", "-").replace("_", "-"),)
    kwargs: dict[str, Any] = {"dest": SETTING + doc.key, "default": argparse.SUPPRESS,
                              "help": argparse.SUPPRESS if doc.cli == "hidden" else _help(doc)}
    if doc.type is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(doc.type) is Literal:
        kwargs["choices"] = list(typing.get_args(doc.type))
    else:
        kwargs["type"] = doc.type
        kwargs["metavar"] = METAVARS.get(doc.key) or {int: "N", float: "S"}.get(doc.type, "TEXT")
    parser.add_argument(*names, **kwargs)


COMMON_FLAGS = {"database_url": ("--db",), "plugins_dir": ("--plugins",), "log_level": ("--log-level",),
                "log_format": ("--log-format",)}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML settings file (default: $MJSCHED_CONFIG)")
    docs = {d.key: d for d in config.field_docs()}
    for key, flags in COMMON_FLAGS.items():
        _add_setting(parser, docs[key], *flags)


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    docs = [d for d in config.field_docs() if d.cli != "common"]
    for doc in docs + config.field_docs(config.Metrics, "metrics."):
        _add_setting(parser, doc, *(("--jobs", "--jobs-file") if doc.key == "jobs_file" else ()))
    parser.add_argument("--run-for", type=float, metavar="S", help="stop (gracefully) after S seconds")


def _job_fields(parser: argparse.ArgumentParser, *, adding: bool) -> None:
    """The job fields as options (store names as ``job:<name>``). ``adding``: type and cron required."""
    def add(*flags: str, field: str, **kwargs: Any) -> None:
        parser.add_argument(*flags, dest=JOB + field, default=argparse.SUPPRESS, **kwargs)

    add("--type", field="job_type", required=adding, metavar="TYPE", help="the plugin's job type (see `plugins list`)")
    add("--cron", field="cron_expression", required=adding, metavar="EXPR",
        help=f"the schedule: {SUPPORTED_FORMS}")
    add("--tz", field="timezone", metavar="ZONE", help="IANA time zone the schedule is read in (default UTC; "
                                                       "not the host's 'localtime')")
    add("--configuration", field="configuration", metavar="JSON", help="the plugin's configuration as a JSON object")
    add("--description", field="description", metavar="TEXT", help="free text shown in listings")
    add("--status", field="status", choices=values(JobStatus), help="default Active for a new job")
    add("--concurrency-mode", field="concurrency_mode", choices=values(ConcurrencyMode),
        help="when a run is still live at the next occurrence: Skip it (default), Queue one, QueueAll (up to "
             "--max-queued, run in order), Replace the live run (cancel it, start the new one), or run Concurrent")
    add("--max-queued", field="max_queued", type=int, metavar="N",
        help=f"QueueAll: at most N occurrences wait for the live run, the oldest skipped beyond it "
             f"(default {DEFAULT_MAX_QUEUED})")
    add("--missed-run-policy", field="missed_run_policy", choices=values(MissedRunPolicy),
        help="occurrences missed while no supervisor ran: Skip them, RunOnce (default) or RunAll")
    # -- time knobs (issue 12 point 10) --
    add("--dst-gap-policy", field="dst_gap_policy", choices=DST_GAP_POLICIES,
        help="an occurrence whose local time does not exist (DST spring forward): Shift to the first valid "
             "instant after the gap (default) or Skip it")
    add("--dst-fold-policy", field="dst_fold_policy", choices=DST_FOLD_POLICIES,
        help="occurrences in a repeated local hour (DST fall back): OnceIfFixedHour (default: a fixed hour "
             "runs in the first copy only, a wildcard or step hour in both), Once, or Both copies")
    add("--missed-run-grace-s", field="missed_run_grace_s", type=float, metavar="S",
        help="an occurrence found more than S seconds late is missed (handled by --missed-run-policy); "
             "default: missed once the next occurrence is due")
    add("--max-total-runtime-s", field="max_total_runtime_s", type=float, metavar="S",
        help="hard cap on a run's runtime: killed S seconds after it started, whatever its heartbeats")
    # -- end of time knobs --
    # -- retries and pause on repeated failure (issue 12 points 5, 8) --
    add("--max-retries", field="max_retries", type=int, metavar="N",
        help="retry a failed or timed-out occurrence up to N times (default 0: no retry)")
    add("--retry-backoff-s", field="retry_backoff_s", type=float, metavar="S",
        help="delay before the first retry (default 10), multiplied by --retry-backoff-factor for each next one")
    add("--retry-backoff-factor", field="retry_backoff_factor", type=float, metavar="F",
        help="each retry waits F times longer than the one before (default 2; 1: a constant delay)")
    add("--retry-backoff-max-s", field="retry_backoff_max_s", type=float, metavar="S",
        help="cap on the delay between retries (default: none)")
    add("--retry-max-jitter-s", field="retry_max_jitter_s", type=float, metavar="S",
        help="add up to S seconds to each retry's delay, stable per attempt (default 0)")
    add("--retry-on", field="retry_on", metavar="A,B",
        help=f"run statuses that retry, at least one, of {', '.join(RETRY_ON_CHOICES)} (default Failed,Timeout; a "
             "worker crash is Failed)")
    add("--pause-after-failures", field="pause_after_failures", type=int, metavar="N",
        help="pause the job after N consecutive failed runs (final failures, after retries); resume clears it")
    add("--max-jitter-s", field="max_jitter_s", type=float, metavar="S",
        help="random delay, stable per occurrence, up to S seconds (below the schedule's interval)")
    add("--max-runtime-minutes", field="max_runtime_minutes", type=int, metavar="N",
        help="the run's deadline, if longer than lease_timeout_s")
    add("--max-memory-mb", field="max_memory_mb", type=int, metavar="MB",
        help="each run may allocate at most MB more memory (RLIMIT_DATA; see docs/operating/isolation.md)")
    add("--max-cpu-s", field="max_cpu_s", type=int, metavar="S", help="each run may use at most S seconds of CPU")
    add("--max-open-files", field="max_open_files", type=int, metavar="N",
        help="open files limit of each run (at least 64: the worker holds about 20 itself)")
    add("--max-processes", field="max_processes", type=int, metavar="N",
        help="process limit of each run (RLIMIT_NPROC: per user, not for root)")
    add("--nice", field="nice", type=int, metavar="N", help="scheduling priority of each run, -20..19")
    add("--start-at", field="start_at", metavar="ISO",
        help="no occurrence before this; without an offset it is read in --tz")
    add("--end-at", field="end_at", metavar="ISO", help="no occurrence after this (the job becomes Expired)")
    add("--notify-recipients", field="notify_recipients", metavar="A,B",
        help="email addresses for this job's notices (default: notifications.email.recipients)")
    for flag, field, text in (
            ("--run-immediately-if-never-run", "run_immediately_if_never_run", "run at once if it has never run"),
            ("--notify-on-success", "notify_on_success", "send a notice after each successful run"),
            ("--notify-on-failure", "notify_on_failure", "send a notice after each failed run (default on)"),
            ("--notify-on-missed", "notify_on_missed",
             "notify when an occurrence is skipped (concurrency) or missed (missed-run policy)")):
        add(flag, field=field, action=argparse.BooleanOptionalAction, help=text)


def _reads(parser: argparse.ArgumentParser, func: Any, *, read_only: bool = False) -> None:
    parser.set_defaults(func=func, uses_settings=True, read_only=read_only)


def build_parser() -> argparse.ArgumentParser:
    """The ``mjsched`` parser. Namespace: ``func`` (the command), ``uses_settings``, ``read_only``,
    ``set:<key>`` settings flags, ``job:<field>`` job fields, and each command's own options."""
    fmt = argparse.RawDescriptionHelpFormatter
    common = _Parser(add_help=False)
    _common(common)
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON (store column names, ISO-8601 UTC times)")

    parser = _Parser(prog="mjsched", description="Serve, and manage jobs, runs and plugins: a cron-job scheduler "
                     "whose plugins run in pooled, killable child processes.", epilog=EPILOG, formatter_class=fmt)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    _common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    serve = sub.add_parser("serve", parents=[common], help="run the scheduler", formatter_class=fmt,
                           description="Run the scheduler until SIGTERM/SIGINT (or --run-for): poll, lease, run "
                                       "jobs in worker children, record, notify.",
                           epilog="example:\n  mjsched serve --db sqlite:///mjsched.db --max-concurrent-jobs 10")
    _serve_flags(serve)
    _reads(serve, system.cmd_serve)

    jobs_p = sub.add_parser("jobs", help="manage jobs").add_subparsers(dest="action", metavar="ACTION",
                                                                       required=True, parser_class=_Parser)
    add = jobs_p.add_parser("add", parents=[common], help="create a job (Active)", formatter_class=fmt,
                            epilog="example:\n  mjsched jobs add ping --type http_check --cron '*/5 * * * *' "
                                   "--configuration '{\"url\": \"https://example.org\"}'")
    add.add_argument("name", help="unique job name (at most 200 characters, no control characters)")
    _job_fields(add, adding=True)
    _reads(add, jobs.cmd_add)
    update = jobs_p.add_parser("update", parents=[common], formatter_class=fmt,
                               help="change a job's fields; its runs and counters are kept",
                               epilog="example:\n  mjsched jobs update backup --cron '0 3 * * *' --tz UTC")
    update.add_argument("name", help="the job to change")
    _job_fields(update, adding=False)
    _reads(update, jobs.cmd_update)
    listing = jobs_p.add_parser("list", parents=[common, as_json], help="list jobs")
    _reads(listing, jobs.cmd_list, read_only=True)
    for verb, text, func, extra in (
            ("show", "show one job", jobs.cmd_show, [as_json]),
            ("pause", "stop scheduling a job", jobs.cmd_pause, []),
            ("resume", "schedule a job again from now", jobs.cmd_resume, []),
            ("remove", "delete a job and its runs", jobs.cmd_remove, []),
            ("run", "run a job now, in a worker; exit 1 if it fails (a Paused job runs and stays Paused)",
             jobs.cmd_run, [as_json])):
        p = jobs_p.add_parser(verb, parents=[common, *extra], help=text)
        p.add_argument("name", help="the job's name")
        _reads(p, func, read_only=verb == "show")
    bf = jobs_p.add_parser("backfill", parents=[common, as_json], formatter_class=fmt,
                           help="run a job's occurrences of a past window (pending until a supervisor runs them)",
                           epilog="example:\n  mjsched jobs backfill report --from 2026-11-30T00:00 "
                                  "--to 2026-11-30T23:59\n"
                                  "naive times are in the job's timezone; occurrences that already ran are "
                                  "not added again")
    bf.add_argument("name", help="the job's name")
    bf.add_argument("--from", dest="window_start", required=True, metavar="ISO", help="the window's start (included)")
    bf.add_argument("--to", dest="window_end", required=True, metavar="ISO",
                    help="the window's end (included, not in the future)")
    bf.add_argument("--max", dest="max_occurrences", type=int, default=DEFAULT_BACKFILL_MAX, metavar="N",
                    help=f"refuse a window of more than N occurrences (default {DEFAULT_BACKFILL_MAX})")
    bf.add_argument("--by", metavar="WHO", help="who asks, for the record (default: <user>@<host>)")
    _reads(bf, jobs.cmd_backfill)
    sync = jobs_p.add_parser("sync", parents=[common], help="create or update jobs from a TOML file, all or nothing")
    sync.add_argument("file", help="TOML file of [[jobs]] tables (fields as in `jobs add`, by store name)")
    _reads(sync, jobs.cmd_sync)

    runs_p = sub.add_parser("runs", help="inspect runs").add_subparsers(dest="action", metavar="ACTION",
                                                                        required=True, parser_class=_Parser)
    rl = runs_p.add_parser("list", parents=[common, as_json], help="list runs, newest first")
    rl.add_argument("--job", metavar="NAME", help="only this job's runs")
    rl.add_argument("--status", choices=values(RunStatus), help="only runs in this status")
    rl.add_argument("--limit", type=int, default=20, metavar="N", help="at most N runs (default 20)")
    _reads(rl, runs.cmd_list, read_only=True)
    rs = runs_p.add_parser("show", parents=[common, as_json], help="show one run")
    rs.add_argument("id", type=int, help="the run's id")
    _reads(rs, runs.cmd_show, read_only=True)
    rc = runs_p.add_parser("cancel", parents=[common, as_json],
                           help="cancel a live run: the supervisor holding it kills its process tree at its next "
                                "lease renewal (within lease_renew_interval_s, 10 s by default) and records it "
                                "Cancelled")
    rc.add_argument("id", type=int, help="the run's id")
    rc.add_argument("--by", metavar="WHO", help="who asks, for the record (default: <user>@<host>)")
    rc.add_argument("--wait", type=float, nargs="?", const=60.0, default=None, metavar="S",
                    help="wait up to S seconds (default 60) for the run to end, and say how it ended; exit 1 if "
                         "it finished before the cancel took effect or is still running")
    _reads(rc, runs.cmd_cancel)
    rr = runs_p.add_parser("retry", parents=[common, as_json],
                           help="run a run's occurrence again now: same scheduled_at, next attempt (a supervisor "
                                "starts it at its next poll)")
    rr.add_argument("id", type=int, help="the run's id")
    rr.add_argument("--by", metavar="WHO", help="who asks, for the record (default: <user>@<host>)")
    _reads(rr, runs.cmd_retry)
    rlogs = runs_p.add_parser("logs", parents=[common], help="print what a run wrote (stdout, stderr, logging)",
                              formatter_class=fmt, epilog="example:\n  mjsched runs logs 42 --follow")
    rlogs.add_argument("id", type=int, help="the run's id")
    rlogs.add_argument("--follow", "-f", action="store_true", help="keep printing while the run is Running")
    rlogs.add_argument("--raw", action="store_true",
                       help="on a terminal too, print control characters (ANSI colours, cursor moves) as the run "
                            "wrote them; by default a terminal shows them as \\xNN escapes, and Unicode format "
                            "characters (bidi overrides, zero-width ones) as \\uNNNN (a pipe or a file always gets "
                            "the output as stored)")
    _reads(rlogs, runs.cmd_logs, read_only=True)
    rp = runs_p.add_parser("prune", parents=[common, as_json],
                           help="delete old finished runs (retention.keep_days, retention.keep_min_per_job)")
    rp.add_argument("--keep-days", type=float, metavar="D", help="keep finished runs this many days (0: keep all; "
                                                                 "default: retention.keep_days)")
    rp.add_argument("--keep-min-per-job", type=int, metavar="M", help="always keep each job's newest M finished "
                                                                      "runs (default: retention.keep_min_per_job)")
    rp.add_argument("--dry-run", action="store_true", help="only count what would be deleted")
    _reads(rp, runs.cmd_prune)
    st = sub.add_parser("status", parents=[common, as_json],
                        help="supervisors, in-flight runs, next due jobs, recent failures")
    _reads(st, system.cmd_status, read_only=True)

    cron_p = sub.add_parser("cron", help="see what a schedule will do").add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    nxt = cron_p.add_parser("next", parents=[as_json], help="the next occurrences, local and UTC, DST notes",
                            formatter_class=fmt, epilog="example:\n  mjsched cron next '30 2 * * *' --tz Europe/Berlin")
    nxt.add_argument("expression", help=SUPPORTED_FORMS)
    nxt.add_argument("--tz", default="UTC", metavar="ZONE", help="IANA time zone (default UTC)")
    nxt.add_argument("--after", metavar="ISO", help="start (default now); without an offset it is read in --tz")
    nxt.add_argument("--count", type=int, default=10, metavar="N", help="how many occurrences (default 10)")
    nxt.add_argument("--dst-gap-policy", "--dst-gap", dest="dst_gap", default=DEFAULT_DST_GAP, choices=DST_GAP_POLICIES,
                     help=f"the job's dst_gap_policy, as in `jobs add` (default {DEFAULT_DST_GAP})")
    nxt.add_argument("--dst-fold-policy", "--dst-fold", dest="dst_fold", default=DEFAULT_DST_FOLD,
                     choices=DST_FOLD_POLICIES,
                     help=f"the job's dst_fold_policy, as in `jobs add` (default {DEFAULT_DST_FOLD})")
    nxt.set_defaults(func=system.cmd_cron_next, uses_settings=False, read_only=True)

    plugins = sub.add_parser("plugins", help="inspect plugins").add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    pl = plugins.add_parser("list", parents=[common, as_json],
                            help="job types found, and modules that failed (exit 1 if any failed)")
    _reads(pl, system.cmd_plugins_list)
    reload_p = plugins.add_parser("reload", parents=[common],
                                  help="make every supervisor of the database load the plugin code on its disk; "
                                       "workers are replaced as their runs end")
    _reads(reload_p, system.cmd_plugins_reload)
    check = sub.add_parser("check", parents=[common, as_json],
                           help="validate the settings, import every plugin, check every job; exit 0 when all is well")
    check.add_argument("--jobs", metavar="FILE", dest=SETTING + "jobs_file", default=argparse.SUPPRESS,
                       help="also validate this TOML jobs file (default: the configured one)")
    _reads(check, system.cmd_check)

    dash = sub.add_parser("dashboard", parents=[common], formatter_class=fmt,
                          help="the web dashboard: jobs, runs, supervisors, live; run now, pause, resume, edit",
                          description="Serve the web dashboard of the database until SIGTERM/SIGINT. Binds to "
                                      "127.0.0.1 unless told; another address needs a dashboard password or "
                                      "token (settings [dashboard], MJSCHED_DASHBOARD_*). Needs the dashboard "
                                      "extra: pip install 'mjsched_isolated[dashboard]'.",
                          epilog="examples:\n  mjsched dashboard --db sqlite:///mjsched.db\n"
                                 "  MJSCHED_DASHBOARD_OPERATOR_PASSWORD=... mjsched dashboard --host 0.0.0.0\n"
                                 "  mjsched dashboard --hash-password   # prints a hash for the settings file")
    dash.add_argument("--host", dest=SETTING + "dashboard.host", default=argparse.SUPPRESS, metavar="HOST",
                      help="address to listen on (default 127.0.0.1)")
    dash.add_argument("--port", dest=SETTING + "dashboard.port", type=int, default=argparse.SUPPRESS, metavar="PORT",
                      help="port to listen on (default 8520; 0: a free one, logged)")
    dash.add_argument("--hash-password", action="store_true",
                      help="read a password on stdin, print its scrypt hash for the settings, and exit")
    _reads(dash, dashboard.cmd_dashboard)

    db = sub.add_parser("db", help="database schema").add_subparsers(dest="action", metavar="ACTION",
                                                                     required=True, parser_class=_Parser)
    _reads(db.add_parser("current", parents=[common], help="the schema revision; exit 0 if up to date, 1 if not"),
           system.cmd_db_current)
    _reads(db.add_parser("upgrade", parents=[common], help="apply pending schema migrations"), system.cmd_db_upgrade)
    return parser
