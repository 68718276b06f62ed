"""``mjsched runs ...``: list, show, cancel, logs, prune."""

from __future__ import annotations

import argparse
import sys
import time

from mjsched_isolated import ops
from mjsched_isolated.cli import render
from mjsched_isolated.cli.commands import open_store, utcnow
from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.errors import InputError, NotFoundError

LIST_COLUMNS = ["id", "job_name", "status", "scheduled_at", "attempt", "started_at", "duration_ms", "error_message"]
PRUNE_FLAGS = {"retention.keep_days": "--keep-days", "retention.keep_min_per_job": "--keep-min-per-job"}

MAX_LIMIT = ops.MAX_LIMIT


def cmd_list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= MAX_LIMIT:
        raise InputError("--limit", f"must be an integer from 1 to {MAX_LIMIT}, got {args.limit}")
    store = open_store(args)
    try:
        rows = ops.list_runs(store, job=args.job, status=args.status, limit=args.limit)
    except NotFoundError as exc:
        raise exc.renamed("--job") from None
    finally:
        store.close()
    if args.json:
        render.print_json(rows)
    else:
        render.table(rows, LIST_COLUMNS)
    return Exit.OK


def cmd_show(args: argparse.Namespace) -> int:
    if not 0 < args.id < 2**63:
        raise NotFoundError("id", f"no run with id {args.id}")
    with open_store(args) as store:
        row = ops.get_run(store, args.id)
    if args.json:
        render.print_json(row)
    else:
        render.listing(row, width=22)  # terminal-safe: a plugin's escape codes do not reach the terminal
    return Exit.OK


WAIT_POLL_S = 0.2  # how often `runs cancel --wait` reads the run row


def cmd_cancel(args: argparse.Namespace) -> int:
    """Record the cancel request; with ``--wait``, poll the row (an outer loop: it reads clocks) until the
    run has ended or the bound passes, and say whether the cancel took effect or came too late."""
    if not 0 < args.id < 2**63:
        raise NotFoundError("id", f"no run with id {args.id}")
    if args.wait is not None and not 0 <= args.wait <= 86400:
        raise InputError("--wait", f"must be from 0 to 86400 seconds, got {args.wait:g}")
    with open_store(args) as store:
        try:
            row = ops.cancel_run(store, args.id, args.by)
        except NotFoundError:
            raise
        except InputError as exc:
            if exc.field != "id":
                raise (exc.renamed("--by") if exc.field == "requested_by" else exc) from None
            # the run exists but has ended: not bad input (a race with its end is normal), a refused
            # request, like `--wait` seeing the run finish first
            print(f"error: {exc}", file=sys.stderr)
            return Exit.FAILED
        if args.wait is not None:
            give_up = time.monotonic() + args.wait
            while row["status"] == "Running" and time.monotonic() < give_up:
                time.sleep(min(WAIT_POLL_S, max(0.0, give_up - time.monotonic())))
                row = ops.get_run(store, args.id)
        orphan = _nobody_to_end(store, args.id) if row["status"] == "Running" else None
    if args.json:
        render.print_json(row)
    elif orphan is not None:
        print(f"error: cancel of run {row['id']} (job {row['job_name']}) requested, but {orphan}: the run "
              "stays Running until `mjsched serve` runs (it records such a run Failed, abandoned)", file=sys.stderr)
        return Exit.FAILED
    elif row["status"] == "Running":
        holder = row["executed_by_instance"]
        print(f"cancel of run {row['id']} (job {row['job_name']}) requested by {row['cancel_requested_by']}: "
              f"supervisor {holder} stops it at its next lease renewal (a run waiting for its instant: before it "
              "starts)"
              + (f"; still running after {args.wait:g} s" if args.wait is not None else ""))
    elif row["status"] == "Cancelled":
        print(f"run {row['id']} (job {row['job_name']}) Cancelled: {row['error_message']}")
    else:
        print(f"run {row['id']} (job {row['job_name']}) finished {row['status']} before the cancel took effect: "
              "the cancel came too late and the run keeps its outcome")
    if orphan is not None or (args.wait is not None and row["status"] != "Cancelled"):
        return Exit.FAILED
    return Exit.OK
