"""``mjsched jobs ...``: add, update, list, show, pause, resume, remove, run, sync."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from mjsched_isolated import jobspec, ops, planner
from mjsched_isolated.cli import render
from mjsched_isolated.cli.commands import iso_arg, job_fields, open_store, utcnow
from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.errors import InputError

LIST_COLUMNS = ["name", "job_type", "status", "cron_expression", "timezone", "next_run_at", "last_run_at",
                "run_count", "success_count", "failure_count"]


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job options as store field values; malformed option text is an error naming the flag."""
    fields = job_fields(args)
    if "configuration" in fields:
        fields["configuration"] = (jobspec.parse_configuration(fields["configuration"], "--configuration")
                                   if fields["configuration"] else None)
    for key in ("start_at", "end_at"):
        if key in fields:
            fields[key] = iso_arg("--" + key.replace("_", "-"), fields[key]) if fields[key] else None
    if "notify_recipients" in fields:
        fields["notify_recipients"] = _comma_list("--notify-recipients", fields["notify_recipients"])
    if "retry_on" in fields:
        fields["retry_on"] = _retry_on(fields["retry_on"])
    return fields


def _retry_on(text: str) -> list[str]:
    """``--retry-on``'s statuses, checked like :func:`jobspec.check` checks the API's and a jobs file's list
    (same fields: ``retry_on``, ``retry_on[<index>]``), but echoing each item as typed, spaces included: at
    least one, each a known status, none twice. ``''`` and ``' '`` are refused as ``retry_on=[]`` is (an
    unset shell variable in quotes would otherwise mean the default)."""
    if not text.strip():
        raise InputError("retry_on", f"must list at least one status, got {text!r} (to retry nothing, set "
                                     f"--max-retries 0; the default is {','.join(planner.RETRY_ON_DEFAULT)})")
    raw = text.split(",")
    items = [item.strip() for item in raw]
    for i, item in enumerate(items):
        if item not in planner.RETRY_ON_CHOICES:
            raise InputError(f"retry_on[{i}]", f"must be one of {', '.join(planner.RETRY_ON_CHOICES)}, "
                                               f"got {raw[i]!r}")
        if item in items[:i]:
            raise InputError(f"retry_on[{i}]", f"{raw[i]!r} is listed twice (first as retry_on[{items.index(item)}])")
    return items


def _comma_list(flag: str, text: str) -> list[str] | None:
    """``A,B`` as a list; an empty text (``''``) clears the field (None: the default). A blank text (``' '``)
    or an empty item (``a,,b``, ``,,,``, a trailing comma) is an error naming the flag, not silently
    dropped: it is most often a lost value (an unset shell variable in quotes, say)."""
    if not text:
        return None
    if not text.strip():
        raise InputError(flag, f"{text!r} is blank (give A,B, or '' to clear)")
    items = [item.strip() for item in text.split(",")]
    for position, item in enumerate(items, 1):
        if not item:
            raise InputError(flag, f"item {position} of {text!r} is empty (give A,B with no empty items, "
                                   "or '' to clear)")
    return items


def _next(job: dict) -> str:
    return render.fmt(job["next_run_at"])


def cmd_add(args: argparse.Namespace) -> int:
    now = utcnow()
    values = ops.prepare_job(args.settings, {"name": args.name, **_fields(args)}, now)  # before any database
    with open_store(args) as store:
        job = ops.insert_job(store, values, now)
    print(f"job {render.safe(job['name'])!r} added ({job['status']}); next run {_next(job)}")
    return Exit.OK


def cmd_update(args: argparse.Namespace) -> int:
    changes = _fields(args)
    if not changes:
        raise InputError("jobs update", "nothing to change: give at least one field option (see --help)")
    with open_store(args) as store:
        job = ops.update_job(store, args.settings, args.name, changes, utcnow())
    print(f"job {render.safe(job['name'])!r} updated ({job['status']}); next run {_next(job)}")
    return Exit.OK


def cmd_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = ops.list_jobs(store)
    if args.json:
        render.print_json(rows)
    else:
        render.table(rows, LIST_COLUMNS)
    return Exit.OK


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        row = ops.get_job(store, args.name)
    if args.json:
        render.print_json(row)
    else:
        pending = row.get("pending_backfill") or []
        row["pending_backfill"] = ", ".join(
            f"{render.fmt(p['scheduled_at']) if p['scheduled_at'] else 'manual'} ({p['kind'].lower()}, attempt "
            f"{p['attempt']}, by {p['requested_by']})" for p in pending) + (
            ", ..." if row.get("pending_backfill_count", 0) > len(pending) else "") or None
        render.listing(row)
    return Exit.OK


