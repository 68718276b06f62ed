"""The command functions, one module per command group; each takes the parsed namespace and returns an
:class:`~mjsched_isolated.cli.exits.Exit` code. Helpers shared by them live here."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import TYPE_CHECKING, Any

from mjsched_isolated.errors import InputError

SETTING = "set:"  # namespace prefix of a settings flag: set:<settings key>
JOB = "job:"  # namespace prefix of a job field option: job:<store column>

if TYPE_CHECKING:
    from mjsched_isolated.store import Store


def open_store(args: argparse.Namespace) -> Store:
    """The store named by ``--db`` (a read-only command refuses a SQLite file that does not exist)."""
    from mjsched_isolated import ops  # noqa: PLC0415 - loaded only where needed

    return ops.open_store(args.settings.database_url, must_exist=args.read_only)


def utcnow() -> dt.datetime:
    """The wall clock, aware UTC: commands are outer loops; operations take ``now``."""
    return dt.datetime.now(dt.UTC)


def iso_arg(field: str, value: str | None) -> dt.datetime | None:
    """Parse an ISO-8601 option value. Raises :class:`InputError` naming ``field``."""
    if value is None:
        return None
    try:
        return dt.datetime.fromisoformat(value)
    except ValueError:
        raise InputError(field, f"not an ISO-8601 date-time: {value!r}") from None


def settings_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The nested settings table spelled by the flags given on the command line (highest precedence)."""
    table: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(SETTING) or value is None:
            continue
        *sections, key = dest[len(SETTING):].split(".")
        node = table
        for part in sections:
            node = node.setdefault(part, {})
        node[key] = value
    return table


def job_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job fields given as options, by store name (raw strings as typed, for the command to convert)."""
    return {dest[len(JOB):]: value for dest, value in vars(args).items() if dest.startswith(JOB)}
