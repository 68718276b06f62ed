"""``python -m mjsched_isolated`` / ``mjsched``: parse, load the settings, configure logging, run the
command, and map errors to exit codes (:class:`~mjsched_isolated.cli.exits.Exit`).

Errors are one line on stderr: ``error: <field>: <message>``. Handlers for logging are configured here
and nowhere else.
"""

from __future__ import annotations

import os
import sys

import sqlalchemy as sa

from mjsched_isolated import logs
from mjsched_isolated._version import __version__
from mjsched_isolated.cli import render
from mjsched_isolated.cli.commands import settings_flags
from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.cli.parser import build_parser
from mjsched_isolated.config import load_settings
from mjsched_isolated.errors import InputError, MjschedError
from mjsched_isolated.store.migrate import SchemaError


def main(argv: list[str] | None = None) -> int:
    """Run ``mjsched`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"mjsched {__version__}")
        return Exit.OK
    if not getattr(args, "func", None):
        parser.print_usage(sys.stderr)
        render.error("a command is required (see mjsched --help)")
        return Exit.BAD_INPUT
    if args.uses_settings:
        try:
            args.settings = load_settings(config_path=getattr(args, "config", None), flags=settings_flags(args))
        except InputError as exc:
            render.error(str(exc))
            return Exit.BAD_INPUT
        logs.configure(args.settings.log_level, args.settings.log_format, args.settings.instance)
    else:
        logs.configure("INFO", "text")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `mjsched status | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.FAILED
    except (InputError, SchemaError) as exc:
        render.error(str(exc))
        return Exit.BAD_INPUT
    except (MjschedError, TimeoutError) as exc:
        render.error(str(exc))
        return Exit.FAILED
    except sa.exc.SQLAlchemyError as exc:  # e.g. the database went away mid-command
        render.error(f"database: {(str(getattr(exc, 'orig', exc)).strip().splitlines() or ['?'])[0]}")
        return Exit.FAILED