FOLLOW_POLL_S = 1.0  # the worker sends a live run's output about once a second


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the run's output in order; with ``--follow``, keep printing until the run has ended. On a
    terminal, control characters are shown as escapes (:func:`render.visible`) unless ``--raw``; into a
    pipe or a file the output is written as it was stored."""
    if not 0 < args.id < 2**63:
        raise NotFoundError("id", f"no run with id {args.id}")
    escape = not args.raw and sys.stdout.isatty()
    with open_store(args) as store:
        after = -1
        while True:
            chunks, running = ops.run_output(store, args.id, after)
            for seq, text in chunks:
                sys.stdout.write(render.visible(text) if escape else text)
                after = seq
            sys.stdout.flush()
            if not (args.follow and running):
                return Exit.OK
            if (orphan := _nobody_to_end(store, args.id)) is not None:
                print(f"error: run {args.id} is still Running but {orphan}: stopped following "
                      "(`mjsched serve` ends it: a live supervisor records an orphaned run Failed)", file=sys.stderr)
                return Exit.FAILED
            time.sleep(FOLLOW_POLL_S)


def _nobody_to_end(store, run_id: int) -> str | None:
    """Why nobody will ever end the Running run ``run_id`` as things stand (no supervisor alive, its
    holder's lease included), or None while some supervisor is alive: then the holder finishes it, or
    another one abandons it once the holder's lease has expired, and ``--follow`` keeps following."""
    now = store.db_now()
    if any(s["lease_expires_at"] > now and s["stopped_at"] is None for s in store.list_supervisors()):
        return None
    holder = ops.get_run(store, run_id)["executed_by_instance"]
    return f"no supervisor is alive to end it (its holder {holder} has stopped or its lease has expired)"


def cmd_prune(args: argparse.Namespace) -> int:
    """Defaults come from the settings (file, environment); the flags override them for this call."""
    try:
        retention = ops.retention_with(args.settings.retention, keep_days=args.keep_days,
                                       keep_min_per_job=args.keep_min_per_job)
    except InputError as exc:
        given = args.keep_days is not None or args.keep_min_per_job is not None
        raise (exc.renamed(PRUNE_FLAGS.get(exc.field, exc.field)) if given else exc) from None
    with open_store(args) as store:
        result = ops.prune(store, retention, dry_run=args.dry_run)
    if args.json:
        render.print_json(result)
    elif retention.keep_days <= 0:
        print("keep_days is 0: every run is kept; nothing pruned")
    else:
        print(f"{'would prune' if args.dry_run else 'pruned'} {result.pruned} finished run(s) older than "
              f"{retention.keep_days:g} days (keeping the newest {retention.keep_min_per_job} per job) and "
              f"{result.notifications_pruned} delivered or given-up notification(s)")
    return Exit.OK


def cmd_retry(args: argparse.Namespace) -> int:
    """``runs retry``: make the next attempt of the run's occurrence pending; a running ``serve`` starts it."""
    if not 0 < args.id < 2**63:
        raise NotFoundError("id", f"no run with id {args.id}")
    with open_store(args) as store:
        try:
            entry = ops.retry_run(store, args.id, utcnow(), requested_by=args.by)
        except InputError as exc:
            raise (exc.renamed("--by") if exc.field == "requested_by" else exc) from None
    if args.json:
        render.print_json(entry)
        return Exit.OK
    occurrence = render.fmt(entry["scheduled_at"]) if entry["scheduled_at"] else "a manual run"
    waits = "" if entry["job_status"] == "Active" else f"; the job is {entry['job_status']}: it starts once resumed"
    print(f"retry of run {args.id} (job {render.safe(entry['job_name'])}, occurrence {occurrence}) pending as attempt "
          f"{entry['attempt']}: a running `serve` starts it at its next poll{waits}")
    return Exit.OK
