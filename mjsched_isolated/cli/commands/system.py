"""``mjsched serve``, ``status``, ``check``, ``plugins list``, ``cron next`` and ``db current|upgrade``."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from mjsched_isolated import config, cron, ops, proctree
from mjsched_isolated.cli import render
from mjsched_isolated.cli.commands import iso_arg, open_store, utcnow
from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.errors import InputError
from mjsched_isolated.status import (
    FAILURE_COLUMNS,
    IN_FLIGHT_COLUMNS,
    NEXT_DUE_COLUMNS,
    SUPERVISOR_COLUMNS,
)
from mjsched_isolated.store.supervisors import InstanceInUseError

MAX_RUN_FOR_S = 10 * 365 * 86400


def cmd_serve(args: argparse.Namespace) -> int:
    from mjsched_isolated.supervisor import Supervisor  # noqa: PLC0415 - loaded only where needed
    from mjsched_isolated.supervisor import metrics as metrics_mod  # noqa: PLC0415 - loaded only where needed
    from mjsched_isolated.supervisor.pool import Pool  # noqa: PLC0415 - loaded only where needed

    settings: config.Settings = args.settings
    if args.run_for is not None and not 0 <= args.run_for <= MAX_RUN_FOR_S:
        raise InputError("--run-for", f"must be a finite number of seconds >= 0, got {args.run_for}")
    if (foreign_proc := proctree.foreign_proc()) is not None:  # every worker would be judged by a stranger's pid
        raise InputError("/proc", foreign_proc)
    # a wrong working directory or a host not yet updated: serving without its plugins would leave (or,
    # before, skip) every occurrence of their job types
    ops.require_plugins_dir(settings)
    jobs_file = config.default_jobs_file(settings)
    # checked (configurations by their plugins) before the database is opened: a bad file creates nothing
    specs = ops.load_jobs_file(settings, jobs_file) if jobs_file else None
    metrics = metrics_mod.for_settings(settings)
    metrics.start_server()  # a port that cannot be bound is bad input: found before anything is written
    pool = Pool.from_settings(settings)
    log = logging.getLogger("mjsched.cli")

    def waiting(attempt: int, pause_s: float, reason: str) -> None:
        """The database server is unreachable: say so (health too), and let the workers load the
        plugins meanwhile, so the first poll after it comes back can dispatch at once."""
        metrics.poll(f"waiting for the database (try {attempt}): {reason}")
        log.warning("database %s unreachable (try %d: %s); trying again in %.1f s%s",
                    config.redact_url(settings.database_url), attempt, reason, pause_s,
                    "" if settings.wait_for_db_s is None else f" (gives up after {settings.wait_for_db_s:g} s)")
        pool.start()

    try:
        store = ops.open_store_waiting(settings.database_url, auto_upgrade=settings.auto_upgrade,
                                       wait_s=settings.wait_for_db_s, on_wait=waiting)
    except BaseException:
        pool.close()
        metrics.stop_server()
        raise
    try:
        holder = store.instance_holder(settings.instance, socket.gethostname(), os.getpid())
        if holder is not None:  # before the jobs file is synced: nothing written (a race is caught at registration)
            raise InstanceInUseError(holder)
        if jobs_file and specs is not None:
            created, updated = ops.apply_jobs(store, specs, utcnow())
            log.info("jobs file %s synced: %d created, %d updated", jobs_file, created, updated)
        return Supervisor(settings, store, pool, metrics=metrics).serve(run_for_s=args.run_for)
    finally:
        pool.close()  # serve() closes it too; this is for a jobs file that failed before serve() began
        metrics.stop_server()  # also when the jobs file or the pool failed before serve() began
        store.close()


def cmd_status(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = ops.status(store)
    if args.json:
        render.print_json(report)
        return Exit.OK
    print(f"database time {render.fmt(report['db_time'])}")
    for warning in report["warnings"]:
        print(f"WARNING {render.safe(warning)}")
    for title, key, columns in (("Supervisors", "supervisors", SUPERVISOR_COLUMNS),
                                ("In-flight runs", "in_flight", IN_FLIGHT_COLUMNS),
                                ("Next due jobs", "next_due", NEXT_DUE_COLUMNS),
                                ("Recent failures", "recent_failures", FAILURE_COLUMNS)):
        print(f"\n{title}:")
        if report[key]:
            render.table(report[key], columns)
        else:
            print("(none)")
    return Exit.OK


def cmd_check(args: argparse.Namespace) -> int:
    report = ops.check(args.settings)
    if args.json:
        render.print_json(report)
    else:
        for line in report.notes:
            print(render.safe(line))
        for line in report.problems:
            print(f"PROBLEM {render.cell(line)}")
        print("all is well" if report.ok else f"{len(report.problems)} problem(s)")
    return Exit.OK if report.ok else Exit.FAILED


def cmd_plugins_list(args: argparse.Namespace) -> int:
    from mjsched_isolated.supervisor.inspection import inspect_plugins  # noqa: PLC0415 - loaded only where needed

    report = inspect_plugins(args.settings)
    if args.json:
        render.print_json({"plugins": report.plugins, "failures": report.failures, "warnings": report.warnings})
    else:
        for info in report.plugins:
            where = "(built-in)" if info.builtin else info.module
            print(render.cell(f"{info.job_type:20} {where:24} {info.description}"))
        for warning in report.warnings:
            print(f"WARNING {render.cell(warning)}")
        for failure in report.failures:
            print(f"FAILED {render.cell(failure.module)}: {render.cell(ops.last_line(failure.error))}")
    return Exit.FAILED if report.failures else Exit.OK


def cmd_plugins_reload(args: argparse.Namespace) -> int:
    """Ask every supervisor of this database to reload its plugins (a ``plugin_reloads`` row)."""
    with open_store(args) as store:
        request = store.request_plugin_reload(f"{socket.gethostname()}-{os.getpid()}")
    print(f"plugin reload requested (request {request['id']}): every supervisor of this database loads the plugin "
          f"code on its disk within lease_renew_interval_s ({args.settings.lease_renew_interval_s:g} s) and replaces "
          f"its workers as their runs end; one whose new code fails to import keeps its workers and logs why")
    return Exit.OK


def cmd_cron_next(args: argparse.Namespace) -> int:
    from mjsched_isolated.cronshow import MAX_COUNT, describe_next  # noqa: PLC0415 - loaded only where needed

    if not 1 <= args.count <= MAX_COUNT:
        raise InputError("--count", f"must be between 1 and {MAX_COUNT}, got {args.count}")
    try:
        zone = cron.zone(args.tz)
        after = iso_arg("--after", args.after) or utcnow()
        if after.tzinfo is None:
            after = after.replace(tzinfo=zone)
        rows = describe_next(args.expression, args.tz, after, args.count, args.dst_gap, args.dst_fold)
    except InputError as exc:
        raise exc.renamed({"timezone": "--tz", "cron_expression": "expression"}.get(exc.field, exc.field)) from None
    if args.json:
        render.print_json(rows)
        return Exit.OK
    for row in rows:
        local = row["local"].strftime("%Y-%m-%d %H:%M:%S %Z (%z)")
        print(f"{local:36} {row['utc'].strftime('%Y-%m-%dT%H:%M:%SZ')}  {row['note'] or ''}".rstrip())
    return Exit.OK


def cmd_db_current(args: argparse.Namespace) -> int:
    from mjsched_isolated.store import migrate, schema  # noqa: PLC0415 - loaded only where needed

    ops.require_existing_database(args.settings.database_url)  # reads only: a typo in --db creates nothing
    engine = schema.connect(args.settings.database_url)
    try:
        state = migrate.check(engine)
    finally:
        engine.dispose()
    print(state.message())
    return Exit.OK if state.up_to_date else Exit.FAILED


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from mjsched_isolated.store import migrate, schema  # noqa: PLC0415 - loaded only where needed

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
    return Exit.OK