def cmd_pause(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        ops.pause_job(store, args.name, utcnow())
    print(f"job {render.safe(args.name)!r} paused (a run in progress is not interrupted)")
    return Exit.OK


def cmd_resume(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        job = ops.resume_job(store, args.name, utcnow())
    if job["status"] == "Expired":  # not resumed: said on stderr, and not 0 (a script must not think it runs)
        render.error(f"job {render.safe(args.name)!r} not resumed: its end_at {render.fmt(job['end_at'])} has passed "
                     f"(it is Expired); move end_at first (`jobs update {render.safe(args.name)} --end-at ...`)")
        return Exit.FAILED
    print(f"job {render.safe(args.name)!r} active; next run {_next(job)}")
    return Exit.OK


def cmd_remove(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        ops.remove_job(store, args.name)
    print(f"job {render.safe(args.name)!r} removed")
    return Exit.OK


class _Terminated(KeyboardInterrupt):
    """SIGTERM during ``jobs run``: handled as Ctrl-C (the run cancelled), but exit 143 (128 + SIGTERM)."""


def _raise_interrupt(signum: int, frame: object) -> None:
    raise _Terminated


def cmd_run(args: argparse.Namespace) -> int:
    store = open_store(args)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        outcome = ops.run_job(store, args.settings, args.name, on_paused=lambda job: render.note(
            f"job {job['name']!r} is Paused: running it once now, as asked; its schedule stays paused"))
        if outcome.queued:
            if args.json:
                render.print_json({"job_name": args.name, "queued": True, "run_id": None})
            else:
                print(f"job {render.safe(args.name)!r} is running; queued: its next run starts as soon as the "
                      "live one ends")
            return Exit.OK
        assert outcome.run_id is not None
        run = ops.get_run(store, outcome.run_id)
    except KeyboardInterrupt as exc:
        render.error(f"{'terminated' if isinstance(exc, _Terminated) else 'interrupted'}; the run of {args.name!r} "
                     "was cancelled")
        return Exit.TERMINATED if isinstance(exc, _Terminated) else Exit.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        store.close()
    if args.json:
        render.print_json(run)
    else:
        print(f"run {run['id']}: {run['status']} in {run['duration_ms'] or 0:.0f} ms"
              + (f": {render.cell(run['error_message'])}" if run["error_message"] else ""))
    sys.stdout.flush()
    return Exit.OK if run["status"] == "Completed" else Exit.FAILED


def cmd_sync(args: argparse.Namespace) -> int:
    specs = ops.load_jobs_file(args.settings, args.file)  # before any database
    with open_store(args) as store:
        created, updated = ops.apply_jobs(store, specs, utcnow())
    print(f"{args.file}: {created} job(s) created, {updated} updated")
    return Exit.OK


def cmd_backfill(args: argparse.Namespace) -> int:
    """``jobs backfill``: make the window's occurrences pending; a running ``serve`` starts them."""
    start, end = iso_arg("--from", args.window_start), iso_arg("--to", args.window_end)
    assert start is not None and end is not None  # required options
    with open_store(args) as store:
        try:
            result = ops.backfill_job(store, args.name, start, end, utcnow(), max_occurrences=args.max_occurrences,
                                      requested_by=args.by)
        except InputError as exc:
            flags = {"from": "--from", "to": "--to", "max": "--max", "requested_by": "--by"}
            raise (exc.renamed(flags[exc.field]) if exc.field in flags else exc) from None
    if args.json:
        render.print_json(result)
        return Exit.OK
    print(f"job {render.safe(args.name)!r}: {len(result.added)} occurrence(s) added for backfill "
          f"({result.occurrences} in {render.fmt(result.window_start)} .. {render.fmt(result.window_end)}; "
          f"{len(result.already_run)} already run, {len(result.already_pending)} already pending, "
          f"{len(result.left_to_schedule)} left to the regular schedule)")
    if result.added:
        print(f"first {render.fmt(result.added[0])}, last {render.fmt(result.added[-1])}: a running `serve` starts "
              "them one by one under the job's concurrency mode")
    return Exit.OK
